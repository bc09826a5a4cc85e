"""Where tier 1 breaks down and tier 2 does not: round robin vs tier 1 (the chat preset, no KV
events) vs tier 2 (the chat preset with kv_events), in one run, per phase.

    .venv/bin/python bench/bench_kv_pressure.py [--replicas 3] [--tenants 8] [--users 4] [--turns 4]
        [--rate 6] [--pressure 1.5] [--json FILE]

One fleet over real processes: a router with its control plane, one agent, and three models that
differ only in how they are routed — `rr` (round robin), `t1` (the chat preset; tier 1 only) and
`t2` (the chat preset with `kv_events = true`; tier 2 votes too) — each with --replicas simulated
vLLM replicas (`llmgw sim --engine vllm`, started by the agent) whose KV caches together hold
1/--pressure of the workload's working set (--sim-kv-blocks). The models are measured one after
the other with the same schedule, each on its own (empty) engines. Three phases, each a fresh set
of multi-turn conversations (users resending their history) of the same tenants (long system
prompts), open-loop arrivals:

- pressure: the conversations alone; the working set is --pressure x the fleet's KV.
- burst: the same, while waves of unique long prompts evict: through the router by default (tier 1
  records them as held, and its model of each engine's cache forgets the tenants' prefixes that the
  engine, evicting a sequence's tail first, still holds), or with --burst-via engines straight to
  the engines (another gateway sharing them: the router sees none of it).
- restart: the first replica's engine is killed as the phase starts (the agent restarts it, empty);
  the router is not told what it lost.

Per phase and model: the prefix-cache hit rate of the conversations' requests (cached prompt
tokens / prompt tokens, from each response's usage), TTFT p50/p90 (first streamed byte), and for
t2 how tier 2's tokenize step went. Bounded: a fixed number of requests, on 127.0.0.1; every
process is stopped at the end."""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefix_routing import text, working_set_blocks
from loadgen import Conn, Latencies, build_request
from procs import spawn, stop

MODELS = {"rr": "round robin", "t1": "tier 1", "t2": "tier 2"}
PHASES = ("pressure", "burst", "restart")
TOKEN = "bench-join-token-0"
ROUTER_PORT = [0]


def conversations(seed: int, tenants: int, users: int, turns: int, sys_words: int) -> list[list[dict]]:
    """Per phase, the conversations in arrival order (new users of the same tenants each phase)."""
    rng = random.Random(seed)
    systems = [f"You are tenant {t}'s assistant. " + text(rng, sys_words) for t in range(tenants)]
    out = []
    for _ in PHASES:
        convs = [{"tenant": t, "system": systems[t], "turns": [text(rng, 40) for _ in range(turns)]}
                 for t in range(tenants) for _ in range(users)]
        rng.shuffle(convs)
        out.append(convs)
    return out


class Fleet:
    def __init__(self, tmp: Path, a: argparse.Namespace, kv_blocks: int) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = ["--sim-kv-blocks", str(kv_blocks), "--max-model-len", str(a.max_model_len),
                "--sim-prefill-ms-per-token", str(a.prefill_ms), "--sim-decode-ms-per-token", "8",
                "--enable-prompt-tokens-details"]
        lines = ['[server]', 'host = "127.0.0.1"', '[router]', 'scrape_interval_s = 0.25', 'queue_size = 4096',
                 '[control]', f'listen = "127.0.0.1:{port}"', f'join_token = "{TOKEN}"',
                 f'store = "{tmp / "router.db"}"', 'heartbeat_s = 0.5',
                 '[admin]', f'socket = "{tmp / "admin.sock"}"',
                 '[[strategies]]', 'name = "rr"', 'picker = "round-robin"', 'weights = { load = 1.0 }']
        for name in MODELS:
            lines += ['[[models]]', f'name = "{name}"', 'engine = "vllm"',
                      'strategy = "chat"', '[models.deploy]',
                      f'count = {a.replicas}', 'simulate = true', 'health_timeout_s = 60.0',
                      f'kv_events = {"true" if name == "t2" else "false"}', f'args = {json.dumps(args)}']
        (tmp / "router.toml").write_text("\n".join(lines) + "\n")
        (tmp / "agent.toml").write_text("\n".join([
            '[agent]', 'node = "n1"', f'router = "127.0.0.1:{port}"', f'join_token = "{TOKEN}"',
            f'state_dir = "{tmp / "agent"}"', '[agent.restart]', 'base_s = 0.2', 'max_s = 1.0']) + "\n")
        r, info = self._spawn("router")
        self.url = info["url"]
        ROUTER_PORT[0] = int(info["port"])
        self.router_pid = r.pid
        self._spawn("agent")
        self.admin = httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp / "admin.sock")),
                                  base_url="http://llmgw", timeout=10)

    def _spawn(self, role: str) -> tuple[subprocess.Popen[bytes], dict]:
        p, info = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", role, "--config",
                         str(self.tmp / f"{role}.toml"), "--port", "0", "--log-level", "warning"])
        self.procs.append(p)
        return p, info

    def replicas(self, model: str) -> list[dict[str, Any]]:
        return sorted((r for r in self.admin.get("/api/v1/replicas").json() if r["model"] == model),
                      key=lambda r: r["replica"])

    def wait_ready(self, model: str, n: int, timeout: float = 120.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            reps = [r for r in self.replicas(model) if r["state"] == "ready"]
            if len(reps) == n and self._scraped(model):
                return reps
            if time.monotonic() > deadline:
                raise SystemExit(f"{model}: {len(reps)} of {n} replicas ready after {timeout:.0f} s")
            time.sleep(0.1)

    def _scraped(self, model: str) -> bool:
        text = httpx.get(f"{self.url}/metrics").text
        stale = [line for line in text.splitlines()
                 if line.startswith("llmgw_endpoint_stale{") and f'endpoint="{model}/' in line]
        return bool(stale) and all(line.endswith(" 0.0") for line in stale)

    def metric(self, prefix: str) -> dict[str, float]:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in httpx.get(f"{self.url}/metrics").text.splitlines() if line.startswith(prefix)}

    def close(self) -> None:
        self.admin.close()
        for p in reversed(self.procs):  # the agent first: it stops its engines
            stop(p)


class Phase:
    def __init__(self) -> None:
        self.ttft = Latencies()
        self.prompt = 0
        self.cached = 0
        self.errors = 0


async def one(port: int, model: str, messages: list[dict], ph: Phase | None, max_tokens: int = 8) -> str:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    c = await Conn.open("127.0.0.1", port)
    try:
        t0 = time.perf_counter()
        # rr is routed by the [[strategies]] "rr", asked for by header (a deploy model's own strategy
        # must be a preset today: the control plane's store checks it against the presets only)
        headers = {"x-llmgw-strategy": "rr"} if model == "rr" and port == ROUTER_PORT[0] else {}
        await c.stream.send_all(build_request("POST", "/v1/chat/completions", body, headers=headers))
        end = await c._until(b"\r\n\r\n")
        ok = bytes(c.buf[:end]).startswith(b"HTTP/1.1 200")
        del c.buf[: end + 4]
        while b"data: " not in c.buf:
            await c._more()
        first = time.perf_counter() - t0
        while b"data: [DONE]" not in c.buf:
            await c._more()
    except (ConnectionError, trio.BrokenResourceError):
        ok = False
    finally:
        await c.aclose()
    if not ok:
        if ph is not None:
            ph.errors += 1
        return ""
    answer = ""
    for part in bytes(c.buf).split(b"data: ")[1:]:
        part = part.split(b"\r\n")[0].strip()
        if not part.startswith(b"{"):
            continue
        chunk = json.loads(part)
        for ch in chunk.get("choices", []):
            answer += ch.get("delta", {}).get("content") or ""
        usage = chunk.get("usage")
        if usage and ph is not None:
            ph.prompt += usage["prompt_tokens"]
            ph.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if ph is not None:
        ph.ttft.values.append(first)
    return answer


async def run_phase(port: int, model: str, convs: list[dict], rate: float, seed: int, ph: Phase,
                    burst: tuple[list[str], int, bool, str] | None) -> None:
    rng = random.Random(seed)
    turns = sum(len(c["turns"]) for c in convs) / len(convs)
    starts, t = [], 0.0
    for _ in convs:
        t += rng.expovariate(rate / turns)
        starts.append(t)
    t_start = trio.current_time()

    async def conversation(at: float, conv: dict, crng: random.Random) -> None:
        await trio.sleep_until(t_start + at)
        history = [{"role": "system", "content": conv["system"]}]
        for user in conv["turns"]:
            history.append({"role": "user", "content": user})
            history.append({"role": "assistant", "content": await one(port, model, history, ph)})
            await trio.sleep(crng.expovariate(1 / 0.3))

    async def bursts(urls: list[str], words: int, via_router: bool, kind: str) -> None:
        # a wave of unique long prompts every second, one per replica: through the router (tier 1
        # records them as held, tier 2 sees what the engines keep) or straight to the engines
        # (another gateway sharing them: the router sees nothing)
        brng = random.Random(seed + 1)
        systems = sorted({c["system"] for c in convs})
        for wave in range(int(t) + 1):
            await trio.sleep_until(t_start + wave)
            async with trio.open_nursery() as n:
                for u in urls:
                    if kind == "tenants":  # a tenant's new user, as a gateway without affinity sends it
                        msg = [{"role": "system", "content": brng.choice(systems)},
                               {"role": "user", "content": text(brng, 40)}]
                    else:
                        msg = [{"role": "user", "content": text(brng, words)}]
                    to = port if via_router else int(u.rsplit(":", 1)[1])
                    n.start_soon(lambda to=to, msg=msg: one(to, model, msg, None, 1))

    async with trio.open_nursery() as nursery:
        if burst is not None:
            nursery.start_soon(bursts, *burst)
        for i, (at, conv) in enumerate(zip(starts, convs)):
            nursery.start_soon(conversation, at, conv, random.Random(seed * 7919 + i))


def pct(ph: Phase, p: float) -> float:
    return 1e3 * ph.ttft.pct(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--users", type=int, default=4, help="new users per tenant in each phase")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--sys-words", type=int, default=400)
    ap.add_argument("--rate", type=float, default=6.0, help="requests/s offered (open loop)")
    ap.add_argument("--pressure", type=float, default=1.5, help="working set / the fleet's KV")
    ap.add_argument("--burst-words", type=int, default=300, help="size of a burst prompt")
    ap.add_argument("--burst-via", choices=["router", "engines"], default="router")
    ap.add_argument("--burst-kind", choices=["unique", "tenants"], default="unique",
                    help="unique long prompts, or the tenants' new users (with --burst-via engines: a "
                         "second gateway without affinity in front of the same engines)")
    ap.add_argument("--prefill-ms", type=float, default=0.25, help="the simulator's prefill cost per token")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--decisions", help="append each phase's routing decisions (chosen, note) here, JSON lines")
    a = ap.parse_args()
    phases = conversations(a.seed, a.tenants, a.users, a.turns, a.sys_words)
    ws = working_set_blocks([c for p in phases for c in p], 8)
    kv_blocks = max(a.max_model_len // 16 + 1, int(ws / a.pressure / a.replicas))
    n_req = sum(len(c["turns"]) for p in phases for c in p)
    print(f"{n_req} conversation requests per model in 3 phases ({a.tenants} tenants x {a.users} new users x "
          f"{a.turns} turns each), system prompts ~{2 * a.sys_words} tokens, {a.rate}/s open loop; "
          f"{a.replicas} replicas x {kv_blocks} KV blocks: the working set ({ws} blocks) is "
          f"{ws / (kv_blocks * a.replicas):.2f}x the fleet's KV")
    tmp = Path(tempfile.mkdtemp(prefix="kvpressure-"))
    fleet = Fleet(tmp, a, kv_blocks)
    results: dict[str, dict[str, Any]] = {}
    t_begin = time.monotonic()
    try:
        for model in a.models.split(","):
            reps = fleet.wait_ready(model, a.replicas)
            urls = [r["url"] for r in reps]
            tier2_0 = fleet.metric("llmgw_kv_tokenize_total")
            res = results[model] = {}
            for i, name in enumerate(PHASES):
                ph = Phase()
                if name == "restart":  # behind the router's back: the engine dies, the agent restarts it
                    victim = fleet.replicas(model)[0]
                    __import__("os").kill(victim["pid"], signal.SIGKILL)
                burst = (urls, a.burst_words, a.burst_via == "router", a.burst_kind) if name == "burst" else None
                trio.run(run_phase, ROUTER_PORT[0], model, phases[i], a.rate, a.seed + i, ph, burst)
                res[name] = {"hit_rate": ph.cached / max(1, ph.prompt), "ttft_p50_ms": pct(ph, 50),
                             "ttft_p90_ms": pct(ph, 90), "requests": len(ph.ttft.values), "errors": ph.errors}
                if a.decisions:
                    ds = fleet.admin.get("/api/v1/decisions", params={"model": model, "limit": 1000}).json()
                    with open(a.decisions, "a") as f:
                        f.writelines(json.dumps({"model": model, "phase": name, "chosen": d.get("chosen"),
                                                "note": d.get("note")}) + "\n" for d in reversed(ds[:res[name]["requests"] + 64]))
                if name == "restart":
                    fleet.wait_ready(model, a.replicas)
            if model == "t2":
                now = fleet.metric("llmgw_kv_tokenize_total")
                res["tier2_tokenize"] = {k.split('"')[1]: v - tier2_0.get(k, 0.0) for k, v in now.items() if v}
        print(f"{'phase':9} {'routing':12} {'hit rate':>8} {'TTFT p50':>9} {'p90':>9}  requests (errors)")
        for name in PHASES:
            for model in results:
                r = results[model][name]
                print(f"{name:9} {MODELS[model]:12} {r['hit_rate']:8.1%} {r['ttft_p50_ms']:7.1f}ms "
                      f"{r['ttft_p90_ms']:7.1f}ms  {r['requests']} ({r['errors']})")
        if "t1" in results and "t2" in results:
            print("tier 2 vs tier 1, TTFT p90: " + ", ".join(
                f"{n} {results['t1'][n]['ttft_p90_ms'] / max(1e-9, results['t2'][n]['ttft_p90_ms']):.2f}x"
                for n in PHASES) + "  (target >= 1.5x in burst and restart)")
        if "t2" in results:
            print(f"tier 2's tokenize step: {results['t2'].get('tier2_tokenize')}")
        print(f"({time.monotonic() - t_begin:.0f} s)")
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))
    finally:
        fleet.close()


if __name__ == "__main__":
    main()
