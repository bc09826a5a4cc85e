"""The router's request path, as I/O: the OpenAI endpoint over HTTP, the upstream call, the
relay of the answer. What to do is the core's (:mod:`llmgw.route.dispatch`): the shell asks it
once per request (``plan``), once per attempt (``next``: an attempt to send, or a ticket to wait
on) and once when an attempt ends (``finish``: which waiting requests may now proceed).

The body goes to the engine unchanged (but for the explicit adapter list of a llama.cpp model with
declared adapters: :mod:`llmgw.route.lora_body`); the response streams back as it arrives (one write per
upstream read, done by the upstream pool's relay task without a task switch per chunk;
backpressure from the client's socket). A retry on another replica happens only
while nothing has been sent to the client; a client that leaves closes the upstream connection
at once, so the engine aborts the sequence; an answer that breaks off mid-body ends the client's
response unfinished (no last chunk), after an in-band error event on a stream."""

from __future__ import annotations

import json
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import Iterable

import trio

from llmgw.config import Config, ModelConfig
from llmgw.daemon.net.fd_limit import RESERVE, connection_cap, nofile_limit
from llmgw.daemon.net.httpserver import Request, Response, ServerOptions, ServerStats
from llmgw.daemon.net.upstream import (
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)
from llmgw.daemon.router.adapter_loader import AdapterLoader, AdapterMetrics
from llmgw.daemon.router.kv_index import RouterKvIndex
from llmgw.daemon.router.metrics import RouterMetrics, Tier2DecisionMetrics
from llmgw.daemon.router.peer_feed import PeerFeed
from llmgw.daemon.router.registry import Registry, Replica
from llmgw.daemon.router.model_list import ModelList
from llmgw.daemon.router.tenancy import Admitted, Tenancy, TenantMetrics
from llmgw.daemon.router.tokenize import Tier2Metrics, Tokenizer
from llmgw.daemon.router.pd_call import prefill
from llmgw.daemon.router.proxy_wire import (
    JSON,
    AdapterMissing,
    consteq,
    content_type,
    error_response,
    failure_of,
    header_value,
    id_bits,
    request_id,
    server_error_body,
    tracestate,
)
from llmgw.daemon.router.pd_metrics import PdMetrics
from llmgw.daemon.router.otel_export import TraceExportMetrics, make_exporter, trace_sink
from llmgw.daemon.router.trace_log import TraceLog
from llmgw.http1.sinks import BodyAborted, BodySink
from llmgw.route.adapters import Load
from llmgw.route.admission import Ticket
from llmgw.route.attempt import Attempt
from llmgw.route.breaker import FailureKind
from llmgw.route.dispatch import KINDS, RouterCore
from llmgw.route.plan import Plan
from llmgw.route.planner import STRATEGY_HEADER
from llmgw.route.tier2 import Tokenize
from llmgw.inputs.echo import echo
from llmgw.route.openai_req import ApiError
from llmgw.route.prefix_scorer import PrefixRouting
from llmgw.route.readiness import readiness
from llmgw.route.types import Decision
from llmgw.tenants.book import Principal

log = logging.getLogger("llmgw.router")

__all__ = ["INTERNAL_HEADER", "REVISION_HEADER", "STRATEGY_HEADER", "Router"]

REVISION_HEADER = "x-llmgw-revision"  # "candidate": to the model's candidate revision
INTERNAL_HEADER = "x-llmgw-internal"  # with the router's internal token

class Router:
    def __init__(self, cfg: Config, pool: UpstreamPool, *, seed: int | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.registry = Registry(cfg)
        self.core = RouterCore(cfg, self.registry, cache_stats=self.registry.cache_stats, wall=time.time,
                               rng=random.Random(seed), clock=time.perf_counter, ids=id_bits)
        self.registry.on_capacity = self.core.capacity_known
        self.registry.on_adapters = self._adapters_listed
        self.registry.on_scraped = lambda rep: self._wake(self.core.scraped(rep, trio.current_time()))
        self._wakers: dict[Ticket, trio.Event] = {}
        self.http_stats = ServerStats()  # the OpenAI endpoint's connections (see server_options)
        self.metrics = RouterMetrics(self.core, registry=self.registry, http=self.http_stats)
        self.tokenizer = Tokenizer(pool)  # the HTTP calls of tier 2's step (kv_events models only)
        self.metrics.registry.register(Tier2Metrics(self.core.tier2_state()))
        self.adapter_port = self.core.adapter_port()
        self.adapters = AdapterLoader(self.adapter_port, pool, self._wake)  # LoRA on demand (vLLM)
        self.metrics.registry.register(AdapterMetrics(self.adapter_port))
        self.tier2_metrics = Tier2DecisionMetrics(self.core.kv_stats(), time.time())
        self.metrics.registry.register(self.tier2_metrics)
        self.core.watch_tier2(self.tier2_metrics.observe_tokenize)
        self.metrics.registry.register(PdMetrics(self.core))
        # Tier 2's index of what each engine holds: the router's own, fed by the control plane
        # through RouterPort (kv_events, kv_forget ...); its parity task runs beside the router's.
        self.kv = RouterKvIndex()
        self.core.use_kv_index(self.kv.index.leading_blocks, self.kv.alarmed, self.kv.holds_any)
        self._parity: dict[Attempt, int] = {}  # an attempt's open parity check (RouterKvIndex.check_open)
        # finished traces to a JSONL file, when [router.traces] file is set (its task: main.py)
        self.trace_log = TraceLog(cfg.router.traces) if cfg.router.traces.file else None
        # ... and as OpenTelemetry spans over OTLP, when [router.traces] otlp_endpoint is set (its task: main.py)
        self.otlp = make_exporter(cfg.router.traces, id_bits)
        self.core.on_trace_end = trace_sink(self.trace_log, self.otlp)
        self.metrics.registry.register(TraceExportMetrics(self.core.traceparent_invalid, self.otlp))
        # who sends each request, what it may use, and what it used (docs/tenants.md): the book
        # is the config's static keys until the control plane pushes the store's (set_tenants)
        self.tenancy = Tenancy(cfg, trio.current_time, time.time)
        self.metrics.registry.register(TenantMetrics(self.tenancy))
        self.rid_header = cfg.server.request_id_header.lower()
        # What the control plane's eval runner sends (INTERNAL_HEADER) to reach a candidate
        # revision (REVISION_HEADER): a secret of this process, never logged or answered.
        self.internal_token = secrets.token_hex(16)
        self.draining = False  # stopping (SIGTERM): /ready answers 503 "draining" (main.py, docs/ha.md)
        self.peer_feed: PeerFeed | None = None  # routing as one: peer_feed.start_peer_feed sets it

    @property
    def decisions(self) -> deque[Decision]:
        """The ring of recent decisions, each with its whole rationale."""
        return self.core.decisions

    @property
    def prefix(self) -> PrefixRouting:
        return self.core.prefix

    def server_options(self) -> ServerOptions:
        """The OpenAI endpoint's HTTP server options: its bounds (the connection cap from
        ``[server] max_connections`` or else from the fd limit) and the counters it keeps."""
        s = self.cfg.server
        nofile = nofile_limit()
        auto = connection_cap(nofile)
        cap = s.max_connections or auto
        if s.max_connections > auto:
            log.warning("server.max_connections = %d is more than the file descriptor limit %d allows (%d: "
                        "an upstream connection for each, and %d for the rest): expect accept() to fail "
                        "(EMFILE) before the cap is reached", cap, nofile, auto, RESERVE)
        log.info("OpenAI endpoint: at most %d connections (file descriptor limit %d)", cap, nofile)
        return {"max_body_bytes": s.max_body_bytes, "max_connections": cap,
                "first_request_timeout": s.first_request_timeout_s, "stats": self.http_stats,
                "error_body": server_error_body, "on_rejected": self._server_rejected}

    def _server_rejected(self, status: int) -> None:
        """The HTTP server answered a request itself (413 body too large, 431, 400 malformed,
        408): counted like the router's own refusals."""
        self.core.answered("rejected", status)

    # -- replicas placed and withdrawn by the control plane ------------------------------------
    def add_replica(self, m: ModelConfig, rid: str, url: str, *, pool: str, weight: float,
                    node: str | None = None, role: str = "both") -> Replica:
        rep, wake = self.core.add_replica(m, rid, url, pool=pool, weight=weight, node=node, role=role)
        self._wake(wake)
        return rep

    def remove_replica(self, rid: str) -> None:
        self.core.remove_replica(rid)

    def _adapters_listed(self, rep: Replica, names: set[str], asked_at: float) -> None:
        self._wake(self.adapter_port.listed(rep, names, asked_at))

    def _wake(self, tickets: Iterable[Ticket]) -> None:
        for t in tickets:
            ev = self._wakers.get(t)
            if ev is not None:
                ev.set()

    # -- HTTP entry ---------------------------------------------------------------------------
    async def handle(self, req: Request) -> Response:
        rid = request_id(req.header(self.rid_header))
        path = req.path
        try:
            if path == "/health":
                return Response(200, [("content-type", JSON)], b'{"status":"ok"}')
            if path == "/ready":  # like /health, open to load balancers and orchestrators
                return self._ready(req)
            principal = self._authorize(req)  # /metrics too: it names every model and replica
            if path == "/metrics":
                if principal is not None and principal.key is not None:  # a tenant's key, not the operator's
                    raise ApiError(403, "The metrics name every tenant: read them with a key of [server] api_keys.",
                                   code="forbidden")
                return Response(200, [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
                                self.metrics.render())
            if path == "/v1/models" or path.startswith("/v1/models/"):
                if req.method != "GET":
                    raise ApiError(405, f"Method {echo(req.method, quote='')} not allowed on {echo(path, quote='')}")
                listed = ModelList(self.registry, self.tenancy, principal)
                body = listed.all() if path == "/v1/models" else listed.one(path[11:])
                resp = Response(200, [("content-type", JSON), (self.rid_header, rid)], body)
                self.core.answered("ok", 200)
                return resp
            kind = KINDS.get(path)
            if kind is None:
                raise ApiError(404, f"Unknown route {echo(path, quote='')}", code="not_found")
            if req.method != "POST":
                raise ApiError(405, f"Method {echo(req.method, quote='')} not allowed on {echo(path, quote='')}")
            return await self._proxy(req, kind, rid, principal)
        except ApiError as e:
            # Every client request is counted once: the core counted those that ended in it;
            # the rest are the router's own refusals (401, 404 model or route, 405, 400), under
            # model "-" (a name the client made up must not become a series).
            if not e.counted and path != "/metrics":
                self.core.answered("rejected", e.status)
            return error_response(e, rid, self.rid_header)
        except Exception as e:  # a bug: the server answers 500 and logs it; the request still counts
            if path != "/metrics" and not getattr(e, "llmgw_counted", False):
                self.core.answered("failed", 500)
            raise

    def _ready(self, req: Request) -> Response:
        """200 once every model that should have replicas has one that can serve, else 503; the
        body says which (llmgw.route.readiness) — to a caller with a key of [server] api_keys when keys
        are set, since it names the models; to anyone else (a tenant's key too), only the status."""
        r = readiness(self.registry, draining=self.draining)
        body = r.to_dict()
        try:
            if self.tenancy.authenticate(req.header("authorization"), count=False).key is not None:
                body = {"status": body["status"]}  # a tenant's key: the models are the operator's business
        except ApiError:
            body = {"status": body["status"]}
        return Response(200 if r.ready else 503, [("content-type", JSON)], json.dumps(body).encode())

    def _authorize(self, req: Request) -> Principal | None:
        """Who sent `req` (401 when its key is missing, unknown, revoked or expired); None for
        llmgw's own eval runner (its internal token: no tenant, no quota, not counted as use)."""
        token = req.header(INTERNAL_HEADER)
        if token is not None and consteq(token, self.internal_token):
            return None
        return self.tenancy.authenticate(req.header("authorization"))

    # -- the request path ---------------------------------------------------------------------
    async def _proxy(self, req: Request, kind: str, rid: str, principal: Principal | None) -> Response:
        core = self.core
        revision = req.header(REVISION_HEADER)
        token = req.header(INTERNAL_HEADER)
        internal = token is not None and consteq(token, self.internal_token)
        if revision is not None and (revision not in ("candidate", "live") or not internal):
            raise ApiError(403, f"The {REVISION_HEADER} header is for llmgw's own eval runner.",
                           param=REVISION_HEADER, code="forbidden")
        traceparent = req.header("traceparent")
        # who sent it: its band and weight in the wait queue, and its trace's tenant and key (the
        # cost, known once planned, is set with the admission: the Limiter's charge)
        tag = None if principal is None else self.tenancy.tag(principal)
        plan = core.plan(kind, req.body, rid, strategy=req.header(STRATEGY_HEADER),
                         session=req.header("x-session-id"), now=trio.current_time(), revision=revision,
                         internal=internal, traceparent=traceparent,
                         tracestate=None if traceparent is None else tracestate(req), tenant=tag)
        adm: Admitted | None = None
        if principal is not None:
            try:
                adm = self.tenancy.admit(principal, plan)  # 403, 429
            except ApiError as e:
                core.refused(plan, trio.current_time(), e.status)
                e.counted = True
                raise
            plan.tenant = self.tenancy.tag(principal, adm.cost)
        headers = [("content-type", "application/json"), ("x-request-id", rid)]
        try:
            while True:
                step = core.next(plan, trio.current_time(), time.time())  # raises the final ApiError
                if type(step) is Attempt:
                    if step.phase == "prefill":  # a disaggregated model's prefill step (pd_call.py)
                        await prefill(core, self.pool, self.cfg.router, plan, step, req.target, headers, self._wake)
                        continue
                    if step.alarm is not None:
                        _log_alarm(step.alarm)
                    if plan.info.kv_hashes:
                        cid = self.kv.check_open(step.replica.view.id, plan.entry.name, plan.info.kv_hashes,
                                                 trio.current_time())
                        if cid is not None:
                            self._parity[step] = cid
                    resp = await self._attempt(plan, step, req, headers, rid, adm)
                    if resp is not None:
                        adm = None  # its body's relay (or aclose) ends it
                        return resp
                elif type(step) is Load:  # its LoRA adapter is being loaded (once, for all who want it)
                    await self.adapters.wait(plan, step)
                elif type(step) is Tokenize:  # tier 2: the prompt's tokens (or the engine's release)
                    a = await self.tokenizer.ask(step)
                    core.tokenized(plan, step, trio.current_time(), a.status, a.body, a.error)
                else:
                    await self._wait(plan, step)  # type: ignore[arg-type]
        except ApiError as e:
            if adm is not None:
                e.headers.extend(adm.headers)
                self.tenancy.end(adm, e.status)
            raise
        except Exception as e:  # a bug: counted once, under its model, as the 500 the server answers
            core.failed(plan)
            _end_trace(plan, "failed", 500)
            e.llmgw_counted = True  # type: ignore[attr-defined]
            self.tenancy.end(adm, 500)
            raise
        except BaseException:  # cancelled (the client left) where no attempt or wait ended it
            _end_trace(plan, "client_cancelled", 499)
            self.tenancy.end(adm, None)
            raise

    async def _wait(self, plan: Plan, ticket: Ticket) -> None:
        """Hold the request while every replica of the model is saturated (bounded, with a
        deadline); the core then decides again. Its arrival may have displaced a waiter from the
        full queue (a lower band's, or a bigger tenant's): woken, that one gets its 429 from next."""
        event = self._wakers[ticket] = trio.Event()
        self._wake(self.core.displaced())
        self.registry.scrape_soon()  # only a fresh reading can show the room it waits for
        try:
            with trio.move_on_at(ticket.deadline):
                await event.wait()
                return
        except BaseException:
            self._wake(self.core.turn_passed(plan, trio.current_time()))
            self.core.left_queue(plan, trio.current_time(), timed_out=False)
            raise
        finally:
            self._wakers.pop(ticket, None)
        self._wake(self.core.turn_passed(plan, trio.current_time()))
        self.core.left_queue(plan, trio.current_time(), timed_out=True)  # raises the 429

    async def _attempt(self, plan: Plan, a: Attempt, req: Request, headers: list[tuple[str, str]],
                       rid: str, adm: Admitted | None) -> Response | None:
        """One try on one replica: the client's Response, or None to ask the core again."""
        rc = self.cfg.router
        rep = a.replica
        a.sent_at = trio.current_time()  # the trace's connect phase starts here
        body = a.body if a.body is not None else req.body  # the core's rewrite (llama.cpp's adapter list)
        if adm is not None and adm.strip:
            body = self.tenancy.upstream_body(adm, body, plan)  # asks for the stream's usage
        # W3C traceparent: the request's trace, the attempt's span (the engine's spans are its children)
        headers = [*headers, *a.trace_headers]
        try:
            # The exchange's own __aenter__: on failure it has closed its connection, and its
            # __aexit__ is only resp.close(), which the body's end calls (no exit stack, no
            # shielded scope a request).
            resp = await self.pool.stream(
                rep.view.url, "POST", req.target, headers, body, connect_timeout=rc.connect_timeout_s,
                first_byte_timeout=a.first_byte_timeout or rc.first_byte_timeout_s,
                idle_timeout=rc.idle_timeout_s).__aenter__()
        except UpstreamError as e:
            self._finish(plan, a, e, None, None)
            return None
        except BaseException:
            self._finish(plan, a, None, None, None)
            raise
        if resp.status == 404 and plan.info.adapter is not None and \
                self.adapter_port.missing(plan, rep, trio.current_time()):
            resp.close()  # the engine lost the adapter: loaded again (or another holder), never the client's 404
            log.info("replica %s answered 404 for adapter %s, which it held: its engine restarted? Trying again",
                     rep.id, plan.info.adapter, extra={"endpoint": rep.id, "request_id": plan.info.request_id})
            self._finish(plan, a, AdapterMissing(f"{rep.id} answered 404 for adapter {plan.info.adapter}",
                                                  url=rep.view.url), None, 404, resp)
            return None
        if resp.status >= 500 and plan.retry_5xx:  # else it is relayed: the engine's own error
            resp.close()
            e = UpstreamProtocolError(f"{rep.id} answered {resp.status}", url=rep.view.url)
            e.public = f"answered {resp.status}"
            self._finish(plan, a, e, None, resp.status, resp)
            return None
        out_headers = [("content-type", content_type(resp, plan.stream)), (self.rid_header, rid),
                       ("x-llmgw-endpoint", header_value(rep.view.id))]
        if resp.status == 200 and plan.stream:
            out_headers.append(("cache-control", "no-cache"))
        if adm is not None:
            out_headers += adm.headers
        return Response(resp.status, out_headers, _Relay(self, plan, a, resp, adm))

    async def _relay(self, plan: Plan, a: Attempt, resp: UpstreamResponse, sink: BodySink,
                     adm: Admitted | None) -> None:
        """The body of a proxied response: the upstream's, relayed to the client as it arrives
        (the pool's relay task writes each read to the client's socket: no task switch a
        chunk); then the bookkeeping. Cancelled when the client leaves."""
        outcome: UpstreamError | str | None = None  # None: cancelled
        head_at = trio.current_time()  # relay() sends the head first: the client's first byte
        if adm is not None:  # the usage tap (a stream's usage-only chunk out when the router asked for it)
            sink = self.tenancy.tap(adm, sink, plan.stream and resp.status == 200)
        try:
            await resp.relay(sink)
            outcome = "ok"
        except UpstreamError as e:
            outcome = e
            if plan.stream:
                # Headers are gone: tell an SSE client in-band, as OpenAI does.
                msg = json.dumps({"error": {"message": f"upstream failed mid-stream: replica {a.replica.view.id}: "
                                                       f"{e.public}", "type": "bad_gateway", "param": None,
                                            "code": "upstream_failed"}})
                if not sink.send_nowait(f"data: {msg}\n\n".encode()):
                    await sink.drain()
            # ... and end the response unfinished (no last chunk): what the client got is not the
            # whole body, and must not pass for it (a non-streamed JSON cut short is no answer).
            raise BodyAborted(f"upstream failed mid-body: {e}") from None
        finally:
            resp.close()  # synchronous: a body not read to its end closes the upstream connection now
            # A failed relay ends the request here (the head is out: no retry): counted as done.
            first = resp.first_byte_at if resp.first_byte_at is not None or outcome == "ok" or outcome is None \
                else head_at
            if adm is not None:
                self.tenancy.end(adm, resp.status, broken=outcome != "ok")
            self._finish(plan, a, outcome, first, resp.status, resp)

    def _finish(self, plan: Plan, a: Attempt, outcome: UpstreamError | str | None, first: float | None,
                status: int | None, resp: UpstreamResponse | None = None) -> None:
        """``outcome``: "ok", the upstream error, or None when the client went away. The core
        gets a ``detail`` a client may read (the replica's id, never its address); the log
        line, tied to the client's answer by the request id, has the whole error and URL.
        ``resp``: the answer, when one came (its times and body bytes go to the trace)."""
        now = trio.current_time()
        if resp is not None:
            a.connected_at, a.head_at, a.bytes_in = resp.connected_at, resp.head_at, resp.body_bytes
            if outcome == "ok" and resp.last_byte_at is not None:
                now = resp.last_byte_at  # when the client got its last byte, not when this task woke
        if outcome == "ok":
            failure, detail = None, ""
        elif outcome is None:
            failure, detail = FailureKind.CLIENT_CANCEL, ""
        else:
            failure = failure_of(outcome)  # type: ignore[arg-type]
            detail = outcome.phase if isinstance(outcome, UpstreamTimeout) else \
                f"replica {a.replica.view.id}: {outcome.public}"  # type: ignore[union-attr]
        self._wake(self.core.finish(plan, a, now, failure, first_byte_at=first, status=status, detail=detail))
        if a.waiters:  # waiters stay: the engine's gauges may lag what just ended
            self.registry.scrape_soon()
        cid = self._parity.pop(a, None) if self._parity else None
        if cid is not None:
            # parity: what the engine stored for a request it answered whole
            self.kv.check_end(cid, now, ok=failure is None and status == 200)
        if log.isEnabledFor(logging.INFO):  # the access log: one JSON line per attempt
            word = "ok" if failure is None else "cancelled" if outcome is None else type(outcome).__name__
            log.info("request %s", word if failure is None or outcome is None
                     else f"failed: {outcome} ({outcome.url or a.replica.view.url})",  # type: ignore[union-attr]
                     extra={"request_id": plan.info.request_id, "model": plan.model, "endpoint": a.replica.id,
                            "status": status, "outcome": word,
                            "ttft_ms": None if first is None else round((first - plan.started) * 1e3, 2),
                            "latency_ms": round((now - plan.started) * 1e3, 2)})


def _end_trace(plan: Plan, outcome: str, status: int) -> None:
    """A request that ended outside the core's bookkeeping: its trace ends too (not left in flight)."""
    if plan.trace is not None and plan.trace.ended is None:
        plan.trace.end(trio.current_time(), outcome, status)


def _log_alarm(on: bool) -> None:
    if on:
        log.warning("prefix routing: zero cache-affinity hits although requests share prefixes "
                    "(check the strategy's prefix weight, cache_salt use and replica capacities)")
    else:
        log.info("prefix routing: affinity hits again")


class _Relay:
    """A proxied response's body (httpserver's RelayBody): Router._relay, once."""
    __slots__ = ("adm", "attempt", "plan", "resp", "router", "used")

    def __init__(self, router: Router, plan: Plan, attempt: Attempt, resp: UpstreamResponse,
                 adm: Admitted | None) -> None:
        self.router, self.plan, self.attempt, self.resp, self.adm = router, plan, attempt, resp, adm
        self.used = False

    async def relay(self, sink: BodySink) -> None:
        if self.used:
            raise RuntimeError("a response body can be relayed once")
        self.used = True
        await self.router._relay(self.plan, self.attempt, self.resp, sink, self.adm)

    async def aclose(self) -> None:
        """relay() never ran (e.g. a HEAD request): close the upstream side, book it as cancelled."""
        if not self.used:
            self.used = True
            self.resp.close()
            self.router.tenancy.end(self.adm, self.resp.status, broken=True)
            self.router._finish(self.plan, self.attempt, None, None, self.resp.status, self.resp)
