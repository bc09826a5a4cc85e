"""The console's adapters view, without a terminal: the event stream's `adapters` section in the
state, and the rows (which replica holds which adapter, loads in progress, failed loads)."""

from __future__ import annotations

from llmgw.tui.adapter_rows import adapter_rows, adapter_summary_lines
from llmgw.tui.state import ConsoleState

ADAPTERS = {
    "replicas": [
        {"replica": "m/0", "model": "m", "cap": 2, "used": 2, "failed": [],
         "adapters": [{"adapter": "sql", "state": "loaded", "inflight": 3, "idle_s": 0.0},
                      {"adapter": "chat", "state": "loading", "inflight": 0, "idle_s": None, "waiting": 7,
                       "unloading": "old"}]},
        {"replica": "m/1", "model": "m", "cap": 2, "used": 0, "adapters": [],
         "failed": [{"adapter": "bad", "reason": "No adapter found for /x", "failures": 2, "retry_in_s": 75}]},
        {"replica": "m/2", "model": "m", "cap": 2, "used": 1, "failed": [],
         "adapters": [{"adapter": "static", "state": "pinned", "inflight": 0, "idle_s": None}]},
    ],
    "loads": {"ok": 4, "failed": 2, "timeout": 0, "not_listed": 0}, "unloads": {"ok": 1, "failed": 0}, "waiting": 7,
}
ENDPOINTS = [{"id": f"m/{i}", "model": "m"} for i in range(3)]


def state_with(adapters: object) -> ConsoleState:
    s = ConsoleState()
    changed = s.apply({"type": "snapshot", "rev": 1, "endpoints": ENDPOINTS, "adapters": adapters})
    assert "adapters" in changed
    return s


def test_the_adapters_section_arrives_in_snapshots_and_updates() -> None:
    s = state_with(ADAPTERS)
    assert s.adapters["waiting"] == 7
    assert s.apply({"type": "update", "rev": 2, "adapters": {"replicas": [], "waiting": 0}}) == {"adapters"}
    assert s.adapters == {"replicas": [], "waiting": 0}
    assert state_with(["not", "a", "dict"]).adapters == {}  # a malformed section is ignored


def test_rows_show_who_holds_what_loads_in_progress_and_failures() -> None:
    rows = adapter_rows(state_with(ADAPTERS))
    cells = [r.cells for r in rows]
    assert cells[0] == ("m/0", "m", "2/2", "sql", "loaded", "3", "0s", "")
    assert cells[1] == ("m/0", "m", "2/2", "chat", "loading", "0", "-", "7 waiting, unloading old")
    assert cells[2][:5] == ("m/1", "m", "0/2", "bad", "failed")
    assert cells[2][7] == "retry in 1m15s (2x): No adapter found for /x"
    assert cells[3][3:5] == ("static", "pinned")
    assert [r.tone for r in rows] == ["good", "busy", "bad", "dim"]
    assert len({r.key for r in rows}) == len(rows)
    assert [r.cells[3] for r in adapter_rows(state_with(ADAPTERS), "m/1")] == ["bad"]
    assert [r.cells[3] for r in adapter_rows(state_with(ADAPTERS), "chat")] == ["chat"]


def test_a_replica_that_left_is_not_shown_and_an_empty_one_shows_its_slots() -> None:
    s = state_with({"replicas": [{"replica": "m/0", "model": "m", "cap": 4, "used": 0, "adapters": [],
                                  "failed": []},
                                 {"replica": "gone/0", "model": "gone", "cap": 4, "used": 1, "adapters": [],
                                  "failed": []}]})
    assert [r.cells[:4] for r in adapter_rows(s)] == [("m/0", "m", "0/4", "-")]


def test_summary_line() -> None:
    assert adapter_summary_lines(state_with(ADAPTERS)) == [
        "loads: ok 4, failed 2 · unloads to make room: ok 1 · requests waiting for a load: 7"]
    assert adapter_summary_lines(ConsoleState()) == ["no adapter summary yet"]
