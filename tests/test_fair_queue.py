"""The fair wait queue (llmgw.route.fair_queue): priority bands, weighted fair queueing on cost
within a band, longest-queue displacement when full — pure unit and property tests; then the
router's core with it (RouterCore: bands, the displaced waiter's 429, band and share in the
decision and the trace)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw.config import parse_config
from llmgw.route.admission import Ticket
from llmgw.route.attempt import Attempt
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import RouterCore
from llmgw.route.fair_queue import FairQueue
from llmgw.route.openai_req import ApiError
from llmgw.route.replicas import ReplicaTable
from llmgw.route.types import TenantTag
from llmgw.tenants.model import BANDS, band_rank

HIGH, NORMAL, LOW = band_rank("high"), band_rank("normal"), band_rank("low")


def _drain(q: FairQueue) -> list[Ticket]:
    out = []
    while len(q):
        out += q.on_capacity(1)
    return out


# -- unit --------------------------------------------------------------------------------------------
def test_one_tenant_is_served_in_arrival_order() -> None:
    q = FairQueue(10)
    ts = [q.enqueue(f"r{i}", 100.0, 0.0, tenant="a", cost=c) for i, c in enumerate([5, 1, 9, 1, 3])]
    assert _drain(q) == ts


def test_a_higher_band_goes_first_and_a_requeue_goes_first_of_its_band() -> None:
    q = FairQueue(10)
    low = q.enqueue("l", 100.0, 0.0, tenant="a", band=LOW)
    n1 = q.enqueue("n1", 100.0, 0.0, tenant="a")
    hi = q.enqueue("h", 100.0, 0.0, tenant="b", band=HIGH)
    n2 = q.enqueue("n2", 100.0, 0.0, tenant="c")
    assert q.on_capacity(1) == [hi]
    first = q.on_capacity(1)[0]
    assert first in (n1, n2)
    q.requeue(first)  # found no room: back, ahead of the rest of its band, behind no lower band
    assert _drain(q) == [first, n2 if first is n1 else n1, low]
    assert q.snapshot()["requeued_total"] == 1


def test_weights_share_tokens_not_requests() -> None:
    """Tenant a sends many small requests, b few long ones, same weight: served tokens stay even."""
    q = FairQueue(1000)
    for i in range(200):
        q.enqueue(f"a{i}", 1e9, 0.0, tenant="a", cost=10)
    for i in range(20):
        q.enqueue(f"b{i}", 1e9, 0.0, tenant="b", cost=100)
    served = {"a": 0, "b": 0}
    for _ in range(60):
        t = q.on_capacity(1)[0]
        served[t.tenant] += t.cost
    assert abs(served["a"] - served["b"]) <= 100


def test_share_is_weight_over_the_waiting_weights() -> None:
    q = FairQueue(10)
    assert q.share("a", NORMAL) == 1.0
    q.enqueue("a", 100.0, 0.0, tenant="a", weight=1.0)
    q.enqueue("b", 100.0, 0.0, tenant="b", weight=3.0)
    q.enqueue("h", 100.0, 0.0, tenant="h", band=HIGH)
    assert q.share("a", NORMAL) == 0.25 and q.share("b", NORMAL) == 0.75 and q.share("h", HIGH) == 1.0
    snap = q.snapshot(1.0)
    assert snap["bands"] == {"normal": 2, "high": 1}
    assert snap["tenants"]["b"] == {"waiting": 1, "cost": 1, "share": 0.75}
    out = q.on_capacity(3)
    assert out[0].tenant == "h" and out[0].share == 1.0
    assert {t.tenant: t.share for t in out[1:]}["a"] in (0.25, 1.0)


def test_full_queue_a_higher_band_displaces_the_lowest_bands_biggest_tenant() -> None:
    q = FairQueue(3)
    q.enqueue("n", 100.0, 0.0, tenant="x")
    l1 = q.enqueue("l1", 100.0, 0.0, tenant="big", band=LOW)
    l2 = q.enqueue("l2", 100.0, 0.0, tenant="big", band=LOW)
    h = q.enqueue("h", 100.0, 0.0, tenant="y", band=HIGH)
    assert h is not None and len(q) == 3
    gone = q.take_displaced()
    assert gone == [l2] and l2.displaced and "higher band" in l2.displaced_by and l2 not in q
    assert q.take_displaced() == []
    assert l1 in q and q.snapshot()["displaced_total"] == 1 and q.displaced_by_band() == {"low": 1}


def test_full_queue_within_a_band_the_longest_queue_loses_never_the_arrivals_own() -> None:
    q = FairQueue(4)
    a = [q.enqueue(f"a{i}", 100.0, 0.0, tenant="a") for i in range(3)]
    b0 = q.enqueue("b0", 100.0, 0.0, tenant="b")
    assert q.enqueue("a3", 100.0, 0.0, tenant="a") is None  # a holds the most: a's arrival is refused
    b1 = q.enqueue("b1", 100.0, 0.0, tenant="b")  # b (1+1) < a (3): a's last ticket goes
    assert b1 is not None and q.take_displaced() == [a[2]] and a[2].displaced_by == "fair share"
    assert q.enqueue("b2", 100.0, 0.0, tenant="b") is None  # now a 2, b 2+1: refused
    assert q.enqueue("l", 100.0, 0.0, tenant="c", band=LOW) is None  # a lower band displaces nobody
    assert _drain(q)[:1] in ([a[0]], [b0])


def test_a_request_leaving_unserved_gives_its_tags_back_and_idle_banks_no_credit() -> None:
    q = FairQueue(10)
    a0 = q.enqueue("a0", 100.0, 0.0, tenant="a", cost=10)
    a1 = q.enqueue("a1", 100.0, 0.0, tenant="a", cost=10)
    assert q.cancel(a1)  # a's last: its tags are given back
    a2 = q.enqueue("a2", 100.0, 0.0, tenant="a", cost=10)
    assert (a2.start, a2.finish) == (a1.start, a1.finish)
    b0 = q.enqueue("b0", 100.0, 0.0, tenant="b", cost=10)
    assert q.on_capacity(3) == [a0, b0, a2]  # ties: the older first
    # b was idle while a was served on: it comes back at the band's time, not ahead of it
    for i in range(5):
        q.enqueue(f"x{i}", 100.0, 0.0, tenant="a", cost=10)
    served = q.on_capacity(4)
    late = q.enqueue("b1", 100.0, 0.0, tenant="b", cost=10)
    assert late.start == served[-1].start > b0.finish  # the band's virtual time: no credit for idling
    assert q.on_capacity(1)[0] is late  # its finish tag (V + 10) is below a's next (V + 20)


def test_expire_cancel_and_deadlines() -> None:
    q = FairQueue(10)
    t1 = q.enqueue("1", 5.0, 0.0, tenant="a")
    t2 = q.enqueue("2", 3.0, 0.0, tenant="b", band=HIGH)
    t3 = q.enqueue("3", 9.0, 0.0, tenant="a")
    assert q.next_deadline() == 3.0
    assert q.expire(4.0) == [t2] and q.next_deadline() == 5.0
    assert q.cancel(t1) and not q.cancel(t1)
    assert q.next_deadline() == 9.0 and list(q) == [t3]
    assert q.admit_now(False) is False
    assert _drain(q) == [t3] and q.admit_now(False) and not q.admit_now(lambda: True)


def test_a_zero_size_queue_refuses_everything() -> None:
    q = FairQueue(0)
    assert q.enqueue("x", 1.0, 0.0, band=HIGH) is None and q.take_displaced() == []


# -- properties --------------------------------------------------------------------------------------
TENANTS = ["a", "b", "c"]


class QueueModel(RuleBasedStateMachine):
    """Any sequence of arrivals, wakes, expiries, cancels, requeues and displacements: every
    ticket is in exactly one place — waiting, let through, expired, cancelled, or displaced."""

    def __init__(self) -> None:
        super().__init__()
        self.q = FairQueue(5)
        self.now = 0.0
        self.waiting: set[int] = set()
        self.out: dict[int, Ticket] = {}  # let through (may be requeued)
        self.gone: set[int] = set()  # expired, cancelled, displaced: never seen again
        self.all: dict[int, Ticket] = {}

    def _displaced(self, arrival_band: int) -> None:
        for t in self.q.take_displaced():
            assert t.seq in self.waiting and t.displaced
            assert t.band <= arrival_band  # never a higher band's ticket
            self.waiting.discard(t.seq)
            self.gone.add(t.seq)

    @rule(tenant=st.sampled_from(TENANTS), band=st.integers(0, 4), cost=st.integers(1, 50),
          weight=st.sampled_from([0.5, 1.0, 3.0]), ttl=st.sampled_from([1.0, 5.0, 50.0]))
    def arrive(self, tenant: str, band: int, cost: int, weight: float, ttl: float) -> None:
        before = len(self.q)
        t = self.q.enqueue(f"r{len(self.all)}", self.now + ttl, self.now, tenant=tenant, band=band,
                           weight=weight, cost=cost)
        self._displaced(band)
        if t is None:
            assert before >= self.q.max_size
            return
        assert t.seq not in self.all
        self.all[t.seq] = t
        self.waiting.add(t.seq)

    @rule(free=st.integers(1, 3))
    def capacity(self, free: int) -> None:
        waiting = [self.all[s] for s in self.waiting]
        got = self.q.on_capacity(free)
        assert len(got) == min(free, len(waiting))
        for t in got:
            assert t.seq in self.waiting
            # a higher band always goes first
            assert all(w.band <= t.band for w in waiting if w.seq in self.waiting)
            self.waiting.discard(t.seq)
            self.out[t.seq] = t

    @precondition(lambda self: bool(self.out))
    @rule(pick=st.integers(0, 100))
    def requeue(self, pick: int) -> None:
        seq = sorted(self.out)[pick % len(self.out)]
        t = self.out.pop(seq)
        self.q.requeue(t)
        self.waiting.add(seq)

    @rule(dt=st.sampled_from([0.5, 2.0, 10.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        for t in self.q.expire(self.now):
            assert t.seq in self.waiting and t.deadline <= self.now
            self.waiting.discard(t.seq)
            self.gone.add(t.seq)

    @precondition(lambda self: bool(self.all))
    @rule(pick=st.integers(0, 1000))
    def cancel(self, pick: int) -> None:
        seq = sorted(self.all)[pick % len(self.all)]
        was = seq in self.waiting
        assert self.q.cancel(self.all[seq]) is was
        if was:
            self.waiting.discard(seq)
            self.gone.add(seq)

    @invariant()
    def every_ticket_is_in_one_place(self) -> None:
        assert {t.seq for t in self.q} == self.waiting
        assert len(self.q) == len(self.waiting)
        assert not (self.waiting & self.gone) and not (set(self.out) & (self.waiting | self.gone))
        assert all(s in self.all for s in self.waiting | self.gone | set(self.out))
        assert sum(self.q.bands().values()) == len(self.waiting)
        snap = self.q.snapshot(self.now)
        assert sum(e["waiting"] for e in snap["tenants"].values()) == len(self.waiting)


TestQueueModel = QueueModel.TestCase
TestQueueModel.settings = settings(max_examples=300, stateful_step_count=50, deadline=None, derandomize=True)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(wa=st.sampled_from([0.5, 1.0, 2.0, 3.0]), wb=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
       costs_a=st.lists(st.integers(1, 400), min_size=30, max_size=60),
       costs_b=st.lists(st.integers(1, 400), min_size=30, max_size=60), n=st.integers(1, 50))
def test_two_backlogged_tenants_are_served_by_weight_within_one_request(
        wa: float, wb: float, costs_a: list[int], costs_b: list[int], n: int) -> None:
    q = FairQueue(1000)
    q.enqueue("warm", 1e9, 0.0, tenant="x", cost=77)  # the band's virtual time moves off zero
    q.on_capacity(1)
    for i, c in enumerate(costs_a):
        q.enqueue(f"a{i}", 1e9, 0.0, tenant="a", weight=wa, cost=c)
    for i, c in enumerate(costs_b):
        q.enqueue(f"b{i}", 1e9, 0.0, tenant="b", weight=wb, cost=c)
    served = {"a": 0, "b": 0}
    order: dict[str, list[str]] = {"a": [], "b": []}
    for _ in range(min(n, len(costs_a), len(costs_b))):  # both stay backlogged
        t = q.on_capacity(1)[0]
        served[t.tenant] += t.cost
        order[t.tenant].append(t.request_id)
    bound = max(max(costs_a) / wa, max(costs_b) / wb)
    assert abs(served["a"] / wa - served["b"] / wb) <= bound + 1e-9
    for k in "ab":  # FIFO for each tenant
        assert order[k] == [f"{k}{i}" for i in range(len(order[k]))]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(0, 4), st.integers(1, 30)), min_size=1,
                max_size=40))
def test_displacement_never_takes_a_higher_band_and_the_order_is_by_band(
        arrivals: list[tuple[str, int, int]]) -> None:
    q = FairQueue(6)
    for i, (tenant, band, cost) in enumerate(arrivals):
        q.enqueue(str(i), 1e9, 0.0, tenant=tenant, band=band, cost=cost)
        assert all(t.band <= band for t in q.take_displaced())
    bands = [t.band for t in _drain(q)]
    assert bands == sorted(bands, reverse=True)


def test_band_names_cover_the_tenants_model() -> None:
    assert [band_rank(b) for b in BANDS] == list(range(len(BANDS)))


# -- the router's core ---------------------------------------------------------------------------------
SATURATED = """
[router]
queue_size = 2
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
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _core() -> RouterCore:
    cfg = parse_config(SATURATED)
    return RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0, rng=random.Random(0))


def _tag(tenant: str, band: str, weight: float = 1.0, cost: int = 100) -> TenantTag:
    return TenantTag(tenant, f"k-{tenant}", band_rank(band), band, weight, cost)


def test_the_core_serves_a_high_band_waiter_before_earlier_low_ones_and_says_so() -> None:
    core = _core()
    first = core.plan("chat", BODY, "first", strategy=None, session=None, now=0.0, tenant=_tag("bulk", "low"))
    a = core.next(first, 0.0, 0.0)
    assert isinstance(a, Attempt)  # the one slot
    lows = [core.plan("chat", BODY, f"low{i}", strategy=None, session=None, now=0.1, tenant=_tag("bulk", "low"))
            for i in range(2)]
    tickets = [core.next(p, 0.1, 0.0) for p in lows]
    assert all(isinstance(t, Ticket) for t in tickets)
    hi = core.plan("chat", BODY, "hi", strategy=None, session=None, now=0.2, tenant=_tag("chat", "high"))
    t_hi = core.next(hi, 0.2, 0.0)
    assert isinstance(t_hi, Ticket)  # the queue was full: the newest low ticket gave its place
    assert core.displaced() == [tickets[1]] and core.displaced() == []
    with pytest.raises(ApiError) as ei:
        core.next(lows[1], 0.3, 0.0)
    assert ei.value.status == 429 and ei.value.counted and "displaced by a higher band" in ei.value.message
    assert core.counters.rejections == {("m", "queue_displaced"): [1, 0.0]}
    assert core.queue_by_band() == {("m", "high"): 1, ("m", "low"): 1}
    assert core.queue_displaced() == {"low": 1}
    assert core.queue_by_tenant() == {"chat": {"waiting": 1, "cost": 100, "share": 1.0},
                                      "bulk": {"waiting": 1, "cost": 100, "share": 1.0}}
    # the slot frees: the high waiter goes first
    woken = core.finish(first, a, 1.0, None, first_byte_at=0.5, status=200)
    assert woken == [t_hi]
    b = core.next(hi, 1.0, 0.0)
    assert isinstance(b, Attempt)
    d = core.decisions[-1]
    assert (d.tenant, d.band, d.share) == ("chat", "high", 1.0)
    tr = hi.trace.to_dict(1.0)
    assert (tr["tenant"], tr["key"], tr["band"], tr["share"]) == ("chat", "k-chat", "high", 1.0)
    assert [p["note"] for p in tr["phases"] if p["name"] == "queued"] == ["band high, share 1.00"]
    assert core.next(lows[0], 1.0, 0.0) is tickets[0]  # still waiting


def test_the_core_without_a_tag_is_the_anonymous_tenant() -> None:
    core = _core()
    p = core.plan("chat", BODY, "x", strategy=None, session=None, now=0.0)
    assert isinstance(core.next(p, 0.0, 0.0), Attempt)
    d = core.decisions[-1]
    assert (d.tenant, d.band, d.share) == ("-", "normal", 1.0)
    assert d.to_json()["band"] == "normal"
    tr = p.trace.to_dict(0.0)
    assert (tr["tenant"], tr["key"], tr["band"]) == ("-", "-", "normal")


def test_explain_and_trace_text_show_tenant_band_and_share() -> None:
    from datetime import UTC

    from llmgw.admin_client.rationale import rationale_lines
    from llmgw.admin_client.trace_view import trace_lines

    core = _core()
    p = core.plan("chat", BODY, "x", strategy=None, session=None, now=0.0, tenant=_tag("team-a", "high", 2.0))
    assert isinstance(core.next(p, 0.0, 0.0), Attempt)
    text = "\n".join(rationale_lines(core.decisions[-1].to_json(), UTC))
    assert "team-a" in text and "high, share 1.00" in text
    assert "  tenant team-a  key k-team-a  band high  share 1.00" in trace_lines(p.trace.to_dict(0.0), UTC)
    # records without them (older routers) show as before
    assert "tenant" not in "\n".join(rationale_lines({"request_id": "r"}, UTC))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["add", "cancel", "serve", "tick"]), st.sampled_from("ab"),
                          st.integers(1, 20), st.integers(0, 99)), max_size=80))
def test_each_tenant_is_served_in_its_order_through_cancels_expiries_and_displacements(
        ops: list[tuple[str, str, int, int]]) -> None:
    q = FairQueue(6)
    now = 0.0
    served: dict[str, list[int]] = {"a": [], "b": []}
    for op, who, cost, pick in ops:
        if op == "add":
            q.enqueue("x", now + cost / 4, now, tenant=who, cost=cost)
            q.take_displaced()
        elif op == "cancel" and len(q):
            ts = list(q)
            q.cancel(ts[pick % len(ts)])
        elif op == "serve":
            for t in q.on_capacity(1):
                served[t.tenant].append(t.seq)
        else:
            now += 1
            q.expire(now)
    for seqs in served.values():
        assert seqs == sorted(seqs)
