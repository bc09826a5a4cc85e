"""Rate-limited logging of repeating faults (llmgw.daemon.net.log_limit): one line when a fault
starts, then at most one per interval, failures and recoveries alike, each with the count of
failures not logged; a fault that flaps logs no more than one that persists."""

from __future__ import annotations

from llmgw.daemon.net.log_limit import LogLimiter, repeats


def test_a_persistent_fault_logs_once_an_interval_with_the_count() -> None:
    lim = LogLimiter(60)
    assert lim.hit("r", 0) == 0  # it starts: a line
    assert [lim.hit("r", t) for t in range(1, 60)] == [None] * 59
    assert lim.hit("r", 60) == 59  # the next line says how many were quiet
    assert repeats(59) == " (59 more failures since the last report)" and repeats(0) == ""


def test_a_flapping_fault_logs_no_more_than_a_persistent_one() -> None:
    lim = LogLimiter(60)
    lines = 0
    for t in range(0, 600, 2):  # fails, then works, every second
        lines += lim.hit("r", t) is not None
        lines += lim.clear("r", t + 1) is not None
    assert lines <= 11


def test_a_recovery_is_logged_when_due_and_keys_are_forgotten() -> None:
    lim = LogLimiter(60)
    assert lim.clear("r", 0) is None  # never failed: nothing to say
    lim.hit("r", 0)
    lim.hit("r", 10)
    assert lim.clear("r", 100) == 1  # recovered, with the one failure not logged
    assert lim.clear("r", 101) is None
    assert lim.hit("r", 200) == 0
    lim.hit("gone", 0)
    lim.keep({"r"})
    assert set(lim.faults) == {"r"}
