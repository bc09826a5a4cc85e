"""Prefill/decode disaggregation: the same replicas aggregated and split, under a mixed workload at
rising rates, in one run.

    .venv/bin/python bench/bench_pd.py [--replicas 4] [--prefillers 1,2] [--rates 2,4,8] [--seconds 20]
        [--long-share 0.25] [--long-words 3200] [--chat-words 60] [--json out.json]
        [--conv-share 0.25 --turns 4 --skip-cached on,off]

Workload (open loop, Poisson, the same schedule for both fleets): interactive **chat** — a short
prompt (``--chat-words``), ``--chat-tokens`` streamed tokens — at each rate of ``--rates``
(requests/s), beside long-prompt **summarisation** (``--long-words``, ``--long-tokens`` out) at
``--long-share`` of that rate. Every prompt is unique (no prefix cache helps either fleet).
With ``--conv-share`` > 0, **conversations** too, at that share of the chat rate: a document
(``--conv-words``) and its first answer, then ``--turns`` follow-up questions, each sent
``--think-s`` after the last answer ended, its prompt the whole history — long, but cached where
the last turn was decoded. Their TTFT, stall and goodput are reported as ``turn``.

Fleets, each ``--replicas`` simulated vLLM replicas (``llmgw sim --engine vllm``, its cost model:
``--prefill-ms-per-token`` per prompt token computed, ``--decode-ms`` per decode step; a step that
prefills a long prompt stalls every stream on that replica) behind one llmgw router:

* **aggregated**: every replica does both (the model has no ``[models.pd]``);
* **split-NP**, for each N of ``--prefillers``: N replicas with ``--kv-transfer-config`` role
  kv_producer, the rest kv_consumer; ``[models.pd] min_prompt_tokens = --threshold`` — chat
  prompts are under it, so they go straight to a decoder (which prefills them), summaries are
  prefilled on a prefiller and their KV pulled by a decoder (``--transfer-ms-per-block`` per
  16-token block). ``--skip-cached on,off`` runs each split fleet with ``[models.pd] skip_cached``
  on (a turn whose history is cached on its decoder is not split) and off (split by the whole
  prompt), in the same run.

Figures per fleet and rate: chat TTFT p90; chat inter-token latency p90 and p99 (every gap
between two streamed events of every chat request); chat stall p90 (each chat stream's longest
pause: what a reader sees as a stutter); summary TTFT p90; goodput (requests/s that met their SLO:
a chat with TTFT ≤ ``--chat-ttft-slo`` and no pause over ``--stall-slo``, a summary with TTFT ≤
``--long-ttft-slo``); errors; requests split, and fallbacks. Then, per fleet against the
aggregated one, where the split wins and where it loses.

Bounded: ``len(rates) × --seconds`` of arrivals per fleet; a request gives up after 120 s; every
process is stopped at the end (by process group)."""

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
from loadgen import Conn, build_request  # noqa: E402
from procs import spawn, start_router, stop  # noqa: E402

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
         "forest ember quartz falcon harbor lantern meadow summit canyon glacier orchard").split()
FLEETS = ("aggregated", "split")  # split-N: N prefillers
REQUEST_TIMEOUT_S = 120.0


def schedule(a: argparse.Namespace, rate: float, seed: int) -> list[tuple[float, str, str]]:
    """(arrival, kind, prompt) for one rate level: chat at `rate`, summaries at long_share × rate,
    conversations (their document) at conv_share × rate."""
    rng = random.Random(seed)
    out = []
    for kind, r, words in (("chat", rate, a.chat_words), ("long", rate * a.long_share, a.long_words),
                           ("conv", rate * a.conv_share, a.conv_words)):
        t = 0.0
        while r > 0:
            t += rng.expovariate(r)
            if t >= a.seconds:
                break
            prompt = f"{kind} {seed} {t:.6f}: " + " ".join(rng.choice(WORDS) for _ in range(words))
            out.append((t, kind, prompt))
    return sorted(out)


def start_fleet(a: argparse.Namespace, fleet: str, procs: list[subprocess.Popen[bytes]], tmp: Path,
                prefillers: int = 0, skip_cached: bool = True) -> str:
    base = [sys.executable, "-m", "llmgw", "sim", "--engine", "vllm", "m", "--host", "127.0.0.1", "--port", "0",
            "--sim-prefill-ms-per-token", str(a.prefill_ms_per_token), "--sim-decode-ms-per-token", str(a.decode_ms),
            "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.batched_tokens),
            "--max-model-len", "16384"]
    roles = ["both"] * a.replicas
    if prefillers:
        roles = ["prefill"] * prefillers + ["decode"] * (a.replicas - prefillers)
    lines = ["[server]", 'host = "127.0.0.1"', "[router]", "scrape_interval_s = 0.25", "queue_size = 4096",
             "[[models]]", 'name = "m"', 'engine = "vllm"']
    if prefillers:
        lines += ["[models.pd]", f"min_prompt_tokens = {a.threshold}", f"skip_cached = {str(skip_cached).lower()}"]
    for role in roles:
        cmd = list(base)
        if role != "both":
            kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
            cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role,
                                                        "kv_load_failure_policy": "recompute"}),
                    "--sim-transfer-ms-per-block", str(a.transfer_ms_per_block)]
        p, info = spawn(cmd)
        procs.append(p)
        lines += ["[[models.replicas]]", f'url = "{info["url"]}"'] + ([f'role = "{role}"'] if role != "both" else [])
    router = start_router(lines, tmp, fleet, procs)
    deadline = time.monotonic() + 30
    while True:
        try:
            ready = httpx.get(f"{router}/ready").status_code == 200
            if ready and httpx.post(f"{router}/v1/completions", json={"model": "m", "prompt": "hi",
                                                                       "max_tokens": 1}).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{fleet}: the router did not become ready within 30 s")
        time.sleep(0.1)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


async def replay(a: argparse.Namespace, port: int, plan: list[tuple[float, str, str]]) -> dict:
    ttft: dict[str, list[float]] = {"chat": [], "long": [], "turn": []}
    gaps: list[float] = []
    stalls: dict[str, list[float]] = {"chat": [], "turn": []}
    good = Counter()
    status: Counter = Counter()
    start = trio.current_time()

    async def call(kind: str, messages: list[dict[str, str]], tokens: int) -> bool:
        """One streamed request (on its own connection: a stream's framing is not parsed, so the
        connection is spent), measured as `kind`; False if it failed."""
        body = json.dumps({"model": "m", "messages": messages, "max_tokens": tokens, "stream": True,
                           "ignore_eos": True}).encode()
        try:
            c = await Conn.open("127.0.0.1", port)
        except OSError:
            status["connect_error"] += 1
            return False
        try:
            code, _, times = await c.stream_times(build_request("POST", "/v1/chat/completions", body))
        except ConnectionError:
            status["cut_short"] += 1
            return False
        finally:
            await c.aclose()
        status[code] += 1
        if code != 200 or not times:
            return False
        ttft[kind].append(times[0])
        mine = [b - x for x, b in zip(times, times[1:])]
        if kind in ("chat", "turn"):
            if kind == "chat":
                gaps.extend(mine)
            stall = max(mine, default=0.0)
            stalls[kind].append(stall)
            if times[0] <= a.chat_ttft_slo and stall <= a.stall_slo:
                good[kind] += 1
        elif times[0] <= a.long_ttft_slo:
            good[kind] += 1
        return True

    async def one(at: float, kind: str, prompt: str) -> None:
        await trio.sleep_until(start + at)
        with trio.move_on_after(REQUEST_TIMEOUT_S * (1 + (a.turns if kind == "conv" else 0))):
            if kind != "conv":
                await call(kind, [{"role": "user", "content": prompt}],
                           a.chat_tokens if kind == "chat" else a.long_tokens)
                return
            # a conversation: the document (a long prompt), then follow-ups over the history
            history = [{"role": "user", "content": prompt}]
            if not await call("long", history, a.long_tokens):
                return
            for t in range(a.turns):
                await trio.sleep(a.think_s)
                history += [{"role": "assistant", "content": f"answer {t}: " + " ".join(WORDS[:a.turn_words])},
                            {"role": "user", "content": f"question {t}: " + " ".join(WORDS[-a.turn_words:])}]
                if not await call("turn", history, a.chat_tokens):
                    return
            return
        status["timeout"] += 1

    async with trio.open_nursery() as n:
        for at, kind, prompt in plan:
            n.start_soon(one, at, kind, prompt)
    return {"chat_ttft_p90": pct(ttft["chat"], 90), "chat_itl_p90": pct(gaps, 90), "chat_itl_p99": pct(gaps, 99),
            "chat_stall_p90": pct(stalls["chat"], 90),
            "long_ttft_p90": pct(ttft["long"], 90), "turn_ttft_p90": pct(ttft["turn"], 90),
            "turn_stall_p90": pct(stalls["turn"], 90), "turns": len(ttft["turn"]),
            "goodput": (good["chat"] + good["long"] + good["turn"]) / a.seconds,
            "good_chat": good["chat"], "good_long": good["long"], "good_turn": good["turn"],
            "requests": len(plan) + a.turns * sum(1 for p in plan if p[1] == "conv"),
            "ok": status.get(200, 0), "errors": {str(k): v for k, v in status.items() if k != 200}}


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += float(value)
    return total


def run_fleet(a: argparse.Namespace, fleet: str, rates: list[float], prefillers: int,
              skip_cached: bool = True) -> list[dict]:
    procs: list[subprocess.Popen[bytes]] = []
    tmp = tempfile.TemporaryDirectory(prefix="bench-pd-")
    out = []
    try:
        router = start_fleet(a, fleet, procs, Path(tmp.name), prefillers, skip_cached)
        port = int(router.rsplit(":", 1)[1])
        for i, rate in enumerate(rates):
            m0 = httpx.get(f"{router}/metrics").text
            r = trio.run(replay, a, port, schedule(a, rate, a.seed + i))
            m1 = httpx.get(f"{router}/metrics").text
            r["split"] = metric_sum(m1, "llmgw_pd_requests_total", path="split") - metric_sum(
                m0, "llmgw_pd_requests_total", path="split")
            r["fallbacks"] = metric_sum(m1, "llmgw_pd_fallbacks_total") - metric_sum(m0, "llmgw_pd_fallbacks_total")
            r["cached"] = metric_sum(m1, "llmgw_pd_requests_total", path="cached") - metric_sum(
                m0, "llmgw_pd_requests_total", path="cached")
            r["blocks"] = metric_sum(m1, "llmgw_pd_transferred_blocks_total") - metric_sum(
                m0, "llmgw_pd_transferred_blocks_total")
            r["rate"] = rate
            out.append(r)
            print(f"{fleet:10} {rate:5.1f}/s {1e3 * r['chat_ttft_p90']:8.0f}ms {1e3 * r['chat_itl_p90']:7.1f}ms "
                  f"{1e3 * r['chat_itl_p99']:7.1f}ms {1e3 * r['chat_stall_p90']:7.0f}ms "
                  f"{1e3 * r['long_ttft_p90']:8.0f}ms {r['goodput']:7.2f}/s "
                  f"{r['ok']:4d}/{r['requests']:<4d} {r['split']:5.0f} {r['fallbacks']:4.0f}  {r['errors'] or '-'}"
                  + (f"\n{'':10} turns: {r['turns']} TTFT p90 {1e3 * r['turn_ttft_p90']:.0f} ms, stall p90 "
                     f"{1e3 * r['turn_stall_p90']:.0f} ms, {r['good_turn']} within SLO; not split as cached "
                     f"{r['cached']:.0f}; KV blocks moved {r['blocks']:.0f}" if a.conv_share > 0 else ""),
                  flush=True)
    finally:
        for p in procs:
            stop(p)
        tmp.cleanup()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--prefillers", default="1,2", help="of the replicas: one split fleet for each")
    ap.add_argument("--rates", default="2,4,8", help="chat requests/s, one level each")
    ap.add_argument("--seconds", type=float, default=20.0, help="arrivals per level")
    ap.add_argument("--long-share", type=float, default=0.25, help="summaries per chat request")
    ap.add_argument("--chat-words", type=int, default=60)
    ap.add_argument("--long-words", type=int, default=3200, help="~8,000 tokens in the simulator's tokenizer")
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=64)
    ap.add_argument("--threshold", type=int, default=1024, help="[models.pd] min_prompt_tokens of the split fleet")
    ap.add_argument("--conv-share", type=float, default=0.0, help="conversations per chat request (0: none)")
    ap.add_argument("--conv-words", type=int, default=1200, help="a conversation's document")
    ap.add_argument("--turns", type=int, default=4, help="follow-up questions a conversation asks")
    ap.add_argument("--turn-words", type=int, default=12, help="words a follow-up (and a made-up answer) adds")
    ap.add_argument("--think-s", type=float, default=0.5, help="between an answer and the next question")
    ap.add_argument("--skip-cached", default="on", help="on, off or on,off: the split fleets' [models.pd] skip_cached")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    ap.add_argument("--decode-ms", type=float, default=15.0, help="--sim-decode-ms-per-token (a decode step)")
    ap.add_argument("--transfer-ms-per-block", type=float, default=0.1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--batched-tokens", type=int, default=8192, help="--max-num-batched-tokens")
    ap.add_argument("--chat-ttft-slo", type=float, default=1.0)
    ap.add_argument("--stall-slo", type=float, default=0.25, help="a chat stream's longest pause, at most")
    ap.add_argument("--long-ttft-slo", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fleets", default=",".join(FLEETS))
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    rates = [float(x) for x in a.rates.split(",")]
    splits = [int(x) for x in a.prefillers.split(",") if x]
    if not all(1 <= n < a.replicas <= 32 for n in splits) or not 0 < a.seconds <= 600 or any(r <= 0 for r in rates):
        raise SystemExit("--prefillers: each 1..replicas-1 (replicas ≤ 32); --seconds 0..600; --rates positive")
    skips = [x.strip() for x in a.skip_cached.split(",")]
    if not skips or any(x not in ("on", "off") for x in skips) or not 0 <= a.turns <= 50 or a.conv_share < 0:
        raise SystemExit("--skip-cached: on, off or on,off; --turns 0..50; --conv-share >= 0")
    print(f"{a.replicas} simulated vLLM replicas (split: {a.prefillers} of them prefill); chat {a.chat_words} "
          f"words → {a.chat_tokens} tokens, summaries {a.long_words} words → {a.long_tokens} tokens at "
          f"{a.long_share:g}× the chat rate; prefill {a.prefill_ms_per_token:g} ms/token, decode step "
          f"{a.decode_ms:g} ms, transfer {a.transfer_ms_per_block:g} ms/block; {a.seconds:g} s a level")
    print(f"{'fleet':10} {'rate':>7} {'chat TTFT':>10} {'ITL p90':>9} {'ITL p99':>9} {'stall':>9} {'long TTFT':>10} "
          f"{'goodput':>9} {'ok':>9} {'split':>5} {'fb':>4}  errors")
    fleets = a.fleets.split(",")
    results = {}
    if "aggregated" in fleets:
        results["aggregated"] = run_fleet(a, "aggregated", rates, 0)
    if "split" in fleets:
        for n in splits:
            for sk in skips:
                name = f"split-{n}P" + ("" if sk == "on" else "-whole")
                results[name] = run_fleet(a, name, rates, n, sk == "on")
    base = results.get("aggregated")
    for name, rs in results.items():
        if base is None or name == "aggregated":
            continue
        for g, s in zip(base, rs):
            print(f"{name} at {g['rate']:g}/s against aggregated: chat ITL p90 {s['chat_itl_p90'] / g['chat_itl_p90']:.2f}×, "
                  f"stall p90 {s['chat_stall_p90'] / g['chat_stall_p90']:.2f}×, chat TTFT p90 "
                  f"{s['chat_ttft_p90'] / g['chat_ttft_p90']:.2f}×, summary TTFT p90 "
                  f"{s['long_ttft_p90'] / g['long_ttft_p90']:.2f}×, goodput {s['goodput'] / max(1e-9, g['goodput']):.2f}×"
                  + (f", turn TTFT p90 {s['turn_ttft_p90'] / g['turn_ttft_p90']:.2f}×" if a.conv_share > 0 else ""))
    for name, rs in results.items():  # skip_cached on against off, where both ran
        whole = results.get(name + "-whole")
        for on, off in zip(rs, whole or []):
            print(f"{name} at {on['rate']:g}/s, skip_cached on against off: turn TTFT p90 "
                  f"{1e3 * on['turn_ttft_p90']:.0f} vs {1e3 * off['turn_ttft_p90']:.0f} ms, chat TTFT p90 "
                  f"{1e3 * on['chat_ttft_p90']:.0f} vs {1e3 * off['chat_ttft_p90']:.0f} ms, summary TTFT p90 "
                  f"{1e3 * on['long_ttft_p90']:.0f} vs {1e3 * off['long_ttft_p90']:.0f} ms, goodput "
                  f"{on['goodput']:.2f} vs {off['goodput']:.2f}/s, KV blocks moved {on['blocks']:.0f} vs {off['blocks']:.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
