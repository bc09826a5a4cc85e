"""The parity self-check's rules (llmgw.kv.parity), with an injected clock and index."""

from __future__ import annotations

import pytest

from llmgw.kv.parity import MAX_SERIES, ParityConfig, ParityTracker


class Index:
    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}

    def holds(self, replica: object, h: object) -> bool:
        return h in self.held.get(replica, set())  # type: ignore[arg-type]


def blocks(*hashes: int) -> list[tuple[str, int]]:
    return [("GPU", h) for h in hashes]


def tracker(**kw: float) -> tuple[ParityTracker, Index]:
    idx = Index()
    return ParityTracker(ParityConfig(**kw), holds=idx.holds), idx  # type: ignore[arg-type]


def test_blocks_reported_after_the_end_pass() -> None:
    t, _ = tracker()
    cid = t.open("r1", "m", [1, 2, 3], 0.0)
    t.end(cid, 0.5, ok=True)
    t.on_delta("r1", blocks(1, 2, 3), reset=False, now=0.6)
    rp = t.replicas["r1"]
    assert (rp.passed, rp.failed, rp.unknown) == (1, 0, 0) and rp.status == "ok"
    t.tick(100.0)  # nothing left to decide
    assert (rp.passed, rp.failed, rp.unknown) == (1, 0, 0)


def test_a_prefix_hit_passes_at_once_from_the_index() -> None:
    t, idx = tracker()
    idx.held["r1"] = {7}
    assert t.open("r1", "m", [7, 8], 0.0) is None
    assert t.replicas["r1"].passed == 1


def test_blocks_stored_then_evicted_while_the_request_ran_still_pass() -> None:
    t, _ = tracker()
    cid = t.open("r1", "m", [1, 2], 0.0)
    t.on_delta("r1", blocks(9, 1), reset=False, now=0.1)  # stored ...
    t.on_delta("r1", blocks(), reset=False, now=0.2)  # ... and evicted (removals do not matter)
    t.end(cid, 0.3, ok=True)
    t.tick(10.0)
    assert t.replicas["r1"].passed == 1 and t.replicas["r1"].failed == 0


def test_other_blocks_but_never_the_expected_fail_after_settling() -> None:
    t, _ = tracker(settle_s=2.0)
    cid = t.open("r1", "m", [1, 2], 0.0)
    t.end(cid, 1.0, ok=True)
    t.on_delta("r1", blocks(50, 51), reset=False, now=1.1)
    t.tick(2.9)
    assert t.replicas["r1"].failed == 0  # not settled yet
    t.tick(3.0)
    rp = t.replicas["r1"]
    assert (rp.passed, rp.failed, rp.unknown) == (0, 1, 0) and rp.status == "suspect"


def test_no_events_at_all_is_unknown_not_a_failure() -> None:
    t, _ = tracker()
    cid = t.open("r1", "m", [1, 2], 0.0)
    t.end(cid, 1.0, ok=True)
    t.on_delta("r1", blocks(), reset=False, now=1.5)  # a message with removals only
    t.tick(10.0)
    rp = t.replicas["r1"]
    assert (rp.passed, rp.failed, rp.unknown) == (0, 0, 1) and rp.status == "unchecked"


def test_a_reset_while_the_check_is_open_makes_it_unknown() -> None:
    t, _ = tracker()
    cid = t.open("r1", "m", [1, 2], 0.0)
    t.on_delta("r1", blocks(60), reset=True, now=0.5)  # a gap: the events it waited for may be lost
    t.end(cid, 1.0, ok=True)
    t.tick(10.0)
    assert t.replicas["r1"].unknown == 1 and t.replicas["r1"].failed == 0


def test_proven_hashes_survive_a_reset_so_a_full_hit_on_old_blocks_passes() -> None:
    t, idx = tracker()
    cid = t.open("r1", "m", [1, 2], 0.0)
    t.on_delta("r1", blocks(1, 2), reset=False, now=0.1)
    t.end(cid, 0.2, ok=True)
    # the index is cleared (a gap); the engine still holds 1, 2 and stores nothing new for them
    t.on_delta("r1", blocks(), reset=True, now=1.0)
    idx.held["r1"] = set()
    assert t.open("r1", "m", [1, 2, 3], 2.0) is None
    assert t.replicas["r1"].passed == 2


def test_a_failed_request_leaves_no_verdict() -> None:
    t, _ = tracker()
    cid = t.open("r1", "m", [1], 0.0)
    t.on_delta("r1", blocks(5), reset=False, now=0.1)
    t.end(cid, 0.2, ok=False)
    t.tick(100.0)
    rp = t.replicas["r1"]
    assert (rp.passed, rp.failed, rp.unknown) == (0, 0, 0) and not rp.open and not rp.by_hash


def test_the_alarm_goes_on_after_three_failures_in_a_row_and_off_at_a_pass() -> None:
    t, _ = tracker(settle_s=1.0)
    now = 0.0
    for i in range(3):
        cid = t.open("r1", "m", [100 + i], now)
        t.end(cid, now + 0.1, ok=True)
        t.on_delta("r1", blocks(200 + i), reset=False, now=now + 0.2)  # the engine's own (other) hashes
        now += 2.0
        t.tick(now)
        assert t.replicas["r1"].alarm == (i == 2)
    ch = t.take_changes()
    assert [(c.replica, c.model, c.on, c.failed_in_row) for c in ch] == [("r1", "m", True, 3)]
    assert t.replicas["r1"].status == "alarm" and t.replicas["r1"].mismatch_rate == 1.0
    cid = t.open("r1", "m", [300], now)
    t.on_delta("r1", blocks(300), reset=False, now=now + 0.1)
    assert not t.replicas["r1"].alarm
    assert [c.on for c in t.take_changes()] == [False]
    assert t.replicas["r1"].mismatch_rate == pytest.approx(0.75)


def test_unknown_verdicts_neither_raise_nor_clear_the_alarm() -> None:
    t, _ = tracker(settle_s=1.0, alarm_after=2)
    cid = t.open("r1", "m", [1], 0.0)
    t.end(cid, 0.0, ok=True)
    t.on_delta("r1", blocks(9), reset=False, now=0.1)
    t.tick(5.0)
    cid = t.open("r1", "m", [2], 5.0)
    t.end(cid, 5.0, ok=True)
    t.tick(10.0)  # no events: unknown
    assert t.replicas["r1"].fails_in_row == 1 and not t.replicas["r1"].alarm
    cid = t.open("r1", "m", [3], 10.0)
    t.end(cid, 10.0, ok=True)
    t.on_delta("r1", blocks(8), reset=False, now=10.1)
    t.tick(20.0)
    assert t.replicas["r1"].alarm


def test_open_checks_per_replica_are_bounded() -> None:
    t, _ = tracker(max_checks_per_replica=4, max_expected=2)
    for i in range(10):
        t.open("r1", "m", [i * 10, i * 10 + 1, i * 10 + 2], 0.0)
    rp = t.replicas["r1"]
    assert len(rp.open) == 4 and rp.unknown == 6
    assert sum(len(s) for s in rp.by_hash.values()) == 8  # two hashes kept per check


def test_forget_drops_the_checks_and_alarm_but_keeps_the_totals() -> None:
    t, _ = tracker(alarm_after=1, settle_s=1.0)
    cid = t.open("r1", "m", [1], 0.0)
    t.end(cid, 0.0, ok=True)
    t.on_delta("r1", blocks(2), reset=False, now=0.1)
    t.tick(2.0)
    assert t.replicas["r1"].alarm
    t.take_changes()
    t.open("r1", "m", [5], 2.0)
    t.forget("r1")
    rp = t.replicas["r1"]
    assert not rp.alarm and not rp.open and rp.failed == 1 and rp.forgotten
    assert [(c.on, c.forgotten) for c in t.take_changes()] == [(False, True)]
    assert t.totals_by_model() == {"m": (0, 1, 0)}


def test_replica_series_are_bounded() -> None:
    t, _ = tracker()
    for i in range(MAX_SERIES + 10):
        t.open(f"r{i}", "m", [1], 0.0)
        t.forget(f"r{i}")
    assert len(t.replicas) <= MAX_SERIES
