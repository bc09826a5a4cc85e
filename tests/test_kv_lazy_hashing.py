"""Hashing only as far as any replica can hold (PrefixChains.hashes with ``held_any``): what is
hashed is always a prefix of the full chain, all of it when every block is held, one chunk when
nothing is, and a partial chain remembered is extended later, hashing only the new blocks."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kv.hashing import HashContext, event_hash
from llmgw.kv.index import KVIndex
from llmgw.kv.mirror import Snapshot
from llmgw.kv.prefix_chains import PrefixChains

CTX = HashContext.create("0.33.0", "sha256_cbor", 4, "0")


def want(tokens: list[int], salt: str | None = None) -> tuple[int, ...]:
    return tuple(event_hash(d) for d in CTX.hash_tokens(tokens, None, salt))  # type: ignore[misc]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 200), st.integers(0, 120)), min_size=1, max_size=10),
       st.integers(1, 5), st.integers(1, 6), st.sampled_from([None, "s"]))
def test_always_a_prefix_of_the_full_chain_and_long_enough(steps: list[tuple[int, int, int]], chunk: int,
                                                           at_least: int, salt: str | None) -> None:
    rng = random.Random(len(steps))
    pc = PrefixChains(max_chains=4, max_tokens=600, per_head=2)
    held: set[int] = set()
    convs = [[7, 7, 7, 7] for _ in range(3)]
    for conv, store, grow in steps:
        toks = convs[conv] + [rng.randrange(3) for _ in range(grow)]
        convs[conv] = toks
        full = want(toks, salt)
        got = pc.hashes(CTX, toks, None, salt, held_any=held.__contains__, chunk=chunk, at_least=at_least)
        assert got == full[:len(got)]
        assert len(got) >= min(len(full), at_least)
        # exact stop: every block hashed past the minimum follows a held block, and it stops only
        # at the end or after a block no replica holds (a chunk's last, or the remembered last)
        if len(got) < len(full):
            assert got[-1] not in held
        held.update(full[:store % (len(full) + 1)])  # an engine stores some of the prompt's blocks


def test_everything_held_hashes_every_block_nothing_held_one_chunk() -> None:
    toks = list(range(400))  # 100 blocks of 4
    full = want(toks)
    pc = PrefixChains()
    assert pc.hashes(CTX, toks, held_any=lambda h: True, chunk=16) == full
    assert pc.hashed_blocks == 100 and pc.skipped_blocks == 0
    pc = PrefixChains()
    asked: list[int] = []
    got = pc.hashes(CTX, toks, held_any=lambda h: asked.append(h) or False, chunk=16)
    assert got == full[:16] and asked == [full[15]]  # one chunk, one look at the index
    assert pc.hashed_blocks == 16 and pc.skipped_blocks == 84
    # the minimum covers the parity check's 16 leading hashes even with a smaller chunk
    assert PrefixChains().hashes(CTX, toks, held_any=lambda h: False, chunk=5) == full[:16]
    assert PrefixChains().hashes(CTX, toks[:20], held_any=lambda h: False) == full[:5]  # fewer than 16: all
    # held up to block 40: hashing stops at the first chunk end past it
    assert PrefixChains().hashes(CTX, toks, held_any=set(full[:40]).__contains__, chunk=16) == full[:48]
    with pytest.raises(ValueError):
        pc.hashes(CTX, toks, held_any=lambda h: False, chunk=0)


def test_a_partial_chain_is_extended_once_its_blocks_are_held() -> None:
    toks = list(range(400))
    full = want(toks)
    idx = KVIndex()
    pc = PrefixChains()
    assert pc.hashes(CTX, toks, held_any=idx.holds_any) == full[:16]
    assert pc.chains == 1 and pc.tokens == 16 * 4  # remembered: the blocks hashed, not the prompt
    # nothing held yet: a repeat takes the 16 remembered hashes and hashes nothing
    assert pc.hashes(CTX, toks, held_any=idx.holds_any) == full[:16] and pc.hashed_blocks == 16
    idx.replace("m/0", Snapshot(1, {"GPU": frozenset(full)}))  # the engine stored the whole prompt
    assert pc.hashes(CTX, toks, held_any=idx.holds_any) == full
    assert pc.hashed_blocks == 100 and pc.reused_blocks == 32 and pc.chains == 1  # extended, one chain
    # another replica's blocks count too, in any medium
    idx2 = KVIndex()
    idx2.replace("m/0", Snapshot(1, {"GPU": frozenset()}))
    idx2.replace("m/1", Snapshot(1, {"CPU": frozenset(full[:20])}))
    assert idx2.holds_any(full[19]) and not idx2.holds_any(full[20])
    assert PrefixChains().hashes(CTX, toks, held_any=idx2.holds_any) == full[:32]
    idx2.remove_replica("m/1")
    assert not idx2.holds_any(full[0])


def test_the_share_is_of_the_prompts_blocks_not_of_the_hashes_computed() -> None:
    import random as _r

    from llmgw.route.kv_scorer import KvCacheScorer
    from llmgw.route.scheduler import Scheduler
    from llmgw.route.strategies import PRESETS
    from llmgw.route.types import EndpointView, RequestInfo

    eps = [EndpointView(id=f"m/{i}", model="m", url=f"http://e{i}", running=0.0, waiting=0.0, kv_usage=0.1,
                        stale=False) for i in range(2)]
    # 32 of a 256-block prompt hashed; m/1 holds all 32: its share is 32/256, not 1
    sc = KvCacheScorer(lambda h: {"m/0": 0, "m/1": len(h)})
    req = RequestInfo("r", "m", "m", kv_hashes=tuple(range(32)), kv_blocks=256)
    d = Scheduler(scorers={"kv_cache": sc}).decide(req, eps, PRESETS["chat"], now=0.0, wall=0.0, rng=_r.Random(1))
    assert d.chosen == "m/1" and "tier 2: 32/256 blocks on m/1" in d.note
    assert {c.endpoint_id: c.scores["kv_cache"] for c in d.candidates} == {"m/0": 0.0, "m/1": 32 / 256}
    assert sc.verdict(req, eps, 1.0) == {1: 32 / 256}
    assert sc.stats.matched_sum == 32
    # kv_blocks 0 (not set): the hashes are all the blocks
    req = RequestInfo("r", "m", "m", kv_hashes=tuple(range(32)))
    assert sc.verdict(req, eps, 2.0) == {1: 1.0}


def test_a_repeated_prompt_is_hashed_further_once_the_engine_stored_it() -> None:
    """Over a real socket: the first request of a long prompt nobody holds hashes 16 blocks (not
    300); the cached repeat keeps them while nothing is held; once the engine has stored the
    prompt, the repeat is hashed further (only the new blocks, no second /tokenize)."""
    import trio

    from llmgw.daemon.net.httpserver import serve_tcp
    from llmgw.daemon.net.upstream import UpstreamPool
    from llmgw.daemon.router.kv_index import RouterKvIndex
    from llmgw.daemon.router.tokenize import Tier2Metrics
    from llmgw.fleet.wire import KvEvents
    from tests.test_kv_tokenize import Engine, Tier2Run, _cfg, _plan

    ctx16 = HashContext.create("0.33.0", "sha256_cbor", 16, "0")
    tokens = [random.Random(3).randrange(150_000) for _ in range(300 * 16 + 5)]
    full = tuple(event_hash(d) for d in ctx16.hash_tokens(tokens))  # type: ignore[misc]

    async def main() -> None:
        engine = Engine()
        engine.tokens = tokens
        async with trio.open_nursery() as nursery, UpstreamPool() as pool:
            port = await nursery.start(serve_tcp, engine.handle, "127.0.0.1", 0)
            t = Tier2Run(_cfg(), pool, timeout=2.0)
            kv = RouterKvIndex(clock=lambda: 0.0)
            t.held_any = kv.holds_any  # as RouterCore.use_kv_index hands it over
            p = _plan(port, "long")
            await t.annotate(p)
            assert p.info.kv_hashes == full[:16] and p.info.kv_blocks == 300
            assert t.chains.hashed_blocks == 16 and t.chains.skipped_blocks == 284
            assert t.cached_bytes == 16 * 44 + 300 * 16 * 4  # the ids of a partial entry count
            again = _plan(port, "long")
            await t.annotate(again)  # nothing held yet: the partial hashes stand
            assert again.info.kv_hashes == full[:16] and again.info.kv_blocks == 300
            assert t.chains.hashed_blocks == 16 and engine.calls == 1
            # the engine stored the prompt (its agent's kv_events reach the index)
            kv.apply(KvEvents(replica="m/0", event_seq=1, reset=True, added=tuple(("GPU", h) for h in full),
                              removed=()))
            third = _plan(port, "long")
            await t.annotate(third)
            assert third.info.kv_hashes == full and third.info.kv_blocks == 300
            assert engine.calls == 1  # not tokenized again
            assert t.chains.hashed_blocks == 300 and t.chains.reused_blocks == 16  # only the new blocks
            assert t.cached_hashes == 300 and t.cached_bytes == 300 * 44  # complete: ids dropped
            m = {s.labels["how"]: s.value for f in Tier2Metrics(t).collect() if f.name == "llmgw_kv_hash_blocks"
                 for s in f.samples}
            assert m == {"hashed": 300.0, "reused": 16.0, "skipped": 284.0}
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_blocks_always_hashed_cover_the_parity_checks_leading_hashes() -> None:
    from llmgw.kv.parity import ParityConfig
    from llmgw.kv.prefix_chains import CHUNK_BLOCKS, MIN_BLOCKS

    assert MIN_BLOCKS >= ParityConfig().max_expected and CHUNK_BLOCKS >= 1
