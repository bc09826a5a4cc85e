"""W3C traceparent in and out, and traces out over OTLP, over real processes: a client sends a
traceparent through a real router to a `llmgw sim` vLLM engine (whose dev-mode
``GET /sim/trace_headers`` says what it received); the router's trace (admin API, `llmgw ctl
trace`) carries the client's trace id; with ``[router.traces] otlp_endpoint`` set, a collector
in this test (a small HTTP server on 127.0.0.1 decoding OTLP/HTTP protobuf with
opentelemetry-proto) receives the request's spans in the client's trace."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.cli.ctl.main import main as ctl_main

from .conftest import start_sim
from .test_router_integration import Daemon, procs, write_config  # noqa: F401
from .test_sim_vllm import metric, wait_for
from .test_traces_integration import _trace

TID = "4bf92f3577b34da6a3ce929d0e0e4736"
PID = "00f067aa0ba902b7"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def _engine(procs: list[Any]) -> Any:
    s = start_sim(["--engine", "vllm", "m", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost"],
                  env={"VLLM_SERVER_DEV_MODE": "1"})
    procs.append(s)
    return s


def _received(engine: Any) -> list[dict[str, Any]]:
    return httpx.get(f"{engine.url}/sim/trace_headers").json()


class Collector:
    """An OTLP/HTTP traces endpoint: POST /v1/traces (protobuf), the spans kept as dicts."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                got = []
                for rs in req.resource_spans:
                    res = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for sp in ss.spans:
                            got.append({"name": sp.name, "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                                        "parent_id": sp.parent_span_id.hex(), "kind": sp.kind,
                                        "start": sp.start_time_unix_nano, "end": sp.end_time_unix_nano,
                                        "status": sp.status.code, "resource": res,
                                        "events": [e.name for e in sp.events],
                                        "attrs": {a.key: _value(a.value) for a in sp.attributes}})
                owner.headers.append({k.lower(): v for k, v in self.headers.items()})
                owner.spans.extend(got)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def of_trace(self, trace_id: str) -> list[dict[str, Any]]:
        return [s for s in list(self.spans) if s["trace_id"] == trace_id]


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


def test_the_clients_traceparent_reaches_the_engine_and_the_trace(procs: list[Any], tmp_path: Path,
                                                                   capsys: Any) -> None:
    engine = _engine(procs)
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": engine.url}]}]))
    procs.append(d)
    r = httpx.post(f"{d.url}/v1/chat/completions", json=BODY,
                   headers={"traceparent": f"00-{TID}-{PID}-01", "tracestate": "rojo=00f067aa0ba902b7",
                            "x-request-id": "tp-1"})
    assert r.status_code == 200, r.text
    (got,) = [h for h in _received(engine) if h["x-request-id"] == "tp-1"]
    version, trace_id, span_id, flags = got["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TID, "01")
    assert span_id not in (PID, "0" * 16) and got["tracestate"] == "rojo=00f067aa0ba902b7"
    t = _trace(tmp_path, "tp-1")
    assert (t["trace_id"], t["parent_span_id"]) == (TID, PID)
    (att,) = t["attempts"]
    assert att["span_id"] == span_id and t["span_id"] not in (span_id, PID)  # the engine's parent: the attempt
    assert ctl_main(["trace", "tp-1", "--socket", str(tmp_path / "admin" / "admin.sock")]) == 0
    assert TID in capsys.readouterr().out
    # no traceparent: the engine still gets one, in a trace of the router's own (the trace's id)
    httpx.post(f"{d.url}/v1/chat/completions", json=BODY, headers={"x-request-id": "tp-2"})
    (got,) = [h for h in _received(engine) if h["x-request-id"] == "tp-2"]
    own = _trace(tmp_path, "tp-2")
    assert own["trace_id"] not in ("", TID) and got["traceparent"].split("-")[1] == own["trace_id"]
    assert own["parent_span_id"] == "" and got["tracestate"] is None
    # a malformed one (upper-case hex) is ignored, never an error, and counted
    r = httpx.post(f"{d.url}/v1/chat/completions", json=BODY,
                   headers={"traceparent": f"00-{TID.upper()}-{PID}-01", "x-request-id": "tp-3"})
    assert r.status_code == 200
    assert _trace(tmp_path, "tp-3")["trace_id"] not in ("", TID)
    assert metric(d.url, "llmgw_traceparent_invalid_total", reason="format") == 1.0


def test_spans_go_to_an_otlp_collector_in_the_clients_trace(procs: list[Any], tmp_path: Path,
                                                             collector: Collector,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's batch delay (5 s by default)
    engine = _engine(procs)
    router = ("[router.traces]\n"
              f"otlp_endpoint = {json.dumps(collector.url)}\n"  # no path: /v1/traces is added
              'otlp_headers = { authorization = "Bearer sekrit-token" }\n'
              'service_name = "gw-test"\n'
              "otlp_phase_spans = true")
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": engine.url}]}], router=router),
               log_level="info")
    procs.append(d)
    r = httpx.post(f"{d.url}/v1/chat/completions", json=BODY,
                   headers={"traceparent": f"00-{TID}-{PID}-01", "x-request-id": "otel-1"})
    assert r.status_code == 200
    wait_for(lambda: len(collector.of_trace(TID)) >= 1 + 1 + 6, timeout=20)  # phase spans: otlp_phase_spans
    spans = collector.of_trace(TID)
    (root,) = [s for s in spans if s["span_id"] == _trace(tmp_path, "otel-1")["span_id"]]
    assert root["parent_id"] == PID and root["name"] == "chat m" and root["kind"] == 2  # SERVER
    assert root["attrs"]["llmgw.request_id"] == "otel-1" and root["attrs"]["gen_ai.request.model"] == "m"
    assert root["attrs"]["llmgw.replica"] == "m/0" and root["attrs"]["http.response.status_code"] == 200
    assert root["attrs"]["llmgw.strategy"] and root["resource"]["service.name"] == "gw-test"
    (att,) = [s for s in spans if s["parent_id"] == root["span_id"] and s["kind"] == 3]  # CLIENT
    (got,) = [h for h in _received(engine) if h["x-request-id"] == "otel-1"]
    assert got["traceparent"].split("-")[2] == att["span_id"]  # the engine's parent span is exported
    phases = sorted((s for s in spans if s["kind"] == 1), key=lambda s: s["start"])  # INTERNAL
    assert [p["name"] for p in phases] == ["prepare", "decide", "connect", "head", "first_byte", "body"]
    assert root["start"] <= phases[0]["start"] and phases[-1]["end"] == root["end"]
    assert collector.headers[0]["authorization"] == "Bearer sekrit-token"
    # a client that says "not sampled" is not exported
    r = httpx.post(f"{d.url}/v1/chat/completions", json=BODY,
                   headers={"traceparent": f"00-{'1' * 32}-{PID}-00", "x-request-id": "otel-2"})
    assert r.status_code == 200
    wait_for(lambda: metric(d.url, "llmgw_trace_spans_total", result="exported") >= len(spans))
    d.stop()  # flushes what is queued
    assert collector.of_trace("1" * 32) == []
    assert "sekrit" not in "".join(d.err)  # the header's value is never logged
    assert any("spans exported over OTLP/HTTP to" in line and "authorization" in line for line in d.err)


def test_without_the_sdk_one_warning_and_traces_stay_local(procs: list[Any], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    shadow = tmp_path / "no-otel"
    (shadow / "opentelemetry").mkdir(parents=True)
    (shadow / "opentelemetry" / "__init__.py").write_text("raise ImportError('not installed (test)')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    engine = _engine(procs)
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": engine.url}]}],
                            router='[router.traces]\notlp_endpoint = "http://127.0.0.1:9/v1/traces"'))
    procs.append(d)
    r = httpx.post(f"{d.url}/v1/chat/completions", json=BODY,
                   headers={"traceparent": f"00-{TID}-{PID}-01", "x-request-id": "local-1"})
    assert r.status_code == 200 and _trace(tmp_path, "local-1")["trace_id"] == TID
    warned = [line for line in d.err if "pip install 'llmgw[otel]'" in line]
    assert len(warned) == 1, d.err


def test_by_default_phases_are_events_of_the_request_and_attempt_spans(procs: list[Any], tmp_path: Path,
                                                                      collector: Collector,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    engine = _engine(procs)
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": engine.url}]}],
                            router=f"[router.traces]\notlp_endpoint = {json.dumps(collector.url + '/v1/traces')}"))
    procs.append(d)
    r = httpx.post(f"{d.url}/v1/chat/completions", json=BODY, headers={"x-request-id": "ev-1"})
    assert r.status_code == 200
    t = _trace(tmp_path, "ev-1")  # no traceparent: the router's own trace, exported all the same
    wait_for(lambda: len(collector.of_trace(t["trace_id"])) >= 2, timeout=20)
    root, att = sorted(collector.of_trace(t["trace_id"]), key=lambda s: s["kind"])  # SERVER 2, CLIENT 3
    assert (root["span_id"], root["parent_id"], root["events"]) == (t["span_id"], "", ["prepare", "decide"])
    assert att["parent_id"] == root["span_id"] and att["events"] == ["connect", "head", "first_byte", "body"]
    assert root["resource"]["service.name"] == "llmgw"


def test_a_collector_that_is_down_costs_only_its_batches(procs: list[Any], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there: every export is refused
    engine = _engine(procs)
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": engine.url}]}],
                            router=f'[router.traces]\notlp_endpoint = "http://127.0.0.1:{port}/v1/traces"'))
    procs.append(d)
    for i in range(3):
        r = httpx.post(f"{d.url}/v1/chat/completions", json=BODY, headers={"x-request-id": f"down-{i}"})
        assert r.status_code == 200
    wait_for(lambda: metric(d.url, "llmgw_trace_spans_total", result="failed") >= 2, timeout=30)
    assert metric(d.url, "llmgw_trace_spans_total", result="exported") == 0
    t0 = time.monotonic()
    d.stop()  # the flush at stop is bounded; no traceback (conftest checks the log)
    assert time.monotonic() - t0 < 9
    # the SDK's words about it: rate-limited (one line a minute of each kind), never a traceback
    assert 1 <= sum("opentelemetry" in line for line in d.err) <= 3, d.err
