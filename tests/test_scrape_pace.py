"""The idle-interval state machine of the scrape loop (llmgw.route.scrape_pace), on an injected
clock: an idle replica is read less often, up to a bound that keeps its reading fresh; any
request, scrape_soon (hurry) or change returns it to the normal cadence."""

from __future__ import annotations

import pytest

from llmgw.route.scrape_pace import ScrapePace, idle_max


def _rounds(pace: ScrapePace, rid: str, start: float, end: float, *, quiet: bool = True, step: float = 1.0,
            inflight: int = 0, completed: int = 0, latency: float = 0.0) -> list[float]:
    """Run the loop's rounds every `step` from `start` to `end`; the times the replica was read."""
    reads, now = [], start
    while now < end:
        if pace.due(rid, now, inflight, completed):
            reads.append(now)
            pace.read(rid, now + latency, quiet=quiet, completed=completed)
        now += step
    return reads


def test_the_bound_keeps_an_idle_reading_fresh() -> None:
    assert idle_max(1.0, 4.0, 5.0) == 3.0  # the defaults: 4 x 1 s, but stale after 5 s
    assert idle_max(1.0, 4.0, 60.0) == 4.0
    assert idle_max(0.25, 4.0, 5.0) == 1.0
    assert idle_max(1.0, 1.0, 60.0) == 1.0  # factor 1: always the interval
    assert idle_max(1.0, 4.0, 2.5) == 1.0  # no room before staleness: never slower
    assert idle_max(1.0, 2.5, 60.0) == 2.0  # whole rounds


def test_a_new_replica_is_read_at_once_and_then_every_round_while_not_quiet() -> None:
    pace = ScrapePace(1.0, 4.0, 60.0)
    assert pace.due("a", 0.0, 0, 0)
    assert _rounds(pace, "a", 0.0, 5.0, quiet=False) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert pace.gap("a") == 1.0


def test_quiet_readings_double_the_gap_up_to_the_bound() -> None:
    pace = ScrapePace(1.0, 4.0, 60.0)
    reads = _rounds(pace, "a", 0.0, 20.0)
    assert reads == [0.0, 2.0, 6.0, 10.0, 14.0, 18.0]  # gaps 2, 4, 4, ...
    assert pace.gap("a") == 4.0


def test_with_the_default_staleness_an_idle_reading_never_goes_stale() -> None:
    interval, stale_after = 1.0, 5.0
    pace = ScrapePace(interval, 4.0, stale_after)
    # The loop: a round reads the replicas due, waits for all of them (a slow one takes up to 1.2
    # intervals here), then sleeps an interval. Every reading of this replica lands before the
    # last one is stale_after old.
    start, last, reads = 0.0, None, 0
    for k in range(300):
        took = 1.2 * interval if k % 5 == 0 else 0.01  # another replica's slow read
        if pace.due("a", start, 0, 0):
            done = start + 0.01
            if last is not None:
                assert done - last <= stale_after, (k, last, done)
            pace.read("a", done, quiet=True, completed=0)
            last, reads = done, reads + 1
        start += took + interval
    assert reads < 300 / 2  # and it was read less often


def test_a_request_on_the_replica_returns_it_to_every_round() -> None:
    pace = ScrapePace(1.0, 4.0, 60.0)
    _rounds(pace, "a", 0.0, 20.0)
    assert pace.gap("a") == 4.0
    assert not pace.due("a", 19.0, 0, 0)
    assert pace.due("a", 19.0, 1, 0)  # a request of ours in flight there
    assert pace.due("a", 19.0, 0, 1)  # or one finished since the last reading
    pace.read("a", 19.0, quiet=False, completed=1)  # the caller: not quiet while our requests run
    assert pace.gap("a") == 1.0 and pace.due("a", 20.0, 0, 1)


def test_a_change_or_a_failure_returns_it_to_the_interval() -> None:
    pace = ScrapePace(1.0, 4.0, 60.0)
    _rounds(pace, "a", 0.0, 20.0)
    pace.read("a", 20.0, quiet=False, completed=0)  # its gauges moved, or the read failed
    assert pace.gap("a") == 1.0
    assert _rounds(pace, "a", 21.0, 24.0, quiet=False) == [21.0, 22.0, 23.0]


def test_hurry_makes_every_replica_due_now_at_the_normal_cadence() -> None:
    pace = ScrapePace(1.0, 4.0, 60.0)
    for rid in ("a", "b"):
        _rounds(pace, rid, 0.0, 20.0)
    assert not pace.due("a", 19.0, 0, 0) and not pace.due("b", 19.0, 0, 0)
    pace.hurry()  # a request waits for room (scrape_soon)
    assert pace.due("a", 19.0, 0, 0) and pace.due("b", 19.0, 0, 0)
    assert pace.gap("a") == pace.gap("b") == 1.0
    pace.read("a", 19.0, quiet=True, completed=0)
    assert pace.gap("a") == 2.0  # quiet again: it slows down again from the interval


def test_the_slow_round_comes_every_ten_intervals_whatever_the_pace() -> None:
    pace = ScrapePace(1.0, 4.0, 60.0)
    slow = []
    now = 0.0
    while now < 40.0:
        if pace.due("a", now, 0, 0):
            if pace.models_due("a", now):
                slow.append(now)
            pace.read("a", now, quiet=True, completed=0)
        now += 1.0
    assert slow[0] == 0.0
    gaps = [b - a for a, b in zip(slow, slow[1:])]
    assert gaps and all(10.0 <= g <= 10.0 + 4.0 for g in gaps)  # at the first reading 10 intervals on


def test_a_replica_that_left_is_forgotten() -> None:
    pace = ScrapePace(1.0, 4.0, 60.0)
    _rounds(pace, "a", 0.0, 10.0)
    _rounds(pace, "b", 0.0, 10.0)
    pace.keep({"b"})
    assert pace.gap("a") == 1.0 and pace.due("a", 10.5, 0, 0)  # as new, if it comes back
    assert pace.gap("b") == 4.0


@pytest.mark.parametrize("factor,every", [(1.0, 1), (1.5, 1), (2.0, 2), (2.9, 2), (3.0, 3)])
def test_the_factor_counts_whole_rounds(factor: float, every: int) -> None:
    pace = ScrapePace(1.0, factor, 60.0)
    reads = _rounds(pace, "a", 0.0, 40.0)
    assert reads[-1] - reads[-2] == every
