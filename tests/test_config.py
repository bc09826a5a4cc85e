import os
import re
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.config import (
    AdminConfig,
    Config,
    ConfigError,
    ConfigProblem,
    MetricNames,
    ModelConfig,
    PoolConfig,
    ReplicaConfig,
    ServerConfig,
    SimConfig,
    default_config,
    dump_config,
    init_config_text,
    load_config,
    parse_config,
)
from llmgw.config.defaults import default_node_name, with_machine_defaults
from llmgw.config.fields import node_name
from llmgw.config.locate import TomlLocator as _Locator


def problems(text: str, filename: str = "t.toml") -> list[tuple[str, int | None, str]]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, filename)
    assert all(p.file == filename for p in info.value.problems)
    return [(p.key, p.line, p.message) for p in info.value.problems]


# --------------------------------------------------------------------------- defaults
def test_defaults():
    cfg = default_config()
    assert cfg == parse_config("") == Config()
    assert cfg.server == ServerConfig(host="127.0.0.1", port=8000, api_keys=(),
                                      max_body_bytes=8 * 1024 * 1024, request_id_header="x-request-id")
    assert cfg.admin.tcp is None and cfg.admin.token is None
    assert cfg.sim == SimConfig(engine="vllm", replicas=2, model="sim-model", extra_args=())
    assert cfg.models == () and cfg.pools == ()


def _machine_fields(cfg):
    return cfg.control.store, cfg.agent.node, cfg.agent.state_dir, cfg.admin.socket


def test_machine_defaults_are_empty_in_the_schema_and_filled_by_the_shell(monkeypatch, tmp_path):
    """The schema is pure data: the four fields that depend on the machine are "" (unset) until the
    shell's with_machine_defaults fills them from the environment, the uid and the hostname."""
    uid = os.getuid()
    assert _machine_fields(parse_config("")) == ("", "", "", "")
    assert _machine_fields(default_config()) == ("", "", "", "")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cfg = with_machine_defaults(parse_config(""))
    assert _machine_fields(cfg) == (f"{tmp_path}/state/llmgw/router.db", default_node_name(),
                                    f"{tmp_path}/state/llmgw/agent", f"{tmp_path}/run/llmgw-{uid}/admin.sock")
    assert node_name(cfg.agent.node) is None and cfg.agent.node
    assert with_machine_defaults(cfg) is cfg  # already resolved: nothing to do
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert with_machine_defaults(default_config()).admin.socket == f"/tmp/llmgw-{uid}/admin.sock"
    given = {"XDG_STATE_HOME": "/given"}  # an explicit environment instead of the process's
    assert with_machine_defaults(default_config(), given).control.store == "/given/llmgw/router.db"
    # a file's explicit values are kept; "" in the file means unset, like leaving the key out
    text = ('[admin]\nsocket = "/x/a.sock"\n[control]\nstore = ":memory:"\n'
            '[agent]\nnode = "gpu-01"\nstate_dir = "/var/lib/a"\n')
    explicit = parse_config(text)
    assert with_machine_defaults(explicit) is explicit
    assert _machine_fields(explicit) == (":memory:", "gpu-01", "/var/lib/a", "/x/a.sock")
    half = with_machine_defaults(parse_config('[agent]\nnode = ""\nstate_dir = "/s"\n'))
    assert (half.agent.node, half.agent.state_dir) == (default_node_name(), "/s")


def test_machine_fields_still_reject_blank_and_bad_values():
    for text, key in (('[admin]\nsocket = " "', "admin.socket"), ('[control]\nstore = " "', "control.store"),
                      ('[agent]\nstate_dir = " "', "agent.state_dir"), ('[agent]\nnode = "-bad"', "agent.node")):
        with pytest.raises(ConfigError) as e:
            parse_config(text)
        assert [p.key for p in e.value.problems] == [key], text


# --------------------------------------------------------------------------- valid file
FULL = '''
[server]
host = "0.0.0.0"
port = 9000
api_keys = ["k1", "k2"]
max_body_bytes = 1024
request_id_header = "X-Req"

[admin]
socket = "/run/llmgw/admin.sock"
tcp = "[::1]:9001"
token = "secret"

[sim]
engine = "llamacpp"
replicas = 0
model = "m"
extra_args = ["--fast"]

[[pools]]
name = "gpu"
priority = -1
max_inflight_per_replica = 4

[[pools]]
name = "burst"
priority = 10

[[models]]
name = "llama"
engine = "vllm"
strategy = "long-context"
pools = ["gpu", "burst"]
metrics = { running = "r", "waiting" = "w", kv_usage = "kv" }

[[models.replicas]]
url = "http://10.0.0.1:8000"
pool = "gpu"
weight = 2

[[models.replicas]]
url = "https://example.com/base"

[[models]]
name = "qwen"
engine = "llamacpp"
replicas = [{ url = "http://h:1", weight = 0.5, pool = "burst" }]
'''


def full_config() -> Config:
    return Config(
        server=ServerConfig(host="0.0.0.0", port=9000, api_keys=("k1", "k2"), max_body_bytes=1024,
                            request_id_header="X-Req"),
        admin=AdminConfig(socket="/run/llmgw/admin.sock", tcp="[::1]:9001", token="secret"),
        sim=SimConfig(engine="llamacpp", replicas=0, model="m", extra_args=("--fast",)),
        pools=(PoolConfig(name="gpu", priority=-1, max_inflight_per_replica=4),
               PoolConfig(name="burst", priority=10)),
        models=(
            ModelConfig(name="llama", engine="vllm", strategy="long-context", pools=("gpu", "burst"),
                        metrics=MetricNames(running="r", waiting="w", kv_usage="kv"),
                        replicas=(ReplicaConfig(url="http://10.0.0.1:8000", pool="gpu", weight=2.0),
                                  ReplicaConfig(url="https://example.com/base"))),
            ModelConfig(name="qwen", engine="llamacpp",
                        replicas=(ReplicaConfig(url="http://h:1", weight=0.5, pool="burst"),)),
        ),
    )


def test_full_valid_file(tmp_path):
    assert parse_config(FULL) == full_config()
    path = tmp_path / "llmgw.toml"
    path.write_text(FULL)
    assert load_config(path) == full_config()
    assert load_config(str(path)) == full_config()
    assert isinstance(full_config().models[0].replicas[0].weight, float)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        default_config().server.port = 1  # type: ignore[misc]


# --------------------------------------------------------------------------- errors
BAD = '''\
# a broken file
[server]
prot = 8080
max_body_bytes = "big"

[sim]
replicas = -1
engine = "vlm"

[[pools]]
name = "gpu"
priority = true

[[models]]
name = "llama"
engine = "vllm"
metrics = { running = 3, kv_usag = "x" }

[[models]]
name = "llama"
strategy = "longcontext"

[[models.replicas]]
url = "ftp://x"
weight = 0

[[models.replicas]]
pool = "gpu"
'''


def test_many_errors_all_reported_with_file_key_line():
    with pytest.raises(ConfigError) as info:
        parse_config(BAD, "llmgw.toml")
    got = [(p.file, p.key, p.line, p.message) for p in info.value.problems]
    assert got == [
        ("llmgw.toml", "server.prot", 3, "unknown key (did you mean 'port'?)"),
        ("llmgw.toml", "server.max_body_bytes", 4, "expected an integer, got a string"),
        ("llmgw.toml", "sim.replicas", 7, "must be >= 0, got -1"),
        ("llmgw.toml", "sim.engine", 8, "expected one of 'vllm', 'llamacpp'; got 'vlm' (did you mean 'vllm'?)"),
        ("llmgw.toml", "pools[0].priority", 12, "expected an integer, got a boolean"),
        ("llmgw.toml", "models[0].metrics.kv_usag", 17, "unknown key (did you mean 'kv_usage'?)"),
        ("llmgw.toml", "models[0].metrics.running", 17, "expected a string, got an integer"),
        # a missing key points at the header of its table
        ("llmgw.toml", "models[1].engine", 19, "missing required key"),
        ("llmgw.toml", "models[1].name", 20, "duplicate name 'llama' (first in models[0])"),
        ("llmgw.toml", "models[1].strategy", 21,
         "expected one of 'chat', 'batch', 'long-context', 'load-balance', 'prefill', 'decode'; got 'longcontext' (did you mean 'long-context'?)"),
        ("llmgw.toml", "models[1].replicas[0].url", 24, "not an http(s) URL: 'ftp://x'"),
        ("llmgw.toml", "models[1].replicas[0].weight", 25, "must be a finite number > 0, got 0.0"),
        ("llmgw.toml", "models[1].replicas[1].url", 27, "missing required key"),
    ]
    text = str(info.value)
    assert len(text.splitlines()) == len(got)
    assert "llmgw.toml:24: models[1].replicas[0].url: not an http(s) URL: 'ftp://x'" in text.splitlines()


def test_unknown_keys():
    assert problems("[server]\nprot = 1\n") == [("server.prot", 2, "unknown key (did you mean 'port'?)")]
    assert problems("[servr]\n") == [("servr", 1, "unknown key (did you mean 'server'?)")]
    assert problems("[[model]]\nname = 'x'\n") == [("model", 1, "unknown key (did you mean 'models'?)")]
    [(key, line, msg)] = problems("\n[sim]\nzzz = 1\n")
    assert (key, line) == ("sim.zzz", 3)
    assert msg == "unknown key; known keys: engine, replicas, model, extra_args"
    [(key, line, msg)] = problems('[server]\n"odd key" = 1\n')
    assert (key, line) == ('server."odd key"', 2)


@pytest.mark.parametrize(("text", "key", "message"), [
    ('[server]\nport = "80"', "server.port", "expected an integer, got a string"),
    ("[server]\nport = true", "server.port", "expected an integer, got a boolean"),
    ("[server]\nport = 80.0", "server.port", "expected an integer, got a float"),
    ("[server]\nhost = 1", "server.host", "expected a string, got an integer"),
    ('[server]\napi_keys = "k"', "server.api_keys", "expected an array, got a string"),
    ("[server]\napi_keys = ['a', 2]", "server.api_keys[1]", "expected a string, got an integer"),
    ("[server]\napi_keys = ['a', '']", "server.api_keys[1]", "must not be empty"),
    ("server = 1", "server", "expected a table, got an integer"),
    ("[[server]]", "server", "expected a table, got an array"),
    ("[models]\nname = 'x'", "models", "expected an array of tables, got a table"),
    ("models = [1]", "models[0]", "expected a table, got an integer"),
    ("[admin]\ntoken = 1979-05-27", "admin.token", "expected a string, got a date"),
    ("[admin]\ntoken = 1979-05-27T07:32:00Z", "admin.token", "expected a string, got a datetime"),
    ("[[models]]\nname='m'\nengine='vllm'\n[[models.replicas]]\nurl='http://a'\nweight='1'",
     "models[0].replicas[0].weight", "expected a float, got a string"),
    ("[[models]]\nname='m'\nengine='vllm'\n[[models.replicas]]\nurl='http://a'\nweight=true",
     "models[0].replicas[0].weight", "expected a float, got a boolean"),
    ("[[pools]]\nname='p'\nmax_inflight_per_replica=0", "pools[0].max_inflight_per_replica",
     "must be >= 1, got 0"),
    ("[server]\nport = 70000", "server.port", "must be in 0..65535, got 70000"),
    ("[server]\nshutdown_grace_s = -1", "server.shutdown_grace_s", "must be in 0..3600, got -1.0"),
    ("[server]\nshutdown_grace_s = 'long'", "server.shutdown_grace_s", "expected a float, got a string"),
    ("[server]\nrequest_id_header = 'x id'", "server.request_id_header",
     "not a valid HTTP header name: 'x id'"),
    ("[admin]\ntcp = 'nohost'\ntoken = 't'", "admin.tcp", "expected \"host:port\", got 'nohost'"),
    ("[admin]\ntcp = 'h:99999'\ntoken = 't'", "admin.tcp", "expected \"host:port\", got 'h:99999'"),
    ("[admin]\ntcp = 'h:1'", "admin.tcp", "a TCP admin listener requires admin.token"),
    ("[[pools]]\npriority = 1", "pools[0].name", "missing required key"),
])
def test_wrong_types_and_values(text, key, message):
    assert [(k, m) for k, _, m in problems(text)] == [(key, message)]


def test_int_is_accepted_for_float():
    cfg = parse_config("[[models]]\nname='m'\nengine='vllm'\nreplicas=[{url='http://a', weight=3}]")
    assert cfg.models[0].replicas[0].weight == 3.0


def test_duplicate_names():
    text = '''
[[models]]
name = "a"
engine = "vllm"
[[models]]
name = "b"
engine = "vllm"
[[models]]
name = "a"
engine = "llamacpp"
[[pools]]
name = "p"
[[pools]]
name = "p"
'''
    assert problems(text) == [
        ("models[2].name", 9, "duplicate name 'a' (first in models[0])"),
        ("pools[1].name", 14, "duplicate name 'p' (first in pools[0])"),
    ]


@pytest.mark.parametrize("url", [
    "ftp://x", "http://", "localhost:8000", "10.0.0.1:8000", "http://a:99999", "http://a b", "", "http//a",
])
def test_bad_url(url):
    text = f"[[models]]\nname='m'\nengine='vllm'\n\n[[models.replicas]]\nurl = {url!r}\n"
    assert problems(text) == [("models[0].replicas[0].url", 6, f"not an http(s) URL: {url!r}")]


@pytest.mark.parametrize("url", ["http://a", "https://a.b:443/v1", "http://[::1]:8000", "http://10.0.0.1:0"])
def test_good_url(url):
    cfg = parse_config(f"[[models]]\nname='m'\nengine='vllm'\nreplicas=[{{url={url!r}}}]")
    assert cfg.models[0].replicas[0].url == url


def test_unknown_pool_reference():
    text = '''[[pools]]
name = "gpu"

[[models]]
name = "m"
engine = "vllm"
pools = ["default", "gpuu"]

[[models.replicas]]
url = "http://a"
pool = "xyz"
'''
    assert problems(text) == [
        ("models[0].pools[1]", 7, "unknown pool 'gpuu' (did you mean 'gpu'?)"),
        ("models[0].replicas[0].pool", 11, "unknown pool 'xyz'"),
    ]
    # the implicit "default" pool needs no declaration
    parse_config("[[models]]\nname='m'\nengine='vllm'\nreplicas=[{url='http://a'}]")


def test_cross_checks_still_run_when_other_sections_are_bad():
    text = "[server]\nport = 'x'\n[admin]\ntcp = 'h:1'\n"
    assert problems(text) == [
        ("server.port", 2, "expected an integer, got a string"),
        ("admin.tcp", 4, "a TCP admin listener requires admin.token"),
    ]


def test_toml_syntax_error_has_line_and_column():
    with pytest.raises(ConfigError) as info:
        parse_config('[server]\nport = 80\nhost = "a\n', "llmgw.toml")
    [p] = info.value.problems
    assert (p.file, p.key, p.line, p.column) == ("llmgw.toml", "", 3, 10)
    assert p.message.startswith("invalid TOML: ")
    assert str(info.value) == f"llmgw.toml:3:10: {p.message}"

    [p] = pytest.raises(ConfigError, parse_config, "[server]\nport = 1\nport = 2\n").value.problems
    assert p.line == 3 and "invalid TOML" in p.message
    [p] = pytest.raises(ConfigError, parse_config, "[server]\nport =").value.problems
    assert p.line is not None


def test_load_config_unreadable(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.toml")
    [p] = info.value.problems
    assert p.file.endswith("missing.toml") and p.line is None and "cannot read" in p.message
    bad = tmp_path / "bin.toml"
    bad.write_bytes(b"a = '\xff'")
    assert "UTF-8" in pytest.raises(ConfigError, load_config, bad).value.problems[0].message


def test_load_config_reports_path(tmp_path):
    path = tmp_path / "llmgw.toml"
    path.write_text("\n[server]\nport = -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}:3: server.port: must be in 0..65535, got -1"


def test_problem_rendering():
    assert str(ConfigProblem("f.toml", "a.b", 3, "bad")) == "f.toml:3: a.b: bad"
    assert str(ConfigProblem("f.toml", "a.b", None, "bad")) == "f.toml: a.b: bad"
    assert str(ConfigProblem("f.toml", "", 2, "oops", 5)) == "f.toml:2:5: oops"
    err = ConfigError([ConfigProblem("f", "a", 1, "x"), ConfigProblem("f", "b", None, "y")])
    assert str(err) == "f:1: a: x\nf: b: y"


# --------------------------------------------------------------------------- locator
def test_locator_handles_tricky_toml():
    text = r'''top = """
[server]
fake = 1
"""
[ "server" ]  # comment [x]
'host' = "a # not a comment"
a.b."c.d" = { x = 1, y = [ { z = 2 },
  { z = 3 } ] }
[[models]]
name = 'x'
[[models]]
name = 'y'
[models.metrics]
running = "r"
[[models.replicas]]
url = "u"
[[models.replicas]]
url = """v""\""""
[[models]]
arr = [
  1,  # one
  2,
]
'''
    tomllib.loads(text)  # the fixture itself is valid TOML
    loc = _Locator(text)
    assert loc.line_of(("top",)) == 1
    assert loc.line_of(("server",)) == 5
    assert loc.line_of(("server", "fake")) == 5  # inside the string: falls back to the table
    assert loc.line_of(("server", "host")) == 6
    assert loc.line_of(("server", "a", "b", "c.d", "x")) == 7
    assert loc.line_of(("server", "a", "b", "c.d", "y", 0, "z")) == 7
    assert loc.line_of(("server", "a", "b", "c.d", "y", 1, "z")) == 8
    assert loc.line_of(("models", 0, "name")) == 10
    assert loc.line_of(("models", 1, "name")) == 12
    assert loc.line_of(("models", 1, "metrics", "running")) == 14
    assert loc.line_of(("models", 1, "replicas", 0, "url")) == 16
    assert loc.line_of(("models", 1, "replicas", 1, "url")) == 18
    assert loc.line_of(("models", 2)) == 19
    assert loc.line_of(("models", 2, "arr", 1)) == 22
    assert loc.line_of(("models", 2, "missing")) == 19
    assert loc.line_of(("nothing",)) is None
    assert loc.line_of(()) is None


def test_problem_without_line_renders_without_it():
    # a key that never appears in the text and has no ancestor there
    assert _Locator("x = 1").line_of(("admin", "tcp")) is None


# --------------------------------------------------------------------------- dump / init
def test_dump_round_trip_examples():
    for cfg in (default_config(), full_config()):
        text = dump_config(cfg)
        assert "None" not in text
        assert parse_config(text) == cfg


names = st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=1, max_size=12).filter(str.strip)
texts = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=12)
ports = st.integers(0, 65535)
int64 = st.integers(-(2**63), 2**63 - 1)
hosts = st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z]{2,5})?", fullmatch=True)
urls = st.builds(lambda s, h, p, path: f"{s}://{h}{p}{path}", st.sampled_from(["http", "https"]), hosts,
                 st.one_of(st.just(""), ports.map(lambda p: f":{p}")),
                 st.from_regex(r"(/[a-z0-9]{1,6}){0,2}", fullmatch=True))
opt_names = st.none() | names
opt_metrics = st.none() | st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,15}", fullmatch=True)
# the prefix-cache counters are renamed together or not at all
prefix_pairs = st.none() | st.tuples(opt_metrics.filter(bool), opt_metrics.filter(bool))
metric_names = st.builds(lambda pair, **kw: MetricNames(prefix_queries=pair and pair[0], prefix_hits=pair and pair[1],
                                                        **kw),
                         prefix_pairs, running=opt_metrics, waiting=opt_metrics, kv_usage=opt_metrics,
                         finished=opt_metrics, cache_info=opt_metrics, lora_info=opt_metrics)


@st.composite
def configs(draw) -> Config:
    pools = draw(st.lists(st.builds(PoolConfig, name=names, priority=int64,
                                    max_inflight_per_replica=st.none() | st.integers(1, 10**6)),
                          max_size=3, unique_by=lambda p: p.name))
    pool_names = st.sampled_from(["default"] + [p.name for p in pools])
    replicas = st.builds(ReplicaConfig, url=urls, pool=pool_names,
                         weight=st.floats(min_value=1e-6, max_value=1e6, allow_nan=False))
    models = draw(st.lists(
        st.builds(ModelConfig, name=names, engine=st.sampled_from(["vllm", "llamacpp"]),
                  strategy=st.sampled_from(["chat", "batch", "long-context"]),
                  pools=st.lists(pool_names, max_size=3).map(tuple),
                  metrics=metric_names,
                  replicas=st.lists(replicas, max_size=3).map(tuple)),
        max_size=3, unique_by=lambda m: m.name))
    tcp = draw(st.none() | ports.map(lambda p: f"127.0.0.1:{p}"))
    return Config(
        server=draw(st.builds(ServerConfig, host=names, port=ports, api_keys=st.lists(names, max_size=3).map(tuple),
                              max_body_bytes=st.integers(1, 2**40),
                              request_id_header=st.from_regex(r"[A-Za-z0-9-]{1,20}", fullmatch=True))),
        admin=AdminConfig(socket=draw(names), tcp=tcp,
                          token=draw(names if tcp else opt_names)),
        sim=draw(st.builds(SimConfig, engine=st.sampled_from(["vllm", "llamacpp"]), replicas=st.integers(0, 64),
                           model=names, extra_args=st.lists(texts, max_size=3).map(tuple))),
        models=tuple(models), pools=tuple(pools),
    )


@settings(max_examples=200, deadline=None)
@given(configs())
def test_dump_parse_round_trip(cfg):
    text = dump_config(cfg)
    assert parse_config(text) == cfg


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    else:
        yield path, obj


@settings(max_examples=100, deadline=None)
@given(configs())
def test_locator_finds_every_dumped_key(cfg):
    """Every leaf key of dumped text is located on a line that assigns exactly that value."""
    text = dump_config(cfg)
    data = tomllib.loads(text)
    lines = text.split("\n")  # not splitlines(): values may contain U+0085 and friends
    loc = _Locator(text)
    for path, value in _leaves(data):
        line = loc.line_of(path)
        assert line is not None, path
        src = lines[line - 1]
        if not src.startswith(f"{path[-1]} = "):  # inside an inline table: the key is on the line
            assert re.search(rf"[{{,]\s*{path[-1]} = ", src), (path, src)
        elif not isinstance(value, list):
            assert tomllib.loads(src) == {path[-1]: value}, (path, src)
        else:
            assert src.startswith(f"{path[-1]} = ["), (path, src)


def test_init_config_text_parses_to_defaults():
    text = init_config_text()
    assert text.startswith("#")
    assert parse_config(text, "llmgw.toml") == default_config()


def test_init_config_examples_are_valid_when_uncommented():
    text = re.sub(r"(?m)^# (?=\[|[a-z_]+ = )", "", init_config_text())
    cfg = parse_config(text)
    assert cfg.admin.tcp == "127.0.0.1:8001" and cfg.admin.token
    assert [p.name for p in cfg.pools] == ["default", "burst"]
    assert [m.name for m in cfg.models] == ["llama-3-8b", "qwen-7b"]
    assert len(cfg.models[0].replicas) == 2
    d = cfg.models[1].deploy
    assert d is not None and d.count == 2 and d.gpus == 1 and d.node_selector == {"llmgw.io/site": "fra"}
    assert cfg.control.join_token and cfg.control.tls_cert and cfg.agent.node == "gpu-01"
    assert cfg.agent.gpus is not None and cfg.agent.gpus[0].memory_mb == 24000


def test_agent_config_errors_are_all_named() -> None:
    from llmgw.config import ConfigError, parse_config

    text = """[agent]
node = "bad name!"
router = "nowhere"
labels = { "llmgw.io/rack" = 7 }
gpus = [{ name = "L4" }]
tls_ca = "ca.pem"

[agent.restart]
crashloop_after = 0

[control]
tls_cert = "c.pem"
lost_after_s = 1.0
"""
    try:
        parse_config(text, "agent.toml")
    except ConfigError as e:
        got = {(p.key, p.line) for p in e.problems}
        msgs = str(e)
    else:
        raise AssertionError("expected errors")
    assert ("agent.node", 2) in got and "not a valid node name" in msgs
    assert ("agent.router", 3) in got and 'expected "host:port"' in msgs
    assert ("agent.labels.llmgw.io/rack", 4) in got or any(k.startswith("agent.labels") for k, _ in got)
    assert any(k.startswith("agent.gpus[0].memory_mb") for k, _ in got)
    assert ("agent.restart.crashloop_after", 9) in got
    assert any(k == "control.tls_key" for k, _ in got) and "tls_cert and tls_key go together" in msgs
    assert any(k == "control.lost_after_s" for k, _ in got)


def test_custom_strategies_are_known_to_models_and_need_a_weight() -> None:
    from llmgw.config import ConfigError, parse_config

    ok = parse_config('[[strategies]]\nname = "rr"\npicker = "round-robin"\nweights = { load = 1.0 }\n'
                      '[[models]]\nname = "m"\nengine = "vllm"\nstrategy = "rr"\n')
    assert ok.models[0].strategy == "rr" and ok.strategies[0].weights.load == 1.0
    try:
        parse_config('[[strategies]]\nname = "z"\n[[models]]\nname = "m"\nengine = "vllm"\nstrategy = "rx"\n',
                     "f.toml")
    except ConfigError as e:
        text = str(e)
        assert "strategies[0].weights: at least one weight must be > 0" in text
        assert "models[0].strategy" in text and "'rx'" in text
    else:
        raise AssertionError("expected a ConfigError")
