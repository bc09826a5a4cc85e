"""The cyclic garbage collector, set for a long-running daemon once it has started.

CPython runs its young-generation collection every 700 net container allocations. A routed
request allocates a few hundred (its plan, trace, decision, headers, parser state), so the
collector ran every two or three requests, and each older-generation pass walked every object
the daemon keeps for its whole life (config, prefix tree, rings, the modules' own). Nearly all
of a request's objects are freed by reference counting the moment it ends: cycles are rare.

So, once started (:func:`settle`): everything alive then is frozen out of the collector's
scans (``gc.freeze``: never collected, never walked again), and the young generation is
collected every :data:`GEN0` allocations instead of 700 — still many times a second under load,
so the memory a cycle holds stays bounded and small. Measured in one run with
bench/bench_request_cost.py's request (in process, CPU time, alternated): 231 → 202 µs median.
"""

from __future__ import annotations

import gc

__all__ = ["GEN0", "settle"]

GEN0 = 20_000  # young collections: every this many net container allocations (CPython: 700)
GEN1 = 20  # middle ones every this many young ones (CPython: 10)
GEN2 = 20  # full ones every this many middle ones (CPython: 10; and only when it pays, its own rule)


def settle() -> None:
    """Freeze what the daemon built to start, and collect less often from now on."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0, GEN1, GEN2)
