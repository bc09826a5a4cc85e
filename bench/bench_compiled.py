"""The pure core compiled with mypyc, priced against pure Python before anyone adopts it (issue 25
item 3). Nothing in the tree changes: a copy of llmgw/ is compiled in a scratch directory and put
first on PYTHONPATH; the pure side is this tree. Both are measured alternated, medians printed:

    .venv/bin/pip install mypy        # ships mypyc; a C compiler and Python's headers are needed
    .venv/bin/python bench/bench_compiled.py [--set hot|broad] [--rounds 4] [--callgrind]

- decide: bench_decide.py's p50 µs per decision (chat preset) at 8, 64 and 512 replicas;
- router CPU: a real router process (default config, two zero-cost stub engines) sent --requests
  streamed chat requests over one keep-alive connection; its utime + stime from /proc per request;
- --callgrind: the router's user-space instructions per request under valgrind (the difference of
  a short and a long run, so start-up cancels) — deterministic, where the CPU figures of a shared
  box move by ±20 % from run to run. Slow (minutes).

--set hot compiles the per-request modules (HOT); --set broad every module of route/, http1/ and
tenants/ that type-checks clean (BROAD_SKIP are left out). --build DIR keeps (and reuses) the build.
Every process started is stopped."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import spawn, stop

ROOT = Path(__file__).resolve().parent.parent
HOT = [f"llmgw/route/{m}.py" for m in (
    "scheduler", "scorers", "filters", "pickers", "planner", "dispatch", "waiting", "fair_queue", "admission",
    "prefix_tree", "prefix_scorer", "trace", "types", "plan", "attempt", "breaker", "openai_req")] + \
    [f"llmgw/http1/{m}.py" for m in ("server", "client", "fields", "response_head")]
# counters: its [count, created] rows are typed list[float] but hold int counts (a compiled
# client_counts would turn them into floats); the others do not type-check clean yet.
BROAD_SKIP = ("__init__.py", "counters.py", "prefix_share.py", "replicas.py", "tier2.py")
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Tell me a story"}],
                   "max_tokens": 8, "stream": True}).encode()


def modules(which: str) -> list[str]:
    if which == "hot":
        return HOT
    return sorted(str(p.relative_to(ROOT)) for d in ("route", "http1", "tenants")
                  for p in (ROOT / "llmgw" / d).glob("*.py") if p.name not in BROAD_SKIP)


def build(dest: Path, mods: list[str]) -> None:
    """llmgw/ copied to dest, `mods` compiled there in place (mypyc puts each .so beside its .py)."""
    if any(dest.glob("*__mypyc*.so")):
        print(f"(reusing the build in {dest})")
        return
    shutil.copytree(ROOT / "llmgw", dest / "llmgw", ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    print(f"mypyc: compiling {len(mods)} modules in {dest} (minutes on 2 cores)...", flush=True)
    log = dest / "build.log"
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "mypyc", "--ignore-missing-imports", *mods], cwd=dest,
                            stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"mypyc failed (log: {log}):\n" + "\n".join(log.read_text().splitlines()[-15:]))


def decide_p50(tree: Path) -> dict[int, float]:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_decide.py"), "--decisions", "2000"],
                         env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                         check=True).stdout
    return {int(p[0]): float(p[3]) for p in (line.split() for line in out.splitlines())
            if len(p) == 5 and p[0].isdigit() and p[1] == "chat"}


def router_run(tree: Path, n: int, tmp: Path, compiled: Path | None, callgrind: str | None = None) -> float:
    """Start engines and a router on `tree`, send n requests (after 20 to warm up); the router's
    CPU µs per request (or, under callgrind, the whole run's instruction total)."""
    engines = [spawn([sys.executable, str(ROOT / "bench" / "stub_engine.py"), "--step-ms", "0"]) for _ in range(2)]
    procs = [p for p, _ in engines]
    try:
        cfg = tmp / "router.toml"
        reps = "\n".join(f'[[models.replicas]]\nurl = "{info["url"]}"' for _, info in engines)
        cfg.write_text(f'[server]\nhost = "127.0.0.1"\n[control]\nlisten = "127.0.0.1:0"\nstore = ":memory:"\n'
                       f'[admin]\nsocket = "{tmp / "a.sock"}"\n[[models]]\nname = "m"\nengine = "vllm"\n{reps}\n')
        cmd = [sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(cfg), "--port", "0",
               "--log-level", "warning"]
        if callgrind:
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind}", *cmd]
        # cwd=tmp: `-m` puts the working directory first on sys.path, and it must not be this tree
        r = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=tmp, start_new_session=True,
                             stderr=open(f"{callgrind}.log", "w") if callgrind else subprocess.DEVNULL,
                             env={**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"})
        procs.append(r)
        port = json.loads(r.stdout.readline())["port"]  # type: ignore[union-attr]
        maps = Path(f"/proc/{r.pid}/maps").read_text()
        assert (str(compiled) in maps) if compiled else ("__mypyc" not in maps), "the router runs the wrong tree"
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)

        def one() -> None:
            c.request("POST", "/v1/chat/completions", BODY, {"content-type": "application/json"})
            resp = c.getresponse()
            data = resp.read()
            assert resp.status == 200 and b"[DONE]" in data, data[:200]
        for _ in range(20):
            one()
        st0 = Path(f"/proc/{r.pid}/stat").read_text().split()
        for _ in range(n):
            one()
        st1 = Path(f"/proc/{r.pid}/stat").read_text().split()
        c.close()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = sum(int(st1[i]) - int(st0[i]) for i in (13, 14)) / ticks * 1e6 / n
        if callgrind:
            r.send_signal(signal.SIGTERM)  # callgrind writes its totals at exit
            r.wait(timeout=300)
            m = re.search(r"Collected : (\d+)", Path(f"{callgrind}.log").read_text())
            assert m, f"no callgrind total in {callgrind}.log"
            return float(m[1])
        return cpu
    finally:
        for p in procs:
            stop(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=("hot", "broad"), default="hot")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--callgrind", action="store_true")
    ap.add_argument("--build", type=Path, help="build (or reuse) the compiled copy here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-compiled-"))
    os.chmod(tmp, 0o700)
    dest = a.build or tmp / "compiled"
    dest.mkdir(parents=True, exist_ok=True)
    build(dest.resolve(), modules(a.set))
    trees = {"pure": (ROOT, None), "compiled": (dest.resolve(), dest.resolve())}
    dec: dict[str, list[dict[int, float]]] = {k: [] for k in trees}
    cpu: dict[str, list[float]] = {k: [] for k in trees}
    for rnd in range(a.rounds):
        for name, (tree, compiled) in trees.items():
            dec[name].append(decide_p50(tree))
            cpu[name].append(router_run(tree, a.requests, tmp, compiled))
            print(f"round {rnd + 1} {name:<9} decide p50 µs {dec[name][-1]}  router CPU {cpu[name][-1]:.0f} µs/req",
                  flush=True)
    print(f"\nmedians of {a.rounds} rounds, --set {a.set} ({len(modules(a.set))} modules compiled)")
    for n in (8, 64, 512):
        p, c = (statistics.median(r[n] for r in dec[k]) for k in trees)
        print(f"decide p50 at {n:>3} replicas: pure {p:7.1f} µs  compiled {c:7.1f} µs  ({p / c:.2f}x)")
    p, c = (statistics.median(cpu[k]) for k in trees)
    print(f"router CPU per request (1 conn): pure {p:.0f} µs  compiled {c:.0f} µs  ({(c / p - 1) * 100:+.0f} %)")
    if a.callgrind:
        per: dict[str, float] = {}
        for name, (tree, compiled) in trees.items():
            short, long_ = (router_run(tree, k, tmp, compiled, str(tmp / f"cg.{name}.{k}")) for k in (100, 600))
            per[name] = (long_ - short) / 500
        print(f"user-space instructions per request (callgrind): pure {per['pure'] / 1e6:.3f} M  compiled "
              f"{per['compiled'] / 1e6:.3f} M  ({(per['compiled'] / per['pure'] - 1) * 100:+.0f} %)")
    if not a.build:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
