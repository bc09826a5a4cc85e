"""Finished request traces out as OpenTelemetry spans over OTLP/HTTP (``[router.traces]
otlp_endpoint``), with the OpenTelemetry SDK — the optional extra ``pip install 'llmgw[otel]'``.

The request path only appends the finished trace to the queue of the SDK's ``BatchSpanProcessor``
(``on_end``: a check and a deque append, a few µs). Everything else happens in the SDK's own
thread, batch by batch: the trace mapped to spans (:mod:`llmgw.route.trace_spans`, pure), the
spans built, encoded as OTLP protobuf and POSTed by the OTLP/HTTP exporter — the trio thread never
waits on the collector, and never pays for the encoding. The queue is the SDK's, bounded
(``OTEL_BSP_MAX_QUEUE_SIZE``, 2048 traces by default; beyond, the SDK drops and this module
counts). An ended trace is not changed any more, so the SDK's thread reads it safely.

A trace the client marked not sampled (its traceparent's flags) is not exported. A collector that
is down or refuses costs only the failed batches, counted (``llmgw_trace_spans_total{result=
"failed"}``), and the SDK's words about them are logged at most once a minute a kind.
``otlp_headers`` (a collector's auth) go only to the exporter, never to a log line. At stop, what
is queued is flushed for at most :data:`STOP_FLUSH_S`.

No SDK installed: :func:`make_exporter` logs one warning naming the extra, and traces stay local
(the ring, the file)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

import trio
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw import __version__
from llmgw.config.schema import TracesConfig
from llmgw.daemon.net.log_limit import LogLimiter, repeats
from llmgw.route.trace import Trace
from llmgw.route.trace_spans import SpanData, exported, spans_of

log = logging.getLogger("llmgw.traces")

__all__ = ["OtlpExport", "TraceExportMetrics", "make_exporter", "otlp_url", "trace_sink"]

STOP_FLUSH_S = 3.0  # what is queued at stop is sent for at most this long
EXPORT_TIMEOUT_S = 10.0  # one export call (with the SDK's retries) to the collector
# The SDK's loggers whose lines are rate-limited (a collector that is down would log every batch).
_SDK_LOGGERS = ("opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export",
                "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                "opentelemetry.exporter.otlp.proto.http._common", "opentelemetry.exporter.http")


def otlp_url(endpoint: str) -> str:
    """The traces URL: as configured, or with OTLP/HTTP's ``/v1/traces`` when it names no path."""
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint


def make_exporter(cfg: TracesConfig, bits: Callable[[int], int]) -> OtlpExport | None:
    """The exporter for ``cfg.otlp_endpoint`` ("": None); None with one warning when the SDK is
    not installed."""
    if not cfg.otlp_endpoint:
        return None
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace.export  # noqa: F401
    except ImportError:
        log.warning("router.traces.otlp_endpoint is set but the OpenTelemetry SDK is not installed: "
                    "pip install 'llmgw[otel]'; traces stay local")
        return None
    return OtlpExport(cfg, bits)


def trace_sink(*sinks: Any) -> Callable[[Trace], None] | None:
    """The core's ``on_trace_end``: each of ``sinks`` (a TraceLog, an OtlpExport; None: absent)
    sees every finished trace."""
    ends = [s.on_end for s in sinks if s is not None]
    if len(ends) <= 1:
        return ends[0] if ends else None

    def each(trace: Trace) -> None:
        for f in ends:
            f(trace)
    return each


class _SdkLogLimit(logging.Filter):
    """At most one line a minute of each of the SDK's messages; counts its queue's drops."""

    def __init__(self, owner: OtlpExport) -> None:
        super().__init__()
        self.owner = owner
        self.limit = LogLimiter(60.0)
        self.lock = threading.Lock()  # the SDK logs from its thread and (a full queue) from ours

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        with self.lock:
            if msg.startswith("Queue full"):
                self.owner.dropped += 1
            n = self.limit.hit((record.name, msg), time.monotonic())
        if n is None:
            return False
        if n:
            record.msg = f"{msg}{repeats(n)}"
        return True


class OtlpExport:
    def __init__(self, cfg: TracesConfig, bits: Callable[[int], int]) -> None:
        from opentelemetry import trace as api
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace.status import Status, StatusCode

        self.url = otlp_url(cfg.otlp_endpoint)
        u = urlsplit(self.url)
        shown = u._replace(netloc=u.netloc.rpartition("@")[2]).geturl()  # never a password in the URL
        log.info("traces: spans exported over OTLP/HTTP to %s as service %s%s", shown, cfg.service_name,
                 f" with headers {', '.join(sorted(cfg.otlp_headers))}" if cfg.otlp_headers else "")
        self.bits = bits
        self.phase_spans = cfg.otlp_phase_spans
        self.traces = 0  # traces handed to the SDK's queue
        self.submitted = 0  # spans made of them (the SDK's thread)
        self.exported = 0  # spans the collector took
        self.failed = 0  # spans in batches that failed (after the SDK's retries)
        self.dropped = 0  # traces the SDK's full queue dropped
        self._filter = _SdkLogLimit(self)
        for name in _SDK_LOGGERS:
            logging.getLogger(name).addFilter(self._filter)
        owner = self
        otlp = OTLPSpanExporter(endpoint=self.url, headers=dict(cfg.otlp_headers), timeout=EXPORT_TIMEOUT_S)

        class Exporter(SpanExporter):  # type: ignore[misc]
            """The SDK's thread: a batch of queued traces to spans, through the OTLP exporter, counted."""

            def export(self, batch: Sequence[Any]) -> Any:
                spans: list[Any] = []
                try:
                    spans = [sp for q in batch for sp in owner.sdk_spans(q.trace)]
                    owner.submitted += len(spans)
                    result = otlp.export(spans) if spans else SpanExportResult.SUCCESS
                except Exception as e:  # never a traceback from the SDK's thread: counted, logged (limited)
                    logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter").warning(
                        "exporting traces failed: %s: %s", type(e).__name__, e)
                    result = SpanExportResult.FAILURE
                if result is SpanExportResult.SUCCESS:
                    owner.exported += len(spans)
                else:
                    owner.failed += len(spans)
                return result

            def shutdown(self) -> None:
                otlp.shutdown()

            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return True

        self.processor = BatchSpanProcessor(Exporter())
        self._resource = Resource.create({"service.name": cfg.service_name, "service.version": __version__})
        self._scope = InstrumentationScope("llmgw", __version__)
        self._api, self._readable, self._event, self._status = api, ReadableSpan, Event, (Status, StatusCode)
        self._kinds = {"server": api.SpanKind.SERVER, "client": api.SpanKind.CLIENT,
                       "internal": api.SpanKind.INTERNAL}
        self._sampled = api.TraceFlags(api.TraceFlags.SAMPLED)
        # what the processor's queue holds: a finished trace, behind the one field the SDK reads
        # of a span before it queues it (its context's sampled flag; only sampled traces come)
        context = api.SpanContext(1, 1, is_remote=False, trace_flags=self._sampled)
        self._queued = type("QueuedTrace", (), {"__slots__": ("trace",), "context": context})

    # -- the request path (the trio thread) ----------------------------------------------------
    def on_end(self, trace: Trace) -> None:
        """A finished trace: onto the SDK's queue (sampled ones only)."""
        if not exported(trace):
            return
        q = self._queued()
        q.trace = trace
        self.processor.on_end(q)
        self.traces += 1

    # -- the SDK's thread --------------------------------------------------------------------------
    def sdk_spans(self, trace: Trace) -> list[Any]:
        tid = int(trace.trace_id, 16)
        return [self._span(tid, s) for s in spans_of(trace, self.bits, phase_spans=self.phase_spans)]

    def _span(self, tid: int, s: SpanData) -> Any:
        api = self._api
        ctx = api.SpanContext(tid, int(s.span_id, 16), is_remote=False, trace_flags=self._sampled)
        parent = api.SpanContext(tid, int(s.parent_id, 16), is_remote=False, trace_flags=self._sampled) \
            if s.parent_id else None
        Status, StatusCode = self._status
        status = Status(StatusCode.ERROR, s.error) if s.error is not None else Status(StatusCode.UNSET)
        events = [self._event(name, attrs, at) for name, at, attrs in s.events]
        return self._readable(name=s.name, context=ctx, parent=parent, resource=self._resource,
                              attributes=s.attributes, events=events, kind=self._kinds[s.kind], status=status,
                              start_time=s.start_ns, end_time=s.end_ns, instrumentation_scope=self._scope)

    # -- the task (main.py) ----------------------------------------------------------------------
    async def run(self) -> None:
        """Wait until cancelled; then flush what is queued (bounded) and stop the SDK's thread."""
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(STOP_FLUSH_S):  # then the thread is left
                await trio.to_thread.run_sync(self.close, abandon_on_cancel=True)

    def close(self) -> None:
        """Flush (at most STOP_FLUSH_S) and shut the SDK's processor down (blocking: a worker thread)."""
        self.processor.force_flush(int(STOP_FLUSH_S * 1000))
        self.processor.shutdown()
        for name in _SDK_LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)


class TraceExportMetrics(Collector):
    """``llmgw_traceparent_invalid_total{reason}`` (clients' malformed traceparents, ignored) and,
    with OTLP export on, ``llmgw_traces_exported_total{result}`` (traces queued, dropped) and
    ``llmgw_trace_spans_total{result}`` (spans submitted, exported, failed)."""

    def __init__(self, invalid: Callable[[], dict[str, int]], export: OtlpExport | None) -> None:
        self.invalid = invalid
        self.export = export

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily("llmgw_traceparent_invalid", "Client traceparent headers that were malformed "
                                "(ignored: the request got a trace of its own), by reason.", labels=["reason"])
        for reason in ("length", "format", "version", "trace_id", "parent_id"):
            c.add_metric([reason], float(self.invalid().get(reason, 0)))
        yield c
        e = self.export
        if e is not None:
            t = CounterMetricFamily("llmgw_traces_exported", "Finished request traces handed to the OpenTelemetry "
                                    "SDK's queue (queued), and those its full queue dropped (dropped).",
                                    labels=["result"])
            t.add_metric(["queued"], float(e.traces))
            t.add_metric(["dropped"], float(e.dropped))
            yield t
            s = CounterMetricFamily("llmgw_trace_spans", "Spans made of exported traces (submitted) and what "
                                    "became of them: exported to the collector, or failed (the batch was refused "
                                    "or the collector unreachable, after the SDK's retries).", labels=["result"])
            for result, n in (("submitted", e.submitted), ("exported", e.exported), ("failed", e.failed)):
                s.add_metric([result], float(n))
            yield s
