"""Tier-2 KV ingest: block events/s per core through the agent's mirror and the router's index,
and the measured memory per block in each (issue 14's target: >= 500k block events/s per core
on the router).

    .venv/bin/python bench/bench_kv_index.py [--blocks 200000] [--per-event 16] [--replicas 8]

An engine with ``--blocks`` KV blocks stores ``--per-event`` blocks per BlockStored and evicts the
oldest the same way once full (a steady churn). Timed, single-threaded: (1) the mirror applying
the batches, (2) the index applying the mirror's deltas (the router's ingest), (3) both.
Memory: tracemalloc around a full mirror and a full index of int (uint64) hashes, vLLM's default.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc

from llmgw.kv.events import BlockRemoved, BlockStored, EventBatch
from llmgw.kv.index import KVIndex
from llmgw.kv.mirror import BlockMirror

DELTA_ITEMS = 4096


def workload(blocks: int, per_event: int, rounds: int, replicas: int,
             seed: int = 1) -> list[EventBatch]:
    """Batch i is engine i % replicas's; each engine holds at most ``blocks``."""
    rng = random.Random(seed)
    lives: list[list[int]] = [[] for _ in range(replicas)]
    out: list[EventBatch] = []
    for i in range(rounds):
        live = lives[i % replicas]
        new = [rng.getrandbits(64) for _ in range(per_event)]
        evs: list = [BlockStored(new, None, [], 16, None, "GPU", None)]
        live.extend(new)
        if len(live) > blocks:
            old, live[:per_event] = live[:per_event], []
            evs.insert(0, BlockRemoved(old, "GPU"))
        out.append(EventBatch(0.0, evs))
    return out


def block_events(batches: list[EventBatch]) -> int:
    return sum(len(e.block_hashes) for b in batches for e in b.events)


def run(batches: list[EventBatch], blocks: int, replicas: int) -> None:
    n = block_events(batches)
    mirrors = [BlockMirror(blocks) for _ in range(replicas)]
    gc.collect()
    t0 = time.perf_counter()
    deltas = []
    for i, b in enumerate(batches):
        m = mirrors[i % replicas]
        m.apply(i // replicas + 1, b)
        if m.pending >= DELTA_ITEMS:
            deltas.append((i % replicas, m.take_delta(DELTA_ITEMS)))
    for r, m in enumerate(mirrors):
        while m.pending:
            deltas.append((r, m.take_delta(DELTA_ITEMS)))
    t1 = time.perf_counter()
    idx = KVIndex(max_blocks_per_replica=blocks)
    sent = sum(len(d) for _, d in deltas)
    t2 = time.perf_counter()
    for r, d in deltas:
        idx.apply_delta(r, d)
    t3 = time.perf_counter()
    print(f"{n} block events over {replicas} engines ({len(batches)} batches), "
          f"{sent} net changes in {len(deltas)} deltas")
    print(f"  agent mirror:  {n / (t1 - t0) / 1e3:8.0f} k block events/s")
    print(f"  router index:  {n / (t3 - t2) / 1e3:8.0f} k block events/s "
          f"({sent / (t3 - t2) / 1e3:.0f} k net changes/s)  target >= 500 k")
    held = sorted(mirrors[0].blocks()["GPU"])[:256]  # a request replica 0 fully holds
    q = held + [random.Random(2).getrandbits(64)]
    t4 = time.perf_counter()
    for _ in range(1000):
        idx.leading_blocks(q)
    assert idx.leading_blocks(q)[0] == len(held)
    assert idx.stats.unknown_removals == 0
    print(f"  leading_blocks ({len(q)} hashes, {replicas} replicas, one holding {len(held)}): "
          f"{(time.perf_counter() - t4) * 1e3:.1f} µs")


def memory(blocks: int) -> None:
    rng = random.Random(3)
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    m = BlockMirror(blocks)
    m.apply(1, EventBatch(0.0, [BlockStored(hashes, None, [], 16, None, "GPU", None)]))
    with_pending = tracemalloc.get_traced_memory()[0] - base
    d = m.take_delta(blocks)
    del d
    steady = tracemalloc.get_traced_memory()[0] - base
    base2 = tracemalloc.get_traced_memory()[0]
    idx = KVIndex(max_blocks_per_replica=blocks)
    snap = m.full_copy()
    idx.replace("r", snap)
    del snap
    gc.collect()
    index = tracemalloc.get_traced_memory()[0] - base2
    tracemalloc.stop()
    print(f"memory, {blocks} uint64 blocks (hash ints shared with the caller, not counted):")
    print(f"  mirror: {steady / blocks:.0f} B/block steady, {with_pending / blocks:.0f} B/block "
          f"with every block pending")
    print(f"  index:  {index / blocks:.0f} B/block")
    print("  a uint64 hash int itself: 32-36 B more per distinct block where it is not shared")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--per-event", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=100_000)
    a = ap.parse_args()
    per = a.blocks // a.replicas
    run(workload(per, a.per_event, a.rounds, a.replicas), per, a.replicas)
    memory(a.blocks)


if __name__ == "__main__":
    main()
