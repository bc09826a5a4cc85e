"""Every metric name the router scrapes can be renamed per model, and vLLM's old and new
spellings both work by default (issue 21 item 19): the pure contract and config here, then a
router in front of three engines — vLLM ≤ 0.10's spelling, today's, and a renamed one — over
real sockets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.config import ConfigError, MetricNames, model_from_dict, parse_config
from llmgw.route.contract import CONTRACTS, ROLES, contract_for, scrape

from .stub_engine import COMPLETION, StubEngine, answer
from .test_router_integration import Daemon
from .test_sim_vllm import wait_for

LORA = 'max_lora="2",running_lora_adapters="a1",waiting_lora_adapters=""'
CACHE = 'block_size="16",num_gpu_blocks="512",engine="0"'


def body(names: dict[str, str]) -> bytes:
    """A /metrics body with every role of the contract, under the given names."""
    return (f'{names["running"]}{{engine="0"}} 2\n{names["waiting"]}{{engine="0"}} 1\n'
            f'{names["kv_usage"]}{{engine="0"}} 0.25\n'
            f'{names["finished"]}{{finished_reason="stop",engine="0"}} 40\n'
            f'{names["prefix_queries"]}{{engine="0"}} 1000\n{names["prefix_hits"]}{{engine="0"}} 300\n'
            f'{names["cache_info"]}{{{CACHE}}} 1\n{names["lora_info"]}{{{LORA}}} 1.7e9\n').encode()


NEW = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
       "kv_usage": "vllm:kv_cache_usage_perc", "finished": "vllm:request_success_total",
       "prefix_queries": "vllm:prefix_cache_queries_total", "prefix_hits": "vllm:prefix_cache_hits_total",
       "cache_info": "vllm:cache_config_info", "lora_info": "vllm:lora_requests_info"}
OLD = {**NEW, "kv_usage": "vllm:gpu_cache_usage_perc", "prefix_queries": "vllm:gpu_prefix_cache_queries_total",
       "prefix_hits": "vllm:gpu_prefix_cache_hits_total"}  # vLLM 0.10 (and 0.11 with hidden metrics)
RENAMED = {role: f"fork:{role}" + ("_total" if role in ("finished", "prefix_queries", "prefix_hits") else "")
           for role in ROLES}


def _read_all(r: Any) -> None:
    assert r.ok, r.errors
    assert (r.running, r.waiting, r.kv_usage, r.finished_total) == (2.0, 1.0, 0.25, 40.0)
    assert (r.prefix_queries_total, r.prefix_hits_total) == (1000.0, 300.0)
    assert (r.kv_blocks, r.block_size, r.lora_max, r.lora_running) == (512, 16, 2, ("a1",))


# -- the pure contract ------------------------------------------------------------------------------
@pytest.mark.parametrize("names", [NEW, OLD], ids=["new", "old"])
def test_both_spellings_are_read_by_default(names: dict[str, str]) -> None:
    r = scrape("vllm", None, body(names))
    _read_all(r)
    assert r.names_used == names


def test_every_role_can_be_renamed() -> None:
    ov = MetricNames(**RENAMED)
    r = scrape("vllm", ov, body(RENAMED) + body(NEW).replace(b" 2\n", b" 99\n"))  # the defaults, ignored
    _read_all(r)
    assert r.names_used == RENAMED
    assert contract_for("vllm", ov).names() == frozenset(RENAMED.values())


def test_a_renamed_optional_metric_that_is_missing_is_an_error_naming_it() -> None:
    r = scrape("vllm", {"finished": "fork:done_total", "cache_info": "fork:cache"}, body(NEW))
    assert r.errors == ["missing mandatory metric fork:done_total", "missing mandatory metric fork:cache"]
    assert r.running == 2.0 and r.finished_total is None and r.kv_blocks is None  # no silent fallback
    r = scrape("vllm", {"cache_info": "vllm:num_requests_running"}, body(NEW))  # there, but no such labels
    assert r.errors == ["metric vllm:num_requests_running has no usable value "
                        "(with num_gpu_blocks and block_size labels)"]
    # without overrides, an optional metric's absence is no error
    assert scrape("vllm", None, body(NEW).split(b"vllm:request_success")[0]).ok
    assert contract_for("vllm", MetricNames()) is CONTRACTS["vllm"]


def test_llamacpp_takes_a_finished_counter_when_one_is_named() -> None:
    text = ("llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n"
            "llamacpp:prompt_tokens_total 700\nllamacpp:prompt_tokens_cached_total 300\nproxy:done_total 9\n")
    assert scrape("llamacpp", None, text).finished_total is None
    r = scrape("llamacpp", {"finished": "proxy:done_total"}, text)
    assert r.ok and r.finished_total == 9.0 and r.prefix_queries_total == 1000.0


# -- config -----------------------------------------------------------------------------------------
MODEL = '[[models]]\nname = "m"\nengine = "vllm"\nmetrics = {{ {} }}\n[[models.replicas]]\nurl = "http://a:1"\n'


def _problems(metrics: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_config(MODEL.format(metrics), "t.toml")
    return [(p.key, p.message) for p in info.value.problems]


def test_config_accepts_every_name_and_names_the_bad_field() -> None:
    cfg = parse_config(MODEL.format(", ".join(f'{k} = "{v}"' for k, v in RENAMED.items())))
    assert cfg.models[0].metrics == MetricNames(**RENAMED)
    assert _problems('finished = "vllm:request success"') == [
        ("models[0].metrics.finished", "not a Prometheus metric name (letters, digits, '_' and ':', "
                                       "not starting with a digit): 'vllm:request success'")]
    assert _problems('prefix_hits = "x_total"') == [
        ("models[0].metrics.prefix_queries", "prefix_queries and prefix_hits go together")]
    assert _problems('lora_infos = "x"') == [
        ("models[0].metrics.lora_infos", "unknown key (did you mean 'lora_info'?)")]
    with pytest.raises(ConfigError) as info:  # a model given to the admin API: the same checks
        model_from_dict({"name": "m", "engine": "vllm", "metrics": {"prefix_queries": "q_total"},
                         "replicas": [{"url": "http://a:1"}]})
    assert [(p.key, p.message) for p in info.value.problems] == [
        ("metrics.prefix_hits", "prefix_queries and prefix_hits go together")]


# -- over real sockets ------------------------------------------------------------------------------
def _engine(names: dict[str, str]) -> StubEngine:
    metrics = body(names)

    def handle(conn: Any, method: str, path: str, _: bytes) -> None:
        if path == "/metrics":
            conn.sendall(answer(200, metrics, [("content-type", "text/plain")]))
        elif path == "/v1/models":
            conn.sendall(answer(200, b'{"object":"list","data":[]}'))
        else:
            conn.sendall(answer(200, COMPLETION))
    return StubEngine(handle)


def test_a_router_reads_old_new_and_renamed_engines(tmp_path: Path) -> None:
    engines = {"old": _engine(OLD), "new": _engine(NEW), "renamed": _engine(RENAMED)}
    sock = tmp_path / "admin.sock"
    lines = ["[server]", 'host = "127.0.0.1"', "[router]", "scrape_interval_s = 0.2",
             "[control]", f"store = {json.dumps(str(tmp_path / 'router.db'))}",
             "[admin]", f"socket = {json.dumps(str(sock))}"]
    for name, eng in engines.items():
        lines += ["[[models]]", f'name = "{name}"', 'engine = "vllm"']
        if name == "renamed":
            lines.append("metrics = { " + ", ".join(f'{k} = "{v}"' for k, v in RENAMED.items()) + " }")
        lines += ["[[models.replicas]]", f"url = {json.dumps(eng.url)}"]
    cfg = tmp_path / "llmgw.toml"
    cfg.write_text("\n".join(lines) + "\n")
    d = Daemon(cfg)
    try:
        admin = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x")

        def scraped() -> dict[str, Any]:
            return {e["model"]: e for e in admin.get("/api/v1/endpoints").json() if e.get("scrape")}
        # (a scrape can time out on a loaded machine: wait for one that was read)
        wait_for(lambda: [e["scrape_error"] for e in scraped().values()] == [None] * 3)
        for model, e in scraped().items():
            s = e["scrape"]
            assert e["scrape_error"] is None and s["errors"] == [], (model, e)
            assert (e["running"], e["waiting"], e["kv_usage"]) == (2.0, 1.0, 0.25), model
            assert (s["finished_total"], s["prefix_queries_total"], s["prefix_hits_total"]) == (40.0, 1000.0, 300.0)
            assert (s["kv_blocks"], s["block_size"], s["lora_max"], s["lora_running"]) == (512, 16, 2, ["a1"])
        r = httpx.post(f"{d.url}/v1/completions", json={"model": "renamed", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
    finally:
        d.stop()
        for eng in engines.values():
            eng.stop()


def test_a_bad_metric_name_in_the_file_is_refused_naming_the_field(tmp_path: Path) -> None:
    cfg = tmp_path / "llmgw.toml"
    cfg.write_text(MODEL.format('prefix_queries = "vllm:prefix_cache_queries_total"'))
    p = subprocess.run([sys.executable, "-m", "llmgw", "config", "check", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode != 0
    assert "models[0].metrics.prefix_hits: prefix_queries and prefix_hits go together" in p.stdout + p.stderr
