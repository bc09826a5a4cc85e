"""The metric contract per engine kind, on real-looking /metrics bodies from our simulators."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from llmgw.config import MetricNames
from llmgw.route.contract import CONTRACTS, DrainRate, ScrapeResult, contract_for, evaluate, scrape
from llmgw.route.prom import parse
from llmgw.sim.llamacpp_core import Metrics as LlamaMetrics
from llmgw.sim.llamacpp_surface import metrics_text
from llmgw.sim.vllm_metrics import VllmMetrics


def fake_core(running: int = 3, waiting: int = 2, kv: float = 0.25, queries: int = 1000, hits: int = 400,
              loras: tuple[set[str], set[str]] = (set(), set())) -> Any:
    return SimpleNamespace(num_running=running, num_waiting=waiting, kv_usage=lambda: kv, prefix_queries=queries,
                           prefix_hits=hits, ext_queries=0, ext_hits=0, num_preemptions=0,
                           running_loras=lambda: loras[0], waiting_loras=lambda: loras[1])


def vllm_body(version: tuple[int, ...] = (0, 12, 0), *, engine: str = "0", success: dict[str, int] | None = None,
              **kw: Any) -> bytes:
    core_kw = {k: kw.pop(k) for k in list(kw) if k in ("running", "waiting", "kv", "queries", "hits", "loras")}
    m = VllmMetrics(fake_core(**core_kw), "sim-model", version, **kw)
    m.labels["engine"] = engine  # the gauges and counters are labelled at scrape time
    m.success.update(success or {})
    return m.render()


def llama_body(processing: int = 1, deferred: int = 4, prompt: int = 700, cached: int = 300) -> str:
    core = SimpleNamespace(metrics=LlamaMetrics(prompt_tokens=prompt, prompt_cached=cached, predicted_tokens=50),
                           requests_processing=processing, requests_deferred=deferred)
    return metrics_text(core)  # type: ignore[arg-type]


# -- vLLM --------------------------------------------------------------------------------------
def test_vllm_current_names() -> None:
    body = vllm_body((0, 12, 0), success={"stop": 7, "length": 2, "abort": 1},
                     cache_info={"num_gpu_blocks": "2048", "block_size": "16", "enable_prefix_caching": "True"})
    r = scrape("vllm", None, body)
    assert r.ok, r.errors
    assert (r.running, r.waiting, r.kv_usage) == (3.0, 2.0, 0.25)
    assert r.finished_total == 10.0  # summed over finished_reason, aborts included
    assert (r.prefix_queries_total, r.prefix_hits_total) == (1000.0, 400.0)
    assert (r.kv_blocks, r.block_size, r.kv_capacity_tokens) == (2048, 16, 2048 * 16)
    assert r.names_used["kv_usage"] == "vllm:kv_cache_usage_perc"
    assert r.engines == 1 and r.lora_max is None and r.lora_running == ()
    # the full parse gives the same answer as the filtered fast path
    assert evaluate("vllm", None, parse(body)) == r


def test_vllm_old_kv_name_only() -> None:
    # An old engine that only has vllm:gpu_* names (0.10.x had both; drop the new ones).
    text = vllm_body((0, 10, 1), kv=0.5).decode()
    old_only = "\n".join(ln for ln in text.splitlines()
                         if "kv_cache_usage_perc" not in ln and "vllm:prefix_cache_" not in ln)
    r = scrape("vllm", None, old_only)
    assert r.ok and r.kv_usage == 0.5
    assert r.names_used["kv_usage"] == "vllm:gpu_cache_usage_perc"
    assert r.names_used["prefix_queries"] == "vllm:gpu_prefix_cache_queries_total"
    assert (r.prefix_queries_total, r.prefix_hits_total) == (1000.0, 400.0)


def test_vllm_both_kv_names_prefers_the_new_one() -> None:
    text = vllm_body((0, 10, 1), kv=0.5).decode() + 'vllm:gpu_cache_usage_perc{engine="9"} 0.9\n'
    r = scrape("vllm", None, text)
    assert r.kv_usage == 0.5 and r.names_used["kv_usage"] == "vllm:kv_cache_usage_perc"
    assert r.prefix_queries_total == 1000.0  # new and old prefix counters are never added up


def test_missing_mandatory_metrics_are_listed_errors() -> None:
    text = "\n".join(ln for ln in vllm_body().decode().splitlines() if "num_requests_running" not in ln)
    r = scrape("vllm", None, text)
    assert not r.ok
    assert r.errors == ["missing mandatory metric vllm:num_requests_running"]
    assert r.running is None and r.waiting == 2.0 and r.kv_usage == 0.25  # the rest is still read
    text = "\n".join(ln for ln in text.splitlines() if "cache_usage_perc" not in ln)
    r = scrape("vllm", None, text)
    assert r.errors == ["missing mandatory metric vllm:num_requests_running",
                        "missing mandatory metric vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc"]


def test_empty_body_lists_all_three() -> None:
    r = scrape("vllm", None, b"")
    assert len(r.errors) == 3 and all(e.startswith("missing mandatory metric") for e in r.errors)


def test_overrides_replace_names() -> None:
    text = ('my_running{x="a"} 4\nmy_running{x="b"} 1\nmy_waiting 7\nmy_kv 0.75\n'
            'vllm:num_requests_running 99\nvllm:kv_cache_usage_perc 0.1\n')
    for ov in (MetricNames(running="my_running", waiting="my_waiting", kv_usage="my_kv"),
               {"running": "my_running", "waiting": "my_waiting", "kv_usage": "my_kv"}):
        r = scrape("vllm", ov, text)
        assert r.ok and (r.running, r.waiting, r.kv_usage) == (5.0, 7.0, 0.75)
        assert r.names_used == {"running": "my_running", "waiting": "my_waiting", "kv_usage": "my_kv"}
    # a partial override keeps the other defaults
    r = scrape("vllm", MetricNames(waiting="my_waiting"), text)
    assert (r.running, r.waiting, r.kv_usage) == (99.0, 7.0, 0.1)
    # an overridden name that is missing is an error naming it
    r = scrape("vllm", {"kv_usage": "nope"}, text)
    assert r.errors == ["missing mandatory metric vllm:num_requests_waiting", "missing mandatory metric nope"]
    assert contract_for("vllm", MetricNames()) is CONTRACTS["vllm"]


def test_data_parallel_sums_running_waiting_and_averages_kv() -> None:
    bodies = [vllm_body(engine="0", running=3, waiting=1, kv=0.2, success={"stop": 5},
                        cache_info={"num_gpu_blocks": "1000", "block_size": "16"}),
              vllm_body(engine="1", running=4, waiting=2, kv=0.6, success={"stop": 6},
                        cache_info={"num_gpu_blocks": "1000", "block_size": "16"})]
    # the simulator labels its cache_config_info engine="0" always; vLLM labels it per engine
    bodies[1] = bodies[1].replace(b'block_size="16",engine="0"', b'block_size="16",engine="1"')
    r = scrape("vllm", None, b"".join(bodies))
    assert r.ok, r.errors
    assert (r.running, r.waiting, r.engines) == (7.0, 3.0, 2)
    assert r.kv_usage == pytest.approx(0.4)
    assert r.finished_total == 11.0
    assert r.kv_blocks == 2000 and r.kv_capacity_tokens == 32000


def test_lora_info_takes_the_newest_sample() -> None:
    text = ('vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e9\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora,chat-lora",'
            'waiting_lora_adapters="x"} 1.8e9\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="nan",waiting_lora_adapters=""} NaN\n')
    r = scrape("vllm", None, text)
    assert r.lora_max == 2 and r.lora_running == ("sql-lora", "chat-lora") and r.lora_waiting == ("x",)
    r = scrape("vllm", None, vllm_body(lora_enabled=True, max_loras=3, loras=({"a"}, {"b", "c"})))
    assert r.lora_max == 3 and r.lora_running == ("a",) and r.lora_waiting == ("b", "c")


def test_bad_values_are_errors_not_exceptions() -> None:
    base = "vllm:num_requests_running NaN\nvllm:num_requests_waiting 1\n"
    r = scrape("vllm", None, base + "vllm:kv_cache_usage_perc 57\n")
    assert r.errors == ["metric vllm:num_requests_running has no finite value",
                        "metric vllm:kv_cache_usage_perc = 57 is not a fraction 0..1 (a percentage?)"]
    r = scrape("vllm", None, "vllm:num_requests_running 1\nvllm:num_requests_waiting 1\n"
                             "vllm:kv_cache_usage_perc 1.0000000001\n")
    assert r.ok and r.kv_usage == 1.0


def test_garbage_bodies() -> None:
    r = scrape("vllm", None, b"<html>502 Bad Gateway</html>")
    assert r.errors and r.errors[0].startswith("not Prometheus text")
    r = scrape("vllm", None, b"\x00\x01garbage")
    assert not r.ok and r.running is None
    r = scrape("vllm", None, "vllm:num_requests_running{ 1\nvllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0\n")
    assert r.errors == ["missing mandatory metric vllm:num_requests_running"] and r.malformed_lines == 1


def test_unknown_kind_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        evaluate("tgi", None, [])


# -- llama.cpp ---------------------------------------------------------------------------------
def test_llamacpp_current_build_has_no_kv_metric_and_that_is_fine() -> None:
    body = llama_body(processing=2, deferred=5, prompt=700, cached=300)
    for name in ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:tokens_predicted_total"):
        assert name in body  # the names of llamacpp.md, from our simulator
    r = scrape("llamacpp", None, body)
    assert r.ok, r.errors
    assert (r.running, r.waiting, r.kv_usage) == (2.0, 5.0, None)
    assert r.finished_total is None  # no finished-request counter: the router counts completions
    assert (r.prefix_queries_total, r.prefix_hits_total) == (1000.0, 300.0)
    assert r.kv_capacity_tokens is None


def test_llamacpp_old_build_kv_ratio_is_used() -> None:
    body = llama_body() + "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.42\n" \
                          "llamacpp:kv_cache_tokens 1234\n"
    r = scrape("llamacpp", None, body)
    assert r.ok and r.kv_usage == 0.42


def test_llamacpp_missing_mandatory_and_kv_override() -> None:
    r = scrape("llamacpp", None, "llamacpp:requests_processing 1\n")
    assert r.errors == ["missing mandatory metric llamacpp:requests_deferred"]
    r = scrape("llamacpp", {"kv_usage": "my:kv"}, llama_body())
    assert r.errors == ["missing mandatory metric my:kv"]  # asked for by name: now mandatory


def test_contract_names_cover_what_evaluate_reads() -> None:
    n = contract_for("vllm").names()
    assert {"vllm:num_requests_running", "vllm:request_success_total", "vllm:cache_config_info",
            "vllm:lora_requests_info", "vllm:gpu_prefix_cache_hits_total"} <= n
    assert "llamacpp:kv_cache_usage_ratio" in contract_for("llamacpp").names()
    assert CONTRACTS["llamacpp"].notes  # the stand-ins are stated


def test_scrape_result_defaults() -> None:
    r = ScrapeResult(kind="vllm")
    assert r.ok and r.errors == []


# -- drain rate --------------------------------------------------------------------------------
def test_drain_rate_over_window() -> None:
    d = DrainRate(window=10.0)
    assert d.rate() is None
    d.observe(0.0, 100)
    assert d.rate() is None
    d.observe(1.0, 105)
    assert d.rate() == 5.0
    for t in range(2, 21):
        d.observe(float(t), 105 + 2 * (t - 1))  # 2/s from now on
    assert d.rate() == pytest.approx(2.0)  # the 5/s second fell out of the window
    assert d.rate(now=40.0) is None  # no observation in the last 10 s: unknown


def test_drain_rate_counter_reset() -> None:
    d = DrainRate(window=60.0)
    d.observe(0.0, 1000)
    d.observe(10.0, 1100)  # 10/s
    d.observe(20.0, 30)  # engine restarted: 30 since the restart
    d.observe(30.0, 130)
    assert d.resets == 1
    assert d.rate() == pytest.approx((100 + 30 + 100) / 30.0)
    assert d.rate() >= 0


def test_drain_rate_ignores_bad_observations() -> None:
    d = DrainRate(window=60.0)
    d.observe(10.0, 10)
    d.observe(10.0, 50)  # same time
    d.observe(5.0, 60)  # time going back
    d.observe(11.0, math.nan)
    d.observe(12.0, 20)
    assert d.rate() == pytest.approx(5.0)
    d.clear()
    assert d.rate() is None
    with pytest.raises(ValueError):
        DrainRate(window=0)


def test_drain_rate_from_simulated_scrapes() -> None:
    d = DrainRate(window=30.0)
    for t, done in ((0.0, 0), (5.0, 10), (10.0, 25)):
        r = scrape("vllm", None, vllm_body(success={"stop": done, "length": 1}))
        assert r.finished_total is not None
        d.observe(t, r.finished_total)
    assert d.rate() == pytest.approx(2.5)
