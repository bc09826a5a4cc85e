"""Prefix index: lookup + insert time for 32 KB prompts (target <= 150 µs on the reference 2-core
box) and the index's MEASURED memory after 1M distinct prompts against its budget.

    .venv/bin/python bench/bench_prefix.py [--ops 2000] [--prompts 1000000] [--budget-mib 64]
                                           [--replicas 64] [--traced 150000]

Part 1 builds a chat-like index — 40 system prompts of 2-8 KB, ``--ops`` conversations of
16-31 KB on them, each on one of 64 vLLM replicas (1 MiB of KV each) — and times ``match`` +
``record`` of 32 KB heads in two mixes: "next turn" (the recorded history plus a new message:
the head extends a leaf) and "diverging" (a regeneration or a new conversation: the head leaves
a recorded label in its middle, so a common-prefix search and a split). Then the whole
``Scheduler.decide`` with the prefix scorer and three others, and the commit (the scorer's ``observe``), at 64
candidates.

Part 2 records ``--prompts`` distinct short prompts (one of 1000 shared 16-byte prefixes + 48
random bytes) round-robin over the replicas, untraced (timed), and measures the live index by
walking its objects (sys.getsizeof, each once); then a second run of ``--traced`` prompts with
tracemalloc on from before the index exists (the allocator's own count, ~8× slower), which
also checks the object walk. Under two minutes on the reference box. The machine is shared:
p50 is the figure to compare."""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
import types

from llmgw.route.prefix_capacity import Capacity, PrefixConfig, partition_key
from llmgw.route.prefix_scorer import PrefixRouting, PrefixScorerConfig
from llmgw.route.prefix_tree import PrefixIndex
from llmgw.route.scheduler import Scheduler
from llmgw.route.strategies import Strategy
from llmgw.route.types import EndpointView, RequestInfo

P = partition_key("llama-70b")
HEAD = 32 << 10


def pct(ts: list[float], q: float) -> float:
    return ts[min(len(ts) - 1, int(len(ts) * q))]


def build(rng: random.Random, replicas: int, convs: int) -> tuple[PrefixIndex, list[bytes]]:
    """A chat fleet's index: 40 system prompts of 2-8 KB, ``convs`` conversations of 16-31 KB
    on them, each recorded on a random replica (1 MiB of KV per replica)."""
    idx = PrefixIndex(PrefixConfig(budget_bytes=256 << 20))
    for r in range(replicas):  # 16K blocks × 16 tokens ≈ 1 MiB of head bytes per replica
        idx.set_capacity(f"r{r}", Capacity.vllm(num_gpu_blocks=16384, block_size=16))
    systems = [b"system\0" + rng.randbytes(rng.randrange(2048, 8192)) for _ in range(40)]
    heads = []
    for c in range(convs):
        h = rng.choice(systems) + b"\x1euser\0"
        h += rng.randbytes(rng.randrange(16 << 10, 31 << 10) - len(h))
        heads.append(h)
        idx.record(P, h, f"r{rng.randrange(replicas)}", float(c))
    return idx, heads


def timed(idx: PrefixIndex, heads: list[bytes], replicas: int, now: float) -> list[list[float]]:
    perf = time.perf_counter
    tm: list[float] = []
    tr: list[float] = []
    gc.collect()
    for k, h in enumerate(heads):
        t0 = perf()
        idx.match(P, h, now)
        t1 = perf()
        idx.record(P, h, f"r{k % replicas}", now)
        t2 = perf()
        tm.append((t1 - t0) * 1e6)
        tr.append((t2 - t1) * 1e6)
    return [sorted(tm), sorted(tr), sorted(a + b for a, b in zip(tm, tr))]


def row(name: str, ts: list[float]) -> None:
    print(f"  {name:<26} {statistics.fmean(ts):>8.1f} {pct(ts, 0.5):>8.1f} {pct(ts, 0.99):>8.1f}")


def part1(ops: int, replicas: int) -> None:
    rng = random.Random(1)
    idx, convs = build(rng, replicas, ops)
    st = idx.stats()
    print(f"32 KB heads over {st['nodes']} nodes ({st['bytes'] / 2**20:.1f} MiB accounted), "
          f"{replicas} replicas, {ops} ops per mix")
    print(f"  {'':<26} {'mean µs':>8} {'p50 µs':>8} {'p99 µs':>8}")
    # the next turn: the recorded history + a new message, to 32 KB (extends a leaf)
    nxt = [c + rng.randbytes(HEAD - len(c)) for c in convs]
    # a regeneration / new conversation: diverges INSIDE a recorded label (LCP + split)
    div = [c[: rng.randrange(2048, len(c))] for c in convs]
    div = [d + rng.randbytes(HEAD - len(d)) for d in div]
    for name, heads in (("next turn", nxt), ("diverging", div)):
        tm, tr, both = timed(idx, heads, replicas, 1e6)
        row(f"{name}: match", tm)
        row(f"{name}: record", tr)
        row(f"{name}: match + record", both)

    # the whole decision with the prefix scorer, and the after-pick record
    pr = PrefixRouting(idx, PrefixScorerConfig())
    sched = Scheduler(scorers=pr.scorers())
    strat = Strategy("chat+prefix", {"load": 0.3, "queue": 0.15, "kv": 0.15, "prefix": 0.4})
    eps = [EndpointView(id=f"r{i}", model="llama-70b", url=f"http://r{i}",
                        running=float(rng.randrange(0, 32)), waiting=float(rng.randrange(0, 4)),
                        kv_usage=rng.uniform(0.05, 0.9), scraped_at=0.0, stale=False)
           for i in range(replicas)]
    heads = [c + rng.randbytes(rng.randrange(1, 1024)) for c in nxt]  # the turn after
    heads = [h[:HEAD] for h in heads]
    perf = time.perf_counter
    td: list[float] = []
    ta: list[float] = []
    gc.collect()
    for k, h in enumerate(heads):
        r = RequestInfo(request_id=f"q{k}", model="llama-70b", base_model="llama-70b", head=h)
        t0 = perf()
        d = sched.decide(r, eps, strat, now=2e6, wall=0.0, rng=rng, commit=False)
        t1 = perf()
        sched.commit(d, r, 2e6)  # the prefix scorer's observe: record and classify
        t2 = perf()
        td.append((t1 - t0) * 1e6)
        ta.append((t2 - t1) * 1e6)
    row("decide (prefix + 3 scorers)", sorted(td))
    row("commit (observe)", sorted(ta))
    print(f"  outcomes: {pr.metrics()['decisions']}")


def deep_size(root: object) -> int:
    """Bytes of every object reachable from ``root`` (sys.getsizeof, each object once; classes,
    modules and functions excluded): a measurement of the live structure, like tracemalloc's
    but possible after an untraced run. Shared small objects (replica names, small ints) are
    counted too, so it errs high."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    seen = {id(root)}
    stack = [root]
    total = 0
    while stack:
        o = stack.pop()
        total += sys.getsizeof(o)
        for r in gc.get_referents(o):
            if id(r) not in seen and not isinstance(r, skip):
                seen.add(id(r))
                stack.append(r)
    return total


def fill(idx: PrefixIndex, rng: random.Random, prompts: int, replicas: int,
         probe: int = 0, base: int = 0) -> int:
    systems = [b"sys%05d|tenant|" % i for i in range(1000)]
    names = [f"r{r}" for r in range(replicas)]
    rb = rng.randbytes
    choice = rng.choice
    worst = 0
    for k in range(prompts):
        idx.record(P, choice(systems) + rb(48), names[k % replicas], float(k))
        if probe and k % probe == 0:
            worst = max(worst, tracemalloc.get_traced_memory()[0] - base)
    return worst


def new_index(replicas: int, budget: int) -> PrefixIndex:
    idx = PrefixIndex(PrefixConfig(budget_bytes=budget))
    for r in range(replicas):
        idx.set_capacity(f"r{r}", Capacity.vllm(num_gpu_blocks=4096, block_size=16))
    return idx


def part2(prompts: int, replicas: int, budget: int, traced: int) -> None:
    mib = 2**20
    # 1) the full run, untraced (tracemalloc slows every allocation ~8×): timed, then the live
    #    structure measured object by object
    rng = random.Random(2)
    gc.collect()
    t0 = time.perf_counter()
    idx = new_index(replicas, budget)
    fill(idx, rng, prompts, replicas)
    elapsed = time.perf_counter() - t0
    st = idx.stats()
    gc.collect()
    size = deep_size(idx)
    print(f"{prompts} distinct prompts (64 B on 1000 shared 16 B prefixes), {replicas} replicas, "
          f"budget {budget / mib:.0f} MiB: {elapsed:.1f} s "
          f"({elapsed / prompts * 1e6:.1f} µs/record)")
    print(f"  nodes {st['nodes']}, evicted {st['evicted_budget']}, released by capacity "
          f"{st['released_capacity']}, accounted {st['bytes'] / mib:.2f} MiB")
    print(f"  measured (object walk): {size / mib:.2f} MiB -> "
          f"{'within' if size <= budget else 'OVER'} budget ({size / budget:.0%})")
    del idx
    if not traced:
        return
    # 2) tracemalloc from before the index exists, over enough prompts to churn the whole
    #    budget several times: the allocator's own view, and a check on the object walk
    rng = random.Random(3)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    idx = new_index(replicas, budget)
    worst = fill(idx, rng, traced, replicas, probe=4096, base=base)
    used = tracemalloc.get_traced_memory()[0] - base
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    elapsed = time.perf_counter() - t0
    st = idx.stats()
    size = deep_size(idx)
    print(f"  tracemalloc, {traced} prompts ({st['evicted_budget']} evicted, {elapsed:.0f} s): "
          f"now {used / mib:.2f} MiB, worst sampled {max(worst, used) / mib:.2f} MiB, "
          f"peak {peak / mib:.2f} MiB -> {'within' if used <= budget else 'OVER'} budget "
          f"({used / budget:.0%}); object walk {size / mib:.2f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--prompts", type=int, default=1_000_000)
    ap.add_argument("--budget-mib", type=float, default=64)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--traced", type=int, default=150_000,
                    help="prompts for the tracemalloc run (0: skip it)")
    args = ap.parse_args()
    budget = int(args.budget_mib * 2**20)
    t0 = time.perf_counter()
    part1(args.ops, args.replicas)
    part2(args.prompts, args.replicas, budget, args.traced)
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
