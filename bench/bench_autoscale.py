"""Autoscaling against fixed fleets: SLO attainment and replica-seconds on a load trace.

A router daemon and an agent daemon place simulated vLLM replicas whose cold start is realistic in
shape (process start-up, then model load: `--sim-start-seconds`, `--sim-load-seconds`), compressed
in time with the trace. Two traces, open loop (Poisson arrivals, seeded):

* **day**: a compressed day — a quiet night, a ramp to a midday peak and back down:
  λ(t) = low + (peak − low) · ((1 − cos 2πt/T) / 2)², whose mean is low + 0.375 (peak − low);
* **bursty**: a low base load with bursts of `--burst-rate` lasting `--burst-seconds` at random gaps.

Each trace is replayed against fresh fleets: **autoscaled** (`[models.autoscale]`, concurrency
target per replica, min 1), **floor** (the same, never below the average fleet: a warm floor for
bursts), **fixed at the average** and **fixed at the peak** (count = ceil(rate × service time /
target), the service time measured unloaded, the same per-replica target the autoscaler aims at).
For each: the share of requests whose time to first token is within `--slo-ms` (a failed request
misses it), TTFT percentiles, and replica-seconds (every replica placed and not yet stopped,
sampled from the admin API: a starting or draining replica holds its GPU too). The issue's goal:
≥ 95 % attainment at ≤ 60 % of the peak fleet's replica-seconds.

    .venv/bin/python bench/bench_autoscale.py                  # both traces, four fleets each: ~30 min
    .venv/bin/python bench/bench_autoscale.py --traces day --day-seconds 120
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Conn, Latencies, build_request  # noqa: E402
from procs import spawn, stop  # noqa: E402

TOKEN = "bench-autoscale-join"
REQUEST_TIMEOUT_S = 120.0
GONE = {"stopped", "failed", "crashed"}
WORDS = ("weather", "river", "engine", "garden", "silver", "market", "window", "harbor", "signal", "forest",
         "copper", "lantern", "meadow", "canvas", "orbit", "pepper", "violet", "quartz", "summit", "ember")


# -- traces -----------------------------------------------------------------------------------------
def poisson(rate_at: Any, seconds: float, top: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of rate rate_at(t) ≤ top over [0, seconds) (thinning)."""
    out, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= seconds:
            return out
        if rng.random() * top < rate_at(t):
            out.append(t)


def day_rate(a: argparse.Namespace) -> Any:
    T = a.day_seconds
    return lambda t: a.low_rate + (a.peak_rate - a.low_rate) * ((1 - math.cos(2 * math.pi * t / T)) / 2) ** 2


def bursty_rate(a: argparse.Namespace, rng: random.Random) -> tuple[Any, list[tuple[float, float]]]:
    bursts, t = [], a.burst_seconds
    while True:
        t += rng.uniform(0.5, 1.5) * a.burst_gap
        if t + a.burst_seconds > a.bursty_seconds - a.burst_seconds:
            break
        bursts.append((t, t + a.burst_seconds))
        t += a.burst_seconds
    return (lambda x: a.burst_rate if any(s <= x < e for s, e in bursts) else a.low_rate), bursts


# -- the fleet --------------------------------------------------------------------------------------
def engine_args(a: argparse.Namespace) -> list[str]:
    return ["--max-num-seqs", str(a.max_num_seqs), "--sim-decode-ms-per-token", str(a.decode_ms),
            "--sim-start-seconds", str(a.start_seconds), "--sim-load-seconds", str(a.load_seconds)]


def toml(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")


def write_config(tmp: Path, a: argparse.Namespace, count: int, autoscale_min: int | None, port: int) -> Path:
    lines = ["[server]", 'host = "127.0.0.1"', "[router]", "scrape_interval_s = 0.5",
             "[control]", f'listen = "127.0.0.1:{port}"', f"join_token = {toml(TOKEN)}",
             f"store = {toml(str(tmp / 'router.db'))}", "autoscale_interval_s = 1.0",
             "[admin]", f"socket = {toml(str(tmp / 'admin' / 'admin.sock'))}",
             "[[models]]", 'name = "m"', 'engine = "vllm"',
             "[models.deploy]", f"count = {count}", "simulate = true", "health_timeout_s = 120.0",
             "args = [" + ", ".join(toml(x) for x in engine_args(a)) + "]"]
    if autoscale_min is not None:
        lines += ["[models.autoscale]", f"min = {autoscale_min}", f"max = {a.max_replicas}", 'metric = "concurrency"',
                  f"target = {a.target}", f"window_s = {a.window_s}", f"panic_window_s = {a.panic_window_s}",
                  f"down_delay_s = {a.down_delay_s}", f"cold_start_s = {a.start_seconds + a.load_seconds + 1:g}"]
    path = tmp / "router.toml"
    path.write_text("\n".join(lines) + "\n")
    agent = tmp / "agent.toml"
    agent.write_text("\n".join(["[agent]", 'node = "gpu-1"', f'router = "127.0.0.1:{port}"',
                                f"join_token = {toml(TOKEN)}", f"state_dir = {toml(str(tmp / 'agent'))}"]) + "\n")
    return path


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Fleet:
    def __init__(self, a: argparse.Namespace, count: int, autoscale_min: int | None) -> None:
        self.tmpdir = tempfile.TemporaryDirectory(prefix="bench-autoscale-")
        tmp = Path(self.tmpdir.name)
        port = free_port()
        cfg = write_config(tmp, a, count, autoscale_min, port)
        self.procs: list[subprocess.Popen[bytes]] = []
        rp, info = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(cfg),
                          "--port", "0", "--log-level", "warning"])
        self.procs.append(rp)
        self.url = info["url"]
        self.port = int(self.url.rsplit(":", 1)[1])
        self.socket = str(tmp / "admin" / "admin.sock")
        ap, _ = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "agent", "--config", str(tmp / "agent.toml"),
                       "--log-level", "warning"])
        self.procs.append(ap)
        self.admin = httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), base_url="http://llmgw", timeout=10)
        deadline = time.monotonic() + 180
        while self.ready() < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"the fleet did not reach {count} ready replicas in 180 s")
            time.sleep(0.2)

    def replicas(self) -> list[dict[str, Any]]:
        return [r for r in self.admin.get("/api/v1/replicas").json() if r["model"] == "m"]

    def ready(self) -> int:
        return sum(1 for r in self.replicas() if r["state"] == "ready" and r["desired"] == "run")

    def close(self) -> None:
        self.admin.close()
        for p in reversed(self.procs):  # the agent first: it stops its engines
            stop(p)
        self.tmpdir.cleanup()


# -- a run ------------------------------------------------------------------------------------------
async def replay(f: Fleet, arrivals: list[float], a: argparse.Namespace, *, sample_every: float | None = 0.5,
                 offset: int = 0) -> dict[str, Any]:
    lat, status = Latencies(), Counter()
    samples: list[tuple[float, int, int]] = []  # (t, placed, ready)
    words = random.Random(a.seed + 1)
    reqs = [build_request("POST", "/v1/completions", json.dumps({  # prompts of their own: no two share a prefix
        "model": "m", "prompt": f"request {offset + i}: " + " ".join(words.choice(WORDS) for _ in range(a.prompt_words)),
        "max_tokens": a.max_tokens, "stream": True, "ignore_eos": True}).encode()) for i in range(len(arrivals))]
    start = trio.current_time()
    end_at = arrivals[-1] if arrivals else 0.0

    async def one(at: float, req: bytes) -> None:
        await trio.sleep_until(start + at)
        with trio.move_on_after(REQUEST_TIMEOUT_S):
            try:
                c = await Conn.open("127.0.0.1", f.port)
            except OSError:
                status["connect_error"] += 1
                return
            try:
                code, _, first = await c.stream_events(req)
                status[code] += 1
                if first is not None:
                    lat.values.append(first)
            except (ConnectionError, trio.BrokenResourceError, ValueError):
                status["cut_short"] += 1
            finally:
                await c.aclose()
            return
        status["timeout"] += 1

    async def sample() -> None:
        while trio.current_time() - start <= end_at:
            rows = await trio.to_thread.run_sync(f.replicas)
            placed = sum(1 for r in rows if r["state"] not in GONE)
            ready = sum(1 for r in rows if r["state"] == "ready" and r["desired"] == "run")
            samples.append((trio.current_time() - start, placed, ready))
            await trio.sleep(sample_every or 0.5)

    async with trio.open_nursery() as n:
        if sample_every is not None:
            n.start_soon(sample)
        for at, req in zip(arrivals, reqs, strict=True):
            n.start_soon(one, at, req)
    # replica-seconds over the trace: each sample's count held until the next one
    rs = sum(p * (t2 - t1) for (t1, p, _), (t2, _, _) in zip(samples, samples[1:], strict=False))
    slo = a.slo_ms / 1000
    within = sum(1 for x in lat.values if x <= slo)
    return {"requests": len(arrivals), "ok": status.get(200, 0),
            "errors": {str(k): v for k, v in status.items() if k != 200},
            "slo_attainment": within / max(len(arrivals), 1),
            "ttft_p50_ms": lat.pct(50) * 1000, "ttft_p90_ms": lat.pct(90) * 1000, "ttft_p99_ms": lat.pct(99) * 1000,
            "replica_seconds": rs, "max_placed": max((p for _, p, _ in samples), default=0)}


def calibrate(a: argparse.Namespace) -> float:
    """A request's time in the system unloaded (the router's view of it: what concurrency counts),
    the median of 20 one at a time on one replica: the fixed fleets are sized by it."""
    f = Fleet(a, 1, None)
    try:
        async def go() -> float:
            took = []
            for i in range(20):
                t0 = trio.current_time()
                r = await replay(f, [0.0], a, sample_every=None, offset=i)
                assert r["ok"] == 1, r
                took.append(trio.current_time() - t0)
            return sorted(took)[len(took) // 2]
        return trio.run(go)
    finally:
        f.close()


def run_fleet(a: argparse.Namespace, arrivals: list[float], count: int, autoscale_min: int | None) -> dict[str, Any]:
    """Replay the arrivals against a fresh fleet: autoscaled from ``autoscale_min`` (None: fixed at ``count``)."""
    f = Fleet(a, count, autoscale_min)
    try:
        out = trio.run(replay, f, arrivals, a)
        if autoscale_min is not None:
            v = f.admin.get("/api/v1/models/m/autoscale").json()
            moves = Counter("up" if h["desired"] > h["current"] else "down" for h in v.get("history", []))
            out["scale_ups"], out["scale_downs"] = moves.get("up", 0), moves.get("down", 0)
            out["cold_start_s"] = v.get("cold_start_s")
            if a.verbose:
                for h in reversed(v.get("history", [])):
                    print(f"    {h['current']} → {h['desired']} ({h['mode']}): {h.get('reason', '')}; "
                          f"limited by {h.get('limited_by') or 'nothing'}; rule: {h.get('rule', '')}", file=sys.stderr)
        return out
    finally:
        f.close()


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="day,bursty", help="day, bursty or both (default)")
    ap.add_argument("--day-seconds", type=float, default=240.0, help="the compressed day's length")
    ap.add_argument("--bursty-seconds", type=float, default=180.0)
    ap.add_argument("--low-rate", type=float, default=1.0, help="requests/s at night and between bursts")
    ap.add_argument("--peak-rate", type=float, default=20.0, help="requests/s at the day's peak")
    ap.add_argument("--burst-rate", type=float, default=16.0)
    ap.add_argument("--burst-seconds", type=float, default=20.0)
    ap.add_argument("--burst-gap", type=float, default=40.0, help="mean quiet time between bursts")
    ap.add_argument("--slo-ms", type=float, default=500.0, help="the TTFT target")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--decode-ms", type=float, default=150.0, help="--sim-decode-ms-per-token")
    ap.add_argument("--max-num-seqs", type=int, default=6)
    ap.add_argument("--start-seconds", type=float, default=2.0, help="--sim-start-seconds (cold start, part 1)")
    ap.add_argument("--load-seconds", type=float, default=4.0, help="--sim-load-seconds (cold start, part 2)")
    ap.add_argument("--target", type=float, default=4.0, help="autoscale target: concurrency per replica")
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--panic-window-s", type=float, default=4.0)
    ap.add_argument("--down-delay-s", type=float, default=15.0)
    ap.add_argument("--max-replicas", type=int, default=10)
    ap.add_argument("--fleets", default="autoscaled,floor,average,peak",
                    help="which fleets, in order: autoscaled, floor, average, peak")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--verbose", action="store_true", help="print the autoscaler's decisions (stderr)")
    a = ap.parse_args()
    # stopped by a signal: unwind, so every fleet's finally stops the processes it started
    signal.signal(signal.SIGTERM, _interrupted)

    service_s = calibrate(a)
    print(f"service time (one replica, one request at a time, median of 20): {service_s * 1000:.0f} ms", flush=True)
    results: dict[str, Any] = {}
    for trace in [t.strip() for t in a.traces.split(",") if t.strip()]:
        rng = random.Random(a.seed)
        if trace == "day":
            rate, seconds, peak = day_rate(a), a.day_seconds, a.peak_rate
            extra: dict[str, Any] = {}
        elif trace == "bursty":
            rate, bursts = bursty_rate(a, rng)
            seconds, peak = a.bursty_seconds, max(a.burst_rate, a.low_rate)
            extra = {"bursts": [[round(s, 1), round(e, 1)] for s, e in bursts]}
        else:
            raise SystemExit(f"--traces: unknown trace {trace!r} (day, bursty)")
        arrivals = poisson(rate, seconds, peak, rng)
        avg_rate = len(arrivals) / seconds
        counts = {"average": max(1, math.ceil(avg_rate * service_s / a.target)),
                  "peak": max(1, math.ceil(peak * service_s / a.target))}
        print(f"\n== {trace}: {len(arrivals)} requests over {seconds:g}s, mean {avg_rate:.1f}/s, peak {peak:g}/s; "
              f"service ≈ {service_s * 1000:.0f} ms; fixed fleets: average {counts['average']}, peak {counts['peak']}",
              flush=True)
        rows: dict[str, Any] = {"trace": trace, "requests": len(arrivals), "mean_rate": avg_rate, **extra}
        for fleet in [x.strip() for x in a.fleets.split(",") if x.strip()]:
            if fleet == "autoscaled":
                r = run_fleet(a, arrivals, 1, 1)
            elif fleet == "floor":  # autoscaled, never below the average fleet: a warm floor for bursts
                r = run_fleet(a, arrivals, counts["average"], counts["average"])
            elif fleet in counts:
                r = run_fleet(a, arrivals, counts[fleet], None)
                r["count"] = counts[fleet]
            else:
                raise SystemExit(f"--fleets: unknown fleet {fleet!r} (autoscaled, floor, average, peak)")
            rows[fleet] = r
            print(f"  {fleet:10} SLO {r['slo_attainment'] * 100:5.1f}%  TTFT p50/p90/p99 {r['ttft_p50_ms']:.0f}/"
                  f"{r['ttft_p90_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms  replica-s {r['replica_seconds']:.0f}  "
                  f"max {r['max_placed']}  errors {r['errors'] or 0}"
                  + (f"  ups {r['scale_ups']} downs {r['scale_downs']} cold start {r['cold_start_s']:.1f}s"
                     if r.get("cold_start_s") else ""), flush=True)
        for name in ("autoscaled", "floor"):
            if name in rows and "peak" in rows:
                share = rows[name]["replica_seconds"] / rows["peak"]["replica_seconds"]
                rows[name]["vs_peak_replica_seconds"] = share
                print(f"  {name}: {rows[name]['slo_attainment'] * 100:.1f}% within {a.slo_ms:g} ms at "
                      f"{share * 100:.0f}% of the peak fleet's replica-seconds (goal: ≥ 95% at ≤ 60%)", flush=True)
        results[trace] = rows
    print(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
