"""The peer feed (routing as one, docs/ha.md): what it costs a router to publish its decisions'
prefix-tree inserts, and how many inserts a second a feed carries to a peer, and what that buys.

    .venv/bin/python bench/bench_peer_feed.py [--inserts 20000] [--heads 1,4,16,64] [--only-routing]

Heads are chat-like: one of 20 system prompts of 2 KB, then a conversation's own bytes, to the
size asked (KiB); a new conversation each insert, 4 replicas.

Part 1, the sender: the cost on the decision path (the insert kept in the core's outbox), and
the feed's flush — batching, msgpack, HMAC-SHA256, the PUB socket's send — in process CPU per
insert, with the bytes each insert costs on the wire.

Part 2, carried: two feeds in this process over 127.0.0.1 TCP, the receiver applying every
insert to a real router core's prefix tree. Closed loop: a round of inserts is offered and
flushed, and the next one waits until the receiver applied them all — the rate is the pair's,
sender and receiver sharing one CPU of one process (two routers on two hosts each carry more).
The receiver's CPU per insert is the round's process CPU less the sender's flush.

Part 3, what it buys (pure, virtual time, no sockets): the shared-prefix chat workload (16
tenants of a 2 KB system prompt, 6 users each, 8 turns, 8 requests/s, 0.5 s answers, 1 s think
time) sent round robin over 3 routers' cores — with no feed, and with the feed (each router's
inserts reach the others at its next 20 ms flush + 1 ms) — against 1 router. A "hit" is
judged on a ground truth of what every replica was really sent: the share of each head's bytes
the chosen replica had been sent before (an engine's prefix cache hit, with every replica's
cache large enough).

The machine is shared: run it twice, compare the lower figures."""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time

import trio

from llmgw.config import parse_config
from llmgw.daemon.router.peer_feed import PeerFeed
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import RouterCore
from llmgw.route.attempt import Attempt
from llmgw.route.prefix_share import PrefixInsert
from llmgw.route.prefix_tree import PrefixIndex
from llmgw.route.replicas import ReplicaTable

CFG = "[[models]]\nname = \"m\"\nengine = \"vllm\"\n" + "".join(
    f"[[models.replicas]]\nurl = \"http://127.0.0.1:{p}\"\n" for p in range(1, 5))
KEY = bytes(32)


def core() -> RouterCore:
    cfg = parse_config(CFG)
    return RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=time.time, rng=random.Random(0))


def heads(n: int, kib: int, rng: random.Random) -> list[bytes]:
    systems = [rng.randbytes(2048) for _ in range(20)]
    size = kib * 1024
    out = []
    for k in range(n):
        s = systems[k % len(systems)]
        tail = (b"conversation %d " % k) + rng.randbytes(max(size - len(s) - 24, 0))
        out.append((s + tail)[:size])
    return out


def sender_cost(n: int, kib: int) -> tuple[float, float, float]:
    """(µs on the decision path, µs of the flush, bytes on the wire) per insert."""
    rng = random.Random(kib)
    c = core()
    share = c.prefix_share(limit=n + 1)
    reps = [r.id for r in c.all_replicas()]
    hs = heads(n, kib, rng)
    box = share.outbox  # the decision path's step, alone: PrefixRouting._classify's offer
    t0 = time.process_time()
    for k, h in enumerate(hs):
        box.offer(PrefixInsert("m", None, None, reps[k & 3], h, 1))
    t1 = time.process_time()
    feed = PeerFeed("bench-a", KEY, share, flush_s=3600)
    try:
        t2 = time.process_time()
        feed.flush()
        t3 = time.process_time()
    finally:
        feed.close()
    return (t1 - t0) / n * 1e6, (t3 - t2) / n * 1e6, feed.stats.sent_bytes / n


class _Counted:
    """The receiving core's share, setting an event once ``target`` inserts were applied (so the
    bench waits without spinning: the process CPU is the feed's)."""

    def __init__(self, share) -> None:  # noqa: ANN001
        self.share = share
        self.applied = 0
        self.target = 0
        self.reached = trio.Event()

    def take(self, most=None):  # noqa: ANN001, ANN201
        return self.share.take(most)

    def counts(self):  # noqa: ANN201
        return self.share.counts()

    def apply(self, ins: PrefixInsert, now: float) -> str:
        out = self.share.apply(ins, now)
        if out == "applied":
            self.applied += 1
            if self.applied >= self.target:
                self.reached.set()
        return out


async def carried(n: int, kib: int) -> tuple[float, float, float, int]:
    """(inserts/s end to end, sender µs/insert, receiver µs/insert, messages lost)."""
    # a round is at most 64 messages: below the high-water mark (128), as a 20 ms flush is
    round_size = max(1, min(2048, (64 * 512) // max(kib, 1)))
    rng = random.Random(kib + 1)
    ca, cb = core(), core()
    sa, sb = ca.prefix_share(limit=round_size + 1), _Counted(cb.prefix_share())
    reps = [r.id for r in ca.all_replicas()]
    a = PeerFeed("bench-a", KEY, sa, flush_s=3600)
    b = PeerFeed("bench-b", KEY, sb, flush_s=3600)
    hs = heads(n, kib, rng)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        await nursery.start(b.run)
        b.set_peers({"bench-a": a.address})
        with trio.fail_after(30):  # until b's SUB has joined (warm-up inserts: not applied, "other_model")
            while b.stats.received == 0:
                sa.outbox.offer(PrefixInsert("warm-up", None, None, reps[0], b"warm-up " * 16, 1))
                a.flush()
                await trio.sleep(0.01)
        send_cpu = 0.0
        w0, p0 = time.perf_counter(), time.process_time()
        for start in range(0, n, round_size):
            for k in range(start, min(start + round_size, n)):
                sa.outbox.offer(PrefixInsert("m", None, None, reps[k & 3], hs[k], 1))
            sb.target, sb.reached = min(start + round_size, n), trio.Event()
            t = time.process_time()
            a.flush()
            send_cpu += time.process_time() - t
            with trio.fail_after(60):
                await sb.reached.wait()
        wall, cpu = time.perf_counter() - w0, time.process_time() - p0
        nursery.cancel_scope.cancel()
    return n / wall, send_cpu / n * 1e6, (cpu - send_cpu) / n * 1e6, b.stats.dropped["gap"]


WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
         "forest ember quartz falcon harbor lantern meadow summit canyon glacier orchard").split()


def shared_prefix(routers: int, feed: bool, *, seed: int = 1, tenants: int = 16, users: int = 6, turns: int = 8,
                  rate: float = 8.0, answer_s: float = 0.5, think_s: float = 1.0,
                  flush_s: float = 0.02) -> tuple[float, float, int]:
    """(byte hit rate, decisions the router judged prefix hits, inserts carried) — Part 3."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    systems = [f"You are tenant {t}'s assistant. " + words(300) for t in range(tenants)]
    convs = [(systems[t], [words(40) for _ in range(turns)]) for t in range(tenants) for _ in range(users)]
    rng.shuffle(convs)
    cores = [core() for _ in range(routers)]
    shares = [c.prefix_share() for c in cores] if feed else []
    truth = PrefixIndex()
    ev: list[tuple[float, int, str, object]] = []  # (time, tie, kind, data)
    tie = 0

    def push(t: float, kind: str, data: object) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(ev, (t, tie, kind, data))

    t = 0.0
    for i in range(len(convs)):
        t += rng.expovariate(rate / turns)
        push(t, "turn", (i, 0, []))
    rr = 0
    hit_bytes = head_bytes = judged = decisions = carried = 0
    while ev:
        now, _, kind, data = heapq.heappop(ev)
        if kind == "end":
            c, plan, att = data  # type: ignore[misc]
            c.finish(plan, att, now, None, first_byte_at=now, status=200)
            continue
        if kind == "deliver":
            k, inserts = data  # type: ignore[misc]
            for j, sh in enumerate(shares):
                if j != k:
                    for ins in inserts:
                        sh.apply(ins, now)
                        carried += 1
            continue
        i, n, history = data  # type: ignore[misc]
        system, asks = convs[i]
        msgs = [{"role": "system", "content": system}, *history, {"role": "user", "content": asks[n]}]
        k = rr % routers
        rr += 1
        c = cores[k]
        plan = c.plan("chat", json.dumps({"model": "m", "messages": msgs}).encode(), f"q{rr}", strategy=None,
                      session=None, now=now)
        att = c.next(plan, now, 0.0)
        assert isinstance(att, Attempt)
        head = plan.info.head
        m = truth.match(("m", None, None), head, now)
        hit_bytes += m.holders.get(att.replica.id, (0, 0))[0]
        head_bytes += len(head)
        truth.record(("m", None, None), head, att.replica.id, now)
        decisions += 1
        judged += att.decision.prefix == "hit"
        push(now + answer_s, "end", (c, plan, att))
        if feed:
            inserts = shares[k].take()
            push((int(now / flush_s) + 1) * flush_s + 0.001, "deliver", (k, inserts))
        if n + 1 < turns:
            answer = {"role": "assistant", "content": f"answer {n} " + words(20)}
            push(now + answer_s + think_s, "turn", (i, n + 1, [*history, {"role": "user", "content": asks[n]}, answer]))
    return hit_bytes / head_bytes, judged / decisions, carried


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inserts", type=int, default=20000)
    ap.add_argument("--heads", default="1,4,16,64", help="head sizes in KiB, comma-separated")
    ap.add_argument("--only-routing", action="store_true", help="Part 3 alone")
    args = ap.parse_args()
    sizes = [] if args.only_routing else [int(x) for x in args.heads.split(",") if x]
    if sizes:
        print(f"{args.inserts} inserts per size; 4 replicas; heads: 2 KB system prompt + the conversation")
        print("\nsender (one router's CPU per insert)")
        print(f"{'head':>6} {'offer µs':>9} {'flush µs':>9} {'wire B':>8}")
        for kib in sizes:
            offer, flush, wire = sender_cost(args.inserts, kib)
            print(f"{kib:>4}Ki {offer:>9.2f} {flush:>9.2f} {wire:>8.0f}")
        print("\ncarried (sender and receiver in one process, 127.0.0.1, receiver applying to its tree)")
        print(f"{'head':>6} {'inserts/s':>10} {'MB/s':>7} {'send µs':>8} {'recv µs':>8} {'lost msgs':>9}")
        for kib in sizes:
            rate, send, recv, lost = trio.run(carried, args.inserts, kib)
            print(f"{kib:>4}Ki {rate:>10.0f} {rate * kib * 1024 / 1e6:>7.1f} {send:>8.2f} {recv:>8.2f} {lost:>9}")
    print("\nwhat it buys (shared-prefix chat, round robin over the routers, virtual time)")
    print(f"{'routers':>18} {'byte hit rate':>14} {'judged hits':>12} {'inserts carried':>16}")
    for label, n, fed in (("1", 1, False), ("3, no feed", 3, False), ("3, with the feed", 3, True)):
        hit, judged, carried_n = shared_prefix(n, fed)
        print(f"{label:>18} {hit:>14.1%} {judged:>12.1%} {carried_n:>16}")


if __name__ == "__main__":
    main()
