"""What a request is, before anything is decided (pure): its body parsed, its model (or adapter)
resolved — the live revision, the candidate for a canary's share, or the revision the eval runner
names —, its strategy, and the :class:`~.types.RequestInfo` the scorers read. RouterCore.plan is
:meth:`Planner.plan`; the router's control port sets the strategies, canaries and revision ids
it reads."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from typing import Any

from llmgw.config import Config
from llmgw.config.names import PRESET_NAMES, SCORER_NAMES, is_candidate_key
from llmgw.inputs.echo import echo

from .openai_req import ApiError, parse_body
from .plan import Plan
from .prefix_capacity import MAX_HEAD_BYTES
from .replicas import ModelEntry, ReplicaTable
from .request_head import request_head
from .strategies import Strategy, StrategyError, resolve
from .trace import MAX_NAME, Trace, TraceRing
from .traceparent import SAMPLED, new_span_id, new_trace_id, parse_traceparent, parse_tracestate, sampled
from .fair_queue import ANONYMOUS, NORMAL_NAME
from .types import RequestInfo, TenantTag

__all__ = ["STRATEGY_HEADER", "Planner"]

STRATEGY_HEADER = "x-llmgw-strategy"


class Planner:
    """`scorers`: the scheduler's (a configured strategy weighs only those); `refused`: called
    with a refused request's trace (RouterCore ends it and tells its watcher); `ids`: random bits
    (``getrandbits``) for trace and span ids — apart from `rng`, so ids never shift the scheduler's
    draws."""

    def __init__(self, cfg: Config, table: ReplicaTable, scorers: Collection[str], traces: TraceRing, *,
                 wall: Callable[[], float], rng: random.Random,
                 refused: Callable[[Trace, float, int], None], ids: Callable[[int], int],
                 head_limit: int = MAX_HEAD_BYTES) -> None:
        self.cfg = cfg
        self.head_limit = head_limit  # what the prefix index keeps of a head: no more is rendered
        self.table = table
        self.scorers = scorers
        self.traces = traces
        self._wall = wall
        self.rng = rng
        self._refused = refused
        self.ids = ids
        self.traceparent_invalid: dict[str, int] = {}  # malformed client traceparents ignored, by reason
        self.canary: dict[str, float] = {}  # model -> share of its requests sent to its candidate
        self.revision_ids: dict[str, str] = {}  # model or candidate key -> its revision's id (traces say it)
        self.strategies: dict[str, Strategy] = self._configured_strategies()

    def plan(self, kind: str, body: bytes, rid: str, *, strategy: str | None, session: str | None,
             now: float, revision: str | None = None, internal: bool = False,
             traceparent: str | None = None, tracestate: str | None = None,
             tenant: TenantTag | None = None) -> Plan:
        """`revision="candidate"`: to the model's candidate revision (the eval runner's requests;
        the shell checks who may ask); `"live"`: to the live one, never the canary's share.
        Otherwise the live revision — or, for a model with a canary share (set_canary), the
        candidate for that share of requests. `internal`: the eval runner's request (not client
        traffic: counted apart too, counters.internal). The trace carries the revision's id
        (set_revision) and the client's W3C trace context (`traceparent`, `tracestate`: the
        headers, None when absent; a malformed traceparent is counted and ignored). `tenant`: who
        sent it (the plan and the trace carry it; None: the anonymous tenant)."""
        trace = Trace(rid, name=kind, started=now, wall=self._wall(), bytes_out=len(body))
        if tenant is None:
            trace.tenant, trace.key, trace.band = ANONYMOUS, ANONYMOUS, NORMAL_NAME
        else:
            trace.tenant, trace.key, trace.band = tenant.tenant, tenant.key, tenant.band_name
        trace.share = 1.0
        self._trace_context(trace, traceparent, tracestate)
        trace.mark("prepare", now)
        self.traces.add(trace)
        try:
            b = parse_body(body, kind=kind)
            trace.model, trace.stream = b.model[:MAX_NAME], b.stream  # a client's name: bounded
            if revision == "candidate":
                resolved = self.table.resolve_candidate(b.model)
                if resolved is None:
                    raise ApiError(404, f"The model {echo(b.model, quote='`')} has no candidate revision.",
                                   param="model", code="model_not_found")
            else:
                resolved = self.table.resolve(b.model)
                if resolved is None:
                    raise ApiError(404, f"The model {echo(b.model, quote='`')} does not exist.", param="model",
                                   code="model_not_found")
                share = self.canary.get(resolved[0].name) if self.canary and revision != "live" else None
                if share and self.rng.random() < share:
                    cand = self.table.resolve_candidate(b.model)
                    if cand is not None and any(not r.draining for r in cand[0].replicas):
                        resolved = cand
            entry, adapter = resolved
            # the revision's id (r1, r2…); "candidate" for a candidate whose id the router was not told
            trace.revision = self.revision_ids.get(entry.name) or ("candidate" if is_candidate_key(entry.name) else "")
            strat = self.strategy(entry, strategy)
            trace.strategy = strat.name
        except ApiError as e:  # refused: its trace ends here (the shell counts the request)
            self._refused(trace, now, e.status)
            raise
        salt = b.obj.get("cache_salt")
        # Tier-1 cache affinity: the head the engine caches first, recorded for the chosen replica.
        info = RequestInfo(request_id=rid, model=b.model, base_model=entry.name, adapter=adapter,
                           session_key=session or b.session_key,
                           prompt_tokens_estimate=b.prompt_chars // 4, strategy=strat.name,
                           head=request_head(b.obj, kind, self.head_limit) if kind != "embeddings" else b"",
                           cache_salt=salt if isinstance(salt, str) else None)
        return Plan(info, entry, strat, b.stream, now, body=b.obj, raw=body, trace=trace, internal=internal,
                    tenant=tenant)

    def _trace_context(self, trace: Trace, traceparent: str | None, tracestate: str | None) -> None:
        """The client's trace when its traceparent is valid (ours is a span of it; its sampled flag
        holds), else a new one, sampled by ``[router.traces] otlp_sample``."""
        ctx, bad = parse_traceparent(traceparent)
        if ctx is not None:
            trace.trace_id, trace.parent_span_id, trace.flags = ctx.trace_id, ctx.parent_id, ctx.flags
            trace.tracestate = parse_tracestate(tracestate)
        else:
            if bad:
                self.traceparent_invalid[bad] = self.traceparent_invalid.get(bad, 0) + 1
            trace.trace_id = new_trace_id(self.ids)
            trace.flags = SAMPLED if sampled(trace.trace_id, self.cfg.router.traces.otlp_sample) else 0
        trace.span_id = new_span_id(self.ids)

    def strategy(self, entry: ModelEntry, asked: str | None) -> Strategy:
        name = asked or entry.strategy
        s = self.strategies.get(name)
        if s is None:
            try:
                s = resolve(name)
            except StrategyError as e:
                known = ", ".join(sorted({*self.strategies, *PRESET_NAMES}))
                raise ApiError(400, f"unknown strategy {echo(name)}; known: {known}",
                               param=STRATEGY_HEADER) from e
            self.strategies[name] = s
        return s

    def _configured_strategies(self, configs: Any = None) -> dict[str, Strategy]:
        """[[strategies]] from the config (a preset's name replaces the preset)."""
        out = {}
        for sc in self.cfg.strategies if configs is None else configs:
            w = sc.weights
            weights = {k: getattr(w, k) for k in SCORER_NAMES
                       if getattr(w, k) > 0 and k in self.scorers}
            out[sc.name] = Strategy(sc.name, weights, sc.picker, sc.temperature)
        return out

    def set_strategies(self, configs: Any) -> None:
        """A reloaded config's [[strategies]] (StrategyConfig), in force from the next request."""
        self.strategies = self._configured_strategies(configs)

    def set_canary(self, model: str, share: float) -> None:
        """Send `share` (0–1) of `model`'s client requests to its candidate revision (0: none)."""
        if share > 0:
            self.canary[model] = min(1.0, share)
        else:
            self.canary.pop(model, None)

    def set_revision(self, key: str, revision_id: str) -> None:
        """The revision id a model (or a candidate's key) serves, for its requests' traces ("": none)."""
        if revision_id:
            self.revision_ids[key] = revision_id
        else:
            self.revision_ids.pop(key, None)
