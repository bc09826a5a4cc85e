"""LoRA adapters declared on a model reach its engines: the config's checks, the deploy spec (and
its wire form), the command line and environment for vLLM and llama.cpp, and agent-launched
simulators that start with them — or fail with the reason when an adapter's file is missing."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from llmgw.config import ConfigError, model_from_dict, parse_config
from llmgw.daemon.control.model_deploy import deploy_of
from llmgw.fleet import wire_fields
from llmgw.fleet.engine_cmd import RUNTIME_LORA_ENV, build_command, build_env
from llmgw.fleet.types import EngineSpec, LoraLaunch
from tests.test_engines import Harness, groups, running, sim_spec  # noqa: F401  (fixture)


def _cfg(engine: str, adapters: str, extra: str = "") -> str:
    path = 'model_path = "base.gguf"\n' if engine == "llamacpp" else ""
    return (f'[[models]]\nname = "m"\nengine = "{engine}"\n{extra}[models.deploy]\n{path}\n' + adapters)


TWO = ('[[models.adapters]]\nname = "sql"\nsource = "/lora/sql.gguf"\nstatic = true\n'
       '[[models.adapters]]\nname = "chat"\nsource = "/lora/chat.gguf"\nscale = 0.5\n')


# -- config -------------------------------------------------------------------------------------
def test_llamacpp_adapter_source_must_be_a_gguf_file_naming_the_field():
    bad = '[[models.adapters]]\nname = "sql"\nsource = "org/sql-lora"\n'
    with pytest.raises(ConfigError) as e:
        parse_config(_cfg("llamacpp", bad))
    assert "models[0].adapters[0].source" in str(e.value) and ".gguf" in str(e.value)
    comma = '[[models.adapters]]\nname = "sql"\nsource = "/a,b.gguf"\n'
    with pytest.raises(ConfigError) as e:
        parse_config(_cfg("llamacpp", comma))
    assert "comma" in str(e.value)
    parse_config(_cfg("vllm", bad))  # a repository id is fine for vLLM


def test_admin_model_definition_gets_the_same_check():
    d = {"name": "m", "engine": "llamacpp", "adapters": [{"name": "a", "source": "hf/repo"}]}
    with pytest.raises(ConfigError) as e:
        model_from_dict(d)
    assert "adapters[0].source" in str(e.value)


def test_vllm_max_lora_rank_must_be_one_of_vllms_choices():
    with pytest.raises(ConfigError) as e:
        parse_config(_cfg("vllm", TWO, "max_lora_rank = 24\n"))
    assert "models[0].max_lora_rank" in str(e.value) and "320" in str(e.value)
    parse_config(_cfg("vllm", TWO, "max_lora_rank = 64\n"))
    parse_config(_cfg("vllm", "", "max_lora_rank = 24\n"))  # no adapters: LoRA is off, not checked


# -- the deploy spec ----------------------------------------------------------------------------
def test_spec_vllm_carries_limits_and_static_adapters_only():
    m = parse_config(_cfg("vllm", TWO, "max_loaded_adapters = 3\nmax_lora_rank = 32\n")).models[0]
    lora = deploy_of(m).template.lora
    assert lora == LoraLaunch(max_loras=3, max_rank=32, adapters=(("sql", "/lora/sql.gguf"),))
    no = parse_config(_cfg("vllm", "")).models[0]
    assert deploy_of(no).template.lora is None and "lora" not in deploy_of(no).template.to_wire()


def test_spec_llamacpp_carries_every_adapter_in_order():
    m = parse_config(_cfg("llamacpp", TWO)).models[0]
    assert deploy_of(m).template.lora == LoraLaunch(adapters=(("sql", "/lora/sql.gguf"), ("chat", "/lora/chat.gguf")))


def test_declaring_an_on_demand_vllm_adapter_does_not_change_the_engine():
    one = parse_config(_cfg("vllm", TWO)).models[0]
    more = parse_config(_cfg("vllm", TWO + '[[models.adapters]]\nname = "x"\nsource = "org/x"\n')).models[0]
    assert deploy_of(one).template.spec_hash() == deploy_of(more).template.spec_hash()


def test_wire_round_trip_and_bounds():
    spec = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="m",
                      lora=LoraLaunch(max_loras=2, max_rank=16, adapters=(("a", "/p/a"),)))
    assert wire_fields._spec(spec.to_wire(), "spec") == spec == EngineSpec.from_wire(spec.to_wire())
    for bad, what in [({"adapters": [["a"]]}, "pair"), ({"adapters": [["", "x"]]}, "empty"),
                      ({"max_loras": -1}, "not in"), ({"adapters": [["a", "x"]] * 1025}, "at most")]:
        with pytest.raises(wire_fields.WireProtocolError, match=what):
            wire_fields._spec({**spec.to_wire(), "lora": bad}, "spec")


# -- command lines ------------------------------------------------------------------------------
@pytest.mark.parametrize("simulate", [False, True])
def test_command_line_vllm(simulate):
    lora = LoraLaunch(max_loras=4, max_rank=64, adapters=(("sql", "/l/sql"), ("odd=name", "/l/x")))
    spec = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="org/m", simulate=simulate, lora=lora)
    cmd = build_command(spec, "127.0.0.1", 8001, sys.executable)
    i = cmd.index("--enable-lora")
    assert cmd[i:i + 8] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--lora-modules",
                            "sql=/l/sql", '{"name":"odd=name","path":"/l/x"}']
    assert build_env(spec, {})[RUNTIME_LORA_ENV] == "True"
    plain = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="org/m", simulate=simulate)
    assert "--enable-lora" not in build_command(plain, "h", 1, sys.executable)
    assert RUNTIME_LORA_ENV not in build_env(plain, {})


@pytest.mark.parametrize("simulate", [False, True])
def test_command_line_llamacpp_loads_every_adapter_off(simulate):
    lora = LoraLaunch(adapters=(("sql", "/l/sql.gguf"), ("chat", "/l/c:1.gguf")))
    spec = EngineSpec(replica="m/1", model="m", engine="llamacpp", model_path="b.gguf", simulate=simulate, lora=lora)
    cmd = build_command(spec, "127.0.0.1", 8001, sys.executable)
    i = cmd.index("--lora-scaled")
    assert cmd[i:i + 4] == ["--lora-scaled", "/l/sql.gguf:0", "--lora-scaled", "/l/c:1.gguf:0"]
    assert RUNTIME_LORA_ENV not in build_env(spec, {})


# -- agent-launched simulators ------------------------------------------------------------------
@pytest.mark.anyio
async def test_agent_launched_vllm_sim_serves_static_adapters_and_runtime_loading(tmp_path, groups):  # noqa: F811
    h = Harness(tmp_path, groups)
    lora = LoraLaunch(max_loras=2, max_rank=16, adapters=(("sql", "/l/sql"),))
    async with running(h):
        h.sup.apply([sim_spec(lora=lora)])
        ready = await h.wait_for("ready")
        async with httpx.AsyncClient(timeout=10.0) as c:
            models = (await c.get(ready.url + "/v1/models")).json()["data"]
            assert {(d["id"], d["parent"]) for d in models} == {("m", None), ("sql", "m")}
            r = await c.post(ready.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/l/x"})
            assert r.status_code == 200, r.text  # the runtime API is on


@pytest.mark.anyio
async def test_agent_launched_llamacpp_sim_lists_its_adapters_in_order(tmp_path, groups):  # noqa: F811
    files = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for f in files:
        f.write_bytes(b"GGUF")
    h = Harness(tmp_path, groups)
    lora = LoraLaunch(adapters=(("a", str(files[0])), ("b", str(files[1]))))
    async with running(h):
        h.sup.apply([sim_spec(engine="llamacpp", lora=lora, args=("--sim-zero-cost", "--sim-lora-require-path"))])
        ready = await h.wait_for("ready")
        async with httpx.AsyncClient(timeout=10.0) as c:
            listed = (await c.get(ready.url + "/lora-adapters")).json()
    assert [(a["id"], a["path"], a["scale"]) for a in listed] == [(0, str(files[0]), 0.0), (1, str(files[1]), 0.0)]


@pytest.mark.anyio
async def test_missing_adapter_file_fails_the_engine_with_the_reason_in_its_log_tail(tmp_path, groups):  # noqa: F811
    h = Harness(tmp_path, groups)
    missing = str(tmp_path / "gone.gguf")
    lora = LoraLaunch(adapters=(("gone", missing),))
    async with running(h):
        h.sup.apply([sim_spec(engine="llamacpp", lora=lora, args=("--sim-zero-cost", "--sim-lora-require-path"))])
        bad = await h.wait_for("crashed")
    assert any(missing in line and "not found" in line for line in bad.log_tail), bad.log_tail
    assert json.dumps(bad.to_wire())  # what the router and `ctl replicas` show


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_an_adopted_model_keeps_the_adapters_its_engine_started_with(engine):
    from llmgw.daemon.control.plane.unknown_engines import adopted_model
    m = parse_config(_cfg(engine, TWO, "max_loaded_adapters = 3\n")).models[0]
    spec = deploy_of(m).spec_for("m/1", (), 2)
    back = adopted_model(spec, 1, ())
    assert back is not None and deploy_of(back).spec_for("m/1", (), 2) == spec  # kept, not restarted
