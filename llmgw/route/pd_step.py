"""The prefill step of a disaggregated model's request (:mod:`.pd` has the rules and wire forms),
run by the core (:mod:`.dispatch`) — pure, like it.

1. ``planned(plan)`` once the request is planned: split (``plan.pd = "prefill"``) or not
   (``"decode"``: a decode or ``both`` replica prefills it itself), and why not, counted.
2. ``prefill(plan, now, wall)`` in the core's ``next`` once the request is admitted: first the
   cache check — a decode candidate holding all but less than ``min_prompt_tokens`` of the prompt
   is decided with the model's strategy and, if picked, takes the request unsplit (``cached``,
   ``plan.predecided``); else the prefiller's own decision (its strategy, among ``prefill``
   replicas: filter → score → pick, kept in the decision ring with ``phase = "prefill"``) and its
   attempt, whose ``phase`` is ``"prefill"`` — the shell sends it, reads the whole answer and
   reports with ``prefilled``. None when no prefiller can take it now: the request goes on to
   its decoder, which prefills.
3. ``prefilled(plan, attempt, now, failure, status, data)`` when the prefill attempt ended: its
   permits back (the breaker counts a connect error, a timeout or a 5xx as for any attempt), the
   answer's ``kv_transfer_params`` kept for the decoder — or the fallback's reason — and the next
   ``next`` decides the decoder (the ``decode`` strategy, among ``decode`` and ``both`` replicas).
   A prefiller that could not be reached (nothing was sent) is not a fallback yet: the next
   ``next`` asks another prefiller, if one is there, within ``max_attempts`` prefills.
4. ``decode_body`` / ``decode_failed`` for the decode attempt: the params ride in its body; an
   attempt that failed after it was sent may have pulled the blocks (the prefiller frees them), so
   a retry elsewhere drops them and that decoder prefills."""

from __future__ import annotations

from typing import Any

from .admission import Ticket
from .attempt import Attempt
from .breaker import FailureKind, Permit
from .openai_req import ApiError
from .pd import PdStats, decode_body, prefill_body, read_prefill_answer, role_views
from .plan import Plan
from .prefix_capacity import BYTES_PER_TOKEN
from .trace import AttemptRecord, upstream_headers
from .traceparent import new_span_id
from .types import EndpointView

# The router's core (dispatch.RouterCore): typed loosely, since dispatch imports this module (no
# import cycle, not even for type checking: tests/test_import_contract.py).
RouterCore = Any

__all__ = ["PdSteps"]

_FAILURE_REASON = {FailureKind.CONNECT: "connect", FailureKind.TIMEOUT: "timeout"}


def _batched(body: dict[str, object]) -> bool:
    n = body.get("n")
    prompt = body.get("prompt")
    return (isinstance(n, int) and n > 1) or (isinstance(prompt, list) and len(prompt) > 1
                                               and not all(isinstance(x, int) for x in prompt))


class PdSteps:
    def __init__(self, core: RouterCore, stats: PdStats) -> None:
        self.core = core
        self.stats = stats

    # -- 1. planned -------------------------------------------------------------------------------
    def planned(self, plan: Plan, kind: str) -> None:
        pd = plan.entry.pd
        if pd is None:
            return
        if plan.body is not None and "kv_transfer_params" in plan.body:
            # where the KV comes from is the router's to say: a client's params would have a
            # decoder pull from any host it names (vLLM passes them to its KV connector as they are)
            raise ApiError(400, "kv_transfer_params is set by the router for this model (prefill/decode "
                           "disaggregation); leave it out of the request.", param="kv_transfer_params")
        info = plan.info
        body = plan.body
        if kind not in ("chat", "completions") or body is None:
            why = "not_generation"  # embeddings: one pass, nothing to decode
        elif info.adapter is not None:
            why = "adapter"  # a prefiller would need the adapter too
        elif _batched(body):
            why = "batched"  # several sequences (n > 1) or prompts: one transfer per request is what vLLM's proxy does
        elif info.prompt_tokens_estimate < pd.min_prompt_tokens:
            why = "short"
        else:
            plan.pd = "prefill"
            return
        plan.pd = "decode"
        self.stats.path(plan.model, why)

    # -- 2. the prefill attempt -------------------------------------------------------------------
    def prefill(self, plan: Plan, now: float, wall: float) -> Attempt | None:
        core = self.core
        entry = plan.entry
        pd = entry.pd
        assert pd is not None and plan.body is not None
        plan.pd = "decode"  # whatever happens here, the decoder is next
        info = plan.info
        trace = plan.trace
        views = core.table.views(entry, now)
        tried = plan.tried
        if plan.prefills == 0 and pd.skip_cached and self._cached(plan, role_views(views, "decode"), now, wall):
            return None  # most of the prompt is cached on the decoder it goes to: that one prefills the rest
        if trace is not None:
            trace.mark("decide", now, note="prefill" if not plan.prefills else "prefill again")
        views = role_views(views, "prefill")
        if tried:  # a prefiller that could not be reached is not asked again
            views = [v for v in views if v.id not in tried]
        strategy = core.planner.strategy(entry, pd.prefill_strategy)
        d = core.sched.decide(info, views, strategy, now=now, wall=wall, rng=core.rng, commit=False)
        d.phase = "prefill"
        d.tenant, d.band, d.share = core.wait.admission_of(plan)
        core.decisions.append(d)
        core.counters.decision(d)
        if trace is not None:
            trace.decisions += 1
        chosen = d.chosen
        if chosen is None:
            core.sched.commit(d, info, now)
            return self._skip(plan, now, "no prefiller can take it now" + (f" ({d.note})" if d.note else ""))
        if not core.caps.try_reserve(chosen):
            return self._skip(plan, now, f"{chosen} is at its concurrency cap")
        rep = core.table.replicas[chosen]
        # every prefiller's breaker open (d.fallback): no early probe with a client's request — the
        # decoder prefills it, and the breaker lets its probe through when its cooldown ends
        permit = rep.breaker.allow(now)
        if permit is Permit.DENY:
            core.caps.release(chosen)
            return self._skip(plan, now, f"the breaker of {chosen} is open")
        core.sched.commit(d, info, now)  # only a pick that goes out: stateful scorers learn it
        core._after_commit(d, entry, now)  # the prefiller caches the prompt: tier 1 learns it there
        plan.attempts += 1
        plan.prefills += 1
        a = Attempt(rep, core.caps, permit, d, plan.started)
        a.phase = "prefill"
        a.body = prefill_body(plan.body)
        a.first_byte_timeout = pd.prefill_timeout_s
        if trace is not None:
            a.record = AttemptRecord(plan.attempts, chosen, rep.node, trace.revision, trace.decisions - 1, now,
                                     new_span_id(core.ids))
            a.record.phase = "prefill"
            trace.attempts.append(a.record)
            a.trace_headers = upstream_headers(trace, a.record)
        if plan.prefills == 1:  # a request is split once, however many prefillers it takes
            self.stats.path(plan.model, "split")
        # the decoder: its own strategy (KV headroom, decode load), not the client's affinity one
        plan.strategy = core.planner.strategy(entry, pd.decode_strategy)
        return a

    def _cached(self, plan: Plan, views: list[EndpointView], now: float, wall: float) -> bool:
        """The threshold reads the prompt the decoder would compute, as llm-d's P/D decider does:
        when a decode candidate holds enough of the prompt that the rest is under
        ``min_prompt_tokens`` (tier 2's blocks where its engine publishes them, else tier 1's
        belief), the decoder is decided now, with the model's own (cache-aware) strategy — and if
        the one it picks holds that much, the request goes there unsplit (path ``cached``) and the
        decode loop takes this decision (``plan.predecided``). If load sends it to a replica
        without the prompt, the split goes on. Nothing is decided when no candidate holds enough."""
        core = self.core
        info = plan.info
        pd = plan.entry.pd
        assert pd is not None
        enough = info.prompt_tokens_estimate - pd.min_prompt_tokens  # more than this cached: the rest is short
        held = core.kv_cache.held(info, now) or {}
        total = max(info.kv_blocks, len(info.kv_hashes or ()))
        believed = core.prefix.held_bytes(info, now)

        def cached(rid: str) -> tuple[int, str]:
            if rid in held and total:  # the engine's own word
                return info.prompt_tokens_estimate * min(held[rid], total) // total, "tier 2"
            return int(believed.get(rid, 0) / BYTES_PER_TOKEN), "tier 1"

        if not any(cached(v.id)[0] > enough for v in views if v.id not in plan.tried):
            return False
        if plan.tried:
            views = [v for v in views if v.id not in plan.tried]
        d = core.sched.decide(info, views, plan.strategy, now=now, wall=wall, rng=core.rng, commit=False)
        if d.chosen is None:
            return False
        tokens, tier = cached(d.chosen)
        if tokens <= enough:
            return False
        rest = info.prompt_tokens_estimate - tokens
        why = (f"~{tokens} of ~{info.prompt_tokens_estimate} prompt tokens cached on {d.chosen} ({tier}): "
               f"~{rest} to compute, under min_prompt_tokens {pd.min_prompt_tokens}: not split")
        d.note = f"{d.note}; {why}" if d.note else why
        plan.predecided = d
        self.stats.path(plan.model, "cached")
        if plan.trace is not None:
            plan.trace.mark("decide", now, note=why)
        return True

    def _skip(self, plan: Plan, now: float, why: str) -> None:
        if plan.prefills:  # asked again after a connect error: split already, and that error is why not
            self.stats.fallback(plan.model, "connect")
        else:
            self.stats.path(plan.model, "no_prefiller")
            self.stats.fallback(plan.model, "no_prefiller")
        if plan.trace is not None:
            plan.trace.mark("decide", now, note=f"{why}: the decoder prefills")
        return None

    # -- 3. its end -------------------------------------------------------------------------------
    def prefilled(self, plan: Plan, a: Attempt, now: float, failure: FailureKind | None, *,
                  status: int | None, data: bytes = b"", detail: str = "") -> list[Ticket]:
        """``failure``: how the exchange failed (None: an answer came, ``status`` and its body
        ``data``); ``FailureKind.CLIENT_CANCEL``: the client left — the request ends here, counted."""
        core = self.core
        if a.ended:
            return []
        rep = a.replica
        model = plan.model
        cancelled = failure is FailureKind.CLIENT_CANCEL
        if failure is None:
            params, why, blocks = read_prefill_answer(status, data)
            verdict: FailureKind | None = FailureKind.HTTP_5XX if status is not None and status >= 500 else None
        else:
            params, why, blocks = None, _FAILURE_REASON.get(failure, "engine_error"), 0
            verdict = failure
        if a.record is not None and plan.trace is not None:
            outcome = "ok" if params is not None else (failure.value if failure is not None else why)
            note = detail or (f"answered {status}" if status not in (None, 200) else "")
            plan.trace.attempt_ended(a.record, a.sent_at, a.connected_at, a.head_at, None, now, status,
                                     outcome, note, 0)
        a.end(now, verdict)
        core.kv_cache.ended(rep.id, plan.info, now)
        if verdict is not None and not cancelled:
            core.counters.upstream_error(rep.id, verdict.value)
        if a.sent_at is not None:
            self.stats.observe(self.stats.prefill, model, now - a.sent_at)
        if cancelled:
            core._done(plan, "client_cancelled", 499, None, None, now)
        elif params is not None:
            plan.kv_params, plan.prefilled_on, plan.pd_blocks = params, rep.id, blocks
            self.stats.handed(model, blocks)
        elif failure is FailureKind.CONNECT and self._another_prefiller(plan, rep.id, now):
            plan.pd = "prefill"  # nothing was sent: another prefiller is asked, as a decode attempt would be retried
            if plan.trace is not None:
                plan.trace.mark("decide", now, note=f"the prefill on {rep.id} failed ({why}"
                                                    f"{': ' + detail if detail else ''}): another prefiller")
        else:
            self.stats.fallback(model, why)
            if plan.trace is not None:
                plan.trace.mark("decide", now, note=f"the prefill on {rep.id} gave no KV to pull ({why}"
                                                    f"{': ' + detail if detail else ''}): the decoder prefills")
        return core.capacity_freed(model, now)

    def _another_prefiller(self, plan: Plan, failed: str, now: float) -> bool:
        """After a prefiller could not be reached: is another one there to ask (not tried, its
        breaker letting requests through), within the router's ``max_attempts`` prefills?"""
        plan.tried.add(failed)
        if plan.prefills >= self.core.rc.max_attempts:
            return False
        return any(v.available and v.id not in plan.tried
                   for v in role_views(self.core.table.views(plan.entry, now), "prefill"))

    # -- 4. the decode attempt --------------------------------------------------------------------
    def decode_body(self, plan: Plan, a: Attempt) -> None:
        """The decode attempt's body carries the prefiller's params (when there are any)."""
        if plan.kv_params is None or plan.body is None:
            return
        a.body = decode_body(plan.body, plan.kv_params)
        a.phase = "decode"
        if a.record is not None:
            a.record.phase = "decode"

    def decode_ended(self, plan: Plan, a: Attempt, failure: FailureKind | None, first_byte_at: float | None) -> str:
        """A decode attempt with the prefiller's params ended: its time to the first byte (the
        transfer and the first token) observed; a failure after it was sent drops the params for
        a retry (the blocks may be pulled and freed already) — that decoder prefills. Returns what
        the attempt's error in the trace should add ("" for nothing)."""
        if a.phase != "decode":
            return ""
        if first_byte_at is not None and a.sent_at is not None:
            self.stats.observe(self.stats.transfer, plan.model, first_byte_at - a.sent_at)
        if failure is not None and failure is not FailureKind.CONNECT and failure is not FailureKind.CLIENT_CANCEL \
                and plan.kv_params is not None:
            plan.kv_params = None
            self.stats.fallback(plan.model, "decode_retry")
            return " (a retry goes without the prefiller's KV: its decoder prefills)"
        return ""

