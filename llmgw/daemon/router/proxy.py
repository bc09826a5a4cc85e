"""The router's request path: OpenAI request → admission → decision → proxy → feedback.

The body goes to the engine unchanged; the response streams back as it arrives (one write per
upstream read, done by the upstream pool's relay task without a task switch per chunk;
backpressure from the client's socket). A retry on another replica happens only
while nothing has been sent to the client; a client that leaves closes the upstream connection
at once, so the engine aborts the sequence."""

from __future__ import annotations

import hmac
import json
import logging
import random
import time
from collections import deque
from typing import Any

import trio

from llmgw.config import Config, ModelConfig
from llmgw.daemon.net.httpserver import BodySink, Request, Response
from llmgw.daemon.router.registry import ModelEntry, Registry, Replica
from llmgw.daemon.router.metrics import RouterMetrics
from llmgw.daemon.net.upstream import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)
from llmgw.route.admission import ConcurrencyCaps, WaitQueue, suggest_retry_after
from llmgw.route.breaker import FailureKind, Permit
from llmgw.route.filters import is_saturated
from llmgw.route.openai_req import ApiError, parse_body
from llmgw.route.prefix_scorer import PrefixRouting, PrefixScorerConfig
from llmgw.route.prefix_tree import Capacity, PrefixConfig
from llmgw.route.request_head import request_head
from llmgw.route.scheduler import Scheduler, SchedulerConfig
from llmgw.route.strategies import Strategy, StrategyError, resolve
from llmgw.route.types import Decision, RequestInfo

log = logging.getLogger("llmgw.router")

_JSON = "application/json"
_KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
STRATEGY_HEADER = "x-llmgw-strategy"
# Request ids: 32 random hex digits like uuid4().hex at a sixth of its cost (no getrandom()
# syscall and UUID object a request); not a secret, only unique in practice.
_rid_bits = random.Random().getrandbits


def _error(e: ApiError, rid: str, rid_header: str) -> Response:
    headers = [("content-type", _JSON), (rid_header, rid), *e.headers]
    return Response(e.status, headers, json.dumps(e.body()).encode())


class Router:
    def __init__(self, cfg: Config, pool: UpstreamPool, *, seed: int | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.registry = Registry(cfg)
        rc = cfg.router
        pc = rc.prefix
        self.prefix = PrefixRouting(
            PrefixConfig(budget_bytes=int(pc.budget_mb * (1 << 20))),
            PrefixScorerConfig(guard=pc.guard, abs_gap=pc.abs_gap, rel_gap=pc.rel_gap,
                               spill_factor=pc.spill_factor, spill_slack=pc.spill_slack))
        self.sched = Scheduler(SchedulerConfig(kv_ceiling=rc.kv_ceiling, saturation_load=rc.saturation_load),
                               scorers=self.prefix.scorers())
        self.registry.on_capacity = self._capacity_known
        self._alarm_tick = 0
        self._alarm_on = False
        # Per-replica caps (a pool's max_inflight_per_replica), taken check-and-reserve.
        self.caps = ConcurrencyCaps()
        for rep in self.registry.all_replicas():
            self.caps.set_cap(rep.id, rep.view.max_inflight)
        self.rng = random.Random(seed)
        self.decisions: deque[Decision] = deque(maxlen=rc.decisions_kept)
        self.queues: dict[str, WaitQueue] = {}
        self._wakers: dict[str, trio.Event] = {}
        self.metrics = RouterMetrics(self)
        self.api_keys = set(cfg.server.api_keys)
        self.rid_header = cfg.server.request_id_header.lower()
        self._strategies: dict[str, Strategy] = self._configured_strategies()

    # -- replicas placed and withdrawn by the control plane ------------------------------------
    def add_replica(self, m: ModelConfig, rid: str, url: str, *, pool: str, weight: float,
                    node: str | None = None) -> Replica:
        self.registry.add_model(m)
        rep = self.registry.replicas.get(rid)
        if rep is not None and rep.view.url == url.rstrip("/"):
            rep.draining = False
            return rep
        if rep is not None:  # restarted elsewhere on the node: a fresh replica, fresh state
            self.remove_replica(rid)
        rep = self.registry.add_replica(m, rid, url, pool, weight)
        rep.node = node
        self.caps.set_cap(rid, rep.view.max_inflight)
        self._capacity_freed(m.name)
        return rep

    def remove_replica(self, rid: str) -> None:
        if self.registry.remove_replica(rid) is not None:
            self.prefix.remove_replica(rid)

    # -- HTTP entry ---------------------------------------------------------------------------
    async def handle(self, req: Request) -> Response:
        rid = req.header(self.rid_header) or f"{_rid_bits(128):032x}"
        path = req.path
        try:
            if path == "/health":
                return Response(200, [("content-type", _JSON)], b'{"status":"ok"}')
            if path == "/metrics":
                return Response(200, [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
                                self.metrics.render())
            self._authorize(req)
            if path == "/v1/models":
                if req.method != "GET":
                    raise ApiError(405, f"Method {req.method} not allowed on {path}")
                return self._models(rid)
            kind = _KINDS.get(path)
            if kind is None:
                raise ApiError(404, f"Unknown route {path}", code="not_found")
            if req.method != "POST":
                raise ApiError(405, f"Method {req.method} not allowed on {path}")
            return await self._proxy(req, kind, rid)
        except ApiError as e:
            if e.status not in (401, 404, 405):
                self.metrics.request_done("-", "rejected", e.status, None, None)
            return _error(e, rid, self.rid_header)

    def _authorize(self, req: Request) -> None:
        if not self.api_keys:
            return
        auth = req.header("authorization") or ""
        key = auth[7:] if auth[:7].lower() == "bearer " else None
        if key is None or not any(_consteq(key, k) for k in self.api_keys):
            raise ApiError(401, "Invalid or missing API key.", code="invalid_api_key")

    def _models(self, rid: str) -> Response:
        created = int(time.time())
        data: list[dict[str, Any]] = []
        for m in self.registry.models.values():
            data.append({"id": m.name, "object": "model", "created": created, "owned_by": "llmgw",
                         "root": m.name, "parent": None, "replicas": len(m.replicas)})
            for a in sorted(m.adapters):
                data.append({"id": a, "object": "model", "created": created, "owned_by": "llmgw",
                             "root": a, "parent": m.name, "replicas": len(m.adapters[a])})
        return Response(200, [("content-type", _JSON), (self.rid_header, rid)],
                        json.dumps({"object": "list", "data": data}).encode())

    # -- the request path ---------------------------------------------------------------------
    async def _proxy(self, req: Request, kind: str, rid: str) -> Response:
        started = trio.current_time()
        body = parse_body(req.body, kind=kind)
        resolved = self.registry.resolve(body.model)
        if resolved is None:
            raise ApiError(404, f"The model `{body.model}` does not exist.", param="model",
                           code="model_not_found")
        entry, adapter = resolved
        strategy = self._strategy(entry, req.header(STRATEGY_HEADER))
        info = RequestInfo(request_id=rid, model=body.model, base_model=entry.name, adapter=adapter,
                           session_key=req.header("x-session-id") or body.session_key,
                           prompt_tokens_estimate=body.prompt_chars // 4, strategy=strategy.name)
        await self._admit(entry, rid)
        headers = [("content-type", "application/json"), ("x-request-id", rid)]
        tried: set[str] = set()
        last_error: UpstreamError | None = None
        # Tier-1 cache affinity: the head the engine caches first, recorded for the chosen replica.
        head = request_head(body.obj, kind) if kind != "embeddings" else b""
        salt = body.obj.get("cache_salt") if isinstance(body.obj.get("cache_salt"), str) else None
        attempts = 0
        while attempts < self.cfg.router.max_attempts:
            if head:
                self.prefix.prepare(info, head, cache_salt=salt)
            rep, decision = self._decide(entry, info, strategy, tried)
            if rep is not None and not self.caps.try_reserve(rep.id):
                # Every pool was saturated and the preferred one was kept: its cap is full.
                # Wait for capacity like any saturated request, then decide again.
                if head:
                    self.prefix.forget(info)
                await self._admit(entry, rid, force_wait=True)
                continue
            attempts += 1
            if head:
                now = trio.current_time()
                outcome = self.prefix.after_pick(info, head, decision.chosen, now, cache_salt=salt,
                                                 decision=decision).outcome
                if decision.chosen:
                    self.registry.cache_stats.decision(entry.name, decision.chosen, outcome == "hit", now)
                self._check_prefix_alarm()
            if rep is None:
                break
            tried.add(rep.id)
            result = await self._attempt(rep, decision, req, headers, body.stream, entry.name, rid, started)
            if isinstance(result, Response):
                return result
            last_error = result
        self.metrics.request_done(entry.name, "failed", 502 if last_error else 503, None, None)
        if last_error is None:
            raise ApiError(503, f"No replica of `{entry.name}` can serve this request now.",
                           type_="service_unavailable", headers=[("retry-after", "1")])
        if isinstance(last_error, UpstreamTimeout):
            raise ApiError(504, f"The engine did not answer in time ({last_error.phase}).",
                           type_="timeout")
        raise ApiError(502, f"No replica could serve the request: {last_error}", type_="bad_gateway")

    def _strategy(self, entry: ModelEntry, asked: str | None) -> Strategy:
        name = asked or entry.strategy
        s = self._strategies.get(name)
        if s is None:
            try:
                s = resolve(name)
            except StrategyError as e:
                known = ", ".join(sorted({*self._strategies, "chat", "batch", "long-context"}))
                raise ApiError(400, f"unknown strategy {name!r}; known: {known}", param=STRATEGY_HEADER) from e
            self._strategies[name] = s
        return s

    def _configured_strategies(self) -> dict[str, Strategy]:
        """[[strategies]] from the config (a preset's name replaces the preset)."""
        out = {}
        for sc in self.cfg.strategies:
            w = sc.weights
            weights = {k: getattr(w, k) for k in ("load", "queue", "kv", "inflight", "weight", "session", "prefix")
                       if getattr(w, k) > 0 and k in self.sched.scorers}
            out[sc.name] = Strategy(sc.name, weights, sc.picker, sc.temperature)
        return out

    def _decide(self, entry: ModelEntry, info: RequestInfo, strategy: Strategy,
                tried: set[str]) -> tuple[Replica | None, Decision]:
        now = trio.current_time()
        views = self.registry.views(entry, now)
        if tried:
            views = [v for v in views if v.id not in tried]
        d = self.sched.decide(info, views, strategy, now=now, wall=time.time(), rng=self.rng)
        self.decisions.append(d)
        self.metrics.decision(d)
        return (self.registry.replicas[d.chosen] if d.chosen else None), d

    async def _admit(self, entry: ModelEntry, rid: str, *, force_wait: bool = False) -> None:
        """Hold the request while every replica of the model is saturated (bounded, with a deadline)."""
        cfg = self.sched.config
        q = self.queues.get(entry.name)
        if q is None:
            q = self.queues[entry.name] = WaitQueue(self.cfg.router.queue_size)

        def saturated() -> bool:
            # Replicas behind an open breaker don't count: waiting cannot help them, and the
            # scheduler's all-open fallback handles a model with none available.
            now = trio.current_time()
            live = [r for r in entry.replicas if r.breaker.can_pass(now)]
            return bool(live) and all(is_saturated(r.view, cfg) for r in live)

        if not force_wait and q.admit_now(saturated):
            return
        now = trio.current_time()
        ticket = q.enqueue(rid, now + self.cfg.router.queue_timeout_s, now)
        drain = sum(r.view.drain_rate or 0.0 for r in entry.replicas) or None
        if ticket is None:
            self.metrics.rejected(entry.name, "queue_full")
            raise ApiError(429, "All replicas are saturated and the wait queue is full.", type_="rate_limit",
                           code="saturated", headers=[("retry-after", str(suggest_retry_after(len(q), drain)))])
        event = self._wakers[rid] = trio.Event()
        try:
            with trio.move_on_at(ticket.deadline):
                await event.wait()
                return
            q.cancel(ticket)
            self.metrics.rejected(entry.name, "queue_timeout")
            raise ApiError(429, "All replicas stayed saturated; try again later.", type_="rate_limit",
                           code="saturated", headers=[("retry-after", str(suggest_retry_after(len(q), drain)))])
        except BaseException:
            q.cancel(ticket)
            raise
        finally:
            self._wakers.pop(rid, None)

    def _capacity_freed(self, entry_name: str) -> None:
        q = self.queues.get(entry_name)
        if not q:
            return
        entry = self.registry.models[entry_name]
        cfg = self.sched.config
        for t in q.on_capacity(1, saturated=lambda: all(is_saturated(r.view, cfg) for r in entry.replicas)):
            # one finished request frees room for one waiter
            ev = self._wakers.get(t.request_id)
            if ev is not None:
                ev.set()

    async def _attempt(self, rep: Replica, decision: Decision, req: Request, headers: list[tuple[str, str]],
                       stream: bool, model: str, rid: str, started: float) -> Response | UpstreamError:
        """One try on one replica. Returns the client's Response, or the error to try another with."""
        now = trio.current_time()
        forced = bool(decision.note) and not rep.breaker.can_pass(now)
        permit = rep.breaker.allow(now, force=forced)
        if permit is Permit.DENY:
            self.caps.release(rep.id)
            return UpstreamConnectError(f"breaker of {rep.id} is open")
        rc = self.cfg.router
        v = rep.view
        v.inflight += 1
        try:
            # The exchange's own __aenter__: on failure it has closed its connection, and its
            # __aexit__ is only resp.close(), which the body's end calls (no exit stack, no
            # shielded scope a request).
            resp = await self.pool.stream(
                v.url, "POST", req.target, headers, req.body, connect_timeout=rc.connect_timeout_s,
                first_byte_timeout=rc.first_byte_timeout_s, idle_timeout=rc.idle_timeout_s).__aenter__()
        except UpstreamError as e:
            self._finish(rep, model, e, started, None, permit, rid=rid)
            return e
        except BaseException:
            self._finish(rep, model, "cancelled", started, None, permit, rid=rid)
            raise
        if resp.status >= 500:
            resp.close()
            err = UpstreamProtocolError(f"{rep.id} answered {resp.status}")
            self._finish(rep, model, err, started, None, permit, status=resp.status, rid=rid)
            return err
        out_headers = [("content-type", resp.header("content-type") or _JSON), (self.rid_header, rid),
                       ("x-llmgw-endpoint", rep.id)]
        if resp.status == 200 and stream:
            out_headers.append(("cache-control", "no-cache"))
        return Response(resp.status, out_headers, _Relay(self, resp, rep, model, started, permit, stream, rid))

    async def _relay(self, resp: UpstreamResponse, rep: Replica, model: str, started: float, permit: Permit,
                     stream: bool, rid: str, sink: BodySink) -> None:
        """The body of a proxied response: the upstream's, relayed to the client as it arrives
        (the pool's relay task writes each read to the client's socket: no task switch a
        chunk); then the bookkeeping. Cancelled when the client leaves."""
        outcome: Any = "cancelled"
        try:
            await resp.relay(sink)
            outcome = "ok"
        except UpstreamError as e:
            outcome = e
            if stream:
                # Headers are gone: tell an SSE client in-band, as OpenAI does, then end cleanly.
                msg = json.dumps({"error": {"message": f"upstream failed mid-stream: {e}", "type": "bad_gateway",
                                            "param": None, "code": 502}})
                if not sink.send_nowait(f"data: {msg}\n\n".encode()):
                    await sink.drain()
        finally:
            resp.close()  # synchronous: a body not read to its end closes the upstream connection now
            self._finish(rep, model, outcome, started, resp.first_byte_at, permit, status=resp.status, rid=rid)

    def _finish(self, rep: Replica, model: str, outcome: Any, started: float, first: float | None,
                permit: Permit, status: int | None = None, rid: str = "") -> None:
        v = rep.view
        v.inflight -= 1
        self.caps.release(rep.id)
        rep.completed += 1
        now = trio.current_time()
        b = rep.breaker
        if outcome == "ok":
            b.on_success(now)
            self.metrics.request_done(model, "ok", status or 200, first and first - started, now - started)
        elif outcome == "cancelled":
            b.on_failure(now, FailureKind.CLIENT_CANCEL)
            self.metrics.request_done(model, "client_cancelled", 499, first and first - started, now - started)
        else:
            kind = (FailureKind.CONNECT if isinstance(outcome, UpstreamConnectError) else
                    FailureKind.TIMEOUT if isinstance(outcome, UpstreamTimeout) else
                    FailureKind.RESET if isinstance(outcome, UpstreamClosed) else FailureKind.HTTP_5XX)
            b.on_failure(now, kind)
            self.metrics.upstream_error(rep.id, kind.value if hasattr(kind, "value") else str(kind))
            if first is not None:  # it failed after the client got bytes: the request is done
                self.metrics.request_done(model, "upstream_failed", 502, first - started, now - started)
        if permit is Permit.PROBE and outcome == "cancelled":
            b.release_probe()
        self._capacity_freed(v.model)
        if log.isEnabledFor(logging.INFO):  # the access log: one JSON line per attempt
            log.info("request %s", outcome if isinstance(outcome, str) else f"failed: {outcome}",
                     extra={"request_id": rid, "model": model, "endpoint": rep.id, "status": status,
                            "outcome": outcome if isinstance(outcome, str) else type(outcome).__name__,
                            "ttft_ms": None if first is None else round((first - started) * 1e3, 2),
                            "latency_ms": round((now - started) * 1e3, 2)})


    def _check_prefix_alarm(self) -> None:
        """Log when prefix hits stay at zero while traffic shares prefixes (and when it clears):
        the silent failure mode of affinity routing. Checked every 64 decisions."""
        self._alarm_tick += 1
        if self._alarm_tick % 64:
            return
        on = self.prefix.zero_hit_alarm(trio.current_time())
        if on != self._alarm_on:
            self._alarm_on = on
            if on:
                log.warning("prefix routing: zero cache-affinity hits although requests share prefixes "
                            "(check the strategy's prefix weight, cache_salt use and replica capacities)")
            else:
                log.info("prefix routing: affinity hits again")

    def _capacity_known(self, rep: Replica) -> None:
        """The engine told us what its cache holds (vLLM's cache_config_info): the prefix index
        ages this replica's holdings against it instead of assuming it keeps everything."""
        res = rep.last_scrape
        if rep.slots:
            self.prefix.set_capacity(rep.id, Capacity.llamacpp(rep.slots))
        elif res is not None and res.kv_blocks and res.block_size:
            self.prefix.set_capacity(rep.id, Capacity.vllm(res.kv_blocks, res.block_size))


class _Relay:
    """A proxied response's body (httpserver's RelayBody): Router._relay, once."""
    __slots__ = ("model", "permit", "rep", "resp", "rid", "router", "started", "stream", "used")

    def __init__(self, router: Router, resp: UpstreamResponse, rep: Replica, model: str, started: float,
                 permit: Permit, stream: bool, rid: str) -> None:
        self.router, self.resp, self.rep, self.model, self.started = router, resp, rep, model, started
        self.permit, self.stream, self.rid = permit, stream, rid
        self.used = False

    async def relay(self, sink: BodySink) -> None:
        if self.used:
            raise RuntimeError("a response body can be relayed once")
        self.used = True
        await self.router._relay(self.resp, self.rep, self.model, self.started, self.permit, self.stream,
                                 self.rid, sink)

    async def aclose(self) -> None:
        """relay() never ran (e.g. a HEAD request): close the upstream side, book it as cancelled."""
        if not self.used:
            self.used = True
            self.resp.close()
            self.router._finish(self.rep, self.model, "cancelled", self.started, None, self.permit,
                                status=self.resp.status, rid=self.rid)


def _consteq(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
