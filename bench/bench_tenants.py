"""Tenants under saturation (docs/tenants.md): does one tenant's flood leave another's latency alone,
and what do tenants cost the router per request — in one run, on simulated engines.

    .venv/bin/python bench/bench_tenants.py [--seconds 20] [--replicas 2] [--slots 4]
        [--flood 10] [--steady 0.1] [--cpu-requests 3000] [--tenants 1000] [--json FILE]

The fleet: --replicas simulated vLLM engines (prefill --prefill-ms a token, 16 tokens decoded at 10 ms a token; each request a unique prompt of --prompt-words words, so each pays its prefill, as real chat does), and the
router capping each at --slots requests in flight (`[[pools]] max_inflight_per_replica`), so the fleet's
capacity is known and the router's admission queue (`[router] queue_size` 256, 10 s) holds what
does not fit. The capacity C (requests/s) is measured first, closed loop.

1. Fairness: tenant A floods at --flood × C (open loop), tenant B sends a steady --steady × C, both
   in band `normal` with weight 1, for --seconds. B's TTFT p50/p90 (time to the first byte of the
   answer's body) and its refusals, with the queue in `fifo` order (what llmgw did before tenants:
   `[router] queue_order = "fifo"`) and in `fair` order (the default), against B alone.
2. Bands: the same flood from A in band `low` and the steady share from H in band `high`: H's TTFT
   p90 against H alone.
3. Cost: the router's CPU per streamed request (zero-cost engines, 32 connections, closed loop)
   with no keys at all (open: everyone is the anonymous tenant) and with --tenants tenants of one
   key each (every request authenticated, quota-checked and accounted, round robin over the keys).

Tenants and keys are made through the admin API (POST /api/v1/tenants, /tenants/{name}/keys).
Bounded: a fixed time and number of requests on 127.0.0.1; every process started is stopped by its
PID. Prints figures, no verdict."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Conn, build_request, proc_cpu_seconds  # noqa: E402
from procs import spawn, stop  # noqa: E402

MODEL = "m"
_SERIAL = itertools.count()  # every request of the run a prompt of its own (no cache hit across runs)


FILLER = ("The quarterly report covers revenue, costs, hiring, the new data centre, customer churn and the "
          "roadmap for the next two releases, with tables for each region and a summary for the board. ")


def chat(max_tokens: int = 16, words: int = 0, n: int = 0) -> bytes:
    """A streamed chat request; with `words`, a prompt of about that many words that starts with
    `n` (no two share a cached prefix: each pays its prefill)."""
    text = "Say something short."
    if words:
        filler = FILLER * (words // len(FILLER.split()) + 1)
        text = f"Request {n}. Summarise: " + " ".join(filler.split()[:words])
    return json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": text}]}).encode()


def pct(v: list[float], p: float) -> float:
    if not v:
        return float("nan")
    s = sorted(v)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


async def one(port: int, raw: bytes, out: list[tuple[int, float]]) -> None:
    """One streamed request on a new connection: (status, seconds to the body's first byte)."""
    t0 = time.perf_counter()
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        out.append((0, 0.0))
        return
    try:
        await stream.send_all(raw)
        buf = bytearray()
        first = None
        while True:
            data = await stream.receive_some(65536)
            if not data:
                break
            buf += data
            i = buf.find(b"\r\n\r\n")
            if i >= 0 and first is None and len(buf) > i + 4:
                first = time.perf_counter() - t0
            if buf.endswith(b"0\r\n\r\n") or (i >= 0 and b"content-length" in buf[:i].lower()
                                               and len(buf) >= i + 4 + _length(buf[:i])):
                break
        status = int(buf[9:12]) if len(buf) >= 12 else 0
        out.append((status, first if first is not None else time.perf_counter() - t0))
    except OSError:
        out.append((0, time.perf_counter() - t0))
    finally:
        await stream.aclose()


def _length(head: bytes) -> int:
    for line in head.decode("latin-1").lower().split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":", 1)[1])
    return 0


async def open_loop(port: int, streams: list[tuple[float, Any, list[tuple[int, float]]]], seconds: float) -> None:
    """Each stream: (rate/s, i -> its i-th raw request, where its results go), on a fixed schedule."""
    async with trio.open_nursery() as nursery:
        for rate, raw, out in streams:
            nursery.start_soon(_paced, port, rate, raw, out, seconds, nursery)


async def _paced(port: int, rate: float, raw: Any, out: list[tuple[int, float]], seconds: float,
                 nursery: trio.Nursery) -> None:
    start = trio.current_time()
    n = int(rate * seconds)
    for i in range(n):
        await trio.sleep_until(start + i / rate)
        nursery.start_soon(one, port, raw(i), out)


async def capacity(port: int, raw: bytes, conns: int, seconds: float) -> float:
    done = 0
    end = trio.current_time() + seconds

    async def worker() -> None:
        nonlocal done
        c = await Conn.open("127.0.0.1", port)
        while trio.current_time() < end:
            status, _, _ = await c.request(raw)
            done += status == 200
        await c.aclose()

    async with trio.open_nursery() as n:
        for _ in range(conns):
            n.start_soon(worker)
    return done / seconds


async def closed_loop(port: int, raws: list[bytes], n: int, conns: int) -> None:
    left = n

    async def worker(k: int) -> None:
        nonlocal left
        c = await Conn.open("127.0.0.1", port)
        i = k
        while left > 0:
            left -= 1
            status, _, _ = await c.request(raws[i % len(raws)])
            assert status == 200, status
            i += conns
        await c.aclose()

    async with trio.open_nursery() as nur:
        for k in range(conns):
            nur.start_soon(worker, k)


class Admin:
    def __init__(self, sock: str) -> None:
        self.c = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://admin", timeout=30)

    def tenant(self, name: str, **kw: Any) -> str:
        r = self.c.post("/api/v1/tenants", json={"name": name, **kw})
        assert r.status_code == 201, r.text
        r = self.c.post(f"/api/v1/tenants/{name}/keys", json={"name": "bench"})
        assert r.status_code == 201, r.text
        return r.json()["key"]


def start_router(tmp: Path, tag: str, sims: list[dict], *, slots: int, order: str, cpu: int | None) -> tuple[subprocess.Popen[bytes], int, str]:
    sock = str(tmp / f"{tag}.sock")
    reps = "\n".join(f'[[models.replicas]]\nurl = "{s["url"]}"' for s in sims)
    cfg = tmp / f"{tag}.toml"
    cfg.write_text(f'[server]\nhost = "127.0.0.1"\n[router]\nqueue_size = 256\nqueue_timeout_s = 10.0\n'
                   f'queue_order = "{order}"\n[router.traces]\nkept = 50000\n[control]\nlisten = "127.0.0.1:0"\nstore = "{tmp / (tag + ".db")}"\n'
                   f'[admin]\nsocket = "{sock}"\n[[pools]]\nname = "default"\nmax_inflight_per_replica = {slots}\n'
                   f'[[models]]\nname = "{MODEL}"\nengine = "vllm"\n{reps}\n')
    p, info = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(cfg), "--port", "0",
                     "--log-level", "warning"], cpu=cpu)
    return p, info["port"], sock


def phases(admin: Admin, prefix: str) -> dict[str, float]:
    """Where B's answered requests spent their time, from the router's own traces: each phase's
    median (queued = waiting for a slot; first_byte = the engine's prefill)."""
    per: dict[str, list[float]] = {}
    for t in admin.c.get("/api/v1/traces", params={"limit": 10000}).json():
        if not t["id"].startswith(prefix + "-") or t["status"] != 200:
            continue
        for ph in admin.c.get(f"/api/v1/traces/{t['id']}").json()["phases"]:
            per.setdefault(ph["name"], []).append(ph["duration_ms"] or 0.0)
    return {k: round(statistics.median(v), 1) for k, v in per.items()}


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def summary(res: list[tuple[int, float]]) -> dict[str, Any]:
    ok = [t for s, t in res if s == 200]
    return {"sent": len(res), "ok": len(ok), "refused": sum(1 for s, _ in res if s == 429),
            "failed": sum(1 for s, _ in res if s not in (200, 429)),
            "ttft_p50_ms": round(1e3 * pct(ok, 50), 1), "ttft_p90_ms": round(1e3 * pct(ok, 90), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--flood", type=float, default=10.0)
    ap.add_argument("--steady", type=float, default=0.1)
    ap.add_argument("--cpu-requests", type=int, default=3000)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--prompt-words", type=int, default=300,
                    help="words in each fairness request's prompt (each unique: it pays its prefill); 0: a tiny prompt")
    ap.add_argument("--prefill-ms", type=float, default=0.25, help="the engines' prefill time per prompt token")
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    out: dict[str, Any] = {}
    procs: list[subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    try:
        sims = []
        for _ in range(a.replicas):
            p, info = spawn([sys.executable, "-m", "llmgw", "sim", "--engine", "vllm", MODEL, "--host", "127.0.0.1",
                             "--port", "0", "--max-num-seqs", "64", "--sim-decode-ms-per-token", "10",
                             "--sim-prefill-ms-per-token", str(a.prefill_ms)])
            procs.append(p)
            sims.append(info)
        fair_runs: dict[str, dict[str, Any]] = {}
        cap = 0.0
        for order in ("fifo", "fair"):
            rp, port, sock = start_router(tmp, order, sims, slots=a.slots, order=order, cpu=None)
            procs.append(rp)
            admin = Admin(sock)
            ka, kb = admin.tenant("a"), admin.tenant("b")
            kl = admin.tenant("flood-low", band="low")
            kh = admin.tenant("high", band="high")
            if not cap:
                cap = trio.run(capacity, port, build_request("POST", "/v1/chat/completions", chat(16, a.prompt_words),
                                                             headers=bearer(kb)),
                               a.replicas * a.slots, 3.0)
                print(f"capacity C = {cap:.1f} requests/s ({a.replicas} replicas × {a.slots} slots, prompts of "
                      f"{a.prompt_words} words at {a.prefill_ms} ms a token, 16 tokens at 10 ms)")
                out["capacity_rps"] = round(cap, 1)
            def req(k: str, words: int = a.prompt_words, tag: str = "") -> Any:
                def make(i: int) -> bytes:
                    h = bearer(k) | ({"x-request-id": f"{tag}-{order}-{i}"} if tag else {})
                    return build_request("POST", "/v1/chat/completions", chat(16, words, next(_SERIAL)), headers=h)
                return make
            if order == "fifo":
                alone: list[tuple[int, float]] = []
                trio.run(open_loop, port, [(a.steady * cap, req(kb), alone)], a.seconds)
                fair_runs["B alone"] = summary(alone)
                h_alone: list[tuple[int, float]] = []
                trio.run(open_loop, port, [(a.steady * cap, req(kh), h_alone)], a.seconds)
                fair_runs["high alone"] = summary(h_alone)
            fa: list[tuple[int, float]] = []
            fb: list[tuple[int, float]] = []
            trio.run(open_loop, port, [(a.flood * cap, req(ka), fa), (a.steady * cap, req(kb, tag="b"), fb)], a.seconds)
            fair_runs[f"B beside A's flood, {order}"] = summary(fb) | {"phases_p50_ms": phases(admin, f"b-{order}")}
            fair_runs[f"A's flood, {order}"] = summary(fa)
            if order == "fair":
                la: list[tuple[int, float]] = []
                lh: list[tuple[int, float]] = []
                trio.run(open_loop, port, [(a.flood * cap, req(kl), la), (a.steady * cap, req(kh), lh)], a.seconds)
                fair_runs["high beside a low band's flood"] = summary(lh)
                fair_runs["the low band's flood"] = summary(la)
            stop(rp)
            procs.remove(rp)
        print(f"A floods at {a.flood:g}×C, B sends {a.steady:g}×C, {a.seconds:g} s each:")
        for name, s in fair_runs.items():
            print(f"  {name:36} TTFT p50 {s['ttft_p50_ms']:7.1f} ms  p90 {s['ttft_p90_ms']:7.1f} ms   "
                  f"ok {s['ok']}/{s['sent']}, 429 {s['refused']}, failed {s['failed']}")
            if s.get("phases_p50_ms"):
                print("      the router's traces, each phase's median: " +
                      ", ".join(f"{k} {v:.1f} ms" for k, v in s["phases_p50_ms"].items()))
        alone_p90 = fair_runs["B alone"]["ttft_p90_ms"]
        for order in ("fifo", "fair"):
            r = fair_runs[f"B beside A's flood, {order}"]["ttft_p90_ms"] / alone_p90
            print(f"  B's TTFT p90 beside the flood / alone, {order}: ×{r:.2f}")
            out[f"b_p90_ratio_{order}"] = round(r, 2)
        rh = fair_runs["high beside a low band's flood"]["ttft_p90_ms"] / fair_runs["high alone"]["ttft_p90_ms"]
        print(f"  the high band's TTFT p90 beside the low band's flood / alone: ×{rh:.2f}")
        out["high_p90_ratio"] = round(rh, 2)
        out["runs"] = fair_runs
        if not a.skip_cpu:
            out["cpu"] = cpu_cost(a, tmp, procs)
    finally:
        for p in procs:
            stop(p)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


def cpu_cost(a: argparse.Namespace, tmp: Path, procs: list[subprocess.Popen[bytes]]) -> dict[str, float]:
    """Router CPU per streamed request: no keys vs --tenants tenants with a key each (zero-cost engines)."""
    sims = []
    for _ in range(2):
        p, info = spawn([sys.executable, "-m", "llmgw", "sim", "--engine", "vllm", MODEL, "--host", "127.0.0.1",
                         "--port", "0", "--sim-zero-cost", "--max-num-seqs", "1024", "--sim-kv-blocks", "65536"], cpu=1)
        procs.append(p)
        sims.append(info)
    routers = []
    for tag in ("open", "tenants"):
        rp, port, sock = start_router(tmp, f"cpu-{tag}", sims, slots=100000, order="fair", cpu=0)
        procs.append(rp)
        keys: list[str | None] = [None]
        if tag == "tenants":
            admin = Admin(sock)
            t0 = time.perf_counter()
            keys = [admin.tenant(f"t{i:04d}", quota={"rpm": 1_000_000, "tpm": 1_000_000_000})
                    for i in range(a.tenants)]
            print(f"made {a.tenants} tenants and keys in {time.perf_counter() - t0:.1f} s")
        raws = [build_request("POST", "/v1/chat/completions", chat(8), headers=bearer(k)) for k in keys]
        routers.append((tag, rp, port, raws))
    for _, _, port, raws in routers:
        trio.run(closed_loop, port, raws, 640, 32)  # warm-up
    per: dict[str, list[float]] = {}
    for _ in range(3):
        for tag, rp, port, raws in routers:
            c0 = proc_cpu_seconds(rp.pid)
            trio.run(closed_loop, port, raws, a.cpu_requests, 32)
            per.setdefault(tag, []).append((proc_cpu_seconds(rp.pid) - c0) / a.cpu_requests)
    med = {k: statistics.median(v) for k, v in per.items()}
    print(f"router CPU per streamed request (8 tokens, 32 connections, medians of 3 rounds): "
          f"open {1e3 * med['open']:.3f} ms, {a.tenants} tenants and keys {1e3 * med['tenants']:.3f} ms "
          f"(×{med['tenants'] / med['open']:.3f})")
    return {"open_ms": round(1e3 * med["open"], 4), "tenants_ms": round(1e3 * med["tenants"], 4),
            "ratio": round(med["tenants"] / med["open"], 3)}


if __name__ == "__main__":
    main()
