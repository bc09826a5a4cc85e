"""Traces as data (llmgw.route.trace), their JSONL file (llmgw.daemon.router.trace_log) and
their timeline (llmgw.admin_client.trace_view), without processes."""

from __future__ import annotations

import json
import os
from datetime import timezone
from pathlib import Path

import trio

from llmgw.admin.schema_traces import trace_summary, trace_view
from llmgw.admin_client.trace_view import trace_lines
from llmgw.config.schema import TracesConfig
from llmgw.daemon.router.trace_log import MAX_PENDING, TraceLog
from llmgw.route.trace import MAX_MARKS, MAX_NOTE, AttemptRecord, Trace, TraceRing


def _request(id: str = "r1", t0: float = 100.0) -> Trace:
    t = Trace(id, name="chat", started=t0, wall=1_700_000_000.5, model="m", stream=True, bytes_out=10)
    t.mark("prepare", t0)
    t.mark("decide", t0 + 0.001)
    r = AttemptRecord(1, "m/0", "n1", "", 0, t0 + 0.0012)
    t.attempts.append(r)
    t.attempt_ended(r, t0 + 0.0013, None, None, None, t0 + 0.002, None, "connect", "replica m/0: refused", 0)
    r.retried = True
    t.mark("decide", t0 + 0.0021, note="retry after attempt 1: connect")
    r2 = AttemptRecord(2, "m/1", None, "rev-2", 1, t0 + 0.0022)
    t.attempts.append(r2)
    t.attempt_ended(r2, t0 + 0.0023, t0 + 0.0024, t0 + 0.003, t0 + 0.004, t0 + 0.010, 200, "ok", "", 1234)
    t.end(t0 + 0.010, "ok", 200)
    return t


def test_phases_are_contiguous_and_add_up_to_the_total() -> None:
    d = _request().to_dict()
    names = [(p["name"], p["attempt"]) for p in d["phases"]]
    assert names == [("prepare", 0), ("decide", 0), ("connect", 1), ("decide", 0), ("connect", 2), ("head", 2),
                     ("first_byte", 2), ("body", 2)]
    assert abs(sum(p["duration_ms"] for p in d["phases"]) - d["total_ms"]) < 1e-6 and d["total_ms"] == 10.0
    assert d["retries"] == 1 and d["bytes_in"] == 1234 and d["attempts"][0]["error"] == "replica m/0: refused"
    assert d["attempts"][1]["first_byte_ms"] == 4.0 and d["attempts"][1]["revision"] == "rev-2"
    assert json.loads(json.dumps(d)) == d


def test_marks_never_go_back_nor_grow_without_bound_and_end_once() -> None:
    t = Trace("x", started=10.0, wall=0.0)
    t.mark("a", 10.5)
    t.mark("b", 10.2, note="n" * 10_000)  # earlier than the last: moved up to it
    assert t.marks[-1][1] == 10.5 and len(t.marks[-1][3]) == MAX_NOTE
    for i in range(200):
        t.mark("step", 11.0 + i)
    assert len(t.marks) == MAX_MARKS
    assert t.end(5.0, "ok") and t.ended == t.marks[-1][1]  # never before its last phase
    assert not t.end(500.0, "failed") and t.outcome == "ok"
    t.mark("late", 600.0)
    assert len(t.marks) == MAX_MARKS


def test_an_in_flight_trace_shows_its_open_phase() -> None:
    t = Trace("x", started=0.0, wall=0.0)
    t.mark("prepare", 0.0)
    t.mark("body", 0.002)
    d = t.to_dict(now=0.005)
    assert d["outcome"] == "in_flight" and d["total_ms"] is None and d["phases"][-1]["duration_ms"] == 3.0
    assert t.to_dict()["phases"][-1]["duration_ms"] is None


def test_the_ring_is_bounded_and_finds_the_newest() -> None:
    ring = TraceRing(3)
    for i in range(5):
        ring.add(_request(f"r{i % 4}", t0=float(i)))
    assert len(ring) == 3 and ring.get("r0") is not None and ring.get("r0").started == 4.0  # type: ignore[union-attr]
    assert ring.get("r1") is None
    assert [t.id for t in ring.recent(2)] == ["r0", "r3"]
    job = Trace("job-1", kind="job", name="update m", started=9.0, wall=0.0)
    job.mark("place", 9.0)
    ring.add(job)
    assert [t.id for t in ring.recent(10, kind="job")] == ["job-1"]
    assert [t.id for t in ring.recent(10, outcome="in_flight")] == ["job-1"]


def test_admin_views_carry_every_field() -> None:
    t = _request()
    v = trace_view(t, 0.0)
    assert v.id == "r1" and len(v.phases) == 8 and v.attempts[1].replica == "m/1"
    s = trace_summary(t)
    assert (s.attempts, s.replica, s.total_ms, s.outcome) == (2, "m/1", 10.0, "ok")


def test_the_timeline_names_each_phase_attempt_and_rationale() -> None:
    lines = trace_lines(_request().to_dict(), tz=timezone.utc)
    text = "\n".join(lines)
    assert lines[0].startswith("request r1  chat  model m  stream")
    assert "ok 200  total 10.00 ms  started 22:13:20.500" in lines[1]
    assert "#1 m/0 on n1: connect (replica m/0: refused)" in text and "retried elsewhere" in text
    assert "#2 m/1: ok 200" in text and "1.2 KiB" in text and "retry after attempt 1" in text
    assert "decision 1 of `llmgw ctl explain r1`" in text
    body = next(line for line in lines if " body " in f" {line} ")
    assert "█" in body


def test_the_timeline_survives_what_a_daemon_may_send() -> None:
    hostile = {"id": "\x1b[31mred", "kind": None, "phases": [{"name": "x\ny", "start_ms": "soon", "duration_ms": True},
                                                            "not a phase"],
               "attempts": [{"n": 1, "replica": "\x07bell", "error": "\r\n"}, 7], "started_at": 1e300,
               "total_ms": -5, "bytes_in": 2 ** 40}
    text = "\n".join(trace_lines(hostile))
    assert "\x1b" not in text and "\x07" not in text and "x\ny" not in text
    assert trace_lines({}) and trace_lines({"phases": None, "attempts": None})


def _log(tmp: Path, **kw: object) -> TraceLog:
    return TraceLog(TracesConfig(file=str(tmp / "t.jsonl"), **kw))  # type: ignore[arg-type]


def test_the_file_gets_an_exact_share_and_rotates(tmp_path: Path) -> None:
    log = _log(tmp_path, sample=0.25, max_file_mb=0.002, files_kept=2)
    for i in range(40):
        log.on_end(_request(f"r{i}"))
    log.flush(0.0)
    assert log.written == 10 and log.rotations >= 2
    files = [tmp_path / "t.jsonl", tmp_path / "t.jsonl.1", tmp_path / "t.jsonl.2"]
    assert all(f.exists() for f in files) and not (tmp_path / "t.jsonl.3").exists()
    assert all(f.stat().st_size <= 2 * 1024 * 1.05 for f in files)
    ids = [json.loads(line)["id"] for f in reversed(files) for line in f.read_text().splitlines()]
    assert ids == [f"r{i}" for i in range(3, 40, 4)][-len(ids):]
    assert os.stat(files[0]).st_mode & 0o077 == 0
    log.close()


def test_a_write_that_fails_drops_the_batch_and_goes_on(tmp_path: Path) -> None:
    log = TraceLog(TracesConfig(file=str(tmp_path / "gone" / "t.jsonl")))
    log.on_end(_request())
    log.flush(0.0)  # the directory does not exist: nothing raised
    assert (log.written, log.dropped) == (0, 1)
    (tmp_path / "gone").mkdir()
    log.on_end(_request("r2"))
    log.flush(100.0)
    assert (log.written, log.dropped) == (1, 1)
    assert json.loads((tmp_path / "gone" / "t.jsonl").read_text())["id"] == "r2"
    log.close()


def test_pending_traces_are_bounded(tmp_path: Path) -> None:
    log = _log(tmp_path)
    t = _request()
    for _ in range(MAX_PENDING + 5):
        log.on_end(t)
    assert log.dropped == 5
    log.close()


def test_the_writer_task_flushes_when_cancelled(tmp_path: Path) -> None:
    log = TraceLog(TracesConfig(file=str(tmp_path / "t.jsonl")), flush_s=3600)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(log.run)
            log.on_end(_request())
            await trio.sleep(0)
            n.cancel_scope.cancel()

    trio.run(main)
    assert log.written == 1 and (tmp_path / "t.jsonl").read_text().count("\n") == 1


def test_a_request_that_left_during_planning_does_not_stay_in_flight() -> None:
    """The client leaves while the request is between plan and its first decision (here: in tier
    2's tokenize step, which never answers; the handler is cancelled): its trace ends, cancelled."""
    import importlib.util

    from llmgw.config import parse_config
    from llmgw.daemon.net.httpserver import Request
    from llmgw.daemon.router.proxy import Router

    spec = importlib.util.spec_from_file_location("walk_request", Path(__file__).resolve().parents[1] / "bench"
                                                  / "walk_request.py")
    assert spec is not None and spec.loader is not None
    walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walk)
    router = Router(parse_config(walk.CFG), walk._Pool(0), seed=0)

    async def never(step: object) -> None:
        await trio.sleep_forever()

    router.core.tier2.wants = lambda plan: True  # type: ignore[method-assign]
    router.tokenizer.ask = never  # type: ignore[method-assign,assignment]

    def request(rid: str, body: bytes) -> Request:
        return Request("POST", "/v1/chat/completions", "/v1/chat/completions", "", [("x-request-id", rid)],
                       body, ("127.0.0.1", 1))

    async def main() -> None:
        with trio.move_on_after(0.05):
            await router.handle(request("gone", walk.BODY))
        # a made-up model name is kept bounded
        await router.handle(request("long", json.dumps({"model": "x" * 100_000, "messages": []}).encode()))

    trio.run(main)
    t = router.core.traces.get("gone")
    assert t is not None and t.outcome == "client_cancelled" and t.status == 499 and t.ended is not None
    assert [m[0] for m in t.marks] == ["prepare"]
    lt = router.core.traces.get("long")
    assert lt is not None and len(lt.model) == 256 and lt.outcome == "rejected" and lt.status == 404
