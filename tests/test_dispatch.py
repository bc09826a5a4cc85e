"""The router's core (llmgw.route.dispatch) as the shell drives it, under every order of events a
hypothesis state machine can find: requests arrive, wait in the queue, are woken, resume, leave
or time out; attempts succeed, fail (before or after the first byte), time out, answer 5xx (dropped and
retried, or relayed) or are cancelled;
breakers trip and time passes. Whatever happens:

- every permit is held by a live attempt (cap places, inflight counts, probe slots) and none is
  given back twice;
- every place in a wait queue belongs to a request still waiting;
- every request that ended is counted exactly once in the request counter, and none that is
  still going is."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw.config import parse_config
from llmgw.route.admission import Ticket
from llmgw.route.attempt import Attempt
from llmgw.route.breaker import FailureKind
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import Plan, RouterCore
from llmgw.route.openai_req import ApiError
from llmgw.route.replicas import ReplicaTable

CFG = """
[router]
max_attempts = 2
queue_size = 3
queue_timeout_s = 5.0
[router.breaker]
failure_threshold = 2
cooldown_s = 1.0
half_open_probes = 2
[[pools]]
name = "default"
max_inflight_per_replica = 2
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
[[models.replicas]]
url = "http://127.0.0.1:2"
"""
BODIES = [b'{"model": "m", "messages": [{"role": "user", "content": "%d"}]}' % i for i in range(3)]
FAILURES = [FailureKind.CONNECT, FailureKind.HTTP_5XX, FailureKind.RESET, FailureKind.TIMEOUT]


@dataclass
class Req:
    plan: Plan
    attempt: Attempt | None = None
    ticket: Ticket | None = None  # waiting (in the queue, or woken and not resumed yet)


class CoreLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        cfg = parse_config(CFG)
        self.core = RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0,
                               rng=random.Random(0))
        self.now = 0.0
        self.going: list[Req] = []
        self.done: list[Plan] = []  # the requests that ended, for their traces
        self.ended = 0
        self.n = 0

    # -- the shell's moves ------------------------------------------------------------------------
    def _step(self, r: Req) -> None:
        """Ask the core for the next move, as the shell does after each event."""
        try:
            s = self.core.next(r.plan, self.now, 0.0)
        except ApiError as e:
            assert e.counted
            self._end(r)
            return
        if isinstance(s, Attempt):
            r.attempt, r.ticket = s, None
        else:
            r.attempt, r.ticket = None, s

    def _end(self, r: Req) -> None:
        self.going.remove(r)
        self.done.append(r.plan)
        self.ended += 1

    def _wake(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            assert any(r.ticket is t for r in self.going), "a woken ticket belongs to a waiting request"

    @rule(body=st.sampled_from(BODIES))
    def arrive(self, body: bytes) -> None:
        self.n += 1
        plan = self.core.plan("chat", body, f"q{self.n}", strategy=None, session=None, now=self.now)
        r = Req(plan)
        self.going.append(r)
        self._step(r)

    @precondition(lambda self: any(r.attempt for r in self.going))
    @rule(pick=st.integers(0, 99), how=st.sampled_from([None, FailureKind.CLIENT_CANCEL, *FAILURES]),
          first_byte=st.booleans(), twice=st.booleans())
    def attempt_ends(self, pick: int, how: FailureKind | None, first_byte: bool, twice: bool) -> None:
        live = [r for r in self.going if r.attempt]
        r = live[pick % len(live)]
        a = r.attempt
        assert a is not None
        fb = self.now if first_byte else None
        self._wake(self.core.finish(r.plan, a, self.now, how, first_byte_at=fb, status=200, detail="x"))
        if twice:  # e.g. the relay ends and the body is closed: the second report changes nothing
            assert self.core.finish(r.plan, a, self.now, how, first_byte_at=fb, status=200) == []
        r.attempt = None
        if how is None or how is FailureKind.CLIENT_CANCEL or first_byte:
            self._end(r)  # answered, or the client left, or it failed after the client got bytes
        else:
            self._step(r)  # nothing sent yet: the shell retries

    @precondition(lambda self: any(r.attempt for r in self.going))
    @rule(pick=st.integers(0, 99), relay_end=st.sampled_from([None, FailureKind.CLIENT_CANCEL, FailureKind.RESET]))
    def engine_answers_5xx(self, pick: int, relay_end: FailureKind | None) -> None:
        """As the shell does: drop the 5xx and retry while the plan allows it, else relay it."""
        live = [r for r in self.going if r.attempt]
        r = live[pick % len(live)]
        a = r.attempt
        assert a is not None
        r.attempt = None
        if r.plan.retry_5xx:
            self._wake(self.core.finish(r.plan, a, self.now, FailureKind.HTTP_5XX, first_byte_at=None,
                                        status=500))
            self._step(r)
        else:
            self._wake(self.core.finish(r.plan, a, self.now, relay_end, first_byte_at=self.now, status=500))
            self._end(r)

    @precondition(lambda self: any(r.ticket for r in self.going))
    @rule(pick=st.integers(0, 99))
    def resume(self, pick: int) -> None:
        """A waiting request's event fired, or a spurious wake-up: it asks the core again."""
        waiting = [r for r in self.going if r.ticket]
        self._step(waiting[pick % len(waiting)])

    @precondition(lambda self: any(r.ticket for r in self.going))
    @rule(pick=st.integers(0, 99), timed_out=st.booleans())
    def stops_waiting(self, pick: int, timed_out: bool) -> None:
        waiting = [r for r in self.going if r.ticket]
        r = waiting[pick % len(waiting)]
        try:
            self.core.left_queue(r.plan, self.now, timed_out=timed_out)
            assert not timed_out
        except ApiError as e:
            assert timed_out and e.status == 429 and e.counted
        r.ticket = None
        self._end(r)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(which=st.sampled_from(["m/0", "m/1"]))
    def trip(self, which: str) -> None:
        self.core.table.replicas[which].breaker.trip(self.now)

    # -- what must hold ----------------------------------------------------------------------------
    @invariant()
    def permits_match_live_attempts(self) -> None:
        core = self.core
        for rid, rep in core.table.replicas.items():
            live = [r.attempt for r in self.going if r.attempt and r.attempt.replica is rep]
            assert core.caps.inflight(rid) == len(live)
            assert rep.view.inflight == len(live)
            b = rep.breaker
            if b.state == "half_open":
                probes = [a for a in live if a.probe and a._token[0] == b._epoch]
                assert b.probes_in_flight == len(probes) <= 2
        assert core.caps.snapshot()["over_released_total"] == 0

    @invariant()
    def queue_places_belong_to_waiting_requests(self) -> None:
        q = self.core.queues.get("m")
        queued = list(q) if q is not None else []
        mine = [r.ticket for r in self.going if r.ticket is not None and q is not None and r.ticket in q]
        assert len(queued) == len(mine)
        assert all(any(t is m for m in mine) for t in queued)

    @invariant()
    def traces_follow_the_requests(self) -> None:
        """A request still going has a trace in flight, one that ended a trace that ended; phases
        never go back; each attempt has its record, all but the last of them retried."""
        for r in self.going:
            assert r.plan.trace is not None and r.plan.trace.ended is None
        for p in self.done:
            t = p.trace
            assert t is not None and t.ended is not None and t.outcome and t.status is not None
            starts = [m[1] for m in t.marks]
            assert starts == sorted(starts) and t.ended >= starts[-1]
            assert [a.retried for a in t.attempts] == [True] * (len(t.attempts) - 1) + [False] * bool(t.attempts)
            assert all(a.ended_at is not None for a in t.attempts)
        for r in self.going:
            t = r.plan.trace
            assert t is not None and len(t.attempts) == sum(1 for a in t.attempts if a.ended_at is not None) + \
                (1 if r.attempt is not None else 0)

    @invariant()
    def every_ended_request_is_counted_once(self) -> None:
        counted = sum(int(n) for n, _ in self.core.counters.requests.values())
        assert counted == self.ended


TestCoreLifecycle = CoreLifecycle.TestCase
TestCoreLifecycle.settings = settings(max_examples=250, stateful_step_count=50, deadline=None,
                                      derandomize=True)


SATURATING = """
[router]
saturation_load = 4.0
stale_after_s = 5.0
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
"""


def test_admission_sees_a_scrape_that_came_after_the_last_decision() -> None:
    """The views' staleness is set by decisions; a scrape since then makes the engine's own gauges
    count: a replica the scrape shows saturated holds the next request in the queue."""
    cfg = parse_config(SATURATING)
    core = RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0, rng=random.Random(0))
    first = core.plan("chat", BODIES[0], "a", strategy=None, session=None, now=0.0)
    a = core.next(first, 0.0, 0.0)
    assert isinstance(a, Attempt) and a.replica.view.stale  # never scraped yet
    core.finish(first, a, 0.1, None, first_byte_at=0.05, status=200)
    v = a.replica.view  # the scrape loop's update: the engine is full of other clients' work
    v.running, v.waiting, v.scraped_at = 6.0, 2.0, 1.0
    second = core.plan("chat", BODIES[1], "b", strategy=None, session=None, now=1.0)
    assert isinstance(core.next(second, 1.0, 0.0), Ticket)


def test_a_queued_request_shows_its_wait_in_its_trace() -> None:
    cfg = parse_config(SATURATING)
    core = RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0, rng=random.Random(0))
    first = core.plan("chat", BODIES[0], "a", strategy=None, session=None, now=0.0)
    a = core.next(first, 0.0, 0.0)
    assert isinstance(a, Attempt)
    v = a.replica.view
    v.running, v.waiting, v.scraped_at = 6.0, 2.0, 0.0  # full: the next request waits
    second = core.plan("chat", BODIES[1], "b", strategy=None, session=None, now=0.5)
    assert isinstance(core.next(second, 0.6, 0.0), Ticket)
    v.running, v.waiting = 1.0, 0.0
    core.finish(first, a, 2.0, None, first_byte_at=1.0, status=200)  # room again: "b" is let through
    b = core.next(second, 2.5, 0.0)
    assert isinstance(b, Attempt)
    core.finish(second, b, 3.0, None, first_byte_at=2.8, status=200)
    d = second.trace.to_dict()  # type: ignore[union-attr]
    assert [(p["name"], p["start_ms"], p["duration_ms"]) for p in d["phases"]] == [
        ("prepare", 0.0, 100.0), ("queued", 100.0, 1900.0), ("decide", 2000.0, 0.0), ("connect", 2000.0, 300.0),
        ("body", 2300.0, 200.0)]
    assert d["total_ms"] == 2500.0 and d["outcome"] == "ok"
