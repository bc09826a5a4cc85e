"""Rate-limited logging: a fault that repeats (an engine answering garbage at every scrape, accept
failing while the fd limit is reached) is logged when it starts, then at most one line per
interval for it — a failure or its recovery — each saying how often it failed meanwhile. A fault
that flaps (fails, recovers, fails...) therefore logs as little as one that persists.

    limit = LogLimiter(every_s=60)
    n = limit.hit(key, now)        # it failed: None = stay quiet; else the failures not logged
    if n is not None:
        log.warning("... failed%s", repeats(n))
    n = limit.clear(key, now)      # it works: None = nothing to say (or not now)
    if n is not None:
        log.info("... recovered%s", repeats(n))

Keys are whatever names the fault (a replica id and path, "accept"); ``keep(keys)`` drops the
others, so that the table stays as small as the set of things that can fail."""

from __future__ import annotations

from collections.abc import Collection, Hashable

__all__ = ["LogLimiter", "repeats"]


class _Fault:
    __slots__ = ("failing", "last", "quiet")

    def __init__(self, now: float) -> None:
        self.last = now  # time of the last line about it
        self.quiet = 0  # failures since that line that were not logged
        self.failing = True


class LogLimiter:
    __slots__ = ("every", "faults")

    def __init__(self, every_s: float = 60.0) -> None:
        self.every = every_s
        self.faults: dict[Hashable, _Fault] = {}

    def hit(self, key: Hashable, now: float) -> int | None:
        """``key`` failed at ``now``: the failures not logged so far, to report in a line now,
        or None when a line about ``key`` is more recent than the interval."""
        f = self.faults.get(key)
        if f is None:
            self.faults[key] = _Fault(now)
            return 0
        f.failing = True
        return self._line(f, now, 1)

    def clear(self, key: Hashable, now: float) -> int | None:
        """``key`` works again at ``now``: if it was failing and a line is due, the failures not
        logged so far (report its recovery); else None."""
        f = self.faults.get(key)
        if f is None or not f.failing:
            return None
        f.failing = False
        return self._line(f, now, 0)

    def _line(self, f: _Fault, now: float, count: int) -> int | None:
        if now - f.last >= self.every:
            n, f.last, f.quiet = f.quiet, now, 0
            return n
        f.quiet += count
        return None

    def keep(self, keys: Collection[Hashable]) -> None:
        """Forget the faults of anything not in ``keys`` (replicas gone)."""
        for k in [k for k in self.faults if k not in keys]:
            del self.faults[k]


def repeats(n: int) -> str:
    """The suffix of a rate-limited line: the failures since the previous line not logged."""
    return f" ({n} more failures since the last report)" if n else ""
