"""Cache-aware routing benchmark: round robin vs load-only vs prefix routing, in one run.

    .venv/bin/python bench/bench_prefix_routing.py [--replicas 4] [--tenants 8] [--requests 600]
        [--rate 20] [--saturation]

Workload: several tenants with long system prompts; users in multi-turn conversations resend
their history each turn; open-loop (Poisson) arrivals. Simulator replicas whose KV caches are too
small for the working set but whose sum roughly holds it. For each strategy the caches are reset
(vLLM's dev-mode /reset_prefix_cache) and the same request schedule is replayed through the
router. Reported per strategy: the engines' own prefix-cache hit rate (from their
vllm:prefix_cache_* counters), TTFT p50/p90/p99 (first streamed byte), requests per replica and
max/mean, and router CPU per request. --saturation ramps the rate until the fleet saturates and
reports goodput (requests completed within an SLO) per strategy.

Bounded: a fixed number of requests on 127.0.0.1; every process is stopped at the end."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Conn, Latencies, build_request, proc_cpu_seconds  # noqa: E402

STRATEGIES = {
    "round-robin": {"picker": "round-robin", "weights": {"load": 1.0}},
    "load-only": {"picker": "max-score", "weights": {"load": 0.6, "queue": 0.2, "inflight": 0.2}},
    "prefix": {"picker": "max-score", "weights": {"prefix": 0.6, "load": 0.25, "queue": 0.15}},
}
WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
         "forest ember quartz falcon harbor lantern meadow summit canyon glacier orchard").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def workload(seed: int, tenants: int, users: int, turns: int, sys_words: int) -> list[dict]:
    """Requests in arrival order: each user's turns are in order; users interleave."""
    rng = random.Random(seed)
    systems = [f"You are tenant {t}'s assistant. " + text(rng, sys_words) for t in range(tenants)]
    convs = []
    for t in range(tenants):
        for u in range(users):
            history = [{"role": "system", "content": systems[t]}]
            reqs = []
            for _ in range(turns):
                history = history + [{"role": "user", "content": text(rng, 40)}]
                reqs.append({"messages": list(history), "tenant": t})
                history = history + [{"role": "assistant", "content": text(rng, 20)}]
            convs.append(reqs)
    order = []
    while any(convs):
        c = rng.choice([c for c in convs if c])
        order.append(c.pop(0))
    return order


def working_set_blocks(reqs: list[dict]) -> int:
    """Distinct 16-token blocks of the whole workload: each tenant's system prompt once, plus each
    conversation's own tail at its longest (tokens as the simulator's tokenizer counts them)."""
    from llmgw.sim.tokenizer import Tokenizer, render_chat

    tok = Tokenizer()
    sys_blocks: dict[int, int] = {}
    longest: dict[tuple[int, str], int] = {}
    for r in reqs:
        msgs = r["messages"]
        n_sys = len(tok.encode(render_chat(msgs[:1], add_generation_prompt=False))) // 16
        sys_blocks[r["tenant"]] = n_sys
        n = len(tok.encode(render_chat(msgs))) // 16 + 1
        key = (r["tenant"], msgs[1]["content"])
        longest[key] = max(longest.get(key, 0), n - n_sys)
    return sum(sys_blocks.values()) + sum(longest.values())


def spawn(cmd: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], dict]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "PYTHONHASHSEED": "0", **(env or {})})
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


async def replay(port: int, reqs: list[dict], rate: float, seed: int, strategy: str,
                 slo: float) -> tuple[Latencies, Counter, int]:
    rng = random.Random(seed)
    t = 0.0
    times = []
    for _ in reqs:
        t += rng.expovariate(rate)
        times.append(t)
    lat = Latencies()
    per = Counter()
    good = 0
    start = trio.current_time()

    async def one(at: float, r: dict) -> None:
        nonlocal good
        await trio.sleep_until(start + at)
        body = json.dumps({"model": "m", "messages": r["messages"], "max_tokens": 8, "stream": True,
                           "ignore_eos": True}).encode()
        c = await Conn.open("127.0.0.1", port)
        t0 = time.perf_counter()
        raw = build_request("POST", "/v1/chat/completions", body, headers={"x-llmgw-strategy": strategy})
        await c.stream.send_all(raw)
        end = await c._until(b"\r\n\r\n")
        head = bytes(c.buf[:end]).decode("latin-1").lower()
        del c.buf[: end + 4]
        while b"data: " not in c.buf:
            await c._more()
        ttft = time.perf_counter() - t0
        lat.values.append(ttft)
        for line in head.split("\r\n"):
            if line.startswith("x-llmgw-endpoint:"):
                per[line.split(":", 1)[1].strip()] += 1
        while b"data: [DONE]" not in c.buf:
            await c._more()
        if time.perf_counter() - t0 <= slo:
            good += 1
        await c.aclose()

    async with trio.open_nursery() as nursery:
        for at, r in zip(times, reqs):
            nursery.start_soon(one, at, r)
    return lat, per, good


def engine_counters(urls: list[str]) -> tuple[float, float]:
    q = h = 0.0
    for u in urls:
        for line in httpx.get(f"{u}/metrics").text.splitlines():
            if line.startswith("vllm:prefix_cache_queries_total"):
                q += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_hits_total"):
                h += float(line.rsplit(" ", 1)[1])
    return q, h


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--sys-words", type=int, default=800)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--kv-blocks", type=int, default=0, help="per replica (default: sized from the workload)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slo", type=float, default=2.0, help="goodput: requests done within this many seconds")
    ap.add_argument("--saturation", action="store_true", help="also ramp the rate to saturation")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    reqs = workload(a.seed, a.tenants, a.users, a.turns, a.sys_words)
    blocks = a.kv_blocks or max(64, int(1.1 * working_set_blocks(reqs) / a.replicas))
    procs: list[subprocess.Popen[bytes]] = []
    results = {}
    try:
        sims = []
        for _ in range(a.replicas):
            p, info = spawn([sys.executable, "-m", "llmgw", "sim", "--engine", "vllm", "m", "--host", "127.0.0.1",
                             "--port", "0", "--sim-kv-blocks", str(blocks), "--max-model-len", "8192",
                             "--sim-prefill-ms-per-token", "0.05", "--sim-decode-ms-per-token", "8"],
                            env={"VLLM_SERVER_DEV_MODE": "1"})
            procs.append(p)
            sims.append(info["url"])
        cfg = Path(tempfile.mkdtemp()) / "bench.toml"
        lines = ['[server]', 'host = "127.0.0.1"', '[router]', 'scrape_interval_s = 0.25', 'queue_size = 4096',
                 'saturation_load = 100000.0']
        for name, st in STRATEGIES.items():
            w = ", ".join(f"{k} = {v}" for k, v in st["weights"].items())
            lines += ["[[strategies]]", f'name = "{name}"', f'picker = "{st["picker"]}"', f"weights = {{ {w} }}"]
        lines += ["[[models]]", 'name = "m"', 'engine = "vllm"']
        lines += [f'[[models.replicas]]\nurl = "{u}"' for u in sims]
        cfg.write_text("\n".join(lines) + "\n")
        rp, rinfo = spawn([sys.executable, "-m", "llmgw", "daemon", "--config", str(cfg), "--port", "0",
                           "--log-level", "warning"])
        procs.append(rp)
        print(f"{len(reqs)} requests, {a.tenants} tenants x {a.users} users x {a.turns} turns, "
              f"system prompts ~{a.sys_words * 2} tokens, {a.replicas} replicas x {blocks} KV blocks, "
              f"{a.rate}/s open loop")
        print(f"{'strategy':12} {'hit rate':>8} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'max/mean':>8} "
              f"{'CPU/req':>8}  requests per replica")
        for name in a.strategies.split(","):
            for u in sims:
                httpx.post(f"{u}/reset_prefix_cache")
            q0, h0 = engine_counters(sims)
            cpu0 = proc_cpu_seconds(rp.pid)
            lat, per, good = trio.run(replay, rinfo["port"], reqs, a.rate, a.seed, name, a.slo)
            cpu1 = proc_cpu_seconds(rp.pid)
            q1, h1 = engine_counters(sims)
            hit = (h1 - h0) / max(1.0, q1 - q0)
            counts = [per.get(f"m/{i}", 0) for i in range(a.replicas)]
            imb = max(counts) / (sum(counts) / len(counts))
            results[name] = {"hit_rate": hit, "ttft_p50": lat.pct(50), "ttft_p90": lat.pct(90),
                             "ttft_p99": lat.pct(99), "per_replica": counts, "max_over_mean": imb,
                             "router_cpu_ms": 1e3 * (cpu1 - cpu0) / len(reqs), "goodput": good / len(reqs)}
            r = results[name]
            print(f"{name:12} {hit:8.1%} {1e3 * r['ttft_p50']:7.1f}ms {1e3 * r['ttft_p90']:6.1f}ms "
                  f"{1e3 * r['ttft_p99']:6.1f}ms {imb:8.2f} {r['router_cpu_ms']:6.2f}ms  {counts}")
        if a.saturation:
            print("saturation ramp: goodput (share of requests done within the SLO) by rate")
            for rate in (a.rate * 2, a.rate * 4, a.rate * 8):
                row = []
                for name in a.strategies.split(","):
                    for u in sims:
                        httpx.post(f"{u}/reset_prefix_cache")
                    _, _, good = trio.run(replay, rinfo["port"], reqs, rate, a.seed, name, a.slo)
                    row.append(f"{name} {good / len(reqs):.0%}")
                    results.setdefault("saturation", {}).setdefault(str(rate), {})[name] = good / len(reqs)
                print(f"  {rate:6.0f}/s  " + "  ".join(row))
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
