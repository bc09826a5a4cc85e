"""When to restart a crashed engine: exponential backoff with jitter, and a crash loop (stop trying,
an operator must act) after too many crashes within a window.

Times are the caller's monotonic clock in seconds; randomness is passed in, so this is deterministic.

Reset rule: crashes older than `window_s` are forgotten (a sliding window), and an engine that has
been ready continuously for `window_s` forgets all its crashes: `record_healthy` is called on every
successful health check, the first call after a crash starts the streak, a crash ends it. The backoff
exponent is the number of crashes remembered, so a long healthy run starts again at `base_s`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RestartPolicy"]


@dataclass
class RestartPolicy:
    base_s: float = 1.0
    max_s: float = 60.0
    crashloop_after: int = 5
    window_s: float = 300.0
    jitter: float = 0.2
    _crash_times: list[float] = field(default_factory=list, init=False, repr=False)
    _healthy_since: float | None = field(default=None, init=False, repr=False)

    @property
    def crashes(self) -> int:
        """Crashes remembered (within the window as of the last record_*)."""
        return len(self._crash_times)

    @property
    def first_crash_at(self) -> float | None:
        return self._crash_times[0] if self._crash_times else None

    def record_crash(self, now: float, rand: float) -> float | None:
        """A crash at `now`; `rand` in [0, 1). The delay before the next start, or None: crash loop."""
        self._healthy_since = None
        self._crash_times = [t for t in self._crash_times if now - t < self.window_s]
        self._crash_times.append(now)
        n = len(self._crash_times)
        if n >= self.crashloop_after:
            return None
        delay = min(self.max_s, self.base_s * 2.0 ** (n - 1))
        return delay * (1.0 + self.jitter * (2.0 * rand - 1.0))

    def record_healthy(self, now: float) -> None:
        """The engine answered its health check at `now`."""
        if self._healthy_since is None:
            self._healthy_since = now
        elif now - self._healthy_since >= self.window_s:
            self._crash_times.clear()

    def reset(self) -> None:
        """Forget everything (an operator restarted the engine)."""
        self._crash_times.clear()
        self._healthy_since = None
