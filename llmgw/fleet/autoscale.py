"""How many replicas a model should have: the autoscaler's decision, a pure function of the recent
load window (the control plane's leader runs it every ``[control] autoscale_interval_s``).

One :class:`Autoscaler` per autoscaled model keeps its window: the shell :meth:`~Autoscaler.observe`\\ s a
:class:`Sample` (every router's :class:`RouterLoad` merged, with the plane's ready/starting counts) and
asks :meth:`~Autoscaler.decide` for a :class:`Decision`. Times are the plane's monotonic seconds,
passed in; nothing here reads a clock or does I/O.

The rule (the contract; docs/autoscaling.md repeats it)
-------------------------------------------------------
- Concurrency C = inflight + queued (cold waiters included). C_w: its mean over ``window_s``; C_p:
  over ``panic_window_s`` (at most window_s). Means are over the samples (the shell takes one a round).
- Trend: the least-squares slope of C over the window. When it is > 0 the predicted
  C_pred = L + max(0, min(slope, slope_p)) × cold_start_s — scale ahead of a load still rising, by
  the time a replica takes to start (the median of the last 5 measured placed → ready times, else
  ``cold_start_s``); else C_pred = C_w. slope_p is the slope over the panic window: a step up that
  has levelled off is the load it reached, not a ramp to extrapolate for the whole window.
  L = min(C_p, the least-squares line of C over the window read now): on a ramp the line is where
  the load is and C_p just behind it; on a noisy plateau the line is the window's mean, so a few
  seconds' swell of random arrivals (C_p) is not projected — with the down delay keeping the
  highest recent count, that would ratchet the count up to the noise's peaks.
  C_pred is at most max(C_p, C now) × max_scale_up_rate: a trend is trusted for one step of growth,
  so a lone request into an idle model (a slope of one over a few seconds, times a cold start of
  tens of seconds) predicts no crowd.
- Recommendation (raw), by metric:

  * ``concurrency``: ceil(max(C_w, C_pred) / target).
  * ``kv_usage``: ceil(KV_w / target), KV_w the mean over the window of ready × kv_usage (the KV cache in
    use, in replicas; taken sample by sample so that a window across a scale-up reads right). No KV
    figure: hold (0 when C is 0).
  * ``queue`` (q = (engine_waiting + queued) / max(ready, 1)) and ``ttft_p90`` (the p90 of the window's
    TTFT histogram growth, interpolated in its bucket): r = observed / target. They are observed only
    since ready last changed plus ``panic_window_s`` (what was measured with another count, or while a
    backlog drains after a replica came, says nothing of this one). P = C per ready replica over those samples.

    - r > 1 + tolerance (a breach): raw = ceil(ready × r), and the capacity per replica is learned below
      the breach: cap = min(cap, P × (1 − tolerance)). While replicas are starting the breach asks no
      more than the most of: current, what the breach asked before they were placed, and
      ceil(ready × P × (1 − tolerance) / cap) (more requests per ready replica than the capacity was
      learned at): a ratio that keeps growing while capacity is on its way (a queue, a TTFT) is not
      new load; more requests are.
    - r ≤ 1: the SLO held at this load: cap = max(cap, P) — once a cap is known (it is first learned at a
      breach: a low load that holds says little of what a replica can take).
    - r < 1 − tolerance, or nothing observed: raw = ceil(max(C_w, C_pred) / cap) when cap is known;
      0 when C is 0; else hold (raw = current).
    - Otherwise (inside the tolerance band): hold.
  * Any metric: ready == 0 and (C > 0 or cold waiters) → raw ≥ 1.
- Panic: the same rule over the panic window (C_p, the figure over the panic window; nothing learned).
  When it asks ≥ panic_threshold × max(ready, 1) panic starts (or goes on); it ends when a whole
  ``window_s`` passes without that. In panic the count becomes max(current, the panic raw) at once (no up
  delay) and never goes down.
- Delays (hysteresis): each decision's raw is kept with its time (a step function: each raw holds until
  the next decision). Up: the smallest raw over the last ``up_delay_s`` (0: the raw now) when above
  current. Down: the largest raw over the last ``down_delay_s`` when below current. Else current. A
  delay needs that much history of decisions: an autoscaler that has just started (a new leader)
  neither scales down nor (with an up delay) up until it has decided for the delay. So a steady load
  gives a steady count: no flapping.
- Growth bound: the count grows at most to max(ceil(max(current, 1) × max_scale_up_rate), current + 1)
  in one decision (panic and cold starts included).
- Idle and zero: idle_s is the time since the last arrival or the last sample with C > 0 or cold waiters
  (counted from the autoscaler's start). With min == 0 and idle_s ≥ idle_to_zero_s the count becomes 0
  (mode "idle"); before that its floor is 1 while current ≥ 1. At current == 0 any demand (C > 0, cold
  waiters, or a new arrival since the last decision) makes it ≥ 1 at once (mode "cold": requests wait).
- Blocked (the placer's reason why the model's missing replicas cannot be placed: holds, budgets, no
  room): shown in limited_by as "placement: …", and the count is not raised above current (no runaway
  while nothing can be placed) — except 0 → 1 for a cold start (a request is waiting).
- Bounds [min, max] last ("min N"/"max N" in limited_by when they cut). Pinned (``llmgw ctl scale``):
  the count is the pinned one whatever the bounds (an operator's explicit count); the rule still runs
  and its raw is kept, so a release resumes from a warm window.
- No sample in the last ``window_s`` (the shell could not gather load): the count holds.

Learned state that survives a leader change or a restart (:meth:`Autoscaler.to_doc`): the measured cold
starts and the learned capacity (dropped if the metric or target changed)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from statistics import median

from llmgw.fleet.autoscale_load import (TTFT_BUCKETS, RouterLoad, Sample, arrival_rate, concurrency, line_at, mean,
                                        merge, quantile, slope, ttft_counts)
from llmgw.fleet.autoscale_rule import METRICS, MODES, Decision, Rule

__all__ = ["TTFT_BUCKETS", "INPUT_KEYS", "METRICS", "MODES", "Rule", "Sample", "RouterLoad", "merge", "Decision", "Autoscaler"]

# Decision.inputs' keys, every decision has them all (None: not measured)
INPUT_KEYS = ("concurrency", "concurrency_panic", "concurrency_predicted", "arrival_rate", "ttft_p90_s",
              "queue_per_replica", "kv_usage", "slope_per_s", "cold_start_s", "capacity_per_replica", "idle_s",
              "raw_panic")
HISTORY = 20  # decisions that changed the count, kept for explain and events
COLD_STARTS = 5  # measured cold starts kept (their median is used)
DOC_VERSION = 1


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - 1e-9))  # 8.000000001 / 4 is 2, not 3


def _fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.3g}"


class Autoscaler:
    """One model's autoscaling state: its load window, its recent recommendations, the panic state,
    the measured cold starts and the learned capacity per replica. See the module docstring."""

    def __init__(self, rule: Rule, now: float) -> None:
        self._rule = rule
        self._samples: deque[Sample] = deque()
        self._raws: deque[tuple[float, int]] = deque()  # (t, raw) of each decision
        self._last_active = now
        self._arrived = False  # a new arrival since the last decision
        self._ready_since: float | None = None  # when ready last changed (None: not seen to change)
        self._panic_at: float | None = None  # the last time the panic rule asked for panic
        self._cap: float | None = None  # learned concurrency per replica (queue, ttft_p90)
        self._breach_ask: int | None = None  # what the last breach asked before replicas were starting
        self._cold: deque[float] = deque(maxlen=COLD_STARTS)
        self.history: deque[Decision] = deque(maxlen=HISTORY)
        self.last: Decision | None = None  # the latest decision, changed or not

    # -- state ------------------------------------------------------------------------------------------
    @property
    def rule(self) -> Rule:
        return self._rule

    @rule.setter
    def rule(self, rule: Rule) -> None:
        """A redefined model keeps its window; a capacity learned for another metric or target is dropped."""
        if (rule.metric, rule.target) != (self._rule.metric, self._rule.target):
            self._cap = None
        self._rule = rule

    @property
    def capacity(self) -> float | None:
        """The learned concurrency per replica at which the SLO holds (queue, ttft_p90; else None)."""
        return self._cap

    @property
    def cold_start_s(self) -> float:
        """The median of the last 5 measured placed → ready times, else the rule's prior."""
        return float(median(self._cold)) if self._cold else float(self._rule.cold_start_s)

    @property
    def cold_starts(self) -> tuple[float, ...]:
        """The measured placed → ready times kept (oldest first)."""
        return tuple(self._cold)

    def cold_start_measured(self, seconds: float) -> None:
        """One replica of the model went from placed to ready in ``seconds``."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a cold start takes a finite number of seconds ≥ 0, got {seconds!r}")
        self._cold.append(float(seconds))

    def observe(self, s: Sample) -> None:
        """Add one sample (in time order: an older one than the last is ignored). Samples older than
        max(window_s, down_delay_s) are dropped."""
        prev = self._samples[-1] if self._samples else None
        if prev is not None:
            if s.t < prev.t:
                return
            if s.ready != prev.ready:
                self._ready_since = s.t
            if s.arrivals > prev.arrivals:
                self._arrived = True
                self._last_active = s.t
        if concurrency(s) > 0 or s.cold_waiting > 0:
            self._last_active = s.t
        self._samples.append(s)
        keep = max(self._rule.window_s, self._rule.down_delay_s)
        while self._samples and self._samples[0].t < s.t - keep:
            self._samples.popleft()

    # -- persistence ------------------------------------------------------------------------------------
    def to_doc(self) -> dict[str, object]:
        """What survives a leader change or a restart (plain JSON types). Times do not: they are one
        process's monotonic clock."""
        return {"v": DOC_VERSION, "cold_starts": list(self._cold), "capacity": self._cap,
                "capacity_for": [self._rule.metric, self._rule.target]}

    @classmethod
    def from_doc(cls, rule: Rule, doc: object, now: float) -> Autoscaler:
        """An autoscaler with the learned state of :meth:`to_doc`. Missing keys are fine (nothing
        learned); a value of the wrong shape raises ValueError naming the key."""
        if not isinstance(doc, dict):
            raise ValueError(f"autoscale state: expected an object, got {type(doc).__name__}")
        a = cls(rule, now)
        colds = doc.get("cold_starts", [])
        if not isinstance(colds, list):
            raise ValueError("autoscale state: cold_starts must be a list of seconds")
        for x in colds[-COLD_STARTS:]:
            try:
                a.cold_start_measured(x)
            except ValueError:
                raise ValueError(f"autoscale state: cold_starts holds {x!r}, not seconds ≥ 0") from None
        cap = doc.get("capacity")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float)
                                or not math.isfinite(cap) or cap <= 0):
            raise ValueError(f"autoscale state: capacity must be a number > 0 or null, got {cap!r}")
        learned_for = doc.get("capacity_for", [rule.metric, rule.target])
        if not (isinstance(learned_for, list) and len(learned_for) == 2):
            raise ValueError(f"autoscale state: capacity_for must be [metric, target], got {learned_for!r}")
        if cap is not None and learned_for == [rule.metric, rule.target] and rule.metric in ("queue", "ttft_p90"):
            a._cap = float(cap)
        return a

    # -- the rule ---------------------------------------------------------------------------------------
    def _observed(self, samples: Sequence[Sample]) -> float | None:
        """The queue per replica (mean) or the TTFT p90 over the samples (None: nothing observed)."""
        if self._rule.metric == "queue":
            return mean([(s.engine_waiting + s.queued) / max(s.ready, 1) for s in samples])
        return quantile(ttft_counts(samples), 0.9)

    def _recommend(self, window: Sequence[Sample], span: Sequence[Sample], level: float, ready: int,
                   current: int, starting: int, learn: bool) -> tuple[int | None, float | None, str]:
        """(raw or None to hold, the metric's figure, the sentence) for one window; ``level`` is the
        concurrency the count must carry (max(C_w, C_pred), or C_p for panic), ``span`` the samples the
        ratio metrics observe. Learns the capacity when ``learn``."""
        r = self._rule
        if r.metric == "concurrency":
            raw = _ceil(level / r.target)
            return raw, level, f"concurrency {level:.3g} / target {r.target:g} per replica → ceil = {raw}"
        if r.metric == "kv_usage":
            kv = mean([s.ready * s.kv_usage for s in window if s.kv_usage is not None])
            if kv is None:
                return (0 if level <= 0 else None), None, "kv_usage: no KV figure in the window: hold"
            raw = _ceil(kv / r.target)
            return raw, kv, f"kv_usage: {kv:.3g} replicas' worth of KV cache in use / target {r.target:g} → ceil = {raw}"
        what = "queue per replica" if r.metric == "queue" else "ttft p90"
        observed = self._observed(span)
        per = mean([concurrency(s) / s.ready for s in span if s.ready > 0])
        ratio = None if observed is None else observed / r.target
        head = f"{r.metric}: {what} {_fmt(observed)} vs target {r.target:g}"
        if ratio is not None and ratio > 1 + r.tolerance:
            if learn and per:
                self._cap = min(self._cap if self._cap is not None else math.inf, per * (1 - r.tolerance))
            raw = _ceil(ready * ratio)
            text = f"{head}: ratio {ratio:.2f} > {1 + r.tolerance:g} → ceil({ready} ready × {ratio:.2f}) = {raw}"
            if starting > 0:
                more = _ceil(ready * per * (1 - r.tolerance) / self._cap) if self._cap and per else 0
                bound = max(current, self._breach_ask or 0, more)
                if bound < raw:
                    raw = bound
                    text += f"; {starting} starting: at most {raw} until they are ready"
            elif learn:
                self._breach_ask = raw
            return raw, observed, text
        if learn and starting == 0:
            self._breach_ask = None
        if ratio is not None and ratio <= 1 and learn and per and self._cap is not None:
            self._cap = max(self._cap, per)
        if ratio is None or ratio < 1 - r.tolerance:
            if level <= 0:
                return 0, observed, f"{head}: no load → 0"
            if self._cap:
                raw = _ceil(level / self._cap)
                return raw, observed, (f"{head}: SLO met; concurrency {level:.3g} / learned capacity "
                                       f"{self._cap:.3g} per replica → ceil = {raw}")
            return None, observed, f"{head}: SLO met, no capacity learned yet: hold"
        return None, observed, f"{head}: ratio {ratio:.2f} within tolerance {r.tolerance:g}: hold"

    def decide(self, now: float, current: int, *, pinned: int | None = None, blocked: str | None = None) -> Decision:
        """The decision at ``now`` for a model whose count in force is ``current``. ``pinned``: an
        operator's count (``llmgw ctl scale``); ``blocked``: the placer's reason why the model's missing
        replicas cannot be placed."""
        r = self._rule
        for name, v in (("current", current), ("pinned", pinned)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"autoscale decide: {name} must be a count ≥ 0, got {v!r}")
        window = [s for s in self._samples if now - r.window_s < s.t <= now]
        if not window:
            return self._finish(Decision(
                t=now, current=current, ready=0, starting=0, desired=current if pinned is None else pinned,
                raw=current, mode="stable" if pinned is None else "pinned",
                rule=f"no load sample in the last {r.window_s:g}s: the count holds",
                inputs={**dict.fromkeys(INPUT_KEYS), "cold_start_s": self.cold_start_s,
                        "capacity_per_replica": r.target if r.metric == "concurrency" else self._cap,
                        "idle_s": max(0.0, now - self._last_active)},
                limited_by=self._pin_and_block(pinned, blocked), reason=self._pin_reason(current, pinned)))
        last = window[-1]
        ready, starting = last.ready, last.starting
        cs = self.cold_start_s
        panic_s = min(r.panic_window_s, r.window_s)
        panic_w = [s for s in window if s.t > now - panic_s] or [last]
        c_w = mean([concurrency(s) for s in window]) or 0.0
        c_p = mean([concurrency(s) for s in panic_w]) or 0.0
        points = [(s.t, concurrency(s)) for s in window]
        trend = slope(points)
        recent = slope([(s.t, concurrency(s)) for s in panic_w])
        if trend > 0:  # extrapolated over a cold start, for one step of growth at most
            base = min(c_p, line_at(points, now) or 0.0)  # the level now, not the panic window's noise
            c_pred = min(base + max(0.0, min(trend, recent)) * cs, max(c_p, concurrency(last)) * r.max_scale_up_rate)
        else:
            c_pred = c_w
        level = max(c_w, c_pred)
        settled = (self._ready_since + panic_s) if self._ready_since is not None else -math.inf
        span = [s for s in window if s.t >= settled]
        panic_span = [s for s in panic_w if s.t >= settled]

        raw_s, figure, text = self._recommend(window, span, level, ready, current, starting, learn=True)
        raw = current if raw_s is None else raw_s
        demand_now = concurrency(last) > 0 or last.cold_waiting > 0
        if ready == 0 and demand_now:
            raw = max(raw, 1)
        raw_p, _, _ = self._recommend(panic_w, panic_span, c_p, ready, current, starting, learn=False)
        if raw_p is not None and raw_p >= r.panic_threshold * max(ready, 1) and raw_p > 0:
            self._panic_at = now
        panic = self._panic_at is not None and now - self._panic_at < r.window_s

        self._raws.append((now, raw))
        horizon = max(r.up_delay_s, r.down_delay_s)
        while len(self._raws) > 1 and self._raws[1][0] <= now - horizon:
            self._raws.popleft()  # the first kept is the one in force at now - horizon
        limited: list[str] = []
        desired = self._delayed(now, current, raw, limited)
        mode = "stable"
        if panic:
            mode = "panic"
            if desired < current:
                desired = current
                limited.append("panic: no scale-down")
            desired = max(desired, raw_p or 0)
            if desired >= raw:  # panic went past the up delay
                limited = [x for x in limited if not x.startswith("up delay")]

        idle_s = max(0.0, now - self._last_active)
        reason = ""
        if current == 0:
            if demand_now or self._arrived:
                desired, mode = max(desired, 1), "cold"
                reason = f"demand at 0 replicas ({last.cold_waiting} waiting): cold start"
            else:
                desired = 0
                mode = "idle" if r.min == 0 else mode
        elif r.min == 0 and r.idle_to_zero_s > 0 and idle_s >= r.idle_to_zero_s:
            desired, mode = 0, "idle"
            reason = f"idle for {idle_s:.0f}s ≥ {r.idle_to_zero_s:g}s: scale to zero"
        elif desired < 1:
            desired = 1
            if r.min == 0:
                limited.append(f"min 1 until idle for {r.idle_to_zero_s:g}s")

        if desired > current:
            grow = max(_ceil(max(current, 1) * r.max_scale_up_rate), current + 1)
            if desired > grow:
                desired = grow
                limited.append(f"max scale-up rate ×{r.max_scale_up_rate:g} ({grow})")
        if blocked:
            limited.append(f"placement: {blocked}")
            if desired > current and current > 0:
                desired = current
        if desired > r.max:
            desired = r.max
            limited.append(f"max {r.max}")
        if desired < r.min:
            desired = r.min
            limited.append(f"min {r.min}")
        if pinned is not None:
            desired, mode, limited = pinned, "pinned", list(self._pin_and_block(pinned, blocked))
            reason = self._pin_reason(current, pinned)
        elif desired != current and not reason:
            reason = (f"{'panic: ' if mode == 'panic' else ''}{r.metric} {_fmt(figure)} against target "
                      f"{r.target:g}")
        delay_note = f"; delays: up {r.up_delay_s:g}s, down {r.down_delay_s:g}s"
        rule_text = (f"{text}{delay_note}" + (f"; predicted concurrency {c_pred:.3g} from a trend of "
                                              f"{trend:+.3g}/s over a {cs:.3g}s cold start" if trend > 0 else ""))
        inputs: dict[str, float | None] = {
            "concurrency": c_w, "concurrency_panic": c_p, "concurrency_predicted": c_pred,
            "arrival_rate": arrival_rate(window),
            "ttft_p90_s": quantile(ttft_counts(span if r.metric == "ttft_p90" else window), 0.9),
            "queue_per_replica": mean([(s.engine_waiting + s.queued) / max(s.ready, 1) for s in window]),
            "kv_usage": mean([s.kv_usage for s in window if s.kv_usage is not None]),
            "slope_per_s": trend, "cold_start_s": cs,
            "capacity_per_replica": r.target if r.metric == "concurrency" else self._cap,
            "idle_s": idle_s, "raw_panic": None if raw_p is None else float(raw_p),
        }
        return self._finish(Decision(t=now, current=current, ready=ready, starting=starting, desired=desired,
                                     raw=raw, mode=mode, rule=rule_text, inputs=inputs,
                                     limited_by=tuple(limited), reason=reason))

    def _delayed(self, now: float, current: int, raw: int, limited: list[str]) -> int:
        """The raw recommendation through the up and down delays."""
        r = self._rule

        def over(delay: float, pick: Callable[[Iterable[int]], int]) -> int | None:
            if delay <= 0:
                return raw
            if self._raws[0][0] > now - delay:
                return None  # not decided for that long yet (a new leader): no history to judge by
            first = max(i for i, (t, _) in enumerate(self._raws) if t <= now - delay)
            return pick(x for _, x in list(self._raws)[first:])

        if raw > current:
            up = over(r.up_delay_s, min)
            if up is not None and up > current:
                if up < raw:
                    limited.append(f"up delay {r.up_delay_s:g}s")
                return up
            limited.append(f"up delay {r.up_delay_s:g}s")
        elif raw < current:
            down = over(r.down_delay_s, max)
            if down is not None and down < current:
                if down > raw:
                    limited.append(f"down delay {r.down_delay_s:g}s")
                return down
            limited.append(f"down delay {r.down_delay_s:g}s")
        return current

    @staticmethod
    def _pin_and_block(pinned: int | None, blocked: str | None) -> tuple[str, ...]:
        return ((f"pinned at {pinned} (llmgw ctl scale)",) if pinned is not None else ()) + (
            (f"placement: {blocked}",) if blocked else ())

    @staticmethod
    def _pin_reason(current: int, pinned: int | None) -> str:
        return f"pinned at {pinned} (llmgw ctl scale)" if pinned is not None and pinned != current else ""

    def _finish(self, d: Decision) -> Decision:
        self._arrived = False
        self.last = d
        if d.changed():
            self.history.append(d)
        return d
