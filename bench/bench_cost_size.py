"""The router's cost against body size and fleet size (issue 25, item 4).

    .venv/bin/python bench/bench_cost_size.py inproc [--sizes 1,8,64,512] [--replicas 8,64,512] [--base OTHER]
    .venv/bin/python bench/bench_cost_size.py proc [--sizes 1,8,64,512] [--replicas 8,64,512]
                                                   [--trees .,OTHER] [--rounds 3] [--seconds 4]

Bodies are realistic streamed chat requests of about the given size in KB: a system prompt shared
by every request (a third of the body), then a conversation's history (one of --conversations,
shared by every request of that conversation: what a chat client resends each turn), then a new
user message of ~200 bytes unique to the request. Requests cycle through the conversations, so the
prefix tree sees what real chat traffic shows it: long known prefixes, a short new tail.

``inproc``: the cost of each size-dependent step, in process, µs per request (median of
--rounds): ``parse`` (:func:`parse_body`), ``head`` (:func:`request_head` as the planner calls
it), ``prefix`` (the tier-1 index's match and record of that head over N replicas: what the
prefix scorer and its observe hook do with it), ``tap`` (:func:`with_include_usage` on a body
that has ``stream_options``), and ``whole`` (Router.handle and the relay of a two-event answer,
with bench/walk_request.py's stand-in upstream: the trio shell and the core, no sockets).

``proc``: the router daemon's process CPU per streamed request (from /proc, as
bench/bench_peers.py measures it) with zero-cost stub engines (bench/stub_engine.py --step-ms 0,
8 tokens; a few stub processes each listening on many ports stand for N replicas, since a replica
is its URL), load by wrk (--conns connections, closed loop, keep-alive) with the bodies in turn;
and the idle CPU of that fleet (the router alone for --idle seconds: scrapes, health checks), as
% of one core; "net of idle" takes that background rate out of the loaded figure. The router is pinned to CPU 0, stubs and wrk to CPU 1. --trees runs each figure
with the router imported from each source tree in turn (A/B in one run, alternated per round);
medians are printed. Every process started is stopped at the end."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_peers import WORDS, lua_script, wrk  # noqa: E402
from loadgen import proc_cpu_seconds  # noqa: E402
from procs import spawn, stop  # noqa: E402


# -- bodies ---------------------------------------------------------------------------------------
def _text(rng: random.Random, n: int) -> str:
    out: list[str] = []
    k = 0
    while k < n:
        w = rng.choice(WORDS)
        out.append(w)
        k += len(w) + 1
    return " ".join(out)


def chat_bodies(kb: int, count: int, conversations: int, seed: int = 0) -> list[bytes]:
    """``count`` streamed chat bodies of about ``kb`` KB: a shared system prompt, one of
    ``conversations`` histories, a unique last user message."""
    rng = random.Random(seed * 1000 + kb)
    size = kb * 1024
    system = _text(rng, max(100, size // 3))
    histories: list[list[dict[str, str]]] = []
    for _ in range(conversations):
        hist: list[dict[str, str]] = []
        room = size - len(system) - 400
        turn = 0
        while room > 0:
            n = min(room, max(60, min(2000, size // 10)))
            hist.append({"role": "user" if turn % 2 == 0 else "assistant", "content": _text(rng, n)})
            room -= n + 40
            turn += 1
        if hist and hist[-1]["role"] == "user":
            hist.pop()
        histories.append(hist)
    out = []
    for i in range(count):
        msgs = [{"role": "system", "content": system}, *histories[i % conversations],
                {"role": "user", "content": _text(rng, 200)}]
        out.append(json.dumps({"model": "m", "messages": msgs, "max_tokens": 8, "stream": True}).encode())
    return out


# -- in process -----------------------------------------------------------------------------------
def _walk() -> Any:
    spec = importlib.util.spec_from_file_location("walk_request", HERE / "walk_request.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _per_call(fn: Any, items: list[Any], min_s: float = 0.05) -> float:
    """µs of CPU per call of fn(item), items in turn, for at least min_s."""
    for it in items[:4]:
        fn(it)
    n = 0
    t0 = time.thread_time()
    while True:
        for it in items:
            fn(it)
        n += len(items)
        dt = time.thread_time() - t0
        if dt >= min_s:
            return dt / n * 1e6


def _ab(fns: list[Any], items: list[Any], reps: int = 7) -> list[float]:
    """µs per call of each fn, measured in turn ``reps`` times (A, B, A, B...): the least of each
    (a shared, noisy machine only ever adds time)."""
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for k, fn in enumerate(fns):
            out[k].append(_per_call(fn, items))
    return [min(v) for v in out]


def _load_base(base: Path) -> dict[str, Any]:
    """The size-dependent functions of another source tree (the same files, loaded under other
    names beside this tree's): parse_body, request_head, with_include_usage."""
    mods = {}
    for name, rel in (("parse", "llmgw/route/openai_req.py"), ("head", "llmgw/route/request_head.py"),
                      ("tap", "llmgw/daemon/router/usage_tap.py")):
        spec = importlib.util.spec_from_file_location(f"_base_{name}", base / rel)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        mods[name] = mod
    return {"parse": mods["parse"].parse_body, "head": mods["head"].request_head,
            "tap": mods["tap"].with_include_usage}


def _config(urls: list[str], extra: str = "") -> str:
    reps = "\n".join(f'[[models.replicas]]\nurl = "{u}"' for u in urls)
    return f'[[models]]\nname = "m"\nengine = "vllm"\n{reps}\n{extra}'


def inproc(sizes: list[int], replicas: list[int], rounds: int, conversations: int, base: Path | None) -> None:
    import trio

    from llmgw.config import parse_config
    from llmgw.daemon.net.httpserver import Request
    from llmgw.daemon.router.proxy import Router
    from llmgw.daemon.router.usage_tap import with_include_usage
    from llmgw.route.openai_req import parse_body
    from llmgw.route.prefix_tree import PrefixConfig, PrefixIndex, partition_key
    from llmgw.route.request_head import request_head

    walk = _walk()
    limit = PrefixConfig().max_head_bytes

    def head_of(fn: Any) -> Any:  # as the planner calls it (a tree without the limit: the whole head)
        if "limit" in fn.__code__.co_varnames:
            return lambda o: fn(o, "chat", limit)
        return lambda o: fn(o, "chat")

    steps = {"parse": [lambda b: parse_body(b, kind="chat")], "head": [head_of(request_head)],
             "tap": [lambda p: with_include_usage(p[0], p[1])]}
    if base is not None:
        old = _load_base(base)
        steps["parse"].append(lambda b: old["parse"](b, kind="chat"))
        steps["head"].append(head_of(old["head"]))
        steps["tap"].append(lambda p: old["tap"](p[0], p[1]))
    print(f"in process, µs per request (least of 7 alternated runs; whole: median of {rounds}); "
          f"{conversations} conversations" + (f"; this tree / {base}" if base else ""))
    print(f"{'KB':>4s} {'parse':>15s} {'head':>15s} {'tap':>15s}   " + "".join(f"{'prefix@' + str(n):>10s}" for n in replicas)
          + "".join(f"{'whole@' + str(n):>10s}" for n in replicas))

    def cell(v: list[float]) -> str:
        return f"{v[0]:7.1f}" + (f" / {v[1]:5.0f}" if len(v) > 1 else "       ")

    for kb in sizes:
        bodies = chat_bodies(kb, 2 * conversations, conversations)
        objs = [json.loads(b) for b in bodies]
        heads = [head_of(request_head)(o) for o in objs]
        with_opts = [b[:-1] + b', "stream_options": {"continuous_usage_stats": false}}' for b in bodies]
        pairs = list(zip(with_opts, [json.loads(b) for b in with_opts]))
        res = {"parse": _ab(steps["parse"], bodies), "head": _ab(steps["head"], objs),
               "tap": _ab(steps["tap"], pairs)}
        line = f"{kb:4d} {cell(res['parse']):>15s} {cell(res['head']):>15s} {cell(res['tap']):>15s}   "
        for n in replicas:
            idx = PrefixIndex(PrefixConfig())
            part = partition_key("m")
            names = [f"http://127.0.0.1:{20000 + i}" for i in range(n)]
            clock = [0.0]

            def prefix(i: int) -> None:
                clock[0] += 0.001
                h = heads[i]
                m = idx.match(part, h, clock[0], min_bytes=64)
                idx.record(part, h, m.best() or names[i % n], clock[0])
            line += f"{_ab([prefix], list(range(len(heads))))[0]:10.1f}"
        for n in replicas:
            line += f"{statistics.median(_whole(trio, parse_config, Request, Router, walk, bodies, n) for _ in range(rounds)):10.1f}"
        print(line, flush=True)


def _whole(trio: Any, parse_config: Any, Request: Any, Router: Any, walk: Any, bodies: list[bytes],
           n: int) -> float:
    urls = [f"http://127.0.0.1:{20000 + i}" for i in range(n)]
    router = Router(parse_config(_config(urls)), walk._Pool(0), seed=0)
    reqs = [Request("POST", "/v1/chat/completions", "/v1/chat/completions", "",
                    [("content-type", "application/json")], b, ("127.0.0.1", 1)) for b in bodies]
    out: list[float] = []

    async def main() -> None:
        for r in reqs:
            resp = await router.handle(r)
            await resp.body.relay(walk._Sink())
        k = 0
        t0 = time.thread_time()  # CPU time: a shared machine's other processes are not counted
        while time.thread_time() - t0 < 0.5:
            for r in reqs:
                resp = await router.handle(r)
                await resp.body.relay(walk._Sink())
            k += len(reqs)
        out.append((time.thread_time() - t0) / k * 1e6)

    trio.run(main)
    return out[0]


# -- processes ------------------------------------------------------------------------------------
def start_stubs(n: int, per_proc: int) -> tuple[list[Any], list[str]]:
    procs, urls = [], []
    while len(urls) < n:
        k = min(per_proc, n - len(urls))
        p, info = spawn([sys.executable, str(HERE / "stub_engine.py"), "--step-ms", "0", "--ports", str(k)], cpu=1)
        procs.append(p)
        urls.extend(info["urls"])
    return procs, urls


def start_router(tree: Path, urls: list[str], tmp: Path) -> tuple[Any, int]:
    cfg = tmp / f"llmgw-{len(urls)}.toml"
    cfg.write_text('[server]\nhost = "127.0.0.1"\n[router]\nqueue_size = 4096\n'
                   f'[control]\nlisten = "127.0.0.1:0"\nstore = ":memory:"\n[admin]\nsocket = "{tmp / "a.sock"}"\n'
                   + _config(urls))
    env = {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}  # the tree, not the working directory
    p, info = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(cfg),
                     "--port", "0", "--log-level", "warning"], env=env, cpu=0)
    return p, info["port"]


def proc(sizes: list[int], replicas: list[int], trees: list[Path], rounds: int, seconds: float, conns: int,
         idle: float, conversations: int, per_proc: int) -> None:
    if shutil.which("wrk") is None:
        sys.exit("needs wrk (Debian: apt-get install wrk)")
    tmp = Path(tempfile.mkdtemp())
    scripts = {kb: lua_script(tmp / f"b{kb}.lua", chat_bodies(kb, min(64, 2 * conversations), conversations))
               for kb in sizes}
    cells = [(kb, n) for n in replicas for kb in sizes]
    rows: dict[tuple[int, int, str], dict[str, list[float]]] = {}
    print(f"router CPU per streamed request (ms), wrk -c{conns} {seconds:.0f} s; idle CPU % of a core over "
          f"{idle:.0f} s; trees: {', '.join(str(t) for t in trees)}", flush=True)
    for n in replicas:
        stubs, urls = start_stubs(n, per_proc)
        try:
            for rnd in range(rounds):
                order = trees if rnd % 2 == 0 else list(reversed(trees))
                for tree in order:
                    p, port = start_router(tree, urls, tmp)
                    try:
                        time.sleep(2.0)  # first scrapes and health checks of every replica
                        c0 = proc_cpu_seconds(p.pid)
                        time.sleep(idle)
                        idle_pct = 100 * (proc_cpu_seconds(p.pid) - c0) / idle
                        for kb in sizes:
                            wrk(port, scripts[kb], conns, 1.0)  # warm-up: the tree learns the prefixes
                            c0, w0 = proc_cpu_seconds(p.pid), time.monotonic()
                            r = wrk(port, scripts[kb], conns, seconds)
                            cpu, wall = proc_cpu_seconds(p.pid) - c0, time.monotonic() - w0
                            cpu_ms = 1e3 * cpu / r["n"]
                            # less the fleet's background work (scrapes, health checks) over that time
                            net_ms = 1e3 * max(0.0, cpu - idle_pct / 100 * wall) / r["n"]
                            row = rows.setdefault((kb, n, str(tree)), {})
                            for k, v in (("cpu_ms", cpu_ms), ("net_ms", net_ms), ("rps", r["rps"]), ("idle", idle_pct)):
                                row.setdefault(k, []).append(v)
                            print(f"round {rnd + 1} {str(tree):24s} {kb:4d} KB {n:4d} replicas  CPU {cpu_ms:.3f} ms/req "
                                  f"(net of idle {net_ms:.3f})  {r['rps']:7.0f} req/s  idle {idle_pct:.1f}%", flush=True)
                    finally:
                        stop(p)
        finally:
            for s in stubs:
                stop(s)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nmedians of {rounds} rounds")
    print(f"{'tree':24s} {'KB':>4s} {'replicas':>8s} {'CPU ms/req':>10s} {'net of idle':>11s} {'req/s':>7s} {'idle %':>7s}")
    for kb, n in cells:
        for tree in trees:
            m = {k: statistics.median(v) for k, v in rows[(kb, n, str(tree))].items()}
            print(f"{str(tree):24s} {kb:4d} {n:8d} {m['cpu_ms']:10.3f} {m['net_ms']:11.3f} {m['rps']:7.0f} {m['idle']:7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("inproc", "proc"))
    ap.add_argument("--sizes", default="1,8,64,512", help="body sizes in KB")
    ap.add_argument("--replicas", default="8,64,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--base", default="", help="inproc: another source tree whose parse, head and tap run beside")
    ap.add_argument("--trees", default=".", help="proc: source trees to run the router from, A/B in turn")
    ap.add_argument("--seconds", type=float, default=4.0, help="proc: wrk's duration per figure")
    ap.add_argument("--conns", type=int, default=4, help="proc: wrk's connections")
    ap.add_argument("--idle", type=float, default=3.0, help="proc: seconds of idle CPU measured per router")
    ap.add_argument("--ports-per-stub", type=int, default=64, help="proc: replicas one stub process stands for")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    replicas = [int(x) for x in a.replicas.split(",")]
    if a.mode == "inproc":
        inproc(sizes, replicas, a.rounds, a.conversations, Path(a.base).resolve() if a.base else None)
    else:
        trees = [Path(t).resolve() for t in a.trees.split(",")]
        os.environ.setdefault("PYTHONHASHSEED", "0")
        proc(sizes, replicas, trees, a.rounds, a.seconds, a.conns, a.idle, a.conversations, a.ports_per_stub)


if __name__ == "__main__":
    main()
