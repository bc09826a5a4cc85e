"""What tier 2 adds to a routing decision for a 4k-token prompt (issue 14's target: <= 100 µs),
tokenize excluded and reported separately.

    .venv/bin/python bench/bench_kv_decide.py [--tokens 4096] [--replicas 8] [--reps 200] [--no-roundtrip]

Rows (median µs over --reps, single thread):
- hash, the definition: vLLM's loop, one cbor2 call per block (what llmgw did before)
- hash, cold, all blocks: a prompt never seen, every block hashed (HashContext's hand-written
  CBOR; what the router does without an index)
- hash, never seen, nothing held: the same with the router's index asked where to stop
  (PrefixChains.hashes held_any=KVIndex.holds_any; --replicas replicas holding other blocks): one
  chunk of 16 blocks
- hash, never seen, fully held by a replica (another router's prompt): the index says every block
  is held, so every block is hashed (plus a look at the index per chunk)
- hash, next turn: the same conversation one turn later (+--turn-tokens): the blocks it shares
  with the turn before are taken from the remembered chain (PrefixChains), only the new ones hashed
- hash, repeat: the same tokens again (a retry, a shared prompt)
- index lookup: KVIndex.leading_blocks for the prompt's hashes, --replicas replicas, one holding
  3/4 of them (and for the 16 hashes of a prompt nobody holds)
- scoring: a chat-preset decision with the hashes minus the same decision without (the kv_cache
  scorer's vote)
Then the sums (per case), and separately: parsing and checking the /tokenize answer, and
(unless --no-roundtrip) a /tokenize round trip to a simulated vLLM over loopback. Memory: the
remembered chains per token (tracemalloc)."""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from llmgw.kv.hashing import HashContext, event_hash, hash_block_tokens
from llmgw.kv.index import KVIndex
from llmgw.kv.mirror import Snapshot
from llmgw.kv.prefix_chains import PrefixChains
from llmgw.route.kv_scorer import KvCacheScorer
from llmgw.route.scheduler import Scheduler
from llmgw.route.strategies import PRESETS
from llmgw.route.types import EndpointView, RequestInfo

CTX = HashContext.create("0.33.0", "sha256_cbor", 16, "0")


def med_us(fn: Callable[[], object], reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def definition(tokens: list[int]) -> list[int]:
    out, parent = [], None
    for i in range(len(tokens) // 16):
        parent = hash_block_tokens(CTX.hash_fn, parent, tokens[i * 16:(i + 1) * 16], None, none_hash=CTX.none_hash)
        out.append(event_hash(parent))
    return out  # type: ignore[return-value]


def roundtrip_us(tokens: list[int], reps: int) -> tuple[float, int]:
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from procs import spawn, stop

    p, info = spawn([sys.executable, "-m", "llmgw", "sim", "--engine", "vllm", "m", "--host", "127.0.0.1",
                     "--port", "0", "--max-model-len", "65536"])
    try:
        words = " ".join(f"w{t % 997}" for t in tokens[:len(tokens) // 2])  # ~2 simulated tokens a word
        body = {"model": "m", "messages": [{"role": "user", "content": words}]}
        with httpx.Client(base_url=info["url"]) as c:
            n = len(c.post("/tokenize", json=body).json()["tokens"])
            return med_us(lambda: c.post("/tokenize", json=body).raise_for_status(), reps), n
    finally:
        stop(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--turn-tokens", type=int, default=256, help="what a next turn adds")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-roundtrip", action="store_true")
    a = ap.parse_args()
    rng = random.Random(1)
    # tokens as a /tokenize answer gives them: distinct int objects from json.loads
    answer = json.dumps({"count": a.tokens, "tokens": [rng.randrange(151_000) for _ in range(a.tokens)]})
    prompt = json.loads(answer)["tokens"]
    base = prompt[:a.tokens - a.turn_tokens]  # the turn before: the prompt without its new tokens
    assert len(prompt) == a.tokens
    ref = definition(prompt)
    assert list(PrefixChains().hashes(CTX, prompt)) == ref, "the router's hashes differ from the definition"
    rows: list[tuple[str, float]] = []
    rows.append(("hash, the definition (cbor2 per block)", med_us(lambda: definition(prompt), a.reps)))
    from array import array
    ids = array("I", prompt)  # the tokenize step has them as an array too (its check of the answer)
    rows.append(("hash, cold, all blocks (no index)", med_us(lambda: PrefixChains().hashes(CTX, prompt, ids=ids),
                                                              a.reps)))
    hashes = tuple(ref)
    others = [frozenset(rng.getrandbits(64) for _ in range(2000)) for _ in range(a.replicas)]
    idx = KVIndex()  # replica 0 holds 3/4 of the prompt, the others other blocks
    empty = KVIndex()  # nobody holds any of the prompt's blocks
    full = KVIndex()  # replica 0 holds all of it (another router sent it there)
    for r in range(a.replicas):
        idx.replace(f"m/{r}", Snapshot(1, {"GPU": frozenset(hashes[:len(hashes) * 3 // 4]) if r == 0 else others[r]}))
        empty.replace(f"m/{r}", Snapshot(1, {"GPU": others[r]}))
        full.replace(f"m/{r}", Snapshot(1, {"GPU": frozenset(hashes) if r == 0 else others[r]}))
    unheld = PrefixChains().hashes(CTX, prompt, held_any=empty.holds_any)
    assert unheld == hashes[:16] and PrefixChains().hashes(CTX, prompt, held_any=full.holds_any) == hashes
    rows.append(("hash, never seen, nothing held",
                 med_us(lambda: PrefixChains().hashes(CTX, prompt, ids=ids, held_any=empty.holds_any), a.reps)))
    rows.append(("hash, never seen, fully held by a replica",
                 med_us(lambda: PrefixChains().hashes(CTX, prompt, ids=ids, held_any=full.holds_any), a.reps)))

    def next_turn() -> None:
        pc = PrefixChains()
        pc.hashes(CTX, base)
        t0 = time.perf_counter_ns()
        pc.hashes(CTX, prompt, ids=ids)
        lap.append(time.perf_counter_ns() - t0)
    lap: list[int] = []
    for _ in range(a.reps):
        next_turn()
    rows.append((f"hash, next turn (shares {(a.tokens - a.turn_tokens) // 16} of {a.tokens // 16} blocks)",
                 statistics.median(lap) / 1e3))
    warm = PrefixChains()
    warm.hashes(CTX, prompt)
    rows.append(("hash, repeat", med_us(lambda: warm.hashes(CTX, prompt, ids=ids), a.reps)))

    rows.append((f"index lookup ({a.replicas} replicas)", med_us(lambda: idx.leading_blocks(hashes), a.reps)))
    rows.append((f"index lookup, 16 hashes nobody holds ({a.replicas} replicas)",
                 med_us(lambda: empty.leading_blocks(unheld), a.reps)))

    eps = [EndpointView(id=f"m/{i}", model="m", url="", running=float(i % 5), waiting=0.0, stale=False,
                        kv_usage=0.3, scraped_at=0.0) for i in range(a.replicas)]
    sched = Scheduler(scorers={"kv_cache": KvCacheScorer(lambda h: {"m/0": len(h) * 3 // 4})})
    with_h = RequestInfo("r", "m", "m", kv_hashes=hashes)
    without = RequestInfo("r", "m", "m")
    srng = random.Random(2)
    d_with = med_us(lambda: sched.decide(with_h, eps, PRESETS["chat"], now=0.0, wall=0.0, rng=srng), a.reps)
    d_without = med_us(lambda: sched.decide(without, eps, PRESETS["chat"], now=0.0, wall=0.0, rng=srng), a.reps)
    rows.append(("scoring (decision with hashes - without)", max(0.0, d_with - d_without)))

    print(f"tier 2's added decision cost, a {a.tokens}-token prompt ({a.tokens // 16} blocks of 16), "
          f"median of {a.reps}, µs:")
    for name, us in rows:
        print(f"  {name:52} {us:8.1f}")
    r = dict(rows)
    look = r[f"index lookup ({a.replicas} replicas)"]
    look16 = r[f"index lookup, 16 hashes nobody holds ({a.replicas} replicas)"]
    score = r["scoring (decision with hashes - without)"]
    for name, hash_row, lk in (
            ("never seen, nothing held", "hash, never seen, nothing held", look16),
            ("never seen, fully held by a replica", "hash, never seen, fully held by a replica", look),
            ("never seen, no index (all blocks)", "hash, cold, all blocks (no index)", look),
            ("next turn of a conversation", next(k for k in r if k.startswith("hash, next turn")), look),
            ("repeated prompt", "hash, repeat", look)):
        print(f"  {'total, ' + name:52} {r[hash_row] + lk + score:8.1f}   target <= 100")

    def parse() -> None:  # as Tier2.answer checks it (llmgw.route.tier2)
        toks = json.loads(answer)["tokens"]
        arr = array("I", toks)
        assert not ((arr.count(0) or arr.count(1)) and any(type(t) is bool for t in toks))
    print("tokenize (not in the decision cost):")
    print(f"  {'parse and check the /tokenize answer':52} {med_us(parse, a.reps):8.1f}")
    if not a.no_roundtrip:
        us, n = roundtrip_us(prompt, min(a.reps, 100))
        print(f"  {f'/tokenize round trip, simulated vLLM, {n} tokens':52} {us:8.1f}")

    from llmgw.kv import hashing
    for t in range(151_000):  # the token -> CBOR table, as a long-running router has it (measured apart)
        hashing._UINT[t]
    gc.collect()
    tracemalloc.start()
    m0 = tracemalloc.get_traced_memory()[0]
    pc = PrefixChains()
    n_tok = 0
    for c in range(64):  # 64 conversations' chains, their token lists as json.loads makes them
        toks = json.loads(json.dumps([rng.randrange(151_000) for _ in range(a.tokens)]))
        pc.hashes(CTX, toks)
        n_tok += len(toks)
        del toks
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - m0
    tracemalloc.stop()
    table = sum(sys.getsizeof(v) for v in hashing._UINT.values()) + sys.getsizeof(hashing._UINT)
    print(f"memory: the token -> CBOR table {table / 2**20:.1f} MiB for {len(hashing._UINT)} token ids "
          "(grows to the vocabulary, at most 2^18 ids)")
    print(f"memory: remembered chains {used / n_tok:.1f} B per token ({used / (n_tok // 16):.0f} B per block), "
          f"{pc.chains} chains of {a.tokens} tokens")


if __name__ == "__main__":
    main()
