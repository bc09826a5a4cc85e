"""One try of a request on one replica, and the permits it holds until it ends.

The router's core (:mod:`.dispatch`) takes three permits before an attempt goes upstream: a
place under the replica's concurrency cap (``ConcurrencyCaps.try_reserve``), the breaker's
permit (``Breaker.allow``: PASS when closed, PROBE for a half-open probe slot) and one count of
the replica's live inflight (``EndpointView.inflight``, what the scorers see). ``end`` gives
each back exactly once, whatever happens — success, an upstream failure, a timeout, the client
leaving — and a second ``end`` does nothing (the caller may report from more than one place,
e.g. a relay that ends and a response body that is closed).

The breaker's verdict, by how the attempt ended, each given the attempt's probe token (its own
half-open slot, or ``NO_SLOT`` when it passed a closed breaker) so that only its own slot is
freed — never a slot another probe holds:
* success (``failure=None``) → ``on_success``;
* a counted failure (connect, 5xx, reset, timeout) → ``on_failure(kind)``;
* no verdict (the client cancelled) → ``release_probe``.

Pure: ``now`` is passed in."""

from __future__ import annotations

from llmgw.config import RouterConfig

from .admission import ConcurrencyCaps
from .breaker import COUNTED_FAILURES, NO_SLOT, FailureKind, Permit
from .plan import Plan
from .replicas import Replica
from .trace import AttemptRecord
from .types import Decision

__all__ = ["PREFILL_S_PER_1K_TOKENS", "Attempt", "first_byte_timeout"]

# The fast first-byte deadline's allowance for prefill: seconds per 1,000 prompt tokens (a
# conservative 1,000 tokens/s; GPUs prefill 5-50x faster).
PREFILL_S_PER_1K_TOKENS = 1.0


class Attempt:
    __slots__ = ("alarm", "body", "bytes_in", "caps", "connected_at", "decision", "ended", "first_byte_timeout",
                 "head_at", "permit", "phase", "record", "replica", "sent_at", "started", "trace_headers", "waiters",
                 "_token")

    def __init__(self, replica: Replica, caps: ConcurrencyCaps, permit: Permit, decision: Decision,
                 started: float) -> None:
        """Taken by the core: a place under ``caps`` (reserved) and ``permit``; this adds the
        inflight count."""
        if permit is Permit.DENY:
            raise ValueError("an attempt needs the breaker's PASS or PROBE")
        self.replica = replica
        self.caps = caps
        self.permit = permit
        self.decision = decision
        self.started = started  # when the request (not this attempt) started, monotonic
        self.ended = False
        self.alarm: bool | None = None  # the prefix zero-hit alarm changed to this (None: unchanged)
        self.first_byte_timeout: float | None = None  # seconds; None: the configured ceiling
        self.body: bytes | None = None  # what to send; None: the client's body as it came
        self.phase = ""  # prefill/decode disaggregation: "prefill" (the shell reads the answer), "decode"
        self.waiters = False  # set as it ends: requests of its model still wait (their room may lag)
        # Set by the shell for the trace (plain slots, no call into the core): when the request
        # went out, when the connection was there, when the response head came, body bytes relayed.
        self.sent_at: float | None = None
        self.connected_at: float | None = None
        self.head_at: float | None = None
        self.bytes_in = 0
        self.record: AttemptRecord | None = None  # this attempt in the request's trace
        # W3C trace headers for the engine (traceparent naming this attempt's span; the client's
        # tracestate), made by the core with the attempt: the shell adds them as they are
        self.trace_headers: list[tuple[str, str]] = []
        self._token = replica.breaker.probe_token() if permit is Permit.PROBE else NO_SLOT
        replica.view.inflight += 1

    @property
    def probe(self) -> bool:
        return self.permit is Permit.PROBE

    def end(self, now: float, failure: FailureKind | None, *, verdict: bool = True) -> bool:
        """Give every permit back, once. ``failure``: None for success, else how it failed
        (``FailureKind.CLIENT_CANCEL`` when the client left). ``verdict=False``: the outcome says
        nothing about the replica (yet) — only its probe slot is given back; the core reports
        the verdict later, or never (a poison request). False when already ended."""
        if self.ended:
            return False
        self.ended = True
        rep = self.replica
        rep.view.inflight -= 1
        self.caps.release(rep.view.id)
        b = rep.breaker
        if not verdict:
            b.release_probe(self._token)
        elif failure is None:
            b.on_success(now, self._token)
        elif failure in COUNTED_FAILURES:
            b.on_failure(now, failure, self._token)
        else:
            b.release_probe(self._token)
        return True


def first_byte_timeout(rc: RouterConfig, plan: Plan, rep: Replica) -> float:
    """The ceiling (``first_byte_timeout_s``: long prefills take minutes) — unless another
    replica of the model could start this request right now (not tried, not draining, its
    breaker lets traffic, nothing in flight or queued on it): then a hung engine must not
    hold the request that long, and the deadline is ``first_byte_fast_s`` plus a prefill
    allowance for the prompt's size (``PREFILL_S_PER_1K_TOKENS``). A timeout counts on the
    breaker like any other, so a replica whose requests all time out is ejected after
    ``failure_threshold`` of them (outlier detection)."""
    ceiling = rc.first_byte_timeout_s
    fast = rc.first_byte_fast_s
    if fast <= 0:
        return ceiling
    tried = plan.tried
    for r in plan.entry.replicas:
        if r is rep or r.draining or r.id in tried:
            continue
        v = r.view
        if v.available and v.inflight == 0 and not v.running and not v.waiting:
            return min(ceiling, fast + plan.info.prompt_tokens_estimate / 1000 * PREFILL_S_PER_1K_TOKENS)
    return ceiling
