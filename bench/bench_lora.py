"""Many LoRA adapters on a few replicas: llmgw's adapter routing against a naive policy, in one run.

    .venv/bin/python bench/bench_lora.py [--requests 600] [--rate 20] [--adapters 16] [--replicas 4]
        [--cap 4] [--zipf 1.0] [--load-ms 300] [--json out.json]

Workload: ``--adapters`` adapters of one base model with Zipf popularity (adapter k is asked with
weight 1/k^s), open-loop Poisson arrivals, streamed completions with a unique prompt each (so no
prefix cache or prefix routing helps either side). ``--replicas`` simulated vLLM replicas
(``llmgw sim --engine vllm --enable-lora --max-loras CAP``, the simulator's cost model on, loading
an adapter takes ``--load-ms``). vLLM's worker cache then holds CAP adapters (``--max-cpu-loras``
defaults to ``--max-loras``); a request for an adapter outside it waits while vLLM loads it,
evicting the least recently used.

The two policies, each on fresh replicas behind the same llmgw router (same scorers, same config
but for the adapters), replaying the same schedule:

* **llmgw**: the adapters are declared on-demand (``[[models.adapters]]``, ``max_loaded_adapters =
  CAP``). The router loads an adapter through vLLM's runtime API where it chooses, sends its
  requests to the replicas holding it, unloads the least recently used idle adapter at the cap.
* **naive**: what an adapter-blind deployment does. Every replica is started with every adapter
  registered (``--lora-modules``, as one does without a router that loads them); the adapters are
  not declared to llmgw, which sees them listed by every replica and routes by load alone, as any
  adapter-blind router. An adapter is thus loaded wherever its request lands: vLLM loads it into
  that replica's worker cache on first use, evicting its least recently used one. No bench-side
  logic: this is vLLM's own behaviour, measured.

Figures, per policy: adapter loads (the engines' own count of loads into their worker cache,
from the simulator's ``llmgw_sim_lora_loads_total``, counted from just before the run; for llmgw
it also equals the router's ``llmgw_adapter_loads_total{outcome="ok"}``), requests that waited
for a load (the router's ``llmgw_adapter_load_waits_total`` plus the engines'
``llmgw_sim_lora_load_waits_total``), TTFT p50/p90/p99 (first streamed token at the client),
errors, and requests per replica.

Where the simulator is kinder to naive than a real vLLM: a load delays only the requests for that
adapter (a real engine's step stalls while the worker loads weights), and the engine's batch limit
of CAP distinct adapters is the only other cost of churn. The router's own loads pay the same
``--load-ms`` inside ``/v1/load_lora_adapter``.

Bounded: ``--requests`` requests (default 600 at 20/s: about 35 s per policy) on 127.0.0.1; a
client gives up on a request after 60 s; every process is stopped at the end."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Conn, Latencies, build_request  # noqa: E402
from procs import spawn, start_router, stop  # noqa: E402

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
         "forest ember quartz falcon harbor lantern meadow summit canyon glacier orchard").split()
POLICIES = ("llmgw", "naive")
REQUEST_TIMEOUT_S = 60.0


def schedule(seed: int, n: int, rate: float, adapters: int, zipf: float, words: int) -> list[tuple[float, str, str]]:
    """(arrival time, adapter, prompt) in arrival order; the prompt starts with its number."""
    rng = random.Random(seed)
    names = adapter_names(adapters)
    weights = [1.0 / (k + 1) ** zipf for k in range(adapters)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = f"request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        out.append((t, rng.choices(names, weights)[0], prompt))
    return out


def adapter_names(n: int) -> list[str]:
    return [f"lora-{k:02d}" for k in range(n)]


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += float(value)
    return total


def sim_counters(urls: list[str]) -> tuple[float, float]:
    loads = waits = 0.0
    for u in urls:
        text = httpx.get(f"{u}/metrics").text
        loads += metric_sum(text, "llmgw_sim_lora_loads_total")
        waits += metric_sum(text, "llmgw_sim_lora_load_waits_total")
    return loads, waits


def start_fleet(a: argparse.Namespace, policy: str, procs: list[subprocess.Popen[bytes]],
                tmp: Path) -> tuple[list[str], str]:
    """Fresh simulated replicas and a router in front of them; returns (replica URLs, router URL)."""
    names = adapter_names(a.adapters)
    cmd = [sys.executable, "-m", "llmgw", "sim", "--engine", "vllm", "base", "--host", "127.0.0.1", "--port", "0",
           "--enable-lora", "--max-loras", str(a.cap), "--max-lora-rank", "16", "--sim-lora-load-ms", str(a.load_ms),
           "--sim-decode-ms-per-token", str(a.decode_ms)]
    if policy == "naive":
        cmd += ["--lora-modules", *(f"{n}=/adapters/{n}" for n in names)]
    urls = []
    for _ in range(a.replicas):
        p, info = spawn(cmd, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
        procs.append(p)
        urls.append(info["url"])
    lines = ["[server]", 'host = "127.0.0.1"', "[router]", "scrape_interval_s = 0.25", "queue_size = 4096",
             "[[models]]", 'name = "base"', 'engine = "vllm"']
    if policy == "llmgw":
        lines.append(f"max_loaded_adapters = {a.cap}")
    lines += [f'[[models.replicas]]\nurl = "{u}"' for u in urls]
    if policy == "llmgw":
        lines += [f'[[models.adapters]]\nname = "{n}"\nsource = "/adapters/{n}"' for n in names]
    router = start_router(lines, tmp, policy, procs)
    # Ready when the router lists every adapter as served by some replica (naive: learned from the
    # replicas' /v1/models) and the base model answers.
    deadline = time.monotonic() + 30
    while True:
        try:
            cards = {c["id"]: c for c in httpx.get(f"{router}/v1/models").json()["data"]}
            ok = all(n in cards for n in names) and (policy == "llmgw" or all(
                cards[n].get("replicas") == a.replicas for n in names))
            if ok and httpx.post(f"{router}/v1/completions", json={"model": "base", "prompt": "hi",
                                                                    "max_tokens": 1}).status_code == 200:
                break
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{policy}: the router did not become ready within 30 s")
        time.sleep(0.1)
    return urls, router


async def replay(port: int, plan: list[tuple[float, str, str]], max_tokens: int) -> tuple[Latencies, Counter, Counter]:
    lat = Latencies()
    per: Counter = Counter()
    status: Counter = Counter()
    start = trio.current_time()

    async def one(at: float, adapter: str, prompt: str) -> None:
        await trio.sleep_until(start + at)
        body = json.dumps({"model": adapter, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                           "ignore_eos": True}).encode()
        with trio.move_on_after(REQUEST_TIMEOUT_S):
            try:
                c = await Conn.open("127.0.0.1", port)
            except OSError:
                status["connect_error"] += 1
                return
            try:
                code, head, first = await c.stream_events(build_request("POST", "/v1/completions", body))
                status[code] += 1
                for line in head.split("\r\n"):
                    if line.startswith("x-llmgw-endpoint:"):
                        per[line.split(":", 1)[1].strip()] += 1
                if first is not None:
                    lat.values.append(first)
            except ConnectionError:
                status["cut_short"] += 1
            finally:
                await c.aclose()
            return
        status["timeout"] += 1

    async with trio.open_nursery() as n:
        for at, adapter, prompt in plan:
            n.start_soon(one, at, adapter, prompt)
    return lat, per, status


def run_policy(a: argparse.Namespace, policy: str, plan: list[tuple[float, str, str]]) -> dict:
    procs: list[subprocess.Popen[bytes]] = []
    tmp = tempfile.TemporaryDirectory(prefix="bench-lora-")
    try:
        urls, router = start_fleet(a, policy, procs, Path(tmp.name))
        l0, w0 = sim_counters(urls)
        m0 = httpx.get(f"{router}/metrics").text
        t0 = time.monotonic()
        lat, per, status = trio.run(replay, int(router.rsplit(":", 1)[1]), plan, a.max_tokens)
        took = time.monotonic() - t0
        l1, w1 = sim_counters(urls)
        m1 = httpx.get(f"{router}/metrics").text
        routed_loads = metric_sum(m1, "llmgw_adapter_loads_total", outcome="ok") - metric_sum(
            m0, "llmgw_adapter_loads_total", outcome="ok")
        routed_waits = metric_sum(m1, "llmgw_adapter_load_waits_total") - metric_sum(m0, "llmgw_adapter_load_waits_total")
        return {"loads": l1 - l0, "router_loads": routed_loads, "waited": (w1 - w0) + routed_waits,
                "ttft_p50": lat.pct(50), "ttft_p90": lat.pct(90), "ttft_p99": lat.pct(99),
                "ok": status.get(200, 0), "errors": {str(k): v for k, v in status.items() if k != 200},
                "per_replica": [per.get(k, 0) for k in sorted(per)], "seconds": took}
    finally:
        for p in procs:
            stop(p)
        tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=20.0, help="requests/s, open loop (Poisson)")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--cap", type=int, default=4, help="--max-loras and max_loaded_adapters")
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s (weight 1/k^s)")
    ap.add_argument("--load-ms", type=float, default=300.0, help="time to load an adapter (--sim-lora-load-ms)")
    ap.add_argument("--decode-ms", type=float, default=10.0, help="--sim-decode-ms-per-token")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    if a.requests < 1 or a.requests > 20000 or a.rate <= 0 or a.adapters < 1 or a.replicas < 1 or a.cap < 1:
        raise SystemExit("--requests must be 1..20000, and --rate, --adapters, --replicas, --cap positive")
    plan = schedule(a.seed, a.requests, a.rate, a.adapters, a.zipf, a.prompt_words)
    popularity = Counter(ad for _, ad, _ in plan)
    top = sum(n for _, n in popularity.most_common(a.cap)) / a.requests
    print(f"{a.requests} requests at {a.rate:g}/s over {a.adapters} adapters (Zipf s={a.zipf:g}; the top {a.cap} "
          f"take {top:.0%}), {a.replicas} simulated vLLM replicas with --max-loras {a.cap}, "
          f"a load takes {a.load_ms:g} ms, {a.max_tokens} tokens out at {a.decode_ms:g} ms/token")
    print(f"{'policy':8} {'loads':>6} {'waited':>7} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ok':>5}  errors  "
          "requests per replica")
    results = {}
    for policy in a.policies.split(","):
        if policy not in POLICIES:
            raise SystemExit(f"--policies: unknown policy {policy!r} (known: {', '.join(POLICIES)})")
        r = results[policy] = run_policy(a, policy, plan)
        print(f"{policy:8} {r['loads']:6.0f} {r['waited']:7.0f} {1e3 * r['ttft_p50']:7.1f}ms "
              f"{1e3 * r['ttft_p90']:6.1f}ms {1e3 * r['ttft_p99']:6.1f}ms {r['ok']:5d}  {r['errors'] or '-'}  "
              f"{r['per_replica']}")
    if "llmgw" in results and "naive" in results:
        g, n = results["llmgw"], results["naive"]
        ratio = n["loads"] / max(1.0, g["loads"])
        print(f"llmgw makes {ratio:.1f}x fewer loads than naive (target >= 5x); TTFT p90 "
              f"{1e3 * g['ttft_p90']:.0f} ms vs {1e3 * n['ttft_p90']:.0f} ms (target: equal or better); "
              f"router's own load count {g['router_loads']:.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
