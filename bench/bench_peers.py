"""llmgw beside the Rust routers of vLLM and SGLang, measured in one run on the same engines.

    .venv/bin/python bench/bench_peers.py [--peers-venv DIR] [--requests 6000] [--rounds 3] [--realistic]

The engines are bench/stub_engine.py (zero cost: one token to every stream each --step-ms), the
load is wrk (Debian's `wrk`, a C load generator: a Python client would be the bottleneck) with a
Lua script that POSTs one streamed /v1/chat/completions body. Each router serves the same replicas:

- llmgw with its default strategy (the chat preset: cache-aware, tier 1 prefix tree);
- vLLM's router (`vllm-router`, PyPI package vllm-router) with --policy round_robin and with
  --policy cache_aware, and SGLang's (`sglang_router`, PyPI sglang-router) likewise, when they are
  installed in --peers-venv (`python3 -m venv DIR && DIR/bin/pip install vllm-router sglang-router`;
  the benchmark installs them there with --install-peers). A peer that is missing is left out.

--ab-code DIR adds llmgw run from another tree (before/after a change, in the same run).

Per router: CPU per streamed request (its process's CPU time from /proc over a closed loop at 32
connections, keep-alive), req/s at 32 connections, and the latency wrk sees at 1 connection and at
32, against the same engine reached directly (added p50/p99). The router is pinned to CPU 0; the
engines and wrk to CPU 1. --realistic sends chat bodies of a 200–400-word system prompt and a
6-turn history (~4 KB) instead of one short sentence. Rounds alternate the routers; medians and
ratios against the vLLM router (round robin) are printed at the end.
Bounded: --requests per router per round; every process is stopped at the end."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import proc_cpu_seconds
from procs import spawn, stop

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her all she there would their we him been has when who will more no if out so said what up "
         "its about into than them can only other new some could time these two may then do first any my now such "
         "like our over man me even most made after also did many before must through back years where much your "
         "way well down should because each just those people how too little state good very make world still own "
         "see men work long get here between both life being under never day same another know while last").split()


def chat_body(rng: random.Random, realistic: bool, tokens: int) -> bytes:
    if not realistic:
        messages = [{"role": "user", "content": "Tell me a story"}]
    else:
        system = " ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 400)))
        messages = [{"role": "system", "content": system}]
        for turn in range(6):
            role = "user" if turn % 2 == 0 else "assistant"
            messages.append({"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))})
    return json.dumps({"model": "m", "messages": messages, "max_tokens": tokens, "stream": True}).encode()


def lua_script(path: Path, bodies: list[bytes]) -> Path:
    """wrk's request script: the bodies in turn, one per request, on every connection."""
    items = ",\n".join("[==[" + b.decode() + "]==]" for b in bodies)
    path.write_text(f"""
local bodies = {{
{items}
}}
local i = 0
request = function()
  i = i + 1
  return wrk.format("POST", "/v1/chat/completions", {{["Content-Type"] = "application/json"}}, bodies[(i % #bodies) + 1])
end
local told = 0
response = function(status, headers, body)
  if status ~= 200 and told < 3 then
    told = told + 1
    io.stderr:write(status .. " " .. string.sub(body, 1, 300) .. "\\n")
  end
end
""")
    return path


_LAT = re.compile(r"^\s+(50|99)(?:\.000)?%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_RPS = re.compile(r"Requests/sec:\s+([\d.]+)")
_REQS = re.compile(r"(\d+) requests in")
_ERR = re.compile(r"Non-2xx or 3xx responses: (\d+)|Socket errors: (.*)")


def wrk(port: int, script: Path, conns: int, seconds: float) -> dict[str, float]:
    cmd = ["taskset", "-c", "1", "wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script),
           f"http://127.0.0.1:{port}"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    out = run.stdout
    if run.returncode or _ERR.search(out):
        raise RuntimeError(f"wrk saw errors against port {port}:\n{out}{run.stderr}")
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    lat = {p: float(v) * scale[u] for p, v, u in _LAT.findall(out)}
    return {"rps": float(_RPS.search(out).group(1)), "n": int(_REQS.search(out).group(1)),  # type: ignore[union-attr]
            "p50": lat["50"], "p99": lat["99"]}


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except Exception:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)  # a peer's start: polled, it prints no ready line


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(pid: int, cpu: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except ProcessLookupError:
            pass


def start_stubs(n: int, step_ms: float, procs: list[subprocess.Popen[bytes]]) -> list[dict]:
    """n zero-cost stub engines on CPU 1 (each appended to `procs`): their ready lines."""
    out = []
    for _ in range(n):
        p, info = spawn([sys.executable, str(Path(__file__).with_name("stub_engine.py")), "--step-ms",
                         str(step_ms)], cpu=1)
        procs.append(p)
        out.append(info)
    return out


def llmgw_config(tmp: Path, urls: list[str], extra: str, name: str = "llmgw.toml", sock: str = "a.sock") -> Path:
    """A router config in `tmp`: model "m" on `urls`, no store on disk, its own admin socket;
    `extra` (TOML, "\\n" for newlines) appended."""
    cfg = tmp / name
    reps = "\n".join(f'[[models.replicas]]\nurl = "{u}"' for u in urls)
    cfg.write_text('[server]\nhost = "127.0.0.1"\n[router]\nqueue_size = 4096\n'
                   f'[control]\nlisten = "127.0.0.1:0"\nstore = ":memory:"\n[admin]\nsocket = "{tmp / sock}"\n'
                   f'[[models]]\nname = "m"\nengine = "vllm"\n{reps}\n' + extra.replace("\\n", "\n"))
    return cfg


def start_peer(kind: str, policy: str, venv: Path, urls: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    if kind == "vllm":
        cmd = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--worker-urls", *urls, "--log-level", "warning", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port())]
    else:
        cmd = [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--policy", policy, "--worker-urls", *urls, "--log-level", "warn",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    log = open(Path(tempfile.gettempdir()) / f"llmgw-bench-peer-{kind}-{port}.log", "wb")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
    except Exception:
        stop(p)
        raise RuntimeError(f"{kind} router did not start: see {log.name}") from None
    pin(p.pid, 0)
    return p, port


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers-venv", default=str(Path(tempfile.gettempdir()) / "llmgw-peers-venv"))
    ap.add_argument("--install-peers", action="store_true", help="create --peers-venv and pip install the peers")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=6.0, help="wrk's duration per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--realistic", action="store_true")
    ap.add_argument("--only", default="", help="comma list of router names to run (default: all found)")
    ap.add_argument("--llmgw-config-extra", default="", metavar="TOML")
    ap.add_argument("--ab-code", default=None, metavar="DIR",
                    help="also run llmgw from the package in DIR (e.g. a worktree of an older commit): before/after")
    a = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench_peers needs wrk (Debian: apt-get install wrk)")
    venv = Path(a.peers_venv)
    if a.install_peers and not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "vllm-router", "sglang-router"], check=True)
    rng = random.Random(0)
    tmp = Path(tempfile.mkdtemp())
    script = lua_script(tmp / "req.lua", [chat_body(rng, a.realistic, a.tokens) for _ in range(64 if a.realistic else 1)])
    procs: list[subprocess.Popen[bytes]] = []
    try:
        engines = start_stubs(a.replicas, a.step_ms, procs)
        urls = [e["url"] for e in engines]
        routers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        cfg = llmgw_config(tmp, urls, a.llmgw_config_extra)
        ab_cfg = llmgw_config(tmp, urls, a.llmgw_config_extra, "ab.toml", "b.sock")
        want = set(filter(None, a.only.split(",")))
        if not want or "llmgw" in want:
            p, info = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(cfg),
                             "--port", "0", "--log-level", "warning"], cpu=0)
            procs.append(p)
            routers["llmgw"] = (p, info["port"])
            if a.ab_code:  # PYTHONSAFEPATH: `python -m` must not put the working directory (this tree) first
                env = {"PYTHONPATH": str(Path(a.ab_code).resolve()), "PYTHONSAFEPATH": "1"}
                p, info = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config",
                                 str(ab_cfg), "--port", "0", "--log-level", "warning"],
                                cpu=0, env=env)
                procs.append(p)
                routers[f"llmgw ({Path(a.ab_code).name})"] = (p, info["port"])
        for kind, module in (("vllm", "vllm-router"), ("sglang", "sglang_router")):
            present = (venv / "bin" / "vllm-router").exists() if kind == "vllm" else \
                any((venv / "lib").glob("python3*/site-packages/sglang_router"))
            if not present:
                print(f"({module} not in {venv}: left out; --install-peers installs it)")
                continue
            for policy in ("round_robin", "cache_aware"):
                name = f"{kind} {policy}"
                if want and name not in want and kind not in want:
                    continue
                p, port = start_peer(kind, policy, venv, urls)
                procs.append(p)
                routers[name] = (p, port)
        print(f"{len(urls)} stub engines ({a.tokens} tokens, step {a.step_ms} ms), "
              f"{'realistic ~4 KB' if a.realistic else 'tiny'} chat bodies, wrk {a.seconds:.0f} s per figure")
        direct_port = engines[0]["port"]
        results: dict[str, dict[str, list[float]]] = {}
        for name, (p, port) in routers.items():  # warm-up
            wrk(port, script, 32, 2.0)
        for rnd in range(a.rounds):
            d1 = wrk(direct_port, script, 1, a.seconds)
            d32 = wrk(direct_port, script, 32, a.seconds)
            for name, (p, port) in routers.items():
                r1 = wrk(port, script, 1, a.seconds)
                cpu0 = proc_cpu_seconds(p.pid)
                r32 = wrk(port, script, 32, a.seconds)
                cpu = (proc_cpu_seconds(p.pid) - cpu0) / r32["n"]
                row = {"cpu_ms": 1e3 * cpu, "rps32": r32["rps"], "add_p50_1": r1["p50"] - d1["p50"],
                       "add_p99_1": r1["p99"] - d1["p99"], "add_p99_32": r32["p99"] - d32["p99"]}
                for k, v in row.items():
                    results.setdefault(name, {}).setdefault(k, []).append(v)
                print(f"round {rnd + 1} {name:22s} CPU {row['cpu_ms']:.3f} ms/req  {r32['rps']:7.0f} req/s @32  "
                      f"added @1 p50 {row['add_p50_1']:+.2f} p99 {row['add_p99_1']:+.2f} ms  "
                      f"@32 p99 {row['add_p99_32']:+.2f} ms", flush=True)
        med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
        base = med.get("vllm round_robin")
        print(f"\nmedians of {a.rounds} rounds" + (" (ratio to vLLM router round robin)" if base else ""))
        print(f"{'router':22s} {'CPU ms/req':>14s} {'req/s @32':>16s} {'added p50 @1':>13s} {'added p99 @1':>13s} "
              f"{'added p99 @32':>14s}")
        for n, m in med.items():
            r = (lambda k: f" ({m[k] / base[k]:.2f}x)") if base else (lambda k: "")
            print(f"{n:22s} {m['cpu_ms']:8.3f}{r('cpu_ms'):>8s} {m['rps32']:9.0f}{r('rps32'):>8s} "
                  f"{m['add_p50_1']:+10.2f} ms {m['add_p99_1']:+10.2f} ms {m['add_p99_32']:+11.2f} ms")
    finally:
        for p in procs:
            stop(p)


if __name__ == "__main__":
    main()
