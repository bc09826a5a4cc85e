"""Whose fault is it — the request's or the replica's? The router's core (llmgw.route.dispatch)
blames a replica's breaker only for what the replica did: a request that two replicas answer
5xx is poison (neither breaker counts it, the client gets the engine's error); a hung engine
does not hold a request for the whole first-byte ceiling while another replica is idle; when
every breaker is open the router probes every open replica early instead of one at a time."""

from __future__ import annotations

import random

from llmgw.config import parse_config
from llmgw.route.admission import Ticket
from llmgw.route.attempt import Attempt
from llmgw.route.breaker import FailureKind
from llmgw.route.cache_stats import CacheStats
from llmgw.route.attempt import PREFILL_S_PER_1K_TOKENS
from llmgw.route.dispatch import RouterCore
from llmgw.route.plan import Plan
from llmgw.route.replicas import ReplicaTable

CFG = """
[router]
max_attempts = 3
first_byte_timeout_s = 600.0
first_byte_fast_s = 30.0
[router.breaker]
failure_threshold = 2
cooldown_s = 5.0
half_open_probes = 1
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
[[models.replicas]]
url = "http://127.0.0.1:2"
[[models.replicas]]
url = "http://127.0.0.1:3"
"""
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _core(text: str = CFG) -> RouterCore:
    cfg = parse_config(text)
    return RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0,
                      rng=random.Random(0))


def _plan(core: RouterCore, rid: str = "r", body: bytes = BODY) -> Plan:
    return core.plan("chat", body, rid, strategy=None, session=None, now=0.0)


def _attempt(core: RouterCore, plan: Plan, now: float = 0.0) -> Attempt:
    a = core.next(plan, now, 0.0)
    assert isinstance(a, Attempt)
    return a


def _failures(core: RouterCore) -> dict[str, int]:
    return {rid: r.breaker.snapshot()["failures_total"] for rid, r in core.table.replicas.items()}


def _dropped_5xx(core: RouterCore, plan: Plan, a: Attempt) -> None:
    assert plan.retry_5xx
    core.finish(plan, a, 0.0, FailureKind.HTTP_5XX, first_byte_at=None, status=500, detail="answered 500")


def test_a_request_two_replicas_answer_5xx_is_poison_and_blames_neither() -> None:
    core = _core()
    plan = _plan(core)
    a = _attempt(core, plan)
    _dropped_5xx(core, plan, a)
    b = _attempt(core, plan)
    assert b.replica is not a.replica and not plan.retry_5xx  # the next 5xx is the client's answer
    core.finish(plan, b, 0.1, None, first_byte_at=0.05, status=500)  # relayed to its end
    assert _failures(core) == {"m/0": 0, "m/1": 0, "m/2": 0}
    assert all(r.breaker.state == "closed" for r in core.table.replicas.values())
    c = core.counters
    assert c.poison == {("m",): [1, 0.0]}
    assert c.requests == {("m", "engine_error", 500): [1, 0.0]}
    assert c.upstream_errors[(a.replica.id, "5xx")][0] == 1 and c.upstream_errors[(b.replica.id, "5xx")][0] == 1


def test_poison_requests_cannot_open_every_breaker() -> None:
    """The incident: three poison requests opened every breaker and then 18 of 20 normal ones
    got 502. Now the breakers stay closed and every normal request gets a replica at once."""
    core = _core()
    for k in range(6):
        plan = _plan(core, f"poison{k}")
        a = _attempt(core, plan)
        _dropped_5xx(core, plan, a)
        b = _attempt(core, plan)
        core.finish(plan, b, 0.0, None, first_byte_at=0.0, status=500)
    assert all(r.breaker.state == "closed" for r in core.table.replicas.values())
    for k in range(20):
        plan = _plan(core, f"ok{k}")
        a = _attempt(core, plan)
        core.finish(plan, a, 0.0, None, first_byte_at=0.0, status=200)
    assert core.counters.requests[("m", "ok", 200)][0] == 20


def test_a_5xx_then_a_success_elsewhere_blames_the_first_replica() -> None:
    core = _core()
    plan = _plan(core)
    a = _attempt(core, plan)
    _dropped_5xx(core, plan, a)
    assert _failures(core)[a.replica.id] == 0  # held back
    b = _attempt(core, plan)
    core.finish(plan, b, 0.1, None, first_byte_at=0.05, status=200)
    assert _failures(core) == {r: int(r == a.replica.id) for r in core.table.replicas}
    assert core.counters.poison == {}


def test_a_5xx_then_the_client_leaves_blames_nobody() -> None:
    core = _core()
    plan = _plan(core)
    a = _attempt(core, plan)
    _dropped_5xx(core, plan, a)
    b = _attempt(core, plan)
    core.finish(plan, b, 0.1, FailureKind.CLIENT_CANCEL, first_byte_at=None, status=None)
    assert _failures(core) == {"m/0": 0, "m/1": 0, "m/2": 0}


def test_the_last_attempt_relays_the_engine_error_and_counts_it() -> None:
    core = _core(CFG.replace("max_attempts = 3", "max_attempts = 1"))
    plan = _plan(core)
    a = _attempt(core, plan)
    assert not plan.retry_5xx  # no attempt left: the shell relays the engine's answer
    core.finish(plan, a, 0.1, None, first_byte_at=0.05, status=503)
    assert _failures(core)[a.replica.id] == 1
    assert core.counters.requests == {("m", "engine_error", 503): [1, 0.0]}


# -- a hung engine ------------------------------------------------------------------------------
def test_the_first_byte_deadline_is_short_while_another_replica_is_idle() -> None:
    core = _core()
    long_prompt = b'{"model": "m", "messages": [{"role": "user", "content": "%s"}]}' % (b"x" * 40_000)
    plan = _plan(core, body=long_prompt)
    a = _attempt(core, plan)
    tokens = plan.info.prompt_tokens_estimate
    assert tokens >= 10_000
    assert a.first_byte_timeout == 30.0 + tokens / 1000 * PREFILL_S_PER_1K_TOKENS
    for r in core.table.replicas.values():  # every other replica busy: the ceiling
        if r is not a.replica:
            r.view.inflight = 1
    b = _attempt(core, _plan(core, "r2"))
    assert b.first_byte_timeout == 600.0
    core2 = _core(CFG.replace("first_byte_fast_s = 30.0", "first_byte_fast_s = 0"))
    assert _attempt(core2, _plan(core2)).first_byte_timeout == 600.0


def test_timeouts_eject_a_hung_replica_after_the_threshold() -> None:
    core = _core()
    hung = core.table.replicas["m/0"]
    for k in range(2):  # failure_threshold = 2
        plan = _plan(core, f"t{k}")
        a = _attempt(core, plan)
        while a.replica is not hung:  # steer the attempt to the hung replica
            core.finish(plan, a, 0.0, None, first_byte_at=0.0, status=200)
            plan = _plan(core, f"t{k}x{a.replica.id}")
            for r in core.table.replicas.values():
                r.view.inflight = 0 if r is hung else 5
            a = _attempt(core, plan)
        core.finish(plan, a, 30.0, FailureKind.TIMEOUT, first_byte_at=None, status=None, detail="first_byte")
    assert hung.breaker.state == "open"


# -- every breaker open -----------------------------------------------------------------------
def test_every_breaker_open_probes_each_replica_early_and_then_waits_for_a_slot() -> None:
    core = _core()
    for r in core.table.replicas.values():
        r.breaker.trip(0.0)  # cooldown 5 s: nothing may pass before 5.0
    plans = [_plan(core, f"p{k}") for k in range(4)]
    probes = [core.next(p, 1.0, 0.0) for p in plans[:3]]
    assert all(isinstance(a, Attempt) and a.probe for a in probes)
    assert {a.replica.id for a in probes} == {"m/0", "m/1", "m/2"}  # one early probe each
    assert probes[0].decision.fallback
    waiting = core.next(plans[3], 1.0, 0.0)
    assert isinstance(waiting, Ticket)  # every probe slot taken: it waits instead of a 502
    woken = core.finish(plans[0], probes[0], 1.5, None, first_byte_at=1.2, status=200)
    assert woken == [waiting] and probes[0].replica.breaker.state == "closed"
    a = core.next(plans[3], 1.5, 0.0)
    assert isinstance(a, Attempt) and a.replica is probes[0].replica and not a.probe
