"""Every event that gives a model room lets its waiters through (issue 21 item 4, the pure core):
a scrape whose reading shows room (a burst ended between two scrapes), a drained replica kept
after all, a new replica; and a finished request judges saturation as admission does (live
replicas, stale readings not trusted). The process-level reproduction: test_admission_wake.py."""

from __future__ import annotations

import math
import random

from llmgw.config import parse_config
from llmgw.route.admission import Ticket
from llmgw.route.attempt import Attempt
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import RouterCore
from llmgw.route.filters import room
from llmgw.route.replicas import ReplicaTable
from llmgw.route.types import SchedulerConfig

TWO = """
[router]
stale_after_s = 5.0
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
[[models.replicas]]
url = "http://127.0.0.1:2"
"""
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'


def _core() -> RouterCore:
    cfg = parse_config(TWO)
    return RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0, rng=random.Random(0))


def _full(core: RouterCore, rid: str, at: float, running: float = 128.0) -> None:
    v = core.table.replicas[rid].view
    v.running, v.waiting, v.scraped_at, v.inflight_at_scrape = running, 0.0, at, v.inflight


def _waiter(core: RouterCore, rid: str, now: float):  # type: ignore[no-untyped-def]
    plan = core.plan("chat", BODY, rid, strategy=None, session=None, now=now)
    t = core.next(plan, now, 0.0)
    assert isinstance(t, Ticket)
    return plan, t


def test_room_counts_what_a_replica_still_takes() -> None:
    from llmgw.route.types import EndpointView
    cfg = SchedulerConfig(saturation_load=64.0)
    e = EndpointView(id="a", model="m", url="u", running=60.0, waiting=1.0, scraped_at=0.0, stale=False)
    assert room(e, cfg) == 3
    e.running = 128.0
    assert room(e, cfg) == 0
    assert room(e, SchedulerConfig(saturation_load=None)) == math.inf
    e.max_inflight, e.inflight = 4, 1
    assert room(e, cfg) == 3


def test_a_scrape_that_shows_room_lets_the_waiters_through() -> None:
    core = _core()
    _full(core, "m/0", 0.0)
    _full(core, "m/1", 0.0)
    first, t1 = _waiter(core, "a", 0.5)
    second, t2 = _waiter(core, "b", 0.6)
    rep = core.table.replicas["m/0"]
    assert core.scraped(rep, 1.0) == []  # still full: nobody moves
    _full(core, "m/0", 1.0, running=0.0)  # the burst ended between two scrapes
    assert core.scraped(rep, 1.0) == [t1, t2]  # room for 64: both try, oldest first
    assert isinstance(core.next(first, 1.0, 0.0), Attempt)
    assert isinstance(core.next(second, 1.0, 0.0), Attempt)


def test_a_scrape_lets_through_no_more_waiters_than_the_room_it_shows() -> None:
    core = _core()
    _full(core, "m/0", 0.0)
    _full(core, "m/1", 0.0)
    tickets = [_waiter(core, str(i), 0.5)[1] for i in range(3)]
    _full(core, "m/1", 1.0, running=62.0)  # room for 2
    assert core.scraped(core.table.replicas["m/1"], 1.0) == tickets[:2]


def test_a_finished_request_does_not_trust_a_stale_reading() -> None:
    core = _core()
    plan = core.plan("chat", BODY, "a", strategy=None, session=None, now=0.0)
    a = core.next(plan, 0.0, 0.0)
    assert isinstance(a, Attempt)
    for rid in ("m/0", "m/1"):
        _full(core, rid, 0.0)
    _, t = _waiter(core, "b", 1.0)
    # 10 s later the readings are stale (their engines stopped answering /metrics): only the
    # router's own in-flight counts, and the request that ends leaves room for the waiter
    assert core.finish(plan, a, 10.0, None, first_byte_at=9.0, status=200) == [t]


def test_a_drained_replica_kept_after_all_lets_every_waiter_through() -> None:
    core = _core()
    cfg = parse_config(TWO)
    m = cfg.models[0]
    _full(core, "m/0", 0.0)
    core.table.replicas["m/1"].draining = True
    _, t = _waiter(core, "a", 0.5)
    _, wake = core.add_replica(m, "m/1", "http://127.0.0.1:2", pool="default", weight=1.0)
    assert wake == [t]


def test_a_waiter_that_leaves_as_it_is_let_through_passes_its_turn_on() -> None:
    core = _core()
    for rid in ("m/0", "m/1"):
        _full(core, rid, 0.0)
    first, t1 = _waiter(core, "a", 0.5)
    second, t2 = _waiter(core, "b", 0.6)
    _full(core, "m/0", 1.0, running=63.0)  # room for one
    assert core.scraped(core.table.replicas["m/0"], 1.0) == [t1]
    # "a"'s client leaves before it used its turn: "b" gets it, not the next scrape or finish
    assert core.turn_passed(first, 1.1) == [t2]
    core.left_queue(first, 1.1, timed_out=False)
    _full(core, "m/0", 1.2)
    third, _ = _waiter(core, "c", 1.2)
    assert core.turn_passed(third, 1.2) == []  # still in the queue: nothing was spent

