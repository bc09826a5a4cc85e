"""The end of an attempt (llmgw.route.attempt) and the router's core around it
(llmgw.route.dispatch): every permit an attempt takes — its place under the cap, the breaker's
probe slot, the inflight count — is given back exactly once, whatever sequence of successes,
failures, timeouts and cancels happens."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw.config import parse_config
from llmgw.route.admission import ConcurrencyCaps, Ticket
from llmgw.route.attempt import Attempt
from llmgw.route.breaker import Breaker, BreakerConfig, FailureKind, Permit
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import Plan, RouterCore
from llmgw.route.openai_req import ApiError
from llmgw.route.replicas import Replica, ReplicaTable
from llmgw.route.types import Decision, EndpointView

import random

ENDINGS = [None, FailureKind.CONNECT, FailureKind.HTTP_5XX, FailureKind.RESET, FailureKind.TIMEOUT,
           FailureKind.CLIENT_CANCEL]
MAX_PROBES = 2


def _decision() -> Decision:
    return Decision("r", "m", "chat", "max-score", "m/0", [], [], {}, 0.0, 0.0)


class AttemptPermits(RuleBasedStateMachine):
    """Attempts start (when the cap and the breaker let them) and end in any order and any way,
    some twice; the breaker is tripped from outside and time moves on."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        cfg = BreakerConfig(failure_threshold=2, base_cooldown=1.0, max_cooldown=4.0,
                            half_open_max_probes=MAX_PROBES, success_to_close=2, probe_stale_after=1e9)
        self.rep = Replica(EndpointView(id="m/0", model="m", url="http://x"), Breaker(cfg), None)
        self.caps = ConcurrencyCaps()
        self.caps.set_cap("m/0", 4)
        self.live: list[Attempt] = []
        self.ended: list[Attempt] = []

    @rule()
    def start(self) -> None:
        if not self.caps.try_reserve("m/0"):
            return
        permit = self.rep.breaker.allow(self.now)
        if permit is Permit.DENY:
            self.caps.release("m/0")
            return
        self.live.append(Attempt(self.rep, self.caps, permit, _decision(), self.now))

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, 100), how=st.sampled_from(ENDINGS))
    def end(self, pick: int, how: FailureKind | None) -> None:
        a = self.live.pop(pick % len(self.live))
        assert a.end(self.now, how) is True
        self.ended.append(a)

    @precondition(lambda self: bool(self.ended))
    @rule(pick=st.integers(0, 100), how=st.sampled_from(ENDINGS))
    def end_again(self, pick: int, how: FailureKind | None) -> None:
        a = self.ended[pick % len(self.ended)]
        before = (self.caps.inflight("m/0"), self.rep.view.inflight, self.rep.breaker.snapshot())
        assert a.end(self.now, how) is False
        assert (self.caps.inflight("m/0"), self.rep.view.inflight, self.rep.breaker.snapshot()) == before

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 5.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule()
    def trip(self) -> None:
        self.rep.breaker.trip(self.now)

    @rule()
    def trip_and_wait_out_the_cooldown(self) -> None:
        """Straight to the interesting part: the next allow() turns half-open."""
        self.rep.breaker.trip(self.now)
        self.now += self.rep.breaker.cooldown

    @invariant()
    def every_permit_is_held_by_a_live_attempt(self) -> None:
        n = len(self.live)
        assert self.caps.inflight("m/0") == n
        assert self.rep.view.inflight == n
        assert self.caps.snapshot()["over_released_total"] == 0
        b = self.rep.breaker
        assert b.probes_in_flight <= MAX_PROBES
        # the probes of this half-open period that are really out: never more than allowed
        current = [a for a in self.live if a.probe and a._token[0] == b._epoch]
        if b.state == "half_open":
            assert len(current) <= MAX_PROBES
            assert b.probes_in_flight == len(current)  # each slot is a probe really out
        if not self.live:
            assert b.probes_in_flight == 0


TestAttemptPermits = AttemptPermits.TestCase
TestAttemptPermits.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                       derandomize=True)


def test_an_attempt_needs_a_pass_or_a_probe() -> None:
    rep = Replica(EndpointView(id="m/0", model="m", url="http://x"), Breaker(), None)
    with pytest.raises(ValueError):
        Attempt(rep, ConcurrencyCaps(), Permit.DENY, _decision(), 0.0)


# -- the core: a client's cancel during a half-open probe --------------------------------------------
CFG = """
[router]
max_attempts = 1
[router.breaker]
failure_threshold = 1
cooldown_s = 1.0
half_open_probes = 2
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
"""
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _core(text: str = CFG) -> RouterCore:
    cfg = parse_config(text)
    return RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0,
                      rng=random.Random(0))


PLANS: dict[Attempt, Plan] = {}


def _try(core: RouterCore, rid: str, now: float) -> Attempt | None:
    plan = core.plan("chat", BODY, rid, strategy=None, session=None, now=now)
    try:
        step = core.next(plan, now, 0.0)
    except ApiError:
        return None
    if isinstance(step, Ticket):  # no probe slot free: it would wait for one; it leaves instead
        core.left_queue(plan, now, timed_out=False)
        return None
    PLANS[step] = plan
    return step


def test_a_cancel_during_a_half_open_probe_frees_one_slot_not_two() -> None:
    """Regression: a client cancel during a probe released the probe twice (on_failure(cancel)
    and release_probe), so a recovering replica with half_open_probes = 2 got three probes."""
    core = _core()
    rep = core.table.replicas["m/0"]
    rep.breaker.trip(0.0)
    now = 2.0  # past the cooldown: half-open
    a, b = _try(core, "a", now), _try(core, "b", now)
    assert a is not None and b is not None and a.probe and b.probe
    assert _try(core, "c", now) is None  # both slots taken
    core.finish(PLANS[a], a, now, FailureKind.CLIENT_CANCEL, first_byte_at=None, status=None)
    assert rep.breaker.probes_in_flight == 1
    c = _try(core, "c", now)
    assert c is not None and c.probe  # the freed slot
    assert _try(core, "d", now) is None  # and no more: b and c are the two probes
    assert rep.breaker.probes_in_flight == 2


def test_a_cancelled_ordinary_request_does_not_free_a_probe_slot() -> None:
    """A request that passed a closed breaker and is cancelled while the breaker is half-open
    holds no probe slot: it must not give away one a probe holds."""
    core = _core()
    rep = core.table.replicas["m/0"]
    early = _try(core, "early", 0.0)
    assert early is not None and not early.probe
    rep.breaker.trip(0.0)
    p1, p2 = _try(core, "p1", 2.0), _try(core, "p2", 2.0)
    assert p1 is not None and p2 is not None and p1.probe and p2.probe
    core.finish(PLANS[early], early, 2.0, FailureKind.CLIENT_CANCEL, first_byte_at=None, status=None)
    assert rep.breaker.probes_in_flight == 2
    assert _try(core, "p3", 2.0) is None


def test_finish_twice_counts_and_releases_once() -> None:
    core = _core()
    a = _try(core, "a", 0.0)
    assert a is not None
    wake1 = core.finish(PLANS[a], a, 1.0, None, first_byte_at=0.5, status=200)
    wake2 = core.finish(PLANS[a], a, 1.0, None, first_byte_at=0.5, status=200)
    assert wake1 == [] and wake2 == []
    assert core.counters.requests[("m", "ok", 200)][0] == 1
    assert core.caps.inflight("m/0") == 0 and core.table.replicas["m/0"].view.inflight == 0
    assert core.table.replicas["m/0"].completed == 1


def test_a_failed_request_is_counted_once() -> None:
    """Every attempt failed: the request is counted once, as failed with the status the client
    got (not a second time as a rejection)."""
    core = _core()
    a = _try(core, "a", 0.0)
    assert a is not None
    core.finish(PLANS[a], a, 0.1, FailureKind.TIMEOUT, first_byte_at=None, status=None,
                detail="first_byte")
    with pytest.raises(ApiError) as ei:
        core.next(PLANS[a], 0.2, 0.0)
    assert ei.value.status == 504 and ei.value.counted and "first_byte" in ei.value.message
    assert core.counters.requests == {("m", "failed", 504): [1, 0.0]}
    assert core.counters.upstream_errors == {("m/0", "timeout"): [1, 0.0]}


SATURATED = """
[router]
queue_size = 1
queue_timeout_s = 5.0
[[pools]]
name = "default"
max_inflight_per_replica = 1
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
"""


def test_the_queue_slot_is_left_once_and_a_woken_request_proceeds() -> None:
    core = _core(SATURATED)
    a = _try(core, "a", 0.0)
    assert a is not None
    plan_b = core.plan("chat", BODY, "b", strategy=None, session=None, now=0.0)
    t = core.next(plan_b, 0.0, 0.0)
    assert isinstance(t, Ticket) and core.queue_lengths() == {"m": 1}
    assert core.next(plan_b, 0.0, 0.0) is t  # still waiting: the same ticket
    plan_c = core.plan("chat", BODY, "c", strategy=None, session=None, now=0.0)
    with pytest.raises(ApiError) as ei:
        core.next(plan_c, 0.0, 0.0)  # the queue (size 1) is full
    assert ei.value.status == 429 and ei.value.counted
    woken = core.finish(PLANS[a], a, 1.0, None, first_byte_at=0.5, status=200)
    assert woken == [t] and core.queue_lengths() == {"m": 0}
    b = core.next(plan_b, 1.0, 0.0)
    assert isinstance(b, Attempt) and b.replica.id == "m/0"
    # a waiter that gives up leaves its slot once; a timed-out one gets a counted 429
    plan_d = core.plan("chat", BODY, "d", strategy=None, session=None, now=1.0)
    assert isinstance(core.next(plan_d, 1.0, 0.0), Ticket)
    core.left_queue(plan_d, 2.0, timed_out=False)
    core.left_queue(plan_d, 2.0, timed_out=False)
    assert core.queue_lengths() == {"m": 0}
    plan_e = core.plan("chat", BODY, "e", strategy=None, session=None, now=1.0)
    assert isinstance(core.next(plan_e, 1.0, 0.0), Ticket)
    with pytest.raises(ApiError) as ei:
        core.left_queue(plan_e, 7.0, timed_out=True)
    assert ei.value.status == 429
    assert core.counters.rejections == {("m", "queue_full"): [1, 0.0], ("m", "queue_timeout"): [1, 0.0]}
    assert core.counters.requests[("m", "rejected", 429)][0] == 2
