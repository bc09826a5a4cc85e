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
from procs import spawn, stop  # noqa: E402

# "default" is what a model gets with no strategy configured: no header, the shipped preset and
# the shipped load guard. The others are [[strategies]] sent by header.
STRATEGIES = {
    "default": {},
    "round-robin": {"picker": "round-robin", "weights": {"load": 1.0}},
    # the default before it was cache-aware (the chat preset until 2026-12)
    "old-default": {"picker": "max-score", "weights": {"load": 0.35, "queue": 0.15, "kv": 0.15, "inflight": 0.10,
                                                       "session": 0.25}},
    "load-only": {"picker": "max-score", "weights": {"load": 0.6, "queue": 0.2, "inflight": 0.2}},
    "prefix": {"picker": "max-score", "weights": {"prefix": 0.6, "load": 0.25, "queue": 0.15}},
    # the same weights with the other load guard: a spill gate against the fleet mean
    "prefix-spill": {"picker": "max-score", "weights": {"prefix": 0.6, "load": 0.25, "queue": 0.15},
                     "guard": "spill"},
}
WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
         "forest ember quartz falcon harbor lantern meadow summit canyon glacier orchard").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def workload(seed: int, tenants: int, users: int, turns: int, sys_words: int) -> list[dict]:
    """Conversations in arrival order: a tenant's system prompt, then the user's turns. The
    assistant's turns are whatever the engine answers, resent with the history each turn."""
    rng = random.Random(seed)
    systems = [f"You are tenant {t}'s assistant. " + text(rng, sys_words) for t in range(tenants)]
    convs = [{"tenant": t, "system": systems[t], "turns": [text(rng, 40) for _ in range(turns)]}
             for t in range(tenants) for _ in range(users)]
    rng.shuffle(convs)
    return convs


def working_set_blocks(convs: list[dict], max_tokens: int) -> int:
    """Distinct 16-token blocks of the whole workload: each tenant's system prompt once, plus each
    conversation's own turns (tokens as the simulator's tokenizer counts them)."""
    from llmgw.sim.tokenizer import Tokenizer, render_chat

    tok = Tokenizer()
    sys_blocks = {c["tenant"]: len(tok.encode(render_chat([{"role": "system", "content": c["system"]}],
                                                          add_generation_prompt=False))) // 16 for c in convs}
    tails = sum((sum(len(tok.encode(u)) + 8 for u in c["turns"]) + max_tokens * len(c["turns"])) // 16 + 1
                for c in convs)
    return sum(sys_blocks.values()) + tails


async def replay(port: int | list[int], convs: list[dict], rate: float, seed: int, strategy: str,
                 slo: float, think: float = 0.3, *, body: dict | None = None,
                 outcomes: Counter | None = None) -> tuple[Latencies, Counter, int]:
    """Conversations arrive open loop (Poisson at `rate` requests/s overall); within one, the next
    turn goes out a think time after the answer, with the real answer in the history.

    Several routers (bench_ha.py): `port` a list is a client-side round robin — each request to
    the next port, a refused connection retried once on the one after it; `body` is added to every
    request's JSON (e.g. model, cache_salt); with `outcomes`, a request that fails is counted there
    ("failed: ..."; retries as "retried") and its conversation goes on without that answer, instead
    of the replay raising."""
    rng = random.Random(seed)
    turns_per = sum(len(c["turns"]) for c in convs) / len(convs)
    t = 0.0
    starts = []
    for _ in convs:
        t += rng.expovariate(rate / turns_per)
        starts.append(t)
    lat = Latencies()
    per: Counter = Counter()
    good = 0
    start = trio.current_time()

    ports = [port] if isinstance(port, int) else list(port)
    turn = [0]

    async def connect() -> Conn:
        if len(ports) == 1:
            return await Conn.open("127.0.0.1", ports[0])
        turn[0] += 1
        mine = turn[0]  # others' requests move the turn on while this one connects
        for k in range(2):  # the next router; once more on the one after if it refuses
            sock = trio.socket.socket()
            try:
                await sock.connect(("127.0.0.1", ports[(mine + k) % len(ports)]))
            except ConnectionRefusedError:
                sock.close()
                if k == 1:
                    raise
                if outcomes is not None:
                    outcomes["retried"] += 1
                continue
            sock.setsockopt(6, 1, 1)  # TCP_NODELAY
            return Conn(trio.SocketStream(sock))
        raise AssertionError("unreachable")

    async def one(messages: list[dict]) -> str:
        if outcomes is None:
            return await one_of(messages)
        try:
            return await one_of(messages)
        except (OSError, ValueError, trio.BrokenResourceError) as e:  # refused twice, reset, closed; an error status
            outcomes["failed: " + (str(e) if type(e) is ValueError else type(e).__name__)] += 1
            return ""

    async def one_of(messages: list[dict]) -> str:
        req = json.dumps({"model": "m", "messages": messages, "max_tokens": 8, "stream": True,
                          "ignore_eos": True, **(body or {})}).encode()
        c = await connect()
        try:
            return await exchange(c, req)
        except BaseException:
            with trio.CancelScope(shield=True):
                await c.aclose()
            raise

    async def exchange(c: Conn, req: bytes) -> str:
        nonlocal good
        t0 = time.perf_counter()
        await c.stream.send_all(build_request("POST", "/v1/chat/completions", req,
                                              headers={} if strategy == "default" else {"x-llmgw-strategy": strategy}))
        end = await c._until(b"\r\n\r\n")
        head = bytes(c.buf[:end]).decode("latin-1").lower()
        del c.buf[: end + 4]
        if outcomes is not None and head[9:12] != "200":
            raise ValueError(f"status {head[9:12]}")
        while b"data: " not in c.buf:
            await c._more()
        lat.values.append(time.perf_counter() - t0)
        for line in head.split("\r\n"):
            if line.startswith("x-llmgw-endpoint:"):
                per[line.split(":", 1)[1].strip()] += 1
        while b"data: [DONE]" not in c.buf:
            await c._more()
        if time.perf_counter() - t0 <= slo:
            good += 1
        await c.aclose()
        answer = ""
        for part in bytes(c.buf).split(b"data: ")[1:]:
            part = part.split(b"\r\n")[0].strip()
            if part.startswith(b"{"):
                for ch in json.loads(part).get("choices", []):
                    answer += ch.get("delta", {}).get("content") or ""
        return answer

    async def conversation(at: float, conv: dict, crng: random.Random) -> None:
        await trio.sleep_until(start + at)
        history = [{"role": "system", "content": conv["system"]}]
        for user in conv["turns"]:
            history.append({"role": "user", "content": user})
            answer = await one(history)
            history.append({"role": "assistant", "content": answer})
            await trio.sleep(crng.expovariate(1 / think))

    async with trio.open_nursery() as nursery:
        for i, (at, conv) in enumerate(zip(starts, convs)):
            nursery.start_soon(conversation, at, conv, random.Random(seed * 7919 + i))
    return lat, per, good


def engine_counters(urls: list[str]) -> tuple[float, float]:
    """(prompt tokens queried, prompt tokens served from cache), from the engines' own counters."""
    q = h = 0.0
    for u in urls:
        for line in httpx.get(f"{u}/metrics").text.splitlines():
            if line.startswith("vllm:prefix_cache_queries_total"):
                q += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_hits_total"):
                h += float(line.rsplit(" ", 1)[1])
            elif line.startswith("llamacpp:prompt_tokens_total"):  # evaluated, cached excluded
                q += float(line.rsplit(" ", 1)[1])
            elif line.startswith("llamacpp:prompt_tokens_cached_total"):
                q += float(line.rsplit(" ", 1)[1])
                h += float(line.rsplit(" ", 1)[1])
    return q, h


class RealLlama:
    """Real llama-server replicas (LLMGW_LLAMA_SERVER, built by scripts/build-llama-server), restarted for
    each strategy so every run starts with empty slots; --cache-ram 0: only slots hold prompts."""

    def __init__(self, n: int, slots: int) -> None:
        binary = os.environ.get("LLMGW_LLAMA_SERVER")
        if not binary or not Path(binary).exists():
            raise SystemExit("--engine llamacpp-real needs LLMGW_LLAMA_SERVER (scripts/build-llama-server prints its path)")
        self.binary, self.model = binary, str(Path(binary).resolve().parent.parent / "tiny.gguf")
        self.n, self.slots = n, slots
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self.ports = [free_port() for _ in range(n)]

    def start(self) -> list[str]:
        self.stop()
        for port in self.ports:
            self.procs.append(subprocess.Popen(
                [self.binary, "-m", self.model, "--host", "127.0.0.1", "--port", str(port), "-c",
                 str(4096 * self.slots), "-np", str(self.slots), "-t", "1", "--metrics", "--cache-ram", "0"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        for u in self.urls:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{u}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"llama-server at {u} did not become healthy")
                time.sleep(0.05)
        return self.urls

    def stop(self) -> None:
        for p in self.procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=10)
        self.procs = []


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefix_outcomes(router_url: str) -> Counter:
    out: Counter = Counter()
    for line in httpx.get(f"{router_url}/metrics").text.splitlines():
        if line.startswith("llmgw_prefix_decisions_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = int(float(line.rsplit(" ", 1)[1]))
    return out


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
    ap.add_argument("--ramp", default="2,4,8",
                    help="--saturation: the offered rates, as multiples of --rate (a stepped ramp past the knee)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--engine", choices=["sim", "llamacpp-real"], default="sim",
                    help="llamacpp-real: real llama-server replicas with -np --slots and --cache-ram 0")
    ap.add_argument("--slots", type=int, default=2, help="llamacpp-real: -np per replica")
    a = ap.parse_args()
    convs = workload(a.seed, a.tenants, a.users, a.turns, a.sys_words)
    n_req = sum(len(c["turns"]) for c in convs)
    blocks = a.kv_blocks or max(8192 // 16 + 1, int(1.1 * working_set_blocks(convs, 8) / a.replicas))  # >= one --max-model-len 8192 sequence
    procs: list[subprocess.Popen[bytes]] = []
    results = {}
    real = RealLlama(a.replicas, a.slots) if a.engine == "llamacpp-real" else None
    try:
        sims = []
        for _ in range(a.replicas if real is None else 0):
            p, info = spawn([sys.executable, "-m", "llmgw", "sim", "--engine", "vllm", "m", "--host", "127.0.0.1",
                             "--port", "0", "--sim-kv-blocks", str(blocks), "--max-model-len", "8192",
                             "--sim-prefill-ms-per-token", "0.05", "--sim-decode-ms-per-token", "8"],
                            env={"VLLM_SERVER_DEV_MODE": "1"})
            procs.append(p)
            sims.append(info["url"])
        if real is not None:
            sims = real.start()
        cfg = Path(tempfile.mkdtemp()) / "bench.toml"
        lines = ['[server]', 'host = "127.0.0.1"', '[router]', 'scrape_interval_s = 0.25', 'queue_size = 4096',
                 'saturation_load = 100000.0']
        for name, st in STRATEGIES.items():
            if not st:
                continue
            w = ", ".join(f"{k} = {v}" for k, v in st["weights"].items())  # type: ignore[union-attr]
            lines += ["[[strategies]]", f'name = "{name}"', f'picker = "{st["picker"]}"', f"weights = {{ {w} }}"]
        lines += ["[[models]]", 'name = "m"', f'engine = "{"vllm" if real is None else "llamacpp"}"']
        lines += [f'[[models.replicas]]\nurl = "{u}"' for u in sims]
        cfg.write_text("\n".join(lines) + "\n")
        def start_router(name: str) -> tuple[subprocess.Popen[bytes], dict]:
            # A fresh router per strategy: no run inherits another's prefix index.
            guard = STRATEGIES[name].get("guard", "imbalance" if STRATEGIES[name] else None)
            path = cfg.with_name(f"bench-{guard or 'default'}.toml")
            text = cfg.read_text()
            if guard is not None:
                text = text.replace("[router]\n", f"[router]\nprefix = {{ guard = \"{guard}\" }}\n", 1)
            path.write_text(text)
            rp, rinfo = spawn([sys.executable, "-m", "llmgw", "daemon", "--config", str(path), "--port", "0",
                               "--log-level", "warning"])
            procs.append(rp)
            deadline = time.monotonic() + 10  # wait until it has scraped every replica once
            while time.monotonic() < deadline and "llmgw_endpoint_stale" in (
                    m := httpx.get(f"{rinfo['url']}/metrics").text) and ' 1.0' in "".join(
                    l for l in m.splitlines() if l.startswith("llmgw_endpoint_stale")):
                time.sleep(0.05)
            return rp, rinfo

        def stop_router(p: subprocess.Popen[bytes]) -> None:
            stop(p)
            procs.remove(p)
        what = f"{blocks} KV blocks" if real is None else f"{a.slots} slots (real llama-server, --cache-ram 0)"
        print(f"{n_req} requests, {a.tenants} tenants x {a.users} users x {a.turns} turns, "
              f"system prompts ~{a.sys_words * 2} tokens, {a.replicas} replicas x {what}, "
              f"{a.rate}/s open loop (conversations arrive open loop; turns follow answers)")
        print(f"{'strategy':12} {'hit rate':>8} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'max/mean':>8} "
              f"{'CPU/req':>8}  requests per replica")
        for name in a.strategies.split(","):
            if real is not None:
                real.start()  # empty slots; same ports, so the config still holds
            for u in sims:
                if real is None:
                    httpx.post(f"{u}/reset_prefix_cache")
            rp, rinfo = start_router(name)
            q0, h0 = engine_counters(sims)
            o0 = prefix_outcomes(rinfo["url"])
            cpu0 = proc_cpu_seconds(rp.pid)
            lat, per, good = trio.run(replay, rinfo["port"], convs, a.rate, a.seed, name, a.slo)
            cpu1 = proc_cpu_seconds(rp.pid)
            q1, h1 = engine_counters(sims)
            outcomes = prefix_outcomes(rinfo["url"]) - o0
            hit = (h1 - h0) / max(1.0, q1 - q0)
            counts = [per.get(f"m/{i}", 0) for i in range(a.replicas)]
            imb = max(counts) / (sum(counts) / len(counts))
            results[name] = {"hit_rate": hit, "ttft_p50": lat.pct(50), "ttft_p90": lat.pct(90),
                             "ttft_p99": lat.pct(99), "per_replica": counts, "max_over_mean": imb,
                             "router_cpu_ms": 1e3 * (cpu1 - cpu0) / n_req, "goodput": good / n_req,
                             "prefix_outcomes": dict(outcomes)}
            r = results[name]
            print(f"{name:12} {hit:8.1%} {1e3 * r['ttft_p50']:7.1f}ms {1e3 * r['ttft_p90']:6.1f}ms "
                  f"{1e3 * r['ttft_p99']:6.1f}ms {imb:8.2f} {r['router_cpu_ms']:6.2f}ms  {counts}  "
                  f"{dict(outcomes) if name.startswith('prefix') else ''}")
            stop_router(rp)
        if a.saturation:
            print("saturation ramp: goodput (requests/s done within the SLO, and their share) by offered rate")
            for rate in (a.rate * float(x) for x in a.ramp.split(",")):
                row = []
                for name in a.strategies.split(","):
                    for u in sims:
                        httpx.post(f"{u}/reset_prefix_cache")
                    rp, rinfo = start_router(name)
                    _, _, good = trio.run(replay, rinfo["port"], convs, rate, a.seed, name, a.slo)
                    stop_router(rp)
                    row.append(f"{name} {rate * good / n_req:5.1f}/s ({good / n_req:.0%})")
                    results.setdefault("saturation", {}).setdefault(str(rate), {})[name] = good / n_req
                print(f"  {rate:6.0f}/s  " + "  ".join(row))
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))
    finally:
        if real is not None:
            real.stop()
        for p in procs:
            stop(p)


if __name__ == "__main__":
    main()
