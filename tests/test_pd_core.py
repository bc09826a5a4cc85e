"""Prefill/decode disaggregation in the router's pure core: which requests are split, the prefill
step's form and decision, the decoder's body and decision, every fallback, the trace's phases and
what is counted."""

from __future__ import annotations

import json
import random

from llmgw.config import parse_config
from llmgw.route.attempt import Attempt
from llmgw.route.breaker import FailureKind
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import RouterCore
from llmgw.route.pd import PREFILL_PARAMS, read_prefill_answer
from llmgw.route.replicas import ReplicaTable

CFG = """
[[models]]
name = "m"
engine = "vllm"
[models.pd]
min_prompt_tokens = 50
[[models.replicas]]
url = "http://127.0.0.1:9001"
role = "prefill"
[[models.replicas]]
url = "http://127.0.0.1:9002"
role = "decode"
[[models.replicas]]
url = "http://127.0.0.1:9003"
role = "decode"
"""
LONG = "x " * 400  # ~200 tokens by the estimate (chars / 4)
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
          "remote_engine_id": "e1", "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 9001,
          "tp_size": 1}


def core(cfg_text: str = CFG) -> RouterCore:
    cfg = parse_config(cfg_text)
    return RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0, rng=random.Random(0))


def body(content: str, **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 20,
                       "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2, **extra}).encode()


def answer(params: object) -> bytes:
    return json.dumps({"id": "c", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "length"}],
        "kv_transfer_params": params}).encode()


def prefill_attempt(c: RouterCore, rid: str = "a", content: str = LONG) -> tuple[object, Attempt]:
    p = c.plan("chat", body(content), rid, strategy=None, session=None, now=0.0)
    a = c.next(p, 0.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "prefill"
    a.sent_at = 0.0
    return p, a


def test_a_long_prompt_is_prefilled_then_decoded_with_the_prefillers_params() -> None:
    c = core()
    p, a = prefill_attempt(c)
    assert a.replica.id == "m/0"  # the only prefiller
    sent = json.loads(a.body)  # type: ignore[arg-type]
    # vLLM's proxy's form: params asking for a remote decode, one token, not streamed, no min_tokens
    assert sent["kv_transfer_params"] == PREFILL_PARAMS
    assert sent["stream"] is False and sent["max_tokens"] == 1
    assert "stream_options" not in sent and "min_tokens" not in sent
    assert a.first_byte_timeout == 60.0  # [models.pd] prefill_timeout_s
    assert c.decisions[-1].phase == "prefill" and c.decisions[-1].strategy == "prefill"
    c.prefilled(p, a, 0.2, None, status=200, data=answer(PARAMS))  # type: ignore[arg-type]
    assert a.ended and a.replica.view.inflight == 0
    d = c.next(p, 0.2, 0.0)  # type: ignore[arg-type]
    assert isinstance(d, Attempt) and d.phase == "decode" and d.replica.view.role == "decode"
    sent = json.loads(d.body)  # type: ignore[arg-type]
    assert sent["kv_transfer_params"] == PARAMS  # the client's body as it came, plus the params
    assert sent["stream"] is True and sent["max_tokens"] == 20 and sent["min_tokens"] == 2
    assert c.decisions[-1].phase == "decode" and c.decisions[-1].strategy == "decode"
    d.sent_at, d.connected_at, d.head_at = 0.2, 0.21, 0.22
    c.finish(p, d, 0.5, None, first_byte_at=0.3, status=200)  # type: ignore[arg-type]
    tr = p.trace.to_dict()  # type: ignore[attr-defined]
    names = [ph["name"] for ph in tr["phases"]]
    assert names == ["prepare", "decide", "prefill", "decide", "connect", "transfer", "decode"], names
    assert [x["phase"] for x in tr["attempts"]] == ["prefill", "decode"]
    assert tr["outcome"] == "ok"
    s = c.pd_stats
    assert s.paths[("m", "split")][0] == 1 and s.blocks[("m",)][0] == 3 and not s.fallbacks
    assert s.prefill[("m",)].sum > 0 and s.transfer[("m",)].sum > 0
    assert c.counters.requests[("m", "ok", 200)][0] == 1  # one request, counted once


def test_short_prompts_and_adapter_requests_are_not_split() -> None:
    c = core()
    p = c.plan("chat", body("hi"), "s", strategy=None, session=None, now=0.0)
    a = c.next(p, 0.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "" and a.replica.view.role == "decode"
    assert c.pd_stats.paths[("m", "short")][0] == 1
    assert c.decisions[-1].strategy == "chat"  # the model's own: the decoder prefills, affinity counts


def test_batched_requests_and_embeddings_are_not_split() -> None:
    c = core()
    p = c.plan("chat", body(LONG, n=2), "b", strategy=None, session=None, now=0.0)
    assert p.pd == "decode" and c.pd_stats.paths[("m", "batched")][0] == 1
    p = c.plan("completions", json.dumps({"model": "m", "prompt": [LONG, LONG]}).encode(), "c", strategy=None,
               session=None, now=0.0)
    assert p.pd == "decode" and c.pd_stats.paths[("m", "batched")][0] == 2
    p = c.plan("completions", json.dumps({"model": "m", "prompt": [1, 2, 3] * 200}).encode(), "t", strategy=None,
               session=None, now=0.0)  # token ids: one prompt
    assert p.pd in ("prefill", "decode")
    p = c.plan("embeddings", json.dumps({"model": "m", "input": LONG}).encode(), "e", strategy=None,
               session=None, now=0.0)
    assert p.pd == "decode" and c.pd_stats.paths[("m", "not_generation")][0] == 1


def test_every_prefill_failure_falls_back_to_the_decoder_prefilling() -> None:
    for failure, status, data, reason in [
        (FailureKind.CONNECT, None, b"", "connect"),
        (FailureKind.TIMEOUT, None, b"", "timeout"),
        (None, 500, b'{"error": {}}', "engine_error"),
        (None, 200, b"not json", "bad_answer"),
        (None, 200, answer(None), "no_params"),  # its one token ended it (EOS)
    ]:
        c = core()
        p, a = prefill_attempt(c)
        c.prefilled(p, a, 0.1, failure, status=status, data=data, detail="x")  # type: ignore[arg-type]
        d = c.next(p, 0.1, 0.0)  # type: ignore[arg-type]
        assert isinstance(d, Attempt) and d.phase == "" and d.replica.view.role == "decode", reason
        assert "kv_transfer_params" not in json.loads(d.body if d.body is not None else p.raw), reason  # type: ignore[attr-defined]
        assert c.pd_stats.fallbacks[("m", reason)][0] == 1, reason
        assert "the decoder prefills" in " ".join(m[3] for m in p.trace.marks), reason  # type: ignore[attr-defined]
        counted = failure is not None or status == 500  # the prefiller's breaker counts it like any failure
        assert a.replica.breaker.snapshot()["failures_total"] == (1 if counted else 0), reason


def test_no_prefiller_free_goes_straight_to_a_decoder() -> None:
    c = core()
    pre = c.table.replicas["m/0"]
    pre.draining = True
    p = c.plan("chat", body(LONG), "n", strategy=None, session=None, now=0.0)
    d = c.next(p, 0.0, 0.0)
    assert isinstance(d, Attempt) and d.phase == "" and d.replica.view.role == "decode"
    assert c.pd_stats.fallbacks[("m", "no_prefiller")][0] == 1


def test_a_failed_decode_retries_elsewhere_without_the_params_unless_nothing_was_sent() -> None:
    c = core()
    p, a = prefill_attempt(c)
    c.prefilled(p, a, 0.1, None, status=200, data=answer(PARAMS))  # type: ignore[arg-type]
    d = c.next(p, 0.1, 0.0)  # type: ignore[arg-type]
    assert isinstance(d, Attempt)
    c.finish(p, d, 0.2, FailureKind.CONNECT, first_byte_at=None, status=None)  # type: ignore[arg-type]
    d2 = c.next(p, 0.2, 0.0)  # type: ignore[arg-type]
    assert isinstance(d2, Attempt) and d2.replica is not d.replica and d2.phase == "decode"  # blocks still there
    c.finish(p, d2, 0.3, FailureKind.RESET, first_byte_at=None, status=None)  # type: ignore[arg-type]
    assert p.kv_params is None and c.pd_stats.fallbacks[("m", "decode_retry")][0] == 1  # type: ignore[attr-defined]


def test_a_client_leaving_during_the_prefill_ends_the_request_once() -> None:
    c = core()
    p, a = prefill_attempt(c)
    c.prefilled(p, a, 0.1, FailureKind.CLIENT_CANCEL, status=None)  # type: ignore[arg-type]
    assert a.ended and c.counters.requests[("m", "client_cancelled", 499)][0] == 1


def test_a_model_without_pd_is_routed_as_before() -> None:
    c = core(CFG.replace("[models.pd]\nmin_prompt_tokens = 50\n", "").replace('role = "prefill"', "")
             .replace('role = "decode"', ""))
    p = c.plan("chat", body(LONG), "p", strategy=None, session=None, now=0.0)
    a = c.next(p, 0.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "" and p.pd == ""  # type: ignore[attr-defined]


def test_the_prefill_answer_reader() -> None:
    assert read_prefill_answer(200, answer(PARAMS)) == (PARAMS, "", 3)
    nested = dict(PARAMS, remote_block_ids=[[1, 2], [3, 4, 5]])
    assert read_prefill_answer(200, answer(nested))[2] == 5
    assert read_prefill_answer(200, answer({"do_remote_prefill": False}))[1] == "no_params"
    assert read_prefill_answer(503, b"")[1] == "engine_error"
    assert read_prefill_answer(200, b"[1]")[1] == "no_params"


def test_a_clients_own_kv_transfer_params_are_refused_for_a_disaggregated_model() -> None:
    import pytest
    from llmgw.route.openai_req import ApiError
    c = core()
    with pytest.raises(ApiError) as e:
        c.plan("chat", body("hi", kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.0.0.9"}), "k",
               strategy=None, session=None, now=0.0)
    assert e.value.status == 400 and e.value.param == "kv_transfer_params" and e.value.counted
    assert c.counters.requests[("m", "rejected", 400)][0] == 1


def test_the_prefill_and_decode_queues_are_the_engines_waiting_by_role() -> None:
    c = core()
    for rid, w in (("m/0", 3.0), ("m/1", 1.0), ("m/2", None)):
        c.table.replicas[rid].view.waiting = w
    assert c.pd_queues() == {("m", "prefill"): 3.0, ("m", "decode"): 1.0}


def test_a_disaggregated_model_is_ready_only_with_a_decoder() -> None:
    from llmgw.route.readiness import readiness
    c = core()
    assert readiness(c.table).ready
    for rid in ("m/1", "m/2"):
        c.table.replicas[rid].draining = True
    r = readiness(c.table)  # only the prefiller is left: nothing can answer a request
    assert not r.ready and r.models[0].serving == 0
