"""The console's pure core: applying event-stream lines, and the rows, rationale and banner the
views show, without a terminal."""

from __future__ import annotations

import asyncio
from datetime import UTC
from typing import Any

import pytest

from llmgw.tui.client import AdminRefused, Backoff, DaemonUnreachable, follow
from llmgw.tui.labels import parse_label_edit
from llmgw.tui.cache_rows import cache_model_rows, cache_replica_rows, cache_total_lines
from llmgw.tui.rows import (
    banner_text,
    decision_rows,
    decisions_caption,
    fmt_age,
    fmt_us,
    matches,
    model_rows,
    node_detail,
    node_rows,
    rationale,
    replica_detail,
    replica_rows,
    sparkline,
    status_line,
)
from llmgw.tui.state import ConsoleState
from tests.test_console_fakes import (
    DECISIONS,
    LIVE_DECISIONS,
    WHERE,
    Connection,
    FakeClient,
    decision,
    snapshot,
    stream,
)


def loaded() -> ConsoleState:
    s = ConsoleState()
    for line in stream():
        s.apply(line)
    return s


# -- applying the stream --------------------------------------------------------------------------------
def test_snapshot_then_decisions_update_and_ping() -> None:
    s = ConsoleState()
    changed = s.apply(snapshot())
    assert {"nodes", "models", "replicas", "endpoints", "cache", "decisions", "link"} <= changed
    assert s.link.connected and s.snapshots == 1 and s.rev == 1
    assert [e.decision["request_id"] for e in s.decisions] == [d["request_id"] for d in reversed(DECISIONS)]
    assert s.apply({"type": "decision", "rev": 2, "decision": LIVE_DECISIONS[0]}) == {"decisions"}
    assert s.decisions[0].decision["request_id"] == "req-0007"  # newest first
    assert s.apply({"type": "update", "rev": 3, "nodes": []}) == {"nodes"}
    assert s.nodes == [] and s.models  # an update replaces only the sections it carries
    assert s.apply({"type": "ping", "rev": 4}) == frozenset() and s.rev == 4


def test_unknown_and_malformed_lines_are_ignored() -> None:
    s = loaded()
    before = (list(s.nodes), len(s.decisions))
    assert s.apply({"type": "holds", "rev": 9, "holds": []}) == frozenset()  # a future line type
    assert s.apply({"type": "decision", "rev": 10, "decision": "garbage"}) == frozenset()
    s.apply({"type": "update", "rev": 11, "replicas": "not a list", "cache": [1, 2]})
    assert s.replicas == [] and s.cache == {}
    assert (list(s.nodes), len(s.decisions)) == before
    s.apply({"type": "update", "rev": 12, "nodes": [{"name": "x"}, "junk", 3]})
    assert s.nodes == [{"name": "x"}]
    assert node_rows(s)[0].cells[0] == "x"  # a sparse node still makes a row


def test_decisions_are_bounded_newest_first() -> None:
    s = ConsoleState(max_decisions=5)
    s.apply(snapshot())
    for i in range(20, 30):
        s.apply({"type": "decision", "rev": i, "decision": decision(i)})
    assert [e.decision["request_id"] for e in s.decisions] == [f"req-{i:04d}" for i in range(29, 24, -1)]


def test_a_reconnection_snapshot_merges_without_repeats() -> None:
    s = loaded()  # 6 from the snapshot + 2 live
    s.lost(1, "gone")
    again = snapshot()
    again["decisions"] = [*DECISIONS[3:], *LIVE_DECISIONS, decision(9)]  # overlaps, plus one new
    s.apply(again)
    ids = [e.decision["request_id"] for e in s.decisions]
    assert ids == [f"req-{i:04d}" for i in range(9, 0, -1)]
    assert len({e.seq for e in s.decisions}) == len(ids)  # row keys stay unique
    assert s.snapshots == 2 and s.link.connected


def test_put_node_applies_an_admin_answer_ahead_of_the_stream() -> None:
    s = loaded()
    node = dict(s.node("gpu-a1") or {})
    node["operator_labels"] = {"tier": "prod", "llmgw.io/rack": "r99"}
    assert s.put_node(node) == {"nodes"}
    assert [n["name"] for n in s.nodes] == ["cpu-b1", "gpu-a1", "gpu-a2", "gpu-c1"]
    assert (s.node("gpu-a1") or {})["operator_labels"]["llmgw.io/rack"] == "r99"


# -- rows -------------------------------------------------------------------------------------------------
def test_node_rows_show_state_location_and_engines() -> None:
    rows = {r.key: r for r in node_rows(loaded())}
    a1 = rows["gpu-a1"]
    assert a1.cells[:6] == ("gpu-a1", "ready", "1h02m", "dc1/hall-a/row3/r12/pdu-2", "2×A100-SXM4-80GB", "vllm×2")
    assert a1.cells[6] == "1/2" and a1.tone == "good"  # one of its two replicas is still starting
    assert rows["gpu-a2"].cells[5] == "llamacpp×1, vllm×1"
    assert rows["gpu-c1"].tone == "bad" and rows["cpu-b1"].tone == "warn"
    assert rows["cpu-b1"].cells[-1] == "no heartbeat for 6s"
    detail = "\n".join(node_detail(loaded().node("gpu-a1")))
    assert "tier=prod*" in detail and "llmgw.io/rack=r12  " in detail  # operator labels starred
    assert "#1 A100-SXM4-80GB 80G" in detail


def test_model_and_replica_rows() -> None:
    s = loaded()
    models = {r.key: r for r in model_rows(s)}
    assert models["llama-8b"].cells[3:5] == ("2/3", "3") and models["llama-8b"].tone == "warn"
    assert models["mistral-7b"].tone == "bad" and "no ready node" in models["mistral-7b"].cells[-1]
    assert models["qwen-7b"].tone == "good"
    reps = {r.key: r for r in replica_rows(s)}
    r = reps["llama-8b/1a2b3c"]
    assert r.cells[3] == "ready" and r.cells[5:9] == ("3", "3/1", "42%", "closed")
    assert reps["llama-8b/7a8b9c"].tone == "busy" and reps["llama-8b/7a8b9c"].cells[-1] == "loading weights"
    static = reps["http://10.0.0.9:8000"]  # a static endpoint: no node, its breaker open
    assert static.cells[2:4] == ("(static)", "static") and static.cells[8] == "open" and static.tone == "bad"
    draining = {**s.replicas[1], "desired": "drain", "state": "stopping"}
    s.apply({"type": "update", "rev": 9, "replicas": [s.replicas[0], draining, *s.replicas[2:]]})
    assert replica_rows(s)[1].cells[3] == "stopping (drain)"
    assert list(reps) == ["llama-8b/1a2b3c", "llama-8b/4d5e6f", "llama-8b/7a8b9c", "qwen-7b/c0ffee",
                          "http://10.0.0.9:8000"]
    assert any("Application startup complete" in line for line in replica_detail(s, "llama-8b/1a2b3c"))
    assert any("last failure connect" in line for line in replica_detail(s, "http://10.0.0.9:8000"))


def test_decision_rows_and_filter() -> None:
    s = loaded()
    rows = decision_rows(s, tz=UTC)
    assert rows[0].cells[:4] == ("15:06:42.000", "req-0008", "qwen-7b", "qwen-7b/c0ffee")
    six = next(r for r in rows if r.cells[1] == "req-0006")
    assert six.cells[3] == "none" and six.tone == "bad"
    three = next(r for r in rows if r.cells[1] == "req-0003")
    assert three.cells[6:9] == ("3", "2", "61µs")  # n_candidates beyond the kept two
    assert [r.cells[1] for r in decision_rows(s, "qwen", UTC)] == ["req-0008", "req-0004"]
    assert {r.cells[3] for r in decision_rows(s, "4d5e6f", UTC)} == {"llama-8b/4d5e6f"}
    assert [r.cells[1] for r in decision_rows(s, "LLAMA miss", UTC)] == ["req-0006", "req-0002"]  # every word
    s.apply({"type": "decision", "rev": 9, "decision": {**decision(9), "request_id": "2dbbef75bd3342789ec1d39d3"}})
    long = decision_rows(s, "789ec1d39", UTC)  # the filter sees the whole id, the table its head
    assert [r.cells[1] for r in long] == ["2dbbef75bd334…"]


def test_decisions_caption() -> None:
    assert decisions_caption(8, 8, 8, "") == "8 decisions kept"
    assert decisions_caption(100, 500, 500, " ") == "500 decisions kept, newest 100 shown"
    assert decisions_caption(2, 2, 8, "qwen ") == "2 of 8 kept decisions match “qwen”"


def test_rationale_is_candidates_by_scorers_with_weights_and_drops() -> None:
    r = rationale(decision(7, chosen="llama-8b/4d5e6f"), UTC)
    assert r.columns == ("endpoint", "prefix ×3", "load ×2", "kv ×1", "total", "flags")
    assert r.candidates[0].cells == ("▶ llama-8b/4d5e6f", "1.00", "0.50", "0.58", "4.58", "prefix 12/16 blocks")
    assert r.candidates[0].tone == "good"
    assert r.candidates[1].cells[:5] == ("  llama-8b/1a2b3c", "0.25", "0.83", "0.82", "3.23")
    assert [d.cells for d in r.drops] == [("breaker", "http://10.0.0.9:8000", "breaker open until probe"),
                                          ("ready", "llama-8b/7a8b9c", "starting: not ready")]
    assert dict(r.facts)["chosen"] == "llama-8b/4d5e6f" and dict(r.facts)["decided"] == "15:06:41.750"
    assert rationale(decision(3), UTC).hidden == 1


def test_rationale_tolerates_unweighted_scorers_and_sparse_decisions() -> None:
    d = {"weights": {"load": 1}, "candidates": [{"endpoint": "a", "scores": {"load": 0.5, "session": 1.0}}]}
    r = rationale(d)
    assert r.columns == ("endpoint", "load ×1", "session ×?", "total", "flags")
    assert r.candidates[0].cells == ("  a", "0.50", "1.00", "—", "")
    assert rationale({}).candidates == [] and dict(rationale({}).facts)["chosen"] == "none"


def test_cache_rows_and_sparklines() -> None:
    s = loaded()
    models = {r.key: r for r in cache_model_rows(s)}
    llama = models["llama-8b"]
    assert llama.cells[1:3] == ("81%", "170/40") and llama.tone == "good"
    assert len(llama.cells[3]) == 20 and llama.cells[3].endswith("▅")  # the newest bucket, 0.6
    assert models["qwen-7b"].tone == "warn"
    assert [r.key for r in cache_replica_rows(s, "qwen")] == ["qwen-7b/c0ffee"]
    lines = cache_total_lines(s)
    assert "prefix hit 75% (180 of 240" in lines[0] and "last 3m20s" in lines[1]
    assert cache_total_lines(ConsoleState()) == ["no cache summary yet"]


def test_cache_rows_show_which_tier_decided_and_the_parity() -> None:
    s = loaded()
    reps = {r.key: r for r in cache_replica_rows(s)}
    assert reps["llama-8b/1a2b3c"].cells[2:4] == ("112/13", "ok")
    assert reps["llama-8b/4d5e6f"].cells[2:4] == ("0/46", "ALARM") and reps["llama-8b/4d5e6f"].tone == "bad"
    assert reps["qwen-7b/c0ffee"].cells[2:4] == ("-", "-")  # no kv_events: no tier 2
    line = cache_total_lines(s)[2]
    assert line.startswith("tier 2: 8.4k blocks indexed · 112 decisions by tier 2, 13 fell back to tier 1")
    assert "ALARM on llama-8b/4d5e6f" in line
    s.apply({"type": "update", "rev": 50, "kv": {"enabled": True, "replicas": [{"replica": "llama-8b/1a2b3c", "parity": 3}]}})
    assert "parity not checked yet" in cache_total_lines(s)[2]
    s.apply({"type": "update", "rev": 51, "kv": "garbage"})
    assert s.kv == {} and len(cache_total_lines(s)) == 2


def test_cache_view_drops_replicas_and_models_the_fleet_no_longer_has() -> None:
    """A scale-down removes llama-8b/4d5e6f; the cache summary still counts it for its window, but
    its row (and sparklines) leave with it; a deleted model's row leaves too. Totals stay whole."""
    from tests.test_console_fakes import CACHE, ENDPOINTS, MODELS, REPLICAS

    s = loaded()
    s.kv = {}  # tier 2's line aside (test_cache_rows_show_which_tier_decided_and_the_parity)
    assert [r.key for r in cache_replica_rows(s)] == ["llama-8b/1a2b3c", "llama-8b/4d5e6f", "qwen-7b/c0ffee"]
    assert len(cache_total_lines(s)) == 2
    gone = "llama-8b/4d5e6f"
    s.apply({"type": "update", "rev": 6, "replicas": [r for r in REPLICAS if r["replica"] != gone],
             "endpoints": [e for e in ENDPOINTS if e["id"] != gone]})
    assert [r.key for r in cache_replica_rows(s)] == ["llama-8b/1a2b3c", "qwen-7b/c0ffee"]
    assert [r.key for r in cache_model_rows(s)] == ["llama-8b", "qwen-7b"]
    lines = cache_total_lines(s)
    assert "prefix hit 75% (180 of 240" in lines[0]  # the window's totals still count it
    assert lines[2].startswith("1 replica no longer in the fleet")
    # draining but still there: kept (it is in the replicas, though no longer an endpoint)
    s.apply({"type": "update", "rev": 7, "replicas": REPLICAS,
             "endpoints": [e for e in ENDPOINTS if e["id"] != gone]})
    assert gone in [r.key for r in cache_replica_rows(s)] and len(cache_total_lines(s)) == 2
    # a deleted model: its replicas, endpoints and definition leave; so do its cache rows
    s.apply({"type": "update", "rev": 8, "models": [m for m in MODELS if m["name"] != "qwen-7b"],
             "replicas": [r for r in REPLICAS if r["model"] != "qwen-7b"],
             "endpoints": [e for e in ENDPOINTS if e["model"] != "qwen-7b"]})
    assert [r.key for r in cache_model_rows(s)] == ["llama-8b"]
    assert "qwen-7b/c0ffee" not in [r.key for r in cache_replica_rows(s)]
    # a fleet that is all gone shows no rows, whatever the summary still holds
    s.apply({"type": "update", "rev": 9, "models": [], "replicas": [], "endpoints": [], "cache": CACHE})
    assert cache_model_rows(s) == [] and cache_replica_rows(s) == []
    assert cache_total_lines(s)[2].startswith("3 replicas no longer in the fleet")


def test_formatting() -> None:
    assert sparkline([0.0, None, 0.5, 1.0], 6) == "  ▁ ▅█"
    assert sparkline(None, 3) == "   " and sparkline([2.0, -1], 2) == "█▁"  # out-of-range clamps
    assert [fmt_age(x) for x in (5, 65, 3723, 90000, None, -1)] == ["5s", "1m05s", "1h02m", "1d01h", "—", "—"]
    assert [fmt_us(x) for x in (42, 1500, 2_500_000)] == ["42µs", "1.5ms", "2.50s"]
    assert matches(("gpu-a1", "ready"), "GPU ready") and not matches(("gpu-a1",), "gpu lost")


def test_banner_and_status_line() -> None:
    s = ConsoleState()
    assert banner_text(WHERE, s.link) is None  # connecting for the first time: no alarm yet
    assert "connecting to" in status_line(s, WHERE)
    s.lost(3, "[Errno 111] Connection refused")
    assert banner_text(WHERE, s.link) == (f"daemon unreachable at {WHERE} — retrying (attempt 3): "
                                          "[Errno 111] Connection refused")
    s.apply(snapshot())
    assert banner_text(WHERE, s.link) is None
    assert status_line(s, WHERE) == ("● live, rev 1  ·  nodes 2/4 ready  ·  models 4  ·  replicas 3/4 ready  ·  "
                                     "endpoints 4  ·  decisions 6")
    s.lost(1, "x")
    assert "reconnecting" in status_line(s, WHERE) and "showing rev 1" in status_line(s, WHERE)


# -- the label editor's language --------------------------------------------------------------------------
def test_parse_label_edit() -> None:
    e = parse_label_edit(" llmgw.io/rack=r12, tier=  old- ")
    assert e.set == {"llmgw.io/rack": "r12", "tier": ""} and e.remove == ["old"]
    assert e.describe() == "llmgw.io/rack=r12 tier= old-"
    for bad, msg in (("", "nothing to change"), ("rack", "key=value"), ("=x", "needs a key"),
                     ("bad key!=1", "key=value"), ("-x=1", "not a valid label key"), ("a=1 a-", "both"),
                     ("rack=a llmgw.io/rack=b", "same label")):
        with pytest.raises(ValueError, match=msg):
            parse_label_edit(bad)


# -- the reconnecting follower ----------------------------------------------------------------------------
class _Recorder:
    def __init__(self) -> None:
        self.log: list[Any] = []

    def event(self, e: dict[str, Any]) -> None:
        self.log.append(e["type"])

    def lost(self, attempt: int, reason: str) -> None:
        self.log.append((attempt, reason))


def test_follow_reconnects_and_counts_attempts_from_the_last_snapshot() -> None:
    client = FakeClient(connections=[
        Connection([snapshot(), {"type": "ping", "rev": 2}], then=DaemonUnreachable("peer closed connection")),
        Connection([], then=AdminRefused(401, "Missing or invalid admin token.")),
        Connection([snapshot()], then=DaemonUnreachable("peer closed connection")),
    ])
    rec = _Recorder()

    class Delays:
        def delay(self, attempt: int) -> float:
            return 0.0

    async def run() -> None:
        task = asyncio.ensure_future(follow(client, rec.event, rec.lost, Delays()))
        while client.attempts < 6:
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(run())
    assert rec.log[:7] == ["snapshot", "ping", (1, "peer closed connection"),
                           (2, "401: Missing or invalid admin token."), "snapshot", (1, "peer closed connection"),
                           (2, "[Errno 111] Connection refused")]


def test_backoff_doubles_up_to_a_short_cap() -> None:
    b = Backoff()
    assert [b.delay(n) for n in range(1, 8)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
