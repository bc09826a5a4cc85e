"""The simulator's P/D core, pure: --kv-transfer-config, kv_transfer_params, the prefiller's kept
blocks (pinned, read, expired) and the decoder's computed-token count."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.sim.args import ArgError
from llmgw.sim.blockpool import BlockPool, ReqBlocks
from llmgw.sim.kv_transfer import (
    KvPins,
    RemotePrefill,
    default_engine_id,
    parse_kv_transfer_config,
    parse_read_body,
    prefill_answer_params,
    read_kv_transfer_params,
    remote_prefill_computed,
)

from .test_sim_engine import core, make_req, run_to_end

V = (0, 33, 0)


# -- --kv-transfer-config -------------------------------------------------------------------------
def test_config_as_vllm_validates_it() -> None:
    cfg = parse_kv_transfer_config('{"kv_connector":"NixlConnector","kv_role":"kv_both"}', {}, V)
    assert cfg is not None and cfg.modeled and cfg.kv_role == "kv_both" and cfg.kv_buffer_device == "cuda"
    assert cfg.kv_load_failure_policy == "fail"  # the default since PR #34896
    old = parse_kv_transfer_config('{"kv_connector":"NixlConnector","kv_role":"kv_producer"}', {}, (0, 12, 0))
    assert old is not None and old.kv_load_failure_policy == "recompute"
    dotted = parse_kv_transfer_config(None, {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                             "kv_load_failure_policy": "recompute"}, V)
    assert dotted is not None and dotted.kv_role == "kv_consumer" and dotted.kv_load_failure_policy == "recompute"
    other = parse_kv_transfer_config('{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}', {}, V)
    assert other is not None and not other.modeled
    assert parse_kv_transfer_config('{"kv_role":"kv_both"}', {}, V) is None  # no connector: no transfer
    assert parse_kv_transfer_config(None, {}, V) is None


@pytest.mark.parametrize("text,words", [
    ("{nope", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"kv_connector":"NixlConnector"}', "kv_role is required"),
    ('{"kv_connector":"NixlConnector","kv_role":"decoder"}', "unsupported kv_role 'decoder'"),
    ('{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"retry"}',
     "kv_load_failure_policy"),
    ('{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_rolee":1}', "unknown field(s) ['kv_rolee']"),
    ('{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":[]}',
     "kv_connector_extra_config"),
])
def test_bad_config_names_the_flag(text: str, words: str) -> None:
    with pytest.raises(ArgError) as e:
        parse_kv_transfer_config(text, {}, V)
    assert str(e.value).startswith("--kv-transfer-config: ") and words in str(e.value)


def test_engine_id_is_stable_and_uuid_shaped() -> None:
    a = default_engine_id(0, "127.0.0.1", 8000)
    assert a == default_engine_id(0, "127.0.0.1", 8000) != default_engine_id(0, "127.0.0.1", 8001)
    assert [len(p) for p in a.split("-")] == [8, 4, 4, 4, 12]


# -- kv_transfer_params ---------------------------------------------------------------------------
PROXY_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_request_params_read_as_nixl_reads_them() -> None:
    assert read_kv_transfer_params(None) == (None, None)
    assert read_kv_transfer_params(PROXY_PREFILL) == ("decode", None)
    answer = prefill_answer_params([3, 4], "eng", "cmpl-x-0", "127.0.0.1", 8100)
    assert list(answer) == ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                            "remote_request_id", "remote_host", "remote_port", "tp_size"]
    assert read_kv_transfer_params(answer) == ("prefill", RemotePrefill("eng", "cmpl-x-0", "127.0.0.1", 8100, (3, 4)))
    grouped = dict(answer, remote_block_ids=[[3, 4]])  # the newest connector's per-group lists
    assert read_kv_transfer_params(grouped)[1] == RemotePrefill("eng", "cmpl-x-0", "127.0.0.1", 8100, (3, 4))
    assert read_kv_transfer_params(dict(answer, remote_port=None)) == ("invalid", None)
    assert read_kv_transfer_params(dict(answer, remote_block_ids=[])) == ("invalid", None)
    with pytest.raises(ValueError):
        read_kv_transfer_params([1])


def test_read_body() -> None:
    assert parse_read_body({"remote_request_id": "r", "remote_block_ids": [1, 2]}) == ("r", [1, 2])
    assert parse_read_body({"remote_request_id": "r"}) == ("r", None)
    for bad in ({"remote_block_ids": [1]}, {"remote_request_id": "r", "remote_block_ids": ["x"]}, []):
        with pytest.raises(ValueError):
            parse_read_body(bad)


# -- the decoder's computed tokens -------------------------------------------------------------------
@pytest.mark.parametrize("prompt,local,blocks,expect", [
    (50, 0, 4, (49, 50)),    # the whole prompt loaded (partial block too); the last token recomputed
    (48, 0, 3, (47, 48)),    # block-aligned prompt: the same
    (50, 32, 4, (49, 18)),   # a local prefix hit: only the rest is loaded
    (50, 48, 4, (49, 2)),
    (50, 0, 2, (32, 32)),    # an answer covering less of the prompt: the rest is computed here
    (50, 48, 2, (48, 0)),    # ... and nothing when the local hit covers more
])
def test_decoder_computed_tokens(prompt: int, local: int, blocks: int, expect: tuple[int, int]) -> None:
    assert remote_prefill_computed(prompt, local, blocks, 16) == expect


# -- pinning in the block pool ----------------------------------------------------------------------
def _held(pool: BlockPool, n: int) -> ReqBlocks:
    blocks = pool.allocate(n)
    assert blocks is not None
    return ReqBlocks(blocks)


def test_pins_hold_blocks_until_read_or_expired() -> None:
    pool = BlockPool(10, 16)
    pins = KvPins(pool.free)
    a = pins.pin("a", _held(pool, 3), 40, deadline=10.0)
    pins.pin("b", _held(pool, 2), 20, deadline=12.0)
    assert pool.num_free == 9 - 5 and pins.num_blocks == 5 and pins.next_deadline() == 10.0
    with pytest.raises(ValueError):
        pins.read("a", [a[0], 999])  # not this request's blocks: nothing freed
    assert pool.num_free == 4
    got = pins.read("a", a)
    assert got is not None and got.block_ids == a and got.num_tokens == 40 and pool.num_free == 7
    assert pins.read("a") is None  # read once
    assert pins.expire(11.9) == [] and pool.num_free == 7
    assert [p.req_id for p in pins.expire(12.0)] == ["b"] and pool.num_free == 9
    assert pins.expired == 1 and pins.read_count == 1 and pins.next_deadline() is None
    assert pins.read("b") is None  # expired: unknown now


def _prefill(c: Any, rid: str, prompt: list[int], **kw: Any) -> Any:
    r = make_req(rid, prompt, max_tokens=1, **kw)
    r.remote_decode = True
    c.add_request(r, 0.0)
    run_to_end(c)
    return r


def test_prefill_by_length_pins_its_blocks_in_the_engine() -> None:
    c = core(num_blocks=64, kv_pin_timeout=30.0)
    r = _prefill(c, "p", list(range(1, 51)))  # 50 tokens: 4 blocks, the last partial
    assert r.finish_reason == "length" and r.kv_block_ids is not None and len(r.kv_block_ids) == 4
    assert c.pool.num_free == 63 - 4 and c.kv_usage() > 0  # held, counted in usage
    # The kept full blocks are cached: another request hits them (a reference more, not a copy).
    c.add_request(make_req("q", list(range(1, 51)) + [9] * 5, max_tokens=1), 0.0)
    run_to_end(c)
    assert c.prefix_hits == 48
    assert c.kv_pins.next_deadline() == pytest.approx(30.0, abs=1.0)
    assert c.read_pinned("p", r.kv_block_ids) is not None and c.pool.num_free == 63
    assert c.expire_pinned(1e9) == []


def test_prefill_timeout_frees_and_eos_first_never_pins() -> None:
    c = core(num_blocks=64, kv_pin_timeout=5.0)
    _prefill(c, "p", list(range(1, 40)))
    assert [p.req_id for p in c.expire_pinned(10.0)] == ["p"] and c.pool.num_free == 63
    eos = make_req("e", list(range(1, 40)), max_tokens=1)
    eos.ignore_eos = False
    eos.remote_decode = True
    c2 = core(num_blocks=64, default_output_len=1)  # the model's first token is EOS
    c2.add_request(eos, 0.0)
    run_to_end(c2)
    assert eos.finish_reason == "stop" and eos.kv_block_ids is None and c2.pool.num_free == 63
    assert len(c2.kv_pins) == 0


def test_decoder_skips_the_loaded_prefill() -> None:
    c = core(num_blocks=64, kv_connector=True, prefill_s_per_token=1e-3)
    prompt = list(range(1, 51))
    r = make_req("d", prompt, max_tokens=3)
    r.remote_blocks = 4
    c.add_request(r, 0.0)
    plan = c.schedule(0.0)
    assert plan is not None and plan.prefill_tokens == 1  # only the last prompt token is computed
    assert plan.duration == pytest.approx(1e-3)
    c.complete(plan, plan.duration)
    run_to_end(c, plan.duration)
    assert r.finish_reason == "length" and len(r.output) == 3
    assert r.num_cached_prompt_tokens == 49
    assert (c.prefix_queries, c.prefix_hits) == (50, 0)  # nothing hit locally ...
    assert (c.ext_queries, c.ext_hits) == (50, 50)  # ... all of it loaded
    # The loaded full blocks became cached blocks of this engine (stored like computed ones).
    c.take_kv_events()
    c.add_request(make_req("again", prompt, max_tokens=1), 0.0)
    run_to_end(c)
    assert c.prefix_hits == 48 and (c.ext_queries, c.ext_hits) == (100, 50)


def test_a_normal_request_on_a_connector_engine_counts_external_queries_only() -> None:
    c = core(num_blocks=64, kv_connector=True)
    c.add_request(make_req("n", list(range(1, 30)), max_tokens=1), 0.0)
    run_to_end(c)
    assert (c.ext_queries, c.ext_hits) == (29, 0)
    plain = core(num_blocks=64)
    plain.add_request(make_req("n", list(range(1, 30)), max_tokens=1), 0.0)
    run_to_end(plain)
    assert (plain.ext_queries, plain.ext_hits) == (0, 0)
