"""W3C Trace Context in the core (llmgw.route.traceparent): the strict parser, tracestate's bounds,
the ids, and a request's trace taking the client's trace id (pure, no processes)."""

from __future__ import annotations

import random

import pytest

from llmgw.config import parse_config
from llmgw.route.trace import AttemptRecord, Trace, upstream_headers
from llmgw.route.trace_spans import exported, spans_of
from llmgw.route.traceparent import (
    MAX_TRACESTATE,
    format_traceparent,
    sampled,
    new_span_id,
    new_trace_id,
    parse_traceparent,
    parse_tracestate,
)

TID = "4bf92f3577b34da6a3ce929d0e0e4736"
PID = "00f067aa0ba902b7"
GOOD = f"00-{TID}-{PID}-01"


def test_the_spec_example_parses() -> None:
    ctx, bad = parse_traceparent(GOOD)
    assert bad == "" and ctx is not None
    assert (ctx.trace_id, ctx.parent_id, ctx.flags) == (TID, PID, 1)
    ctx, _ = parse_traceparent(f"00-{TID}-{PID}-00")
    assert ctx is not None and ctx.flags == 0
    ctx, _ = parse_traceparent(f" {GOOD}\t")  # a header's optional whitespace is not the value
    assert ctx is not None


def test_no_header_is_no_context_and_no_fault() -> None:
    assert parse_traceparent(None) == (None, "")


@pytest.mark.parametrize("value, reason", [
    ("", "length"),
    (GOOD[:-1], "length"),  # 54 characters
    (GOOD + "0", "length"),  # version 00 is exactly 55
    (GOOD + "-00", "length"),  # ... even with what a later version may add
    (f"0g-{TID}-{PID}-01", "format"),  # the version is not hex
    (f"ff-{TID}-{PID}-01", "version"),  # forbidden
    (f"00_{TID}-{PID}-01", "format"),
    (f"00-{TID}_{PID}-01", "format"),
    (f"00-{TID}-{PID}_01", "format"),
    (f"00-{TID.upper()}-{PID}-01", "format"),  # upper-case hex is refused (HEXDIGLC)
    (f"00-{TID}-{PID.upper()}-01", "format"),
    (f"00-{TID}-{PID}-0A", "format"),
    (f"00-{TID[:-1]}x-{PID}-01", "format"),
    (f"00-{TID[:-1]}-{PID}0-01", "format"),  # the separators are in the wrong places
    (f"00-{'0' * 32}-{PID}-01", "trace_id"),
    (f"00-{TID}-{'0' * 16}-01", "parent_id"),
    (f"00-{TID}-{PID}-0\u0661", "format"),  # a non-ASCII digit
])
def test_each_malformed_shape_is_refused_with_its_reason(value: str, reason: str) -> None:
    assert parse_traceparent(value) == (None, reason)


def test_a_later_version_is_read_as_version_00_fields() -> None:
    """The spec: a higher version is parsed by version 00's layout; what follows a '-' after the
    55th character is that version's and ignored; any other 56th character makes it invalid."""
    ctx, bad = parse_traceparent(f"cc-{TID}-{PID}-01")
    assert bad == "" and ctx is not None and ctx.trace_id == TID
    ctx, bad = parse_traceparent(f"cc-{TID}-{PID}-01-what-the-future-holds")
    assert bad == "" and ctx is not None and (ctx.parent_id, ctx.flags) == (PID, 1)
    assert parse_traceparent(f"cc-{TID}-{PID}-01.future") == (None, "format")
    assert parse_traceparent(f"cc-{TID}-{PID}-0") == (None, "length")
    assert parse_traceparent(f"cc-{'0' * 32}-{PID}-01") == (None, "trace_id")


def test_unknown_flags_are_not_passed_on() -> None:
    ctx, _ = parse_traceparent(f"00-{TID}-{PID}-ff")
    assert ctx is not None and ctx.flags == 1
    ctx, _ = parse_traceparent(f"00-{TID}-{PID}-02")
    assert ctx is not None and ctx.flags == 0
    assert format_traceparent(TID, PID, 0xff) == f"00-{TID}-{PID}-01"


def test_tracestate_is_kept_valid_and_bounded() -> None:
    assert parse_tracestate(None) == ""
    assert parse_tracestate("rojo=00f067aa0ba902b7, congo=t61rcWkgMzE") == "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
    assert parse_tracestate("a=1,,  ,b=2") == "a=1,b=2"  # empty members are allowed and dropped
    assert parse_tracestate("tenant@vendor=x") == "tenant@vendor=x"
    for bad in ("no-equals", "UPPER=1", "a=1,a=2", "a=b,c", "a=x=y", "a=", "1abc=x", "k=caf\u00e9"):
        assert parse_tracestate(bad) == "", bad
    assert parse_tracestate(",".join(f"k{i}=v" for i in range(33))) == ""  # more than 32 members
    many = ",".join(f"k{i}={'v' * 40}" for i in range(20))  # 20 x 44 characters: over 512
    out = parse_tracestate(many)
    assert len(out) <= MAX_TRACESTATE and out.startswith("k0=") and out.count(",") == len(out) // 45
    big = "big=" + "x" * 200
    out = parse_tracestate(",".join([f"k{i}={'v' * 40}" for i in range(10)] + [big] + ["last=1"]))
    assert big not in out and out.endswith("last=1")  # the long member goes first


def test_ids_are_hex_and_never_zero() -> None:
    assert new_trace_id(lambda n: 0) == "0" * 31 + "1"
    assert new_span_id(lambda n: 0) == "0" * 15 + "1"
    bits = random.Random(1).getrandbits
    t, s = new_trace_id(bits), new_span_id(bits)
    assert len(t) == 32 and len(s) == 16 and int(t, 16) and int(s, 16)


def test_a_new_trace_is_sampled_by_its_ids_low_bits() -> None:
    assert sampled("f" * 32, 1.0) and not sampled("0" * 16 + "f" * 16, 0.0)
    assert sampled("f" * 16 + "0" * 15 + "1", 0.5) and not sampled("0" * 16 + "8" + "0" * 15, 0.5)
    bits = random.Random(5).getrandbits
    share = sum(sampled(new_trace_id(bits), 0.25) for _ in range(4000)) / 4000
    assert 0.22 < share < 0.28


def _planner_core(extra: str = "", **kw):  # type: ignore[no-untyped-def]
    from llmgw.route.cache_stats import CacheStats
    from llmgw.route.dispatch import RouterCore
    from llmgw.route.replicas import ReplicaTable

    cfg = parse_config('[[models]]\nname = "m"\nengine = "vllm"\n[[models.replicas]]\nurl = "http://127.0.0.1:1"\n'
                       + extra)
    return RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 1000.0,
                      rng=random.Random(0), ids=random.Random(7).getrandbits, **kw)


def test_the_request_trace_is_the_clients_trace() -> None:
    core = _planner_core()
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    plan = core.plan("chat", body, "r1", strategy=None, session=None, now=5.0, traceparent=GOOD,
                     tracestate="rojo=1")
    t = plan.trace
    assert t is not None and (t.trace_id, t.parent_span_id, t.flags, t.tracestate) == (TID, PID, 1, "rojo=1")
    assert len(t.span_id) == 16 and t.span_id != PID
    d = t.to_dict(5.0)
    assert (d["trace_id"], d["parent_span_id"], d["span_id"]) == (TID, PID, t.span_id)
    # no traceparent: a trace of the router's own, sampled; a malformed one is counted by its reason
    plan2 = core.plan("chat", body, "r2", strategy=None, session=None, now=5.0, tracestate="rojo=1")
    assert plan2.trace is not None and plan2.trace.trace_id not in ("", TID) and plan2.trace.parent_span_id == ""
    assert plan2.trace.tracestate == "" and plan2.trace.flags == 1
    core.plan("chat", body, "r3", strategy=None, session=None, now=5.0, traceparent=GOOD.upper(),
              tracestate="rojo=1")
    assert core.traceparent_invalid() == {"format": 1}
    assert core.traces.get("r3").tracestate == ""  # never without a valid traceparent


def test_otlp_sample_applies_to_the_routers_own_traces_only() -> None:
    core = _planner_core("[router.traces]\notlp_sample = 0.0\n")
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    own = core.plan("chat", body, "r1", strategy=None, session=None, now=1.0).trace
    theirs = core.plan("chat", body, "r2", strategy=None, session=None, now=1.0, traceparent=GOOD).trace
    assert own is not None and own.flags == 0 and not upstream_headers(own, None)[0][1].endswith("-01")
    assert theirs is not None and theirs.flags == 1


def test_a_refused_request_still_carries_its_trace_id() -> None:
    core = _planner_core()
    with pytest.raises(Exception):
        core.plan("chat", b'{"model": "nope", "messages": []}', "r1", strategy=None, session=None, now=1.0,
                  traceparent=GOOD)
    t = core.traces.get("r1")
    assert t is not None and t.trace_id == TID and t.outcome == "rejected"


def test_upstream_headers_name_the_attempts_span() -> None:
    t = Trace("r", started=0.0, wall=100.0)
    assert upstream_headers(t, None) == []  # no trace id (a job's): none
    t.trace_id, t.span_id, t.flags, t.tracestate = TID, "1" * 16, 1, "rojo=1"
    rec = AttemptRecord(1, "m/0", None, "", 0, 0.0, span_id="2" * 16)
    assert upstream_headers(t, rec) == [("traceparent", f"00-{TID}-{'2' * 16}-01"), ("tracestate", "rojo=1")]
    assert upstream_headers(t, None)[0] == ("traceparent", f"00-{TID}-{'1' * 16}-01")


def _finished_trace() -> Trace:
    t = Trace("r1", name="chat", started=10.0, wall=1000.0, model="m")
    t.trace_id, t.span_id, t.parent_span_id, t.flags, t.strategy = TID, "a" * 16, PID, 1, "balanced"
    t.mark("prepare", 10.0)
    t.mark("decide", 10.001)
    r1 = AttemptRecord(1, "m/0", "n1", "r1", 0, 10.002, span_id="b" * 16)
    r1.retried = True
    t.attempts.append(r1)
    t.attempt_ended(r1, None, None, None, None, 10.010, None, "connect", "connection refused", 0)
    t.mark("decide", 10.010, note="retry")
    r2 = AttemptRecord(2, "m/1", "n2", "r1", 1, 10.011, span_id="c" * 16)
    t.attempts.append(r2)
    t.attempt_ended(r2, None, 10.012, 10.020, 10.030, 10.100, 200, "ok", "", 42)
    t.end(10.100, "ok", 200)
    return t


def test_phases_are_events_on_their_attempt_or_the_request_by_default() -> None:
    t = _finished_trace()
    root, a1, a2 = spans_of(t, random.Random(3).getrandbits)
    assert [e[0] for e in root.events] == ["prepare", "decide", "decide"]
    assert [e[0] for e in a1.events] == ["connect"] and [e[0] for e in a2.events] == ["connect", "head",
                                                                                        "first_byte", "body"]
    name, at, attrs = a2.events[-1]
    assert at == 1000 * 10**9 + 30 * 10**6 and attrs == {"llmgw.duration_ms": 70.0}
    assert root.events[2][2]["llmgw.note"] == "retry"


def test_a_finished_trace_maps_to_request_attempt_and_phase_spans() -> None:
    t = _finished_trace()
    spans = spans_of(t, random.Random(3).getrandbits, phase_spans=True)
    root, a1, a2, *phases = spans
    assert (root.span_id, root.parent_id, root.kind, root.error) == ("a" * 16, PID, "server", None)
    assert root.start_ns == 1000 * 10**9 and root.end_ns == 1000 * 10**9 + 100 * 10**6
    assert root.attributes["gen_ai.request.model"] == "m" and root.attributes["llmgw.replica"] == "m/1"
    assert root.attributes["llmgw.strategy"] == "balanced" and root.attributes["http.response.status_code"] == 200
    assert root.attributes["llmgw.retries"] == 1
    assert (a1.span_id, a1.parent_id, a1.kind, a1.error) == ("b" * 16, "a" * 16, "client", "connection refused")
    assert (a2.span_id, a2.error, a2.attributes["llmgw.node"]) == ("c" * 16, None, "n2")
    assert [p.name for p in phases] == ["prepare", "decide", "connect", "decide", "connect", "head", "first_byte",
                                        "body"]
    by_name = [(p.name, p.parent_id) for p in phases]
    assert by_name[0] == ("prepare", "a" * 16) and by_name[2] == ("connect", "b" * 16)
    assert by_name[-1] == ("body", "c" * 16)
    # contiguous: each phase ends where the next starts, the last at the trace's end
    assert all(p.end_ns == q.start_ns for p, q in zip(phases, phases[1:])) and phases[-1].end_ns == root.end_ns
    assert len({s.span_id for s in spans}) == len(spans)
    assert all(v is not None for s in spans for v in s.attributes.values())


def test_only_finished_sampled_request_traces_are_exported() -> None:
    t = _finished_trace()
    assert exported(t)
    t.flags = 0
    assert not exported(t)  # the client said: not sampled
    t2 = Trace("r2", started=0.0, wall=0.0)
    t2.trace_id, t2.flags = TID, 1
    assert not exported(t2) and spans_of(t2, random.Random(0).getrandbits) == []  # in flight
    job = Trace("job-1", kind="job", started=0.0, wall=0.0)
    job.end(1.0, "ok")
    assert not exported(job)
