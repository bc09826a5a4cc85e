"""What one wake-up from idle costs, by the way a socket is waited for, measured in one run.

    .venv/bin/python bench/bench_wakeup.py [--gap-ms 1.0] [--n 3000] [--rounds 3]

A child process pinned to CPU 0 echoes one byte per wake-up on a socketpair; the parent,
on CPU 1, sends a byte every --gap-ms (so the child's CPU is idle in between, as a
router's is between an engine's chunks) and the child's CPU time is read from /proc.
Modes, alternated round by round:

- blocking: plain blocking recv/send (the kernel's and the VM's own floor);
- trio-task: a trio task in ``trio.lowlevel.wait_readable`` (a task switch and an
  epoll_ctl per wake-up);
- inline-task: llmgw's InlineEpoll with LLMGW_INLINE_IO=0 (its task waits for the
  private epoll, then runs the handler);
- inline: llmgw's InlineEpoll dispatching from trio's I/O step (what the router runs).

Bounded: --n wake-ups per mode and round; every child is reaped."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

MODES = ("blocking", "trio-task", "inline-task", "inline")


def _child(mode: str, sock: socket.socket) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    if mode == "blocking":
        while d := sock.recv(100):
            sock.send(d)
        return
    if mode == "inline-task":
        os.environ["LLMGW_INLINE_IO"] = "0"
    import trio

    from llmgw.daemon.net.inline_epoll import InlineEpoll

    sock.setblocking(False)

    async def with_task() -> None:
        while True:
            await trio.lowlevel.wait_readable(sock)
            d = sock.recv(100)
            if not d:
                return
            sock.send(d)

    async def with_inline() -> None:
        poller = InlineEpoll("bench")
        done = trio.Event()

        def echo(mask: int) -> None:
            while True:
                try:
                    d = sock.recv(100)
                except BlockingIOError:
                    return
                if not d:
                    done.set()
                    poller.forget(sock.fileno())
                    return
                sock.send(d)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            poller.register(sock.fileno(), echo)
            await done.wait()
            nursery.cancel_scope.cancel()

    trio.run(with_task if mode == "trio-task" else with_inline)


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(mode: str, n: int, gap: float) -> float:
    """CPU seconds of the echoing child per wake-up."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        a.close()
        try:
            _child(mode, b)
        finally:
            os._exit(0)
    b.close()
    try:
        a.send(b"w")  # warm-up: the child is up and has run its path once
        a.recv(100)
        c0 = _cpu(pid)
        t = time.perf_counter()
        for _ in range(n):
            a.send(b"x")
            a.recv(100)
            t += gap
            while time.perf_counter() < t:
                pass
        return (_cpu(pid) - c0) / n
    finally:
        a.close()
        os.waitpid(pid, 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gap-ms", type=float, default=1.0)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {1})
    res: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(a.rounds):
        for m in MODES:
            res[m].append(one(m, a.n, a.gap_ms / 1e3))
    print(f"CPU per wake-up from idle ({a.n} wake-ups {a.gap_ms} ms apart, median of {a.rounds} alternated rounds;"
          f" /proc ticks: ±{1e6 / os.sysconf('SC_CLK_TCK') / a.n:.0f} µs):")
    base = statistics.median(res["blocking"])
    for m in MODES:
        med = statistics.median(res[m])
        print(f"  {m:12s} {1e6 * med:6.1f} µs  (+{1e6 * (med - base):5.1f} over blocking)  "
              f"rounds: {' '.join(f'{1e6 * v:.0f}' for v in res[m])}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
