"""The router's core: one request from its parsed body to the replica that serves it, and the
bookkeeping when each attempt ends. Pure — the trio shell (``llmgw.daemon.router.proxy``) does
the I/O and passes ``now`` (monotonic) and ``wall`` (Unix) in.

The shell asks three things, and the answers carry everything it then does:

1. ``plan(...)`` once per request: parse the body, resolve the model (or adapter), pick the
   strategy, build the :class:`~.types.RequestInfo` the scorers read (head and cache_salt
   included) — :mod:`.planner` — and note whether tier 2's step is to come. Raises
   :class:`~.openai_req.ApiError` for a bad request.
2. ``next(plan, now, wall)`` once per attempt: tier 2's step first (:mod:`.tier2`: the prompt's
   KV block hashes, from its cache or by asking the shell), admission (a bounded wait while
   every replica is saturated, by priority band and fair share: :mod:`.waiting`), the decision (filter → score → pick,
   kept in the decision ring and counted), the permits (cap, breaker, inflight: an
   :class:`~.attempt.Attempt`), the commit that lets stateful scorers learn the pick. The
   answer is an Attempt to send upstream, or something to do first and then ask again — a
   :class:`~.admission.Ticket` to wait on, a :class:`~.adapters.Load` of the request's LoRA
   adapter to wait on (reported with ``adapters.waited``), a :class:`~.tier2.Tokenize` call to
   make and answer with ``tokenized(plan, step, now, status, body, error)`` — or an ApiError
   raised (429 when the queue is full, 502/503/504 when no attempt is left), already counted.
   A waiter displaced from a full queue (:mod:`.fair_queue`: by a higher band's arrival, or by
   a tenant with less queued) is woken (``displaced``) and its ``next`` raises the 429.
3. ``finish(plan, attempt, now, failure, ...)`` once per attempt that went out: the permits go
   back exactly once, the request is counted where it ended, and the answer is the waiting
   tickets that may now proceed (``attempt.waiters``: some still wait).

A disaggregated model's long prompt (``[models.pd]``, :mod:`.pd`, :mod:`.pd_step`) first gets an
Attempt whose ``phase`` is ``"prefill"``: its own decision among the prefill replicas, a
prefill-only body. The shell reads its whole answer and reports with ``prefilled(plan, attempt,
now, failure, status=, data=)`` instead of ``finish``; the next ``next`` decides the decoder, whose
attempt (``phase`` ``"decode"``) carries the prefiller's ``kv_transfer_params`` and ends with
``finish`` like any. A prefiller that cannot be reached is replaced by another; a prefill that
fails in any other way falls back to the decoder prefilling.

RouterCore's admission half (waiting, giving up a place, waking waiters) is
:mod:`.dispatch_admission`, what the metrics exporter reads :mod:`.dispatch_reads`.

Besides a request's steps the shell only tells the core what happened (replicas placed and
withdrawn, scrapes, adapters listed, requests it answered itself: ``answered``) and reads what it
exports, by the methods below — never through the core's members.

A waiting request that gives up calls ``left_queue`` (the client went away, or its deadline
passed: then a 429 is raised and counted).

An engine's 5xx follows the request, not the replica: the first 5xx is retried elsewhere with
its breaker verdict held back (``Plan.suspect``); a second 5xx from another replica marks the
request as poison — the client gets that engine's error, neither breaker counts it, and
``llmgw_poison_requests_total`` does; any other end settles the held verdict (a success
elsewhere proves the first replica at fault)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from llmgw.config import Config, ModelConfig

from .adapter_port import AdapterPort
from .adapter_routing import AdapterRouting
from .adapters import AdapterSettings, Load
from .admission import ConcurrencyCaps, Ticket
from .attempt import Attempt, first_byte_timeout
from .breaker import NO_SLOT, FailureKind, Permit
from .cache_stats import CacheStats
from .counters import RouterCounters
from llmgw.inputs.echo import echo
from .kv_scorer import KvCacheScorer
from .load_report import LoadReport
from .lora_body import request_body
from .prefix_scorer import PrefixRouting, PrefixScorerConfig
from .prefix_share import PrefixOutbox, PrefixShare
from .dispatch_admission import Admission
from .dispatch_reads import ExporterReads
from .openai_req import ApiError
from .pd import PdStats, role_views
from .pd_step import PdSteps
from .plan import Plan
from .planner import Planner
from .prefix_capacity import Capacity, PrefixConfig
from .replicas import ModelEntry, Replica, ReplicaTable
from .scheduler import Scheduler
from .tier2 import Tier2, Tokenize
from .trace import AttemptRecord, Trace, TraceRing, upstream_headers
from .traceparent import new_span_id
from .types import Decision, SchedulerConfig, TenantTag
from .waiting import WaitRoom

__all__ = ["KINDS", "RouterCore"]
KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
_ALARM_EVERY = 64  # decisions between two looks at the prefix zero-hit alarm


class RouterCore(Admission, ExporterReads):
    def __init__(self, cfg: Config, table: ReplicaTable, *, cache_stats: CacheStats,
                 wall: Callable[[], float], rng: random.Random, clock: Callable[[], float] | None = None,
                 ids: Callable[[int], int] | None = None) -> None:
        """`clock`: seconds, for measuring tier 2's step and hashing (None: not measured). `ids`:
        random bits (``getrandbits``) for the traces' W3C trace and span ids (None: a fixed-seed
        generator, for tests; the shell passes its own, unseeded)."""
        self.cfg = cfg
        self.table = table
        rc = cfg.router
        self.rc = rc
        pc = rc.prefix
        self.prefix = PrefixRouting(
            PrefixConfig(budget_bytes=int(pc.budget_mb * (1 << 20))),
            PrefixScorerConfig(guard=pc.guard, abs_gap=pc.abs_gap, rel_gap=pc.rel_gap,
                               spill_factor=pc.spill_factor, spill_slack=pc.spill_slack))
        # tier 2: its index lookup is set by the shell (use_kv_index)
        self.kv_cache = KvCacheScorer()
        self.prefix.defer = self.kv_cache.verdict  # where tier 2 knows the holders, tier 1 votes its shares
        self.prefix.deny = self.kv_cache.denied  # where it knows a replica holds none, tier 1's guess is void
        self.prefix.peer_sent = self.kv_cache.peer_sent  # unless it was sent there lately (by a peer too)
        self._share: PrefixShare | None = None  # routing as one: tier 1 shared with other routers
        self.sched = Scheduler(SchedulerConfig(kv_ceiling=rc.kv_ceiling, saturation_load=rc.saturation_load),
                               scorers={**self.prefix.scorers(), "kv_cache": self.kv_cache})
        self.cache_stats = cache_stats
        self.counters = RouterCounters(wall)
        self.rng = rng
        # Every request's trace, in a bounded ring; on_trace_end (the shell's JSONL writer) sees
        # each one as it ends.
        self.traces = TraceRing(rc.traces.kept)
        self.on_trace_end: Callable[[Trace], None] | None = None
        self.ids = ids if ids is not None else random.Random(0x7ACE).getrandbits
        self.planner = Planner(cfg, table, self.sched.scorers, self.traces, wall=wall, rng=rng,
                               refused=lambda t, now, status: self._trace_done(t, now, "rejected", status),
                               ids=self.ids, head_limit=self.prefix.index.config.max_head_bytes)
        self.tier2 = Tier2(cfg, clock=clock)  # tier 2's step (kv_events models)
        # Per-replica caps (a pool's max_inflight_per_replica), taken check-and-reserve.
        self.caps = ConcurrencyCaps()
        for rep in table.all_replicas():
            self.caps.set_cap(rep.id, rep.view.max_inflight)
        self.decisions: deque[Decision] = deque(maxlen=rc.decisions_kept)
        self.wait = WaitRoom(rc.queue_size, self.sched.config, table, fifo=rc.queue_order == "fifo")  # the models' wait queues
        self.queues = self.wait.queues
        self.alarm_on = False
        self._alarm_news: bool | None = None  # a change of alarm_on the shell has not logged yet
        self._alarm_tick = 0
        self.load = LoadReport(table, self.wait, self.counters)  # what the autoscaler reads (load_report.py)
        self.adapters = AdapterRouting(self, AdapterSettings(backoff_s=rc.adapter_backoff_s,
                                                             backoff_max_s=rc.adapter_backoff_max_s))
        for rep in table.all_replicas():
            self.adapters.add_replica(rep)
        self.pd_stats = PdStats(wall)
        self.pd = PdSteps(self, self.pd_stats)  # prefill/decode disaggregation's steps (pd_step.py)

    # -- 1. the request ------------------------------------------------------------------------
    def plan(self, kind: str, body: bytes, rid: str, *, strategy: str | None, session: str | None,
             now: float, revision: str | None = None, internal: bool = False,
             traceparent: str | None = None, tracestate: str | None = None,
             tenant: TenantTag | None = None) -> Plan:
        """The request, planned (:meth:`.planner.Planner.plan`): its model, strategy and
        RequestInfo, its trace (in the client's W3C trace when `traceparent` is valid), and
        whether tier 2's step is to come (a kv_events model under a strategy that weighs it).
        `tenant`: who sent it (its band, weight and cost in the wait queue); None: the anonymous
        tenant "-", band normal, weight 1, cost the prompt estimate."""
        plan = self.planner.plan(kind, body, rid, strategy=strategy, session=session, now=now,
                                 revision=revision, internal=internal, traceparent=traceparent,
                                 tracestate=tracestate, tenant=tenant)
        plan.tier2 = self.tier2.wants(plan)
        if plan.entry.pd is not None:
            try:
                self.pd.planned(plan, kind)  # split (a prefill step first) or not
            except ApiError as e:  # a client's own kv_transfer_params
                self._done(plan, "rejected", e.status, None, None, now)
                e.counted = True
                raise
        if not internal:
            self.load.arrived(plan.model)
        return plan

    def set_strategies(self, configs: Any) -> None:
        """A reloaded config's [[strategies]] (StrategyConfig), in force from the next request."""
        self.planner.set_strategies(configs)

    def set_canary(self, model: str, share: float) -> None:
        """Send `share` (0–1) of `model`'s client requests to its candidate revision (0: none)."""
        self.planner.set_canary(model, share)

    def set_revision(self, key: str, revision_id: str) -> None:
        """The revision id a model (or a candidate's key) serves, for its requests' traces ("": none)."""
        self.planner.set_revision(key, revision_id)

    # -- tier 2's step -------------------------------------------------------------------------
    def tokenized(self, plan: Plan, ask: Tokenize, now: float, status: int | None, body: bytes = b"",
                  error: str = "") -> None:
        """The shell's answer to a :class:`~.tier2.Tokenize` step ``next`` gave: the engine's
        status and body, or (status None) ``error`` — "timeout" or the failure's name. Then ask
        ``next`` again."""
        self.tier2.answer(plan, ask, status, body, error, now)

    def use_kv_index(self, lookup: Callable[[Sequence[int]], Any], alarmed: Callable[[str], bool],
                     held_any: Callable[[int], bool]) -> None:
        """Tier 2 votes with the router's index of what each engine holds (`lookup`: the leading
        blocks each replica holds; `alarmed`: a replica whose parity check failed), and hashes a
        prompt only as far as any replica holds it (`held_any`)."""
        self.kv_cache.lookup = lookup
        self.kv_cache.alarmed = alarmed
        self.tier2.held_any = held_any

    def watch_tier2(self, observe: Callable[[float], None]) -> None:
        """`observe` gets each request's tier-2 step time (seconds of the injected clock)."""
        self.tier2.observe = observe

    # -- 2. an attempt ---------------------------------------------------------------------------
    def next(self, plan: Plan, now: float, wall: float) -> Attempt | Ticket | Load | Tokenize:
        """... or a :class:`~.adapters.Load` of the request's LoRA adapter to wait on (then the
        shell reports with ``adapters.waited`` and asks again), or tier 2's
        :class:`~.tier2.Tokenize` to answer (:meth:`tokenized`, then ask again)."""
        t = plan.ticket
        if t is not None and t.displaced:  # a full queue gave its place away: the 429
            plan.ticket = None
            self._settle(plan, now, count=True)
            raise self._reject(plan, now, "queue_displaced",
                               f"All replicas are saturated and the wait queue is full ({t.displaced_by}).")
        if plan.tier2:
            ask = self.tier2.step(plan, now)
            if ask is not None:
                return ask
        entry = plan.entry
        if plan.ticket is None and not plan.admitted and self.wait.cold(entry):
            # no replica yet (scaled to zero, or starting): wait for one — an adapter's request too,
            # before its load is planned (there is nowhere to load it yet)
            return self._enqueue(plan, now, cold=True)
        if entry.on_demand(plan.info.adapter):
            step = self.adapters.step(plan, now)
            if step is not None:
                return step
        if plan.ticket is not None:  # it waited: let through, or still in the queue
            if plan.ticket in self.wait.queue(entry):
                return plan.ticket
            plan.ticket = None
            plan.admitted = True
            self.wait.let_through(plan, t)  # type: ignore[arg-type]  # t is plan.ticket: not None here
        elif not plan.admitted:
            if self.wait.queue(entry).admit_now(lambda: self.wait.saturated(entry, now)):
                plan.admitted = True
            else:
                return self._enqueue(plan, now)
        if plan.pd == "prefill":  # a disaggregated model's long prompt: its prefill first (pd_step.py)
            pre = self.pd.prefill(plan, now, wall)
            if pre is not None:
                return pre
        table = self.table
        sched = self.sched
        info = plan.info
        trace = plan.trace
        if trace is not None:
            last = trace.attempts[-1] if trace.attempts else None
            trace.mark("decide", now, note="" if last is None or last.outcome == "ok" else
                       f"retry after attempt {last.n}: {last.outcome}: {last.error}")
        while plan.attempts < self.rc.max_attempts + plan.prefills:
            tried = plan.tried
            d, plan.predecided = plan.predecided, None  # the prefill step's cache check decided it (pd_step.py)
            if d is None:
                views = table.views(entry, now)
                if plan.pd:  # disaggregated: decode and both replicas (a prefiller only prefills)
                    views = role_views(views, "decode")
                if tried:
                    views = [v for v in views if v.id not in tried]
                d = sched.decide(info, views, plan.strategy, now=now, wall=wall, rng=self.rng, commit=False)
            d.tenant, d.band, d.share = self.wait.admission_of(plan)
            if plan.kv_params is not None:
                d.phase = "decode"
            self.decisions.append(d)
            self.counters.decision(d)
            if trace is not None:
                trace.decisions += 1
            chosen = d.chosen
            permit = Permit.DENY
            if chosen is not None:
                if not self.caps.try_reserve(chosen):
                    # Every pool was saturated and the preferred one was kept: its cap is full.
                    # Wait for capacity like any saturated request, then decide again.
                    return self._enqueue(plan, now)
                rep = table.replicas[chosen]
                # every breaker open (d.fallback): probe this one early, within its probe limit
                permit = rep.breaker.allow(now, force=d.fallback)
                if permit is Permit.DENY:
                    self.caps.release(chosen)
                    if d.fallback:  # its probe slots are taken: wait for one, don't fail
                        return self._enqueue(plan, now)
            plan.attempts += 1
            if chosen is None:
                sched.commit(d, info, now)
                self._after_commit(d, entry, now)
                break
            tried.add(chosen)
            if permit is Permit.DENY:
                plan.failure, plan.detail = FailureKind.CONNECT, f"breaker of {chosen} is open"
                continue
            sched.commit(d, info, now)
            self._after_commit(d, entry, now)
            a = Attempt(rep, self.caps, permit, d, plan.started)
            try:  # llama.cpp with declared adapters: the explicit per-request list (lora_body)
                a.body = request_body(plan.raw, plan.body, entry, rep, info.adapter)
            except LookupError as e:  # the scheduler keeps only replicas that can: not expected
                a.end(now, None, verdict=False)
                plan.failure, plan.detail = FailureKind.CONNECT, str(e)
                continue
            if info.adapter is not None:  # an adapter with a request in flight is never unloaded
                self.adapters.book.acquire(chosen, info.adapter, now)
            a.alarm, self._alarm_news = self._alarm_news, None
            a.first_byte_timeout = first_byte_timeout(self.rc, plan, rep)
            if trace is not None:
                if trace.attempts and trace.attempts[-1].phase != "prefill":  # a prefill step is not a try
                    trace.attempts[-1].retried = True
                a.record = AttemptRecord(plan.attempts, chosen, rep.node, trace.revision,
                                         trace.decisions - 1, now, new_span_id(self.ids))
                trace.attempts.append(a.record)
                a.trace_headers = upstream_headers(trace, a.record)
            if plan.kv_params is not None:
                self.pd.decode_body(plan, a)  # the prefiller's kv_transfer_params ride along
            plan.retry_5xx = plan.suspect is None and plan.attempts < self.rc.max_attempts
            return a
        self._settle(plan, now, count=True)
        raise self._exhausted(plan, now)

    def _settle(self, plan: Plan, now: float, *, count: bool) -> None:
        """The held-back verdict of a replica that answered this request 5xx: counted now (no
        sign of poison), or dropped (the client left before we could tell)."""
        rep, plan.suspect = plan.suspect, None
        if rep is not None and count:
            rep.breaker.on_failure(now, FailureKind.HTTP_5XX, NO_SLOT)

    def _after_commit(self, d: Decision, entry: ModelEntry, now: float) -> None:
        if d.prefix is None:
            return
        self.cache_stats.decision(entry.name, d.chosen, d.prefix == "hit", now)  # type: ignore[arg-type]
        # The silent failure mode of affinity routing: prefix hits stay at zero while traffic
        # shares prefixes. Looked at every 64 decisions; the shell logs a change.
        self._alarm_tick += 1
        if self._alarm_tick % _ALARM_EVERY:
            return
        on = self.prefix.zero_hit_alarm(now)
        if on != self.alarm_on:
            self.alarm_on = self._alarm_news = on

    def _exhausted(self, plan: Plan, now: float) -> ApiError:
        f = plan.failure
        if f is None:
            e = ApiError(503, f"No replica of {echo(plan.model, quote='`')} can serve this request now.",
                         type_="service_unavailable", headers=[("retry-after", "1")])
        elif f is FailureKind.TIMEOUT:
            e = ApiError(504, f"The engine did not answer in time ({plan.detail}).", type_="timeout")
        else:
            e = ApiError(502, f"No replica could serve the request: {plan.detail}", type_="bad_gateway")
        self._done(plan, "failed", e.status, None, None, now)
        e.counted = True
        return e

    def _done(self, plan: Plan, outcome: str, code: int, ttft: float | None, latency: float | None,
              now: float) -> None:
        """The request ended here: its one count (a second call is a bug, and is not counted)."""
        if not plan.counted:
            plan.counted = True
            self.counters.request_done(plan.model, outcome, code, ttft, latency)
            if plan.internal:
                self.counters.internal_done(plan.model, outcome != "ok" and (code >= 500 or outcome == "failed"), ttft)
            if plan.trace is not None:
                self._trace_done(plan.trace, now, outcome, code)

    def _trace_done(self, trace: Trace, now: float, outcome: str, code: int | None) -> None:
        if trace.end(now, outcome, code) and self.on_trace_end is not None:
            self.on_trace_end(trace)

    # -- 3. the end of an attempt -------------------------------------------------------------------
    def finish(self, plan: Plan, attempt: Attempt, now: float, failure: FailureKind | None, *,
               first_byte_at: float | None, status: int | None, detail: str = "") -> list[Ticket]:
        """``failure``: None when the answer was relayed to its end, else how the attempt failed
        (``FailureKind.CLIENT_CANCEL`` when the client left). ``status``: the engine's, when it
        answered. An engine's 5xx is ``failure=HTTP_5XX`` when the shell dropped it to retry
        (only while ``plan.retry_5xx``), else the relayed answer's status. Idempotent."""
        if attempt.ended:
            return []
        if attempt.phase:
            detail += self.pd.decode_ended(plan, attempt, failure, first_byte_at)
        if attempt.record is not None and plan.trace is not None:
            plan.trace.attempt_ended(attempt.record, attempt.sent_at, attempt.connected_at, attempt.head_at,
                                     first_byte_at, now, status, "ok" if failure is None else failure.value,
                                     detail, attempt.bytes_in)
        rep = attempt.replica
        self.kv_cache.ended(rep.id, plan.info, now)  # its blocks' events are due by a settle time from now
        if plan.info.adapter is not None:
            self.adapters.release(rep.id, plan.info.adapter, now)
        was_closed = rep.breaker.state == "closed"
        model = plan.model
        started = plan.started
        ttft = None if first_byte_at is None else first_byte_at - started
        c = self.counters
        if status is not None and status >= 500:
            c.upstream_error(rep.id, FailureKind.HTTP_5XX.value)
            if failure is FailureKind.HTTP_5XX and plan.retry_5xx:
                # dropped, to be retried elsewhere: the verdict waits for the next replica's word
                attempt.end(now, failure, verdict=False)
                plan.suspect, plan.failure, plan.detail = rep, failure, detail
            else:
                poison = plan.suspect is not None and plan.suspect is not rep
                if poison:  # a second replica failed it the same way: the request is the fault
                    plan.suspect = None
                    c.poisoned(model)
                cancelled = failure is FailureKind.CLIENT_CANCEL
                attempt.end(now, failure if cancelled else FailureKind.HTTP_5XX, verdict=not poison)
                self._settle(plan, now, count=not cancelled)
                if cancelled:
                    self._done(plan, "client_cancelled", 499, ttft, now - started, now)
                elif failure is None:  # the engine's error, relayed as its answer
                    self._done(plan, "engine_error", status, ttft, now - started, now)
                else:
                    self._done(plan, "upstream_failed", 502, ttft, now - started, now)
        else:
            attempt.end(now, failure)
            self._settle(plan, now, count=failure is not FailureKind.CLIENT_CANCEL)
            if failure is None:  # an engine's own 4xx is its answer (the engine is alive), not "ok"
                code = status or 200
                self._done(plan, "ok" if code < 400 else "engine_error", code, ttft, now - started, now)
            elif failure is FailureKind.CLIENT_CANCEL:
                self._done(plan, "client_cancelled", 499, ttft, now - started, now)
            else:
                c.upstream_error(rep.id, failure.value)
                plan.failure, plan.detail = failure, detail
                if first_byte_at is not None:  # it failed after the client got bytes: the request is done
                    self._done(plan, "upstream_failed", 502, ttft, now - started, now)
        rep.completed += 1
        attempt.waiters = bool(self.queues.get(model))
        if not was_closed and rep.breaker.state == "closed":
            # recovered: every request waiting (e.g. for a probe slot) may try again now
            return self.capacity_freed(rep.view.model, everyone=True)
        return self.capacity_freed(rep.view.model, now)

    def prefilled(self, plan: Plan, attempt: Attempt, now: float, failure: FailureKind | None, *,
                  status: int | None, data: bytes = b"", detail: str = "") -> list[Ticket]:
        """A prefill attempt (``attempt.phase == "prefill"``) ended: ``failure`` None with the
        prefiller's ``status`` and whole answer ``data``, else how the exchange failed
        (``CLIENT_CANCEL``: the client left — the request ends, counted). Then ask ``next`` for the
        decode attempt (:meth:`.pd_step.PdSteps.prefilled`)."""
        return self.pd.prefilled(plan, attempt, now, failure, status=status, data=data, detail=detail)

    # -- what the shell counts and reads besides a request's steps -------------------------------
    def answered(self, outcome: str, status: int) -> None:
        """A request the shell answered without a plan (``/v1/models``, the router's own refusals,
        the HTTP server's 413/431/400/408, a bug): its one count, under model "-"."""
        self.counters.request_done("-", outcome, status, None, None)

    def refused(self, plan: Plan, now: float, status: int) -> None:
        """The shell refused the planned request before any attempt (tenancy: 403 for its model,
        429 for a quota): its one count, under its model, and its trace ends."""
        self._done(plan, "rejected", status, None, None, now)

    def failed(self, plan: Plan) -> None:
        """A bug on the request's path: its one count (if not counted yet), under its model, as
        the 500 the server answers."""
        if not plan.counted:
            plan.counted = True
            self.counters.request_done(plan.model, "failed", 500, None, None)

    def model_changed(self, model: str) -> None:
        """`model` was redefined: its adapters or max_loaded_adapters may differ."""
        self.adapters.model_changed(model)

    def adapter_port(self) -> AdapterPort:
        """The adapter state machine's face to the shell (the loader, its metrics, the admin API)."""
        return AdapterPort(self.adapters, self.table, self.rc.adapter_load_timeout_s)

    def prefix_share(self, limit: int = 8192) -> PrefixShare:
        """Routing as one (several routers, :mod:`.prefix_share`): from this call on, each
        decision's prefix insert waits in an outbox of ``limit`` for the shell to send to the
        other routers, and the share applies theirs here. The same share at every call."""
        if self._share is None:
            reps = self.table.replicas
            self.prefix.share = outbox = PrefixOutbox(limit)
            self._share = PrefixShare(outbox, self.prefix.apply_peer,
                                      lambda rid: r.view.model if (r := reps.get(rid)) is not None else None)
        return self._share

    # -- replicas coming and going -------------------------------------------------------------------
    def add_replica(self, m: ModelConfig, rid: str, url: str, *, pool: str, weight: float,
                    node: str | None = None, role: str = "both") -> tuple[Replica, list[Ticket]]:
        """Place (or keep) a replica; the tickets that may proceed now that it is there."""
        table = self.table
        table.add_model(m)
        rep = table.replicas.get(rid)
        if rep is not None and rep.view.url == url.rstrip("/") and rep.view.role == role:
            was_draining, rep.draining = rep.draining, False
            # kept instead of drained: its room is back, every waiter may try
            return rep, self.capacity_freed(m.name, everyone=True) if was_draining else []
        if rep is not None:  # restarted elsewhere on the node: a fresh replica, fresh state
            self.remove_replica(rid)
        rep = table.add_replica(m, rid, url, pool, weight, role)
        rep.node = node
        self.caps.set_cap(rid, rep.view.max_inflight)
        self.adapters.add_replica(rep)
        return rep, self.capacity_freed(m.name, everyone=True)  # a new replica: all may try

    def remove_replica(self, rid: str) -> None:
        if self.table.remove_replica(rid) is not None:
            self.prefix.remove_replica(rid)
            self.adapters.remove_replica(rid)

    def capacity_known(self, rep: Replica) -> None:
        """The engine told us what its cache holds (vLLM's cache_config_info, llama.cpp's slots):
        the prefix index ages this replica's holdings against it instead of assuming it keeps
        everything."""
        res = rep.last_scrape
        if rep.slots:
            self.prefix.set_capacity(rep.id, Capacity.llamacpp(rep.slots))
        elif res is not None and res.kv_blocks and res.block_size:
            self.prefix.set_capacity(rep.id, Capacity.vllm(res.kv_blocks, res.block_size))
