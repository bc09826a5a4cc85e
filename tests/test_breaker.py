"""The per-endpoint breaker, with explicit times (it never reads a clock)."""

from __future__ import annotations

import pytest

from llmgw.route.breaker import (CLOSED, HALF_OPEN, OPEN, Breaker, BreakerConfig, FailureKind, Permit)


def make(**kw: object) -> Breaker:
    return Breaker(BreakerConfig(**kw))  # type: ignore[arg-type]


def test_threshold_one_is_a_plain_cooldown() -> None:
    b = make(failure_threshold=1, base_cooldown=10.0)
    assert b.allow(0.0) is Permit.PASS
    assert b.on_failure(1.0, "connect") is True
    assert b.state == OPEN and b.retry_at == 11.0
    assert not b.can_pass(10.999) and b.allow(10.999) is Permit.DENY
    assert b.can_pass(11.0)
    assert b.allow(11.0) is Permit.PROBE and b.state == HALF_OPEN
    b.on_success(11.5)
    assert b.state == CLOSED and b.retry_at is None
    assert b.allow(11.6) is Permit.PASS


def test_consecutive_failures_open_and_success_resets_the_count() -> None:
    b = make(failure_threshold=3)
    b.on_failure(0, FailureKind.HTTP_5XX)
    b.on_failure(1, FailureKind.TIMEOUT)
    b.on_success(2)  # breaks the run
    b.on_failure(3, FailureKind.RESET)
    b.on_failure(4, FailureKind.CONNECT)
    assert b.state == CLOSED
    b.on_failure(5, FailureKind.CONNECT)
    assert b.state == OPEN and b.retry_at == 5 + b.cfg.base_cooldown


def test_backoff_doubles_and_caps_and_success_resets() -> None:
    b = make(failure_threshold=1, base_cooldown=5.0, backoff_factor=2.0, max_cooldown=30.0)
    b.on_failure(0.0, "5xx")
    seen = [b.cooldown]
    now = 0.0
    for _ in range(5):  # each failed probe re-opens with a longer cooldown
        now = b.retry_at  # type: ignore[assignment]
        assert b.allow(now) is Permit.PROBE
        b.on_failure(now + 0.1, "timeout")
        assert b.state == OPEN
        assert b.retry_at == pytest.approx(now + 0.1 + b.cooldown)
        seen.append(b.cooldown)
    assert seen == [5.0, 10.0, 20.0, 30.0, 30.0, 30.0]
    now = b.retry_at  # type: ignore[assignment]
    assert b.allow(now) is Permit.PROBE
    b.on_success(now + 1)
    assert b.state == CLOSED and b.cooldown == 5.0
    b.on_failure(now + 2, "connect")  # the next trip starts from the base again
    assert b.retry_at == pytest.approx(now + 2 + 5.0)


def test_half_open_admits_exactly_n_probes() -> None:
    b = make(failure_threshold=1, base_cooldown=1.0, half_open_max_probes=3, success_to_close=3)
    b.on_failure(0.0, "connect")
    grants = [b.allow(1.0 + i * 0.01) for i in range(6)]
    assert grants == [Permit.PROBE] * 3 + [Permit.DENY] * 3
    assert b.probes_in_flight == 3 and not b.can_pass(1.1)
    b.release_probe()  # a cancelled probe gives its slot back, no verdict
    assert b.state == HALF_OPEN and b.can_pass(1.1)
    assert b.allow(1.1) is Permit.PROBE and b.allow(1.1) is Permit.DENY


def test_success_needed_to_close() -> None:
    b = make(failure_threshold=1, base_cooldown=1.0, half_open_max_probes=1, success_to_close=2)
    b.on_failure(0, "connect")
    assert b.allow(1) is Permit.PROBE
    b.on_success(2)
    assert b.state == HALF_OPEN  # one of two
    assert b.allow(2) is Permit.PROBE
    b.on_success(3)
    assert b.state == CLOSED


def test_failure_in_half_open_reopens_with_a_longer_cooldown() -> None:
    b = make(failure_threshold=2, base_cooldown=4.0, backoff_factor=3.0, max_cooldown=100.0,
             half_open_max_probes=2, success_to_close=2)
    b.on_failure(0, "5xx")
    b.on_failure(0, "5xx")
    assert b.retry_at == 4.0
    assert b.allow(4.0) is Permit.PROBE and b.allow(4.0) is Permit.PROBE
    b.on_success(5.0)  # one success is not enough…
    b.on_failure(6.0, "reset")  # …and one failure re-opens at once
    assert b.state == OPEN and b.cooldown == 12.0 and b.retry_at == 18.0
    assert b.probes_in_flight == 0
    b.on_success(7.0)  # the other probe's late verdict while open: ignored
    assert b.state == OPEN and b.retry_at == 18.0


def test_non_counting_kinds_do_not_trip_and_free_a_probe() -> None:
    b = make(failure_threshold=1, base_cooldown=1.0)
    for kind in (FailureKind.SCRAPE, FailureKind.CLIENT_4XX, FailureKind.CLIENT_CANCEL, "4xx", "cancel"):
        assert b.on_failure(0, kind) is False
    assert b.state == CLOSED and b.snapshot()["failures_total"] == 0
    b.on_failure(0, "connect")
    assert b.allow(1) is Permit.PROBE and not b.can_pass(1)
    assert b.on_failure(1.5, "4xx") is False  # the engine answered: no verdict, slot back
    assert b.state == HALF_OPEN and b.allow(1.6) is Permit.PROBE
    with pytest.raises(ValueError):
        b.on_failure(2, "bogus")


def test_can_pass_has_no_side_effects() -> None:
    b = make(failure_threshold=1, base_cooldown=1.0)
    b.on_failure(0, "connect")
    for _ in range(3):
        assert b.can_pass(5.0)
    assert b.state == OPEN and b.probes_in_flight == 0


def test_stale_probe_slot_is_reclaimed() -> None:
    b = make(failure_threshold=1, base_cooldown=1.0, probe_stale_after=60.0)
    b.on_failure(0, "connect")
    assert b.allow(1) is Permit.PROBE
    assert b.allow(60.9) is Permit.DENY and not b.can_pass(60.9)
    assert b.can_pass(61.0) and b.allow(61.0) is Permit.PROBE


def test_verdicts_while_open_are_ignored_and_do_not_extend() -> None:
    b = make(failure_threshold=1, base_cooldown=10.0)
    b.on_failure(0, "connect")
    b.on_failure(5, "connect")  # a request admitted before the trip
    b.on_success(6)
    assert b.state == OPEN and b.retry_at == 10.0


def test_permit_is_truthy_like_a_bool() -> None:
    b = make(failure_threshold=1, base_cooldown=10.0)
    assert b.allow(0)
    b.on_failure(0, "connect")
    assert not b.allow(1)


def test_reset_trip_and_snapshot() -> None:
    b = make(failure_threshold=1, base_cooldown=2.0)
    b.trip(3.0, cooldown=7.0)
    snap = b.snapshot()
    assert snap["state"] == "open" and snap["retry_at"] == 10.0 and snap["opened_total"] == 1
    b.reset(4.0)
    assert b.state == CLOSED and b.cooldown == 2.0
    b.on_failure(5.0, "timeout")
    snap = b.snapshot()
    assert snap["last_failure"] == "timeout" and snap["last_failure_at"] == 5.0
    assert set(snap) >= {"consecutive_failures", "probes_in_flight", "half_open_successes", "changed_at",
                         "successes_total"}


def test_config_is_validated() -> None:
    for bad in ({"failure_threshold": 0}, {"base_cooldown": 10, "max_cooldown": 5}, {"backoff_factor": 0.5},
                {"half_open_max_probes": 0}, {"success_to_close": 0}):
        with pytest.raises(ValueError):
            BreakerConfig(**bad)  # type: ignore[arg-type]


def test_force_probes_early_but_keeps_the_probe_limit() -> None:
    b = make(failure_threshold=1, base_cooldown=10.0, backoff_factor=2.0)
    b.on_failure(0, "connect")
    assert b.allow(1.0) is Permit.DENY
    assert b.allow(1.0, force=True) is Permit.PROBE and b.state == HALF_OPEN
    assert b.allow(1.0, force=True) is Permit.DENY  # one probe at a time, forced or not
    b.on_failure(2.0, "connect")
    assert b.state == OPEN and b.retry_at == 22.0
