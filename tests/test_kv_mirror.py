"""llmgw.kv.mirror (the agent's per-engine block mirror) and llmgw.kv.index (the router's index):
a mirror fed random events, its deltas applied to an index, equals the engine's true blocks at
every take; gaps, duplicates, resets, caps and leading-block counts."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, UnknownEvent
from llmgw.kv.index import KVIndex
from llmgw.kv.mirror import BlockMirror, Delta, Outcome


def stored(hashes, medium=None):
    return BlockStored(list(hashes), None, [], 16, None, medium, None)


def removed(hashes, medium=None):
    return BlockRemoved(list(hashes), medium)


def batch(*events):
    return EventBatch(0.0, list(events))


HASHES = st.one_of(st.integers(0, 40), st.binary(min_size=32, max_size=32).map(lambda b: b[:1] * 32))
MEDIA = st.sampled_from([None, "GPU", "CPU"])
EVENT = st.one_of(
    st.builds(lambda hs, m: ("store", m, hs), st.lists(HASHES, max_size=6), MEDIA),
    st.builds(lambda hs, m: ("remove", m, hs), st.lists(HASHES, max_size=6), MEDIA),
    st.just(("clear", None, [])),
    st.just(("unknown", None, [])),
    st.builds(lambda k: ("take", None, k), st.integers(1, 8)),
    st.just(("resend", None, [])),
)


def to_event(kind, medium, hashes):
    return {"store": lambda: stored(hashes, medium), "remove": lambda: removed(hashes, medium),
            "clear": AllBlocksCleared, "unknown": lambda: UnknownEvent("X", None)}[kind]()


def drain(m: BlockMirror, idx: KVIndex, k: int, name="r") -> None:
    while True:
        d = m.take_delta(k)
        assert len(d) <= k
        idx.apply_delta(name, d)
        if not d.more:
            return


@settings(max_examples=300, deadline=None)
@given(st.lists(EVENT, max_size=60), st.integers(1, 40))
def test_mirror_deltas_rebuild_the_engines_blocks(ops, cap):
    m = BlockMirror(cap)
    idx = KVIndex()
    truth: dict = {}  # the engine's blocks (those within the cap; an overflow empties it)
    seq = 0
    for kind, medium, arg in ops:
        if kind == "take":
            drain(m, idx, arg)
            assert idx.blocks("r") == {k: v for k, v in truth.items() if v}
            continue
        if kind == "resend":
            m.resend_all()
            continue
        seq += 1
        out = m.apply(seq, batch(to_event(kind, medium, arg)))
        if kind == "store":
            s = truth.setdefault(medium, set())
            for h in arg:
                if h not in s and sum(map(len, truth.values())) >= cap:
                    assert out is Outcome.OVERFLOW
                    truth.clear()
                    break
                s.add(h)
            else:
                assert out is Outcome.APPLIED
        elif kind == "remove":
            truth.get(medium, set()).difference_update(arg)
        elif kind == "clear":
            truth.clear()
        assert m.blocks() == {k: v for k, v in truth.items() if v}
        assert len(m) <= cap
        assert m.pending <= 2 * cap + 1
    drain(m, idx, 3)
    assert idx.blocks("r") == m.blocks()
    # a fresh router gets the same from a full copy
    idx2 = KVIndex()
    idx2.replace("r", m.full_copy())
    assert idx2.blocks("r") == m.blocks()


def test_add_then_remove_cancels_and_remove_then_add_cancels():
    m = BlockMirror(10)
    m.apply(1, batch(stored([1, 2])))
    assert sorted(h for _, h in m.take_delta(10).added) == [1, 2]
    m.apply(2, batch(stored([3]), removed([3]), removed([1]), stored([1])))
    d = m.take_delta(10)
    assert d.empty and not d.more


def test_gap_duplicate_and_reset():
    m = BlockMirror(10)
    assert m.apply(5, batch(stored([1]))) is Outcome.APPLIED  # first batch: any seq
    assert m.apply(5, batch(stored([2]))) is Outcome.DUPLICATE
    assert m.apply(4, batch(stored([2]))) is Outcome.DUPLICATE
    assert m.apply(8, batch(stored([2]))) is Outcome.GAP
    assert m.blocks() == {None: {1}} and m.last_seq == 5
    # the caller replays 6..8 through the DEALER
    assert m.apply(6, batch()) is Outcome.APPLIED
    assert m.apply(7, batch(removed([1]))) is Outcome.APPLIED
    assert m.apply(8, batch(stored([2]))) is Outcome.APPLIED
    assert m.apply(20, batch(stored([3]))) is Outcome.GAP
    m.reset()  # replay impossible
    assert m.apply(20, batch(stored([3]))) is Outcome.APPLIED
    d = m.take_delta(10)
    assert d.reset and d.added == [(None, 3)] and d.seq == 20
    s = m.stats
    assert (s.duplicates, s.gaps, s.resets, s.batches) == (2, 2, 1, 5)


def test_clear_event_resets_the_router():
    m, idx = BlockMirror(10), KVIndex()
    m.apply(1, batch(stored([1, 2], "GPU")))
    drain(m, idx, 10)
    m.apply(2, batch(AllBlocksCleared(), stored([9], "GPU")))
    drain(m, idx, 10)
    assert idx.blocks("r") == {"GPU": {9}} and m.stats.resets == 1


def test_unknown_events_and_long_hashes_are_counted_not_applied():
    m = BlockMirror(10, max_hash_bytes=32)
    assert m.apply(1, batch(UnknownEvent("Future", {"a": 1}), stored([b"x" * 33, b"y" * 32]))) \
        is Outcome.APPLIED
    assert m.blocks() == {None: {b"y" * 32}}
    assert m.stats.unknown_events == 1 and m.stats.bad_hashes == 1


def test_overflow_resets_instead_of_growing():
    m = BlockMirror(3)
    assert m.apply(1, batch(stored([1, 2, 3]))) is Outcome.APPLIED
    assert m.apply(2, batch(stored([4]))) is Outcome.OVERFLOW
    assert len(m) == 0 and m.stats.overflows == 1
    assert m.take_delta(5).reset


def test_index_cap_empties_the_replica_until_a_reset():
    idx = KVIndex(max_blocks_per_replica=2)
    assert not idx.apply_delta("a", Delta(1, added=[(None, 1), (None, 2), (None, 3)]))
    assert idx.overflowed("a") and idx.size("a") == 0
    assert not idx.apply_delta("a", Delta(2, added=[(None, 4)]))  # partial view: refused
    assert idx.apply_delta("a", Delta(3, reset=True, added=[(None, 4)]))
    assert idx.blocks("a") == {None: {4}} and not idx.overflowed("a")
    idx.set_capacity("b", 1)
    m = BlockMirror(5)
    m.apply(1, batch(stored([1, 2])))
    assert not idx.replace("b", m.full_copy()) and idx.size("b") == 0
    assert idx.stats.overflows == 2


def test_leading_blocks_counts_contiguous_prefix():
    idx = KVIndex()
    idx.apply_delta("a", Delta(1, added=[(None, h) for h in (1, 2, 3, 5)]))
    idx.apply_delta("b", Delta(1, added=[("GPU", 1), ("CPU", 2)]))
    idx.apply_delta("c", Delta(1, added=[(None, 2), (None, 3)]))
    assert idx.leading_blocks([1, 2, 3, 4, 5]) == {"a": 3, "b": 2, "c": 0}
    assert idx.leading_blocks([]) == {"a": 0, "b": 0, "c": 0}
    idx.remove_replica("a")
    assert idx.leading_blocks([1]) == {"b": 1, "c": 0}


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=2), st.sets(st.integers(0, 12), max_size=12), max_size=5),
       st.lists(st.integers(0, 12), max_size=12))
def test_leading_blocks_matches_definition(held, request_hashes):
    idx = KVIndex()
    for name, hs in held.items():
        idx.apply_delta(name, Delta(1, added=[(None, h) for h in hs]))
    want = {}
    for name, hs in held.items():
        n = 0
        while n < len(request_hashes) and request_hashes[n] in hs:
            n += 1
        want[name] = n
    assert idx.leading_blocks(request_hashes) == want


def test_memory_per_block_is_bounded():
    """Measured with tracemalloc: int hashes (vLLM's default) in the mirror and in the index.
    The figures documented in docs/prefix-routing.md come from bench/bench_kv_index.py."""
    n = 50_000
    hashes = [(i * 0x9E3779B97F4A7C15) & (2**64 - 1) for i in range(n)]  # uint64, built untraced
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        m = BlockMirror(n)
        m.apply(1, batch(stored(hashes)))
        m.take_delta(n)  # no pending left: the mirror's steady state
        mirror_bytes = tracemalloc.get_traced_memory()[0] - base
        base = tracemalloc.get_traced_memory()[0]
        idx = KVIndex()
        idx.replace("r", m.full_copy())
        index_bytes = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # a set slot is 16 B at load <= 0.6 plus resize slack; the hash ints are the caller's objects
    assert mirror_bytes / n < 80, mirror_bytes / n
    assert index_bytes / n < 160, index_bytes / n  # includes the snapshot's frozenset, freed later


def test_bad_arguments():
    with pytest.raises(ValueError):
        BlockMirror(0)
    with pytest.raises(ValueError):
        BlockMirror(1).take_delta(0)
    with pytest.raises(ValueError):
        KVIndex(0)
