"""Prefill/decode disaggregation over real processes: a simulated prefiller and decoder started
with --kv-transfer-config, driven through the two legs exactly as vLLM's toy proxy sends them."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import httpx
import pytest

from .conftest import SimProc
from .test_sim_vllm import metric, metrics, wait_for

PROXY_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
ANSWER_KEYS = ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
               "remote_request_id", "remote_host", "remote_port", "tp_size"]
PROMPT = "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up. " * 3
LAB = {"model_name": "sim-model"}


def _cfg(role: str, policy: str | None = None) -> str:
    cfg = {"kv_connector": "NixlConnector", "kv_role": role}
    if policy:
        cfg["kv_load_failure_policy"] = policy
    return json.dumps(cfg)


def _start(sim_factory: Any, *extra: str) -> SimProc:
    return sim_factory(["sim-model", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost", *extra])


def _prefill_leg(url: str, path: str, body: dict[str, Any], rid: str) -> httpx.Response:
    """The prefill leg as toy_proxy_server.py builds it."""
    leg = dict(body, kv_transfer_params=dict(PROXY_PARAMS), stream=False, max_tokens=1)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        leg.pop(k, None)
    return httpx.post(f"{url}{path}", json=leg, headers={"X-Request-Id": rid}, timeout=30)


def _decode_leg(url: str, path: str, body: dict[str, Any], params: Any, rid: str) -> httpx.Response:
    leg = dict(body, kv_transfer_params=params) if params else dict(body)
    return httpx.post(f"{url}{path}", json=leg, headers={"X-Request-Id": rid}, timeout=30)


def _no_tracebacks(*sims: SimProc) -> None:
    for s in sims:
        log = "".join(s.stderr)
        assert "Traceback" not in log and " ERROR " not in log and "ERROR:" not in log, log[-2000:]


@pytest.fixture
def pd(sim_factory: Any) -> tuple[SimProc, SimProc]:
    p = _start(sim_factory, "--kv-transfer-config", _cfg("kv_producer"))
    d = _start(sim_factory, "--kv-transfer-config", _cfg("kv_consumer", "recompute"))
    return p, d


def test_two_legs_completions_then_chat_stream(pd: tuple[SimProc, SimProc]) -> None:
    p, d = pd
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8, "min_tokens": 2}
    rid = str(uuid.uuid4())
    pre = _prefill_leg(p.url, "/v1/completions", body, rid)
    assert pre.status_code == 200
    out = pre.json()
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 1
    params = out["kv_transfer_params"]
    assert list(params) == ANSWER_KEYS
    n_prompt = out["usage"]["prompt_tokens"]
    n_blocks = -(-n_prompt // 16)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == n_blocks and all(isinstance(b, int) for b in params["remote_block_ids"])
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == p.info["port"]
    assert isinstance(params["remote_engine_id"], str) and params["remote_request_id"].startswith("cmpl-")
    assert params["tp_size"] == 1
    # The prefiller holds the blocks (counted in its KV usage) until the decoder reads them.
    assert metric(p.url, "llmgw_sim_kv_transfer_pinned_blocks") == n_blocks
    assert metric(p.url, "vllm:kv_cache_usage_perc", **LAB) > 0

    dec = _decode_leg(d.url, "/v1/completions", body, params, rid)
    assert dec.status_code == 200
    res = dec.json()
    assert res["choices"][0]["finish_reason"] == "length" and res["usage"]["completion_tokens"] == 8
    assert res["usage"]["prompt_tokens"] == n_prompt and res["kv_transfer_params"] is None
    m = metrics(d.url)
    lab = '{engine="0",model_name="sim-model"}'
    assert m[f"vllm:external_prefix_cache_hits_total{lab}"] == n_prompt  # the prompt came from P ...
    assert m[f"vllm:external_prefix_cache_queries_total{lab}"] == n_prompt
    assert m[f"vllm:prefix_cache_hits_total{lab}"] == 0  # ... not from D's own cache
    assert m["llmgw_sim_kv_transfer_blocks_total"] == n_blocks
    assert m[f"vllm:nixl_xfer_time_seconds_count{lab}"] == 1 and m["llmgw_sim_kv_transfer_seconds_count"] == 1
    assert m[f"vllm:nixl_num_failed_transfers_total{lab}"] == 0
    assert metric(p.url, "llmgw_sim_kv_transfer_pinned_blocks") == 0
    assert metric(p.url, "llmgw_sim_kv_transfer_reads_total") == 1
    assert metric(p.url, "vllm:kv_cache_usage_perc", **LAB) == 0

    # Chat, streamed on the decode leg; the prompt's first blocks are now cached on D.
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}}
    rid = str(uuid.uuid4())
    pre = _prefill_leg(p.url, "/v1/chat/completions", chat, rid).json()
    assert pre["choices"][0]["finish_reason"] == "length" and list(pre["kv_transfer_params"]) == ANSWER_KEYS
    n_chat = pre["usage"]["prompt_tokens"]
    leg = dict(chat, kv_transfer_params=pre["kv_transfer_params"])
    with httpx.stream("POST", f"{d.url}/v1/chat/completions", json=leg, headers={"X-Request-Id": rid},
                      timeout=30) as r:
        assert r.status_code == 200
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c.get("kv_transfer_params") is None for c in chunks)
    hits = metric(d.url, "vllm:external_prefix_cache_hits_total", **LAB)
    assert n_prompt < hits <= n_prompt + n_chat
    assert metric(d.url, "llmgw_sim_kv_transfer_failures_total", reason="not_found") == 0
    _no_tracebacks(p, d)


def test_blocks_read_already_or_prefiller_gone_recompute(pd: tuple[SimProc, SimProc]) -> None:
    p, d = pd
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 3}
    params = _prefill_leg(p.url, "/v1/completions", body, "r1").json()["kv_transfer_params"]
    assert _decode_leg(d.url, "/v1/completions", body, params, "r1").status_code == 200
    again = _decode_leg(d.url, "/v1/completions", body, params, "r1")  # the blocks were read: gone
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
    assert metric(d.url, "llmgw_sim_kv_transfer_failures_total", reason="not_found") == 1
    assert metric(d.url, "vllm:nixl_num_failed_transfers_total", **LAB) == 1
    # The second time the prompt was computed on D (a local prefix hit, no external tokens).
    assert metric(d.url, "vllm:external_prefix_cache_hits_total", **LAB) == \
        metric(d.url, "vllm:external_prefix_cache_queries_total", **LAB) / 2

    params = _prefill_leg(p.url, "/v1/completions", body, "r2").json()["kv_transfer_params"]
    p.stop()
    gone = _decode_leg(d.url, "/v1/completions", body, params, "r2")
    assert gone.status_code == 200 and gone.json()["choices"][0]["finish_reason"] == "length"
    assert metric(d.url, "llmgw_sim_kv_transfer_failures_total", reason="unreachable") == 1
    _no_tracebacks(d)


def test_policy_fail_answers_vllms_error(sim_factory: Any) -> None:
    p = _start(sim_factory, "--kv-transfer-config", _cfg("kv_producer"))
    d = _start(sim_factory, "--kv-transfer-config", _cfg("kv_consumer"))  # "fail": 0.33's default
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 3}
    params = _prefill_leg(p.url, "/v1/completions", body, "r").json()["kv_transfer_params"]
    assert _decode_leg(d.url, "/v1/completions", body, params, "r").status_code == 200
    r = _decode_leg(d.url, "/v1/completions", body, params, "r")
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "Internal server error", "type": "InternalServerError",
                                  "param": None, "code": 500}}
    s = _decode_leg(d.url, "/v1/completions", dict(body, stream=True), params, "r")
    assert s.status_code == 200
    events = [e for e in s.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["error"]["code"] == 500
    assert metric(d.url, "vllm:request_success_total", finished_reason="error") == 2
    assert metric(d.url, "llmgw_sim_kv_transfer_failures_total", reason="not_found") == 2
    assert httpx.get(f"{d.url}/health").status_code == 200
    _no_tracebacks(p, d)


def test_eos_first_token_gives_null_params_and_frees(sim_factory: Any) -> None:
    p = _start(sim_factory, "--kv-transfer-config", _cfg("kv_both"), "--sim-output-len", "1")
    out = _prefill_leg(p.url, "/v1/completions", {"model": "sim-model", "prompt": PROMPT}, "r").json()
    assert out["choices"][0]["finish_reason"] == "stop" and out["kv_transfer_params"] is None
    assert metric(p.url, "llmgw_sim_kv_transfer_pinned_blocks") == 0
    assert metric(p.url, "vllm:kv_cache_usage_perc", **LAB) == 0


def test_unread_blocks_expire_after_the_timeout(sim_factory: Any) -> None:
    p = _start(sim_factory, "--kv-transfer-config", _cfg("kv_both", "recompute"),
               "--sim-kv-transfer-timeout-s", "0.3")
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    params = _prefill_leg(p.url, "/v1/completions", body, "r").json()["kv_transfer_params"]
    assert params is not None
    wait_for(lambda: metric(p.url, "llmgw_sim_kv_transfer_expired_total") == 1)
    assert metric(p.url, "llmgw_sim_kv_transfer_pinned_blocks") == 0
    assert metric(p.url, "vllm:kv_cache_usage_perc", **LAB) == 0
    # kv_both: the same engine decodes; the read finds nothing and it recomputes.
    r = _decode_leg(p.url, "/v1/completions", body, params, "r")
    assert r.status_code == 200 and metric(p.url, "llmgw_sim_kv_transfer_failures_total", reason="not_found") == 1
    assert any("Releasing expired KV blocks" in line for line in p.stderr)
    _no_tracebacks(p)


def test_side_channel_and_params_without_a_connector(sim_factory: Any) -> None:
    p = _start(sim_factory, "--kv-transfer-config", _cfg("kv_producer"))
    read = f"{p.url}/_sim/kv_transfer/read"
    assert httpx.post(read, json={"remote_request_id": "nope"}).status_code == 404
    assert httpx.post(read, content=b"{bad").status_code == 400
    assert httpx.post(read, content=b"[" * 100_000).status_code == 400  # too deep: refused, not a traceback
    params = _prefill_leg(p.url, "/v1/completions", {"model": "sim-model", "prompt": PROMPT}, "r").json()[
        "kv_transfer_params"]
    wrong = httpx.post(read, json={"remote_request_id": params["remote_request_id"], "remote_block_ids": [99999]})
    assert wrong.status_code == 409
    assert httpx.post(read, json={"remote_request_id": params["remote_request_id"],
                                  "remote_engine_id": "another"}).status_code == 409
    ok = httpx.post(read, json={k: v for k, v in params.items()
                                if k in ("remote_request_id", "remote_block_ids", "remote_engine_id")})
    assert ok.status_code == 200 and ok.json()["num_blocks"] == len(params["remote_block_ids"])

    plain = _start(sim_factory)  # no --kv-transfer-config: the field is ignored, as vLLM ignores it
    out = _prefill_leg(plain.url, "/v1/completions", {"model": "sim-model", "prompt": PROMPT}, "r").json()
    assert out["kv_transfer_params"] is None
    assert httpx.post(f"{plain.url}/_sim/kv_transfer/read", json={"remote_request_id": "x"}).status_code == 404
    bad = httpx.post(f"{plain.url}/v1/completions", json={"prompt": "x", "kv_transfer_params": [1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
    _no_tracebacks(p, plain)


@pytest.mark.parametrize("args,words", [
    (["--kv-transfer-config", "{not json"], "not valid JSON"),
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector"}'], "kv_role is required"),
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "prefiller"}'], "unsupported kv_role"),
    (["--kv-transfer-config.kv_connector", "NixlConnector"], "kv_role is required"),  # vLLM's dotted form
    (["--kv-transfer-config.kv_connector=NixlConnector", "--kv-transfer-config.kv_role", "kv_both",
      "--kv-transfer-config.kv_load_failure_policy", "never"], "kv_load_failure_policy"),
])
def test_bad_kv_transfer_config_exits_naming_the_flag(args: list[str], words: str) -> None:
    out = subprocess.run([sys.executable, "-m", "llmgw", "sim", "sim-model", "--port", "0", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--kv-transfer-config" in out.stderr and words in out.stderr
    assert "Traceback" not in out.stderr
