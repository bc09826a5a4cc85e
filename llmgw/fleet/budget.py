"""A token bucket: how much of something a sender may do per second, with a burst.

Used by the control plane to bound what one join token or one node may make the router do: new
node names a minute (agent_sessions.py) and KV events a second per node (kv_index.py). Pure: the
caller brings the clock.
"""

from __future__ import annotations

__all__ = ["TokenBucket"]


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; it starts full."""

    __slots__ = ("_at", "_tokens", "burst", "rate")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate, self.burst = rate, burst
        self._tokens, self._at = burst, now

    def take(self, now: float, n: float = 1.0) -> bool:
        """Spend `n` tokens if there are that many (True); otherwise spend none (False). A
        request larger than the burst is allowed once the bucket is full, so it is never stuck."""
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
        if self._tokens >= n or (n > self.burst and self._tokens >= self.burst):
            self._tokens -= n
            return True
        return False

    def available(self, now: float) -> float:
        return min(self.burst, self._tokens + max(0.0, now - self._at) * self.rate)
