"""Two ways to drive psycopg from trio, per call: µs for a typical store write and read.

    .venv/bin/python bench/bench_store_pg.py [--url postgresql://...] [--n 2000]

- "inline": the call runs on the trio thread; psycopg's generator-based waiting blocks it until
  the server answers (PgStore's way: its wait() carries the call's deadline, so a hung server costs
  at most [store] timeout_s).
- "thread": `await trio.to_thread.run_sync(call)`: the trio thread is free meanwhile, but every
  call pays a hand-off to a worker thread and back.
- SQLite (a file, WAL, synchronous=NORMAL) for reference, inline.

The write is a fenced `put_assignment` with a fence set (a transaction: BEGIN, the leader row FOR
SHARE, the upsert, the generation bump, COMMIT) and an unfenced `router_seen` (one autocommitted
statement, the heartbeat); the reads are `generation()` (what followers poll) and `assignments()`
of 50 rows. Without --url a throwaway server is started (tests/pg_server.py: the system's
initdb/postgres, fsync off) over TCP on 127.0.0.1 and stopped at the end."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmgw.daemon.control.store.postgres import PgStore  # noqa: E402
from llmgw.daemon.control.store.rows import AssignmentRow  # noqa: E402
from llmgw.daemon.control.store.sqlite import Store  # noqa: E402


def prepare(st: Any) -> None:
    lease = st.try_lead("bench", 3600.0)
    st.set_fence("bench", lease.epoch)
    st.register_router("bench", {"api": "http://127.0.0.1:1"}, started_at=time.time())
    for i in range(50):
        st.put_assignment(AssignmentRow(f"m/{i}", "m", f"n{i % 5}", {"i": i}))


def ops(st: Any) -> dict[str, Callable[[], Any]]:
    counter = iter(range(10**9))
    return {
        "write: put_assignment (fenced)": lambda: st.put_assignment(
            AssignmentRow("m/0", "m", "n0", {"i": next(counter)})),
        "write: router_seen (heartbeat)": lambda: st.router_seen("bench"),
        "read: generation()": st.generation,
        "read: assignments() (50 rows)": st.assignments,
    }


async def run_inline(fn: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


async def run_thread(fn: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        await trio.to_thread.run_sync(fn)
    return (time.perf_counter() - t0) / n * 1e6


def measure(st: Any, ways: dict[str, Callable[..., Any]], n: int) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}

    async def main() -> None:
        for op, fn in ops(st).items():
            for way, runner in ways.items():
                await runner(fn, max(50, n // 10))  # warm: prepared statements, the thread cache
                samples = [await runner(fn, n // 5) for _ in range(5)]
                out[(op, way)] = statistics.median(samples)

    trio.run(main)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a PostgreSQL DSN (default: start a throwaway server)")
    ap.add_argument("--n", type=int, default=2000, help="calls per measurement")
    args = ap.parse_args()
    server = None
    url = args.url
    if url is None:
        from tests.pg_server import PgServer

        server = PgServer()
        server.start()
        url = server.create_database("bench")
    try:
        pg = PgStore.open(url, timeout_s=5.0)
        prepare(pg)
        res = measure(pg, {"inline": run_inline, "thread": run_thread}, args.n)
        pg.close()
        with tempfile.TemporaryDirectory() as tmp:
            sq = Store.open(os.path.join(tmp, "llmgw", "router.db"))
            prepare(sq)
            res.update(measure(sq, {"sqlite": run_inline}, args.n))
            sq.close()
    finally:
        if server is not None:
            server.cleanup()
    print(f"{'operation':34} {'PG inline':>10} {'PG thread':>10} {'SQLite':>10}   (µs per call, median of 5)")
    for op in ops(_Dummy()):
        print(f"{op:34} {res[(op, 'inline')]:10.0f} {res[(op, 'thread')]:10.0f} {res[(op, 'sqlite')]:10.0f}")


class _Dummy:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


if __name__ == "__main__":
    main()
