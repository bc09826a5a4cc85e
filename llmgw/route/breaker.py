"""Cooldown and circuit breaking as one component per endpoint. Pure: the caller passes `now`.

States: closed → open → half_open → closed (or back to open).

* closed: every request passes. `failure_threshold` CONSECUTIVE counted failures open the breaker
  (any success resets the count). With `failure_threshold=1` this is a plain cooldown: one failure
  takes the endpoint out for `base_cooldown` seconds.
  Why consecutive and not "N failures within W seconds": a success is the best evidence of health we
  get, and the count does not depend on traffic volume. A windowed count trips a busy, healthy
  endpoint with a 0.1 % error rate (1000 req/s → 10 failures in 10 s) and never trips an idle broken
  one; a consecutive count does the opposite of both. An endpoint failing only part of the time is
  left to the scheduler's scores, not to the breaker.
* open: nothing passes until `retry_at`. The first `allow(now)` at or after `retry_at` moves to
  half_open and takes a probe slot.
* half_open: at most `half_open_max_probes` requests in flight. Each success counts; after
  `success_to_close` successes the breaker closes and the cooldown returns to `base_cooldown`. Any
  counted failure re-opens it with the cooldown multiplied by `backoff_factor`, capped at
  `max_cooldown`.

What counts as a failure (the caller passes the kind; see `FailureKind`): connect errors, 5xx answers
from the engine, connection resets mid-stream, and timeouts. What does NOT count:
* a failed /metrics scrape — the engine may be serving requests fine (the scrape path has its own
  staleness handling: EndpointView.stale);
* client-side errors: a 4xx answer (the request was bad, the engine is alive) and a client disconnect
  or cancellation.
`on_failure` with one of the non-counting kinds (SCRAPE, CLIENT_4XX, CLIENT_CANCEL) is accepted and
has no effect beyond giving back a probe slot (like `release_probe`), so a caller may report every
outcome without filtering.

Probe accounting: `allow` returns a `Permit`. `Permit.PROBE` means the request holds a half-open
probe slot, named by `probe_token()` right after the grant, and it must end with exactly one of
`on_success`, `on_failure` or `release_probe` (the last when it ended without a verdict, e.g. the
client went away), each given that token: only that slot is freed, and nothing when it is gone
already (reclaimed as stale, or the breaker has changed state since). A request admitted while
closed passes `NO_SLOT`: its success or failure arriving while half_open is still fresh evidence
about the engine and counts as a verdict, but it frees no slot, since every slot belongs to a
probe in flight. (Without a token — older callers — a verdict frees the oldest slot.) Verdicts
that arrive while open are ignored (they belong to requests that started before the breaker
opened; the cooldown is not extended). A probe slot held longer than `probe_stale_after` seconds
is reclaimed, so a lost verdict cannot wedge an endpoint. `llmgw.route.attempt.Attempt` does this
bookkeeping for the router.

Use `can_pass(now)` (no side effects) to fill EndpointView.available for the scheduler, and
`allow(now)` only for the endpoint actually chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any

__all__ = ["BreakerConfig", "FailureKind", "COUNTED_FAILURES", "Permit", "Breaker", "CLOSED", "OPEN",
           "HALF_OPEN", "NO_SLOT", "ProbeToken"]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
ProbeToken = tuple[int, float]  # (the breaker's state epoch, when the slot was granted)
NO_SLOT: ProbeToken = (-1, 0.0)  # the token of a request that holds no probe slot: never matches


class FailureKind(str, Enum):
    CONNECT = "connect"  # could not connect (refused, DNS, TLS, connect timeout)
    HTTP_5XX = "5xx"  # the engine answered 5xx
    RESET = "reset"  # the connection broke mid-request / mid-stream
    TIMEOUT = "timeout"  # no answer / no next chunk in time
    # Not breaker failures (accepted and ignored, see the module doc):
    SCRAPE = "scrape"  # GET /metrics failed
    CLIENT_4XX = "4xx"  # the engine answered 4xx: the request was bad, the engine is alive
    CLIENT_CANCEL = "cancel"  # the client disconnected or cancelled


COUNTED_FAILURES = frozenset({FailureKind.CONNECT, FailureKind.HTTP_5XX, FailureKind.RESET, FailureKind.TIMEOUT})


class Permit(IntEnum):
    """What `allow` grants; falsy only for DENY, so `if breaker.allow(now):` works."""

    DENY = 0
    PASS = 1  # closed: an ordinary request
    PROBE = 2  # half_open: holds a probe slot until its verdict or release_probe()


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 3  # consecutive counted failures that open it; 1 = a plain cooldown
    base_cooldown: float = 5.0  # seconds open after the first trip
    backoff_factor: float = 2.0  # cooldown multiplier for each re-open after a failed probe
    max_cooldown: float = 60.0
    half_open_max_probes: int = 1
    success_to_close: int = 1  # successes in half_open that close it
    probe_stale_after: float = 600.0  # a probe slot held this long is given back

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        if self.base_cooldown < 0 or self.max_cooldown < self.base_cooldown:
            raise ValueError("need 0 <= base_cooldown <= max_cooldown")
        if self.backoff_factor < 1:
            raise ValueError("backoff_factor must be >= 1")
        if self.half_open_max_probes < 1 or self.success_to_close < 1:
            raise ValueError("half_open_max_probes and success_to_close must be >= 1")
        if self.probe_stale_after <= 0:
            raise ValueError("probe_stale_after must be > 0")


class Breaker:
    """One endpoint's breaker. Not thread-safe; under trio one task touches it at a time."""

    __slots__ = ("cfg", "_state", "_consecutive", "_cooldown", "_retry_at", "_probes", "_half_open_ok",
                 "_changed_at", "_opened_total", "_failures_total", "_successes_total", "_last_failure",
                 "_last_failure_at", "_epoch")

    def __init__(self, cfg: BreakerConfig | None = None) -> None:
        self.cfg = cfg or BreakerConfig()
        self._state = CLOSED
        self._consecutive = 0
        self._cooldown = self.cfg.base_cooldown  # the cooldown of the current/last open period
        self._retry_at: float | None = None
        self._probes: list[float] = []  # start times of probes in flight
        self._half_open_ok = 0
        self._changed_at: float | None = None
        self._opened_total = 0
        self._failures_total = 0
        self._successes_total = 0
        self._last_failure: str | None = None
        self._last_failure_at: float | None = None
        self._epoch = 0  # bumped at every state change: probe tokens of an earlier period are void

    # -- queries ---------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """"closed" | "open" | "half_open". An open breaker past retry_at still reads "open" until
        the next allow() moves it on."""
        return self._state

    @property
    def retry_at(self) -> float | None:
        """When an open breaker lets a probe through; None unless open."""
        return self._retry_at if self._state == OPEN else None

    @property
    def cooldown(self) -> float:
        return self._cooldown

    @property
    def probes_in_flight(self) -> int:
        return len(self._probes)

    def can_pass(self, now: float) -> bool:
        """Would allow(now) grant something? No state change (for the scheduler's filters)."""
        if self._state == CLOSED:
            return True
        if self._state == OPEN:
            return self._retry_at is not None and now >= self._retry_at
        live = sum(1 for t in self._probes if now - t < self.cfg.probe_stale_after)
        return live < self.cfg.half_open_max_probes

    # -- transitions -----------------------------------------------------------------------
    def allow(self, now: float, *, force: bool = False) -> Permit:
        """Check and reserve in one call: PASS when closed; PROBE when a probe slot is free (moving an
        open breaker whose retry_at has come to half_open); DENY otherwise.

        `force=True` lets an open breaker probe before retry_at — when every breaker of a model is
        open (filters.healthy fails open). The probe limit still holds, and a failed early probe
        backs off like any other."""
        if self._state == CLOSED:
            return Permit.PASS
        if self._state == OPEN:
            if not force and (self._retry_at is None or now < self._retry_at):
                return Permit.DENY
            self._to(HALF_OPEN, now)
        self._reclaim_stale(now)
        if len(self._probes) >= self.cfg.half_open_max_probes:
            return Permit.DENY
        self._probes.append(now)
        return Permit.PROBE

    def on_success(self, now: float, token: ProbeToken | None = None) -> None:
        self._successes_total += 1
        if self._state == CLOSED:
            self._consecutive = 0
        elif self._state == HALF_OPEN:
            self._free(token)
            self._half_open_ok += 1
            if self._half_open_ok >= self.cfg.success_to_close:
                self._close(now)
        # OPEN: a request admitted before the trip; ignored.

    def on_failure(self, now: float, kind: FailureKind | str, token: ProbeToken | None = None) -> bool:
        """Report a failed request. Returns True when the kind counts as a breaker failure."""
        kind = FailureKind(kind)
        if kind not in COUNTED_FAILURES:
            if self._state == HALF_OPEN:
                self._free(token)
            return False
        self._failures_total += 1
        self._last_failure, self._last_failure_at = kind.value, now
        if self._state == CLOSED:
            self._consecutive += 1
            if self._consecutive >= self.cfg.failure_threshold:
                self._open(now, self.cfg.base_cooldown)
        elif self._state == HALF_OPEN:
            self._open(now, min(self._cooldown * self.cfg.backoff_factor, self.cfg.max_cooldown))
        return True

    def probe_token(self) -> ProbeToken:
        """The slot the last ``allow`` granted as PROBE (see the module doc)."""
        return (self._epoch, self._probes[-1])

    def release_probe(self, token: ProbeToken | None = None) -> None:
        """A PROBE request ended without a verdict (client cancelled, 4xx...): free its slot.
        With its ``token`` only that slot is freed, and nothing when it is gone already:
        another request's probe slot is never given away."""
        if self._state == HALF_OPEN:
            self._free(token)

    def reset(self, now: float | None = None) -> None:
        """Close by hand (admin), forgetting failures and backoff."""
        self._close(now)

    def trip(self, now: float, cooldown: float | None = None) -> None:
        """Open by hand (admin or an external health signal) for `cooldown` (default base_cooldown)."""
        self._open(now, self.cfg.base_cooldown if cooldown is None else cooldown)

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self._state, "retry_at": self.retry_at, "cooldown": self._cooldown,
            "consecutive_failures": self._consecutive, "probes_in_flight": len(self._probes),
            "half_open_successes": self._half_open_ok, "changed_at": self._changed_at,
            "opened_total": self._opened_total, "failures_total": self._failures_total,
            "successes_total": self._successes_total, "last_failure": self._last_failure,
            "last_failure_at": self._last_failure_at,
        }

    # -- internals -------------------------------------------------------------------------
    def _to(self, state: str, now: float | None) -> None:
        self._epoch += 1
        self._state = state
        self._changed_at = now
        self._probes.clear()
        self._half_open_ok = 0

    def _open(self, now: float, cooldown: float) -> None:
        self._to(OPEN, now)
        self._cooldown = cooldown
        self._retry_at = now + cooldown
        self._opened_total += 1

    def _close(self, now: float | None) -> None:
        self._to(CLOSED, now)
        self._consecutive = 0
        self._cooldown = self.cfg.base_cooldown
        self._retry_at = None

    def _free(self, token: ProbeToken | None) -> None:
        if token is None:
            if self._probes:
                self._probes.pop(0)
            return
        epoch, at = token
        if epoch == self._epoch and at in self._probes:
            self._probes.remove(at)

    def _reclaim_stale(self, now: float) -> None:
        limit = self.cfg.probe_stale_after
        if self._probes and now - self._probes[0] >= limit:
            self._probes = [t for t in self._probes if now - t < limit]
