"""Where tier 2 knows who holds a request's first block, tier 1's guess counts only where the
engines confirm it, tier 2's shares elsewhere: a stale tier-1 belief (the router sent the prefix
to m/0, whose engine has since evicted it or restarted) must not outvote what the engines report
(m/1 holds most of it), while a confirmed holder keeps tier 1's fresher view (a turn whose events
are still on their way). Where tier 2 knows nothing, tier 1 decides as before. Wired as the
router core wires them."""

from __future__ import annotations

import random
from typing import Any

from llmgw.route.kv_scorer import KvCacheScorer
from llmgw.route.prefix_scorer import PrefixRouting
from llmgw.route.scheduler import Scheduler
from llmgw.route.strategies import PRESETS
from llmgw.route.types import EndpointView, RequestInfo

HEAD = b"system\0" + b"a long shared system prompt " * 80


def _eps() -> list[EndpointView]:
    return [EndpointView(id=f"m/{i}", model="m", url=f"http://e{i}", running=0.0, waiting=0.0,
                         kv_usage=0.1, stale=False) for i in range(3)]


def _fleet(held: dict[str, int]) -> tuple[Scheduler, PrefixRouting]:
    prefix = PrefixRouting()
    kv = KvCacheScorer(lambda h: held)
    prefix.defer = kv.verdict  # as llmgw.route.dispatch.RouterCore wires them
    sched = Scheduler(scorers={**prefix.scorers(), "kv_cache": kv})
    # tier 1 learns that m/0 was sent the head
    first = sched.decide(RequestInfo("r0", "m", "m", head=HEAD), _eps()[:1], PRESETS["chat"], now=0.0,
                         wall=0.0, rng=random.Random(1))
    assert first.chosen == "m/0"
    return sched, prefix


def test_a_stale_tier_1_belief_does_not_outvote_the_engines_events() -> None:
    sched, prefix = _fleet({"m/1": 40})  # m/0's engine no longer holds it; m/1's holds 40 of 70 blocks
    d = sched.decide(RequestInfo("r1", "m", "m", head=HEAD, kv_hashes=tuple(range(70))), _eps(), PRESETS["chat"],
                     now=1.0, wall=1.0, rng=random.Random(1))
    assert d.chosen == "m/1", d.note
    assert "tier 2: 40/70 blocks on m/1" in d.note and "tier 1 voted where tier 2 confirms" in d.note
    # tier 1's vote is tier 2's verdict: the affinity keeps both tiers' weight
    assert {c.endpoint_id: (c.scores["prefix"], c.scores["kv_cache"]) for c in d.candidates} == \
        {"m/0": (0.0, 0.0), "m/1": (40 / 70, 40 / 70), "m/2": (0.0, 0.0)}
    assert prefix.deferred == 1


def test_a_confirmed_holder_keeps_tier_1s_fresher_view() -> None:
    # m/0's engine reports 10 of 70 blocks (its last turn's events are not in yet), m/1's 40:
    # tier 1 knows m/0 was sent the whole head, and m/0's engine confirms holding its start
    sched, _ = _fleet({"m/0": 10, "m/1": 40})
    d = sched.decide(RequestInfo("r1", "m", "m", head=HEAD, kv_hashes=tuple(range(70))), _eps(), PRESETS["chat"],
                     now=1.0, wall=1.0, rng=random.Random(1))
    scores = {c.endpoint_id: c.scores["prefix"] for c in d.candidates}
    assert scores["m/0"] > 0.9 and scores["m/1"] == 40 / 70 and scores["m/2"] == 0.0


def test_where_tier_2_knows_no_holder_tier_1_decides() -> None:
    sched, prefix = _fleet({})
    d = sched.decide(RequestInfo("r1", "m", "m", head=HEAD, kv_hashes=tuple(range(70))), _eps(), PRESETS["chat"],
                     now=1.0, wall=1.0, rng=random.Random(1))
    assert d.chosen == "m/0" and "prefix hit" in d.note and "voted where" not in d.note
    assert "no candidate holds the first of 70 blocks; tier 1 decides" in d.note and prefix.deferred == 0


def test_without_hashes_tier_1_is_untouched() -> None:
    sched, prefix = _fleet({"m/1": 40})
    d = sched.decide(RequestInfo("r1", "m", "m", head=HEAD), _eps(), PRESETS["chat"], now=1.0, wall=1.0,
                     rng=random.Random(1))
    assert d.chosen == "m/0" and prefix.deferred == 0


# -- where no candidate holds the first block (issue 21 item 18) --------------------------------------
def _fleet_with_alarm(held: dict[str, int], alarmed: set[str]) -> tuple[Scheduler, PrefixRouting]:
    prefix = PrefixRouting()
    kv = KvCacheScorer(lambda h: held)
    kv.alarmed = alarmed.__contains__
    prefix.defer, prefix.deny = kv.verdict, kv.denied  # as llmgw.route.dispatch.RouterCore wires them
    sched = Scheduler(scorers={**prefix.scorers(), "kv_cache": kv})
    first = sched.decide(RequestInfo("r0", "m", "m", head=HEAD), _eps()[:1], PRESETS["chat"], now=0.0,
                         wall=0.0, rng=random.Random(1))
    assert first.chosen == "m/0"
    return sched, prefix


def test_a_cleared_engines_events_void_tier_1s_belief_about_it() -> None:
    # every engine publishes events; m/0's was cleared (reset_prefix_cache): it holds none of it
    sched, prefix = _fleet_with_alarm({"m/0": 0, "m/1": 0, "m/2": 0}, set())
    d = sched.decide(RequestInfo("r1", "m", "m", head=HEAD, kv_hashes=tuple(range(70))), _eps(), PRESETS["chat"],
                     now=1.0, wall=1.0, rng=random.Random(1))
    assert {c.endpoint_id: c.scores["prefix"] for c in d.candidates} == {"m/0": 0.0, "m/1": 0.0, "m/2": 0.0}
    assert "tier 1 set aside on m/0: its engine's KV events show no first block" in d.note, d.note
    assert "no candidate holds the first of 70 blocks; tier 1 decides" in d.note
    flags = {c.endpoint_id: c.flags for c in d.candidates}
    assert any("belief set aside" in f for f in flags["m/0"]), flags
    assert prefix.set_aside == 1 and prefix.deferred == 0


def test_tier_1_keeps_its_belief_where_the_engine_says_nothing_trustworthy() -> None:
    # m/0 never reported a block (not in the index), or its parity alarm is on: its silence says nothing
    for held, alarmed in (({"m/1": 0, "m/2": 0}, set()), ({"m/0": 0, "m/1": 0, "m/2": 0}, {"m/0"})):
        sched, prefix = _fleet_with_alarm(held, alarmed)
        d = sched.decide(RequestInfo("r1", "m", "m", head=HEAD, kv_hashes=tuple(range(70))), _eps(),
                         PRESETS["chat"], now=1.0, wall=1.0, rng=random.Random(1))
        assert d.chosen == "m/0" and "set aside" not in d.note and prefix.set_aside == 0, d.note
        assert {c.endpoint_id: c.scores["prefix"] for c in d.candidates}["m/0"] > 0.9


def test_a_burst_of_one_new_prompt_follows_its_first_request_while_its_events_are_due() -> None:
    """The events' lag: the first request of a new prompt went to X, whose engine's events about it
    are not in yet. X's silence then says nothing — while the request runs there and a settle time
    after it ended — so the repeats follow it instead of being placed by load; after that, or once
    the index showed X holding it, silence is a clear or an eviction and sets tier 1's belief aside."""
    held = {"m/0": 0, "m/1": 0, "m/2": 0}  # every engine publishes events; none has reported this prompt
    prefix = PrefixRouting()
    kv = KvCacheScorer(lambda h: held)
    prefix.defer, prefix.deny = kv.verdict, kv.denied  # as llmgw.route.dispatch.RouterCore wires them
    sched = Scheduler(scorers={**prefix.scorers(), "kv_cache": kv})
    n = iter(range(100))

    def ask(now: float, *, end: float | None = None) -> Any:
        req = RequestInfo(f"r{next(n)}", "m", "m", head=HEAD, kv_hashes=tuple(range(70)))
        d = sched.decide(req, _eps(), PRESETS["chat"], now=now, wall=now, rng=random.Random(1))
        if end is not None:
            kv.ended(d.chosen, req, end)  # as the router core's finish does
        return d

    x = ask(0.0, end=0.2).chosen  # a cold prompt, placed by load
    running = ask(0.1)  # while the first runs: tier 1's belief stands
    assert running.chosen == x and "set aside" not in running.note, running.note
    kv.ended(x, RequestInfo("r1", "m", "m", head=HEAD, kv_hashes=tuple(range(70))), 0.3)
    d = ask(2.0, end=2.1)  # within the settle time (2 s) after the last end
    assert d.chosen == x and "set aside" not in d.note and kv.awaited == 2, d.note
    d = ask(4.2)  # due since 4.1 and still silent: the engine dropped it
    assert f"tier 1 set aside on {x}" in d.note, d.note
    assert prefix.set_aside == 1

    # once the index showed the holder, a later silence counts at once
    held[x] = 70
    y = ask(10.0, end=10.1)
    assert y.chosen == x and f"tier 2: 70/70 blocks on {x}" in y.note, y.note
    held[x] = 0  # cleared (reset_prefix_cache) straight after
    d = ask(10.2)
    assert f"tier 1 set aside on {x}" in d.note, d.note
    assert len(kv.sends) <= 2  # bounded: settled pairs leave


def test_recent_sends_hold_about_the_last_settle_time_of_sends() -> None:
    from llmgw.route.kv_scorer import RecentSends

    s = RecentSends(lag_s=2.0)
    for k in range(1000):  # a new prompt every 10 ms, each ended 5 ms after it was sent
        now = k * 0.01
        s.sent("m/0", k, now)
        s.ended("m/0", k, now + 0.005)
    assert len(s) <= 210  # ~2 s of sends, not all 1,000
    assert s.pending("m/0", 999, 10.0) and not s.pending("m/0", 0, 10.0)
    s.sent("m/1", 7, 20.0)  # running, never ended: due at most MAX_RUNNING_S
    assert s.pending("m/1", 7, 200.0) and not s.pending("m/1", 7, 321.0)
