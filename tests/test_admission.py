"""Admission control's pure part: concurrency caps and the FIFO wait queue."""

from __future__ import annotations

import pytest

from llmgw.route.admission import ConcurrencyCaps, WaitQueue, suggest_retry_after


# -- caps ------------------------------------------------------------------------------------
def test_try_reserve_checks_and_increments_in_one_call() -> None:
    caps = ConcurrencyCaps()
    caps.set_cap("a", 2)
    assert caps.try_reserve("a") and caps.try_reserve("a")
    assert not caps.try_reserve("a")
    assert caps.inflight("a") == 2 and not caps.has_room("a")
    caps.release("a")
    assert caps.has_room("a") and caps.try_reserve("a")
    assert caps.snapshot()["rejected_total"] == 1


def test_unlimited_and_default_caps() -> None:
    caps = ConcurrencyCaps(default_cap=1)
    caps.set_cap("free", None)
    assert all(caps.try_reserve("free") for _ in range(100))
    assert caps.try_reserve("b") and not caps.try_reserve("b")
    assert caps.cap("b") == 1 and caps.cap("free") is None


def test_lowering_a_cap_below_inflight_blocks_until_drained() -> None:
    caps = ConcurrencyCaps()
    for _ in range(3):
        assert caps.try_reserve("a")
    caps.set_cap("a", 1)
    assert not caps.try_reserve("a")
    caps.release("a")
    caps.release("a")
    assert not caps.try_reserve("a")
    caps.release("a")
    assert caps.try_reserve("a")


def test_over_release_is_counted_not_negative() -> None:
    caps = ConcurrencyCaps()
    caps.release("a")
    assert caps.inflight("a") == 0 and caps.snapshot()["over_released_total"] == 1
    assert caps.try_reserve("a") and caps.inflight("a") == 1


# -- wait queue ------------------------------------------------------------------------------
def test_fifo_and_full() -> None:
    q = WaitQueue(max_size=3)
    tickets = [q.enqueue(f"r{i}", deadline=100.0, now=0.0) for i in range(3)]
    assert all(t is not None for t in tickets)
    assert q.enqueue("r3", deadline=100.0) is None  # full: the caller answers 429
    assert [t.request_id for t in q.on_capacity(2)] == ["r0", "r1"]  # type: ignore[union-attr]
    assert [t.request_id for t in q.on_capacity(5)] == ["r2"]
    assert q.on_capacity() == [] and len(q) == 0
    snap = q.snapshot()
    assert snap["enqueued_total"] == 3 and snap["rejected_full_total"] == 1 and snap["admitted_total"] == 3


def test_on_capacity_respects_saturation() -> None:
    q = WaitQueue(max_size=10)
    q.enqueue("a", 10.0)
    assert q.on_capacity(1, saturated=True) == []
    assert q.on_capacity(1, saturated=lambda: True) == []
    assert [t.request_id for t in q.on_capacity(1, saturated=lambda: False)] == ["a"]


def test_admit_now_never_overtakes_waiters() -> None:
    q = WaitQueue(max_size=10)
    assert q.admit_now(False) and q.admit_now(lambda: False)
    assert not q.admit_now(True)
    q.enqueue("a", 10.0)
    assert not q.admit_now(False)  # someone is waiting: join the queue


def test_expire_returns_deadline_passed_in_deadline_order() -> None:
    q = WaitQueue(max_size=10)
    a = q.enqueue("a", deadline=5.0)
    b = q.enqueue("b", deadline=2.0)
    c = q.enqueue("c", deadline=9.0)
    assert q.next_deadline() == 2.0
    assert q.expire(1.9) == []
    assert q.expire(5.0) == [b, a]
    assert len(q) == 1 and q.next_deadline() == 9.0
    assert q.on_capacity() == [c]
    assert q.next_deadline() is None


def test_cancel_and_requeue_keep_order() -> None:
    q = WaitQueue(max_size=3)
    a, b, c = (q.enqueue(x, 50.0) for x in "abc")
    assert b is not None and q.cancel(b) and not q.cancel(b)
    assert b not in q and len(q) == 2
    assert q.expire(60.0) == [a, c]  # the cancelled ticket's heap entry is skipped
    q2 = WaitQueue(max_size=2)
    x, y = q2.enqueue("x", 50.0), q2.enqueue("y", 50.0)
    got = q2.on_capacity()
    assert got == [x]
    q2.enqueue("z", 50.0)
    q2.requeue(x)  # woken but found no room: back at the head, even past max_size
    assert [t.request_id for t in q2] == ["x", "y", "z"]
    assert [t.request_id for t in q2.on_capacity(3)] == ["x", "y", "z"]
    assert q2.snapshot()["requeued_total"] == 1 and q2.snapshot()["admitted_total"] == 3


def test_requeue_order_strictly_by_arrival() -> None:
    q = WaitQueue(max_size=5)
    ts = [q.enqueue(str(i), 50.0) for i in range(4)]
    first_two = q.on_capacity(2)
    q.requeue(first_two[1])
    q.requeue(first_two[0])
    assert [t.request_id for t in q] == ["0", "1", "2", "3"]
    assert q.expire(50.0) == ts  # deadline ties break by arrival


def test_zero_size_queue_refuses_at_once() -> None:
    q = WaitQueue(max_size=0)
    assert q.enqueue("a", 1.0) is None


def test_heap_is_compacted() -> None:
    q = WaitQueue(max_size=10)
    for i in range(1000):
        t = q.enqueue(str(i), 1e9)
        assert t is not None
        q.cancel(t)
    assert len(q._deadlines) < 200  # noqa: SLF001


def test_snapshot_oldest_wait() -> None:
    q = WaitQueue(max_size=10)
    q.enqueue("a", 100.0, now=10.0)
    q.enqueue("b", 100.0, now=12.0)
    snap = q.snapshot(now=15.0)
    assert snap["length"] == 2 and snap["oldest_wait"] == 5.0 and snap["next_deadline"] == 100.0


# -- Retry-After -----------------------------------------------------------------------------
@pytest.mark.parametrize(("qlen", "rate", "want"), [
    (0, 10.0, 1),  # drains at once: at least 1
    (9, 2.0, 5),  # (9 + 1) / 2
    (10, 2.0, 6),  # ceil(11 / 2)
    (1000, 1.0, 60),  # capped
    (5, 0.0, 60),  # nothing is finishing
    (5, None, 5),  # unknown rate: the default
    (5, float("nan"), 5),
])
def test_suggest_retry_after(qlen: int, rate: float | None, want: int) -> None:
    assert suggest_retry_after(qlen, rate) == want


def test_queue_retry_after_uses_its_length() -> None:
    q = WaitQueue(max_size=100)
    for i in range(19):
        q.enqueue(str(i), 100.0)
    assert q.retry_after(4.0) == 5
    assert q.retry_after(None, default=3) == 3
