"""The autoscaler's shell (docs/autoscaling.md): every ``[control] autoscale_interval_s`` the
leader gives each autoscaled model's load to its :class:`llmgw.fleet.autoscale.Autoscaler` and puts
the count it decides in force.

- **The load**: this router's (``RouterPort.autoscale_load``: llmgw.route.load_report) and, with
  several routers on one store, every live router's, which each writes beside its quota demand
  (``load_demand``, written by the tenants' share sync: daemon/control/usage_sync.py) — merged by
  llmgw.fleet.autoscale.merge with the replicas ready and starting (the plane's assignments).
- **The count in force** is the model's deploy count as the reconciler sees it (``adjust``: the
  plane's ``deploys`` carry it, so placement, lifecycle and views agree). It is kept in the store
  (document kind ``autoscale``, key the model: the count, an operator's pin, the core's state), so a
  restarted router or a new leader goes on from it.
- **A change** is recorded in the fleet's history ("scaled"), as a lifecycle job of kind ``scale``
  (``ctl jobs``), counted (``llmgw_autoscale_decisions_total``; a 0 → 1 wake in
  ``llmgw_cold_starts_total``), and wakes the reconciler.
- **Pinned**: ``llmgw ctl scale MODEL N`` on an autoscaled model pins N (kept in the store) until
  ``llmgw ctl scale MODEL --release``.
- **Cold starts measured**: a replica placed in this run that turns ready gives its model's
  autoscaler its placed → ready time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import trio

from llmgw.config import ModelConfig
from llmgw.fleet.autoscale import Autoscaler, Decision, RouterLoad, Rule, merge

log = logging.getLogger("llmgw.autoscale")

__all__ = ["Autoscaling", "LOAD_PREFIX", "load_demand", "loads_from_demands"]

DOC_KIND = "autoscale"
LOAD_PREFIX = "load:"  # a router's load, flattened into its quota-demand row: load:<model>:<field>
_COUNTS = ("arrivals", "inflight", "queued", "cold_waiting")
_LOAD_FIELDS = (*_COUNTS, "engine_waiting", "kv_usage")


def load_demand(loads: dict[str, dict[str, Any]]) -> dict[str, float]:
    """A router's per-model load as flat numbers for its demand row (``put_demand``)."""
    out: dict[str, float] = {}
    for model, d in loads.items():
        for f in _LOAD_FIELDS:
            v = d.get(f)
            if v is not None:
                out[f"{LOAD_PREFIX}{model}:{f}"] = float(v)
        for i, n in enumerate(d.get("ttft") or ()):
            if n:
                out[f"{LOAD_PREFIX}{model}:ttft{i}"] = float(n)
    return out


def loads_from_demands(row: dict[str, float], buckets: int) -> dict[str, dict[str, Any]]:
    """The inverse of :func:`load_demand` (other keys of the row are the tenants' and ignored)."""
    out: dict[str, dict[str, Any]] = {}
    for key, v in row.items():
        if not key.startswith(LOAD_PREFIX):
            continue
        model, _, f = key[len(LOAD_PREFIX):].rpartition(":")
        if not model:
            continue
        d = out.setdefault(model, {"ttft": [0] * buckets})
        if f.startswith("ttft") and f[4:].isdigit():
            i = int(f[4:])
            if i < buckets:
                d["ttft"][i] = int(v)
        elif f in _COUNTS:
            d[f] = int(v)
        elif f in _LOAD_FIELDS:
            d[f] = v
    return out


class Autoscaling:
    """One per control plane (``plane.autoscaling``)."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane
        self.scalers: dict[str, Autoscaler] = {}
        self.counts: dict[str, int] = {}  # model -> the count in force
        self.pinned: dict[str, int] = {}  # model -> an operator's count (ctl scale)
        self.decisions: dict[str, Decision] = {}  # model -> the latest
        self.cold_starts: dict[str, int] = {}
        self.changes: dict[tuple[str, str], int] = {}  # (model, "up"|"down") -> decisions that changed it
        self.others: dict[str, dict[str, dict[str, Any]]] = {}  # router id -> model -> its load (several routers)
        self.started_wall = time.time()

    # -- the models ---------------------------------------------------------------------------------
    def models(self) -> dict[str, ModelConfig]:
        return {n: m for n, m in self.plane.models.items() if m.autoscale is not None and m.deploy is not None}

    def rule(self, m: ModelConfig) -> Rule:
        return Rule.from_config(m.autoscale)

    def count(self, m: ModelConfig) -> int:
        """The count in force of autoscaled model `m`: its pin, else the autoscaler's, else (never
        decided) its deploy count within [min, max]."""
        a = m.autoscale
        assert a is not None and m.deploy is not None
        if m.name in self.pinned:
            return self.pinned[m.name]
        n = self.counts.get(m.name)
        return min(max(m.deploy.count if n is None else n, a.min), a.max)

    def adjust(self, m: ModelConfig, dep: Any) -> Any:
        """A model's ModelDeploy with the count in force (the plane keeps this one in ``deploys``)."""
        if m.autoscale is None or dep is None:
            return dep
        n = self.count(m)
        return dep if dep.count == n else replace(dep, count=n)

    def candidate_count(self, name: str, cm: ModelConfig) -> int:
        """A candidate revision of autoscaled model `name`: as many replicas as the live model has in
        force (at least one, to be judged; at most the candidate's own max)."""
        live = self.plane.models.get(name)
        n = self.count(live) if live is not None and live.autoscale is not None and live.deploy is not None else 1
        top = cm.autoscale.max if cm.autoscale is not None else n
        return max(1, min(n, top))

    def _apply(self, name: str) -> None:
        m = self.plane.models.get(name)
        dep = self.plane.deploys.get(name)
        if m is not None and dep is not None:
            self.plane.deploys[name] = self.adjust(m, dep)
        self.plane._wake.set()

    # -- the store ----------------------------------------------------------------------------------
    def _doc(self, name: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"count": self.counts.get(name), "pinned": self.pinned.get(name),
                               "cold_starts": self.cold_starts.get(name, 0)}
        s = self.scalers.get(name)
        if s is not None:
            doc["core"] = s.to_doc()
        return doc

    def _save(self, name: str, *, must: bool = False) -> None:
        g = self.plane.guard
        if must:
            g.must_write("put_doc", DOC_KIND, name, self._doc(name))
        else:
            g.write("put_doc", DOC_KIND, name, self._doc(name))

    def load(self, docs: dict[str, dict[str, Any]]) -> None:
        """The stored counts, pins and cores (a start, a new leader, a follower's snapshot)."""
        now = trio.current_time()
        models = self.plane.models
        for name, doc in docs.items():
            try:
                count, pinned = doc.get("count"), doc.get("pinned")
                if count is not None:
                    self.counts[name] = int(count)
                else:
                    self.counts.pop(name, None)
                if pinned is not None:
                    self.pinned[name] = int(pinned)
                else:
                    self.pinned.pop(name, None)
                self.cold_starts[name] = max(self.cold_starts.get(name, 0), int(doc.get("cold_starts", 0)))
                m = models.get(name)
                if m is not None and m.autoscale is not None and "core" in doc and name not in self.scalers:
                    self.scalers[name] = Autoscaler.from_doc(self.rule(m), doc["core"], now)
            except (TypeError, ValueError) as e:
                log.warning("autoscale: the stored state of model %s is unreadable (%s); starting afresh", name, e)
        for name in list(self.plane.deploys):
            m = models.get(name)
            if m is not None and m.autoscale is not None:
                self.plane.deploys[name] = self.adjust(m, self.plane.deploys[name])

    def rewrite(self, st: Any) -> None:
        """Into the store `st` (the StoreGuard's recovery): every autoscaled model's document."""
        for name in self.models():
            st.put_doc(DOC_KIND, name, self._doc(name))

    def model_deleted(self, name: str) -> None:
        for d in (self.scalers, self.counts, self.pinned, self.decisions):
            d.pop(name, None)
        self.plane.guard.write("delete_doc", DOC_KIND, name)

    # -- the operator -------------------------------------------------------------------------------
    def pin(self, name: str, count: int) -> None:
        """``ctl scale`` on an autoscaled model: `count` until released (StoreUnavailable: nothing changed)."""
        before = self.pinned.get(name)
        self.pinned[name] = count
        try:
            self._save(name, must=True)
        except BaseException:
            if before is None:
                self.pinned.pop(name, None)
            else:
                self.pinned[name] = before
            raise
        self.plane.guard.record("scale pinned", model=name, detail=f"{count} replicas (llmgw ctl scale)")
        self._apply(name)

    def release(self, name: str) -> None:
        """The pin goes: the autoscaler decides again from its next round (nothing if not pinned)."""
        before = self.pinned.pop(name, None)
        if before is None:
            return
        m = self.plane.models.get(name)
        if m is not None:
            self.counts[name] = before  # it goes on from the pinned count, not from an old decision
        try:
            self._save(name, must=True)
        except BaseException:
            self.pinned[name] = before
            raise
        self.plane.guard.record("scale released", model=name, detail=f"from {before} replicas")
        self._apply(name)

    # -- the rounds ---------------------------------------------------------------------------------
    def engine_ready(self, model: str, created_wall: float) -> None:
        """A replica of `model` placed in this run answered ready: its cold start, measured."""
        s = self.scalers.get(model)
        if s is None or created_wall < self.started_wall:
            return
        took = time.time() - created_wall
        if 0 <= took < 24 * 3600:
            s.cold_start_measured(took)

    def replicas(self, name: str) -> tuple[int, int]:
        """(ready, starting) replicas of `name` meant to run: an engine ready and routed, or not yet."""
        ready = starting = 0
        router = self.plane.router
        for a in self.plane.assignments.values():
            if a.model != name or a.desired != "run" or a.spec.is_worker:
                continue
            st = router.replica_state(a.replica)
            if a.engine_state == "ready" and st is not None and st.routable:
                ready += 1
            else:
                starting += 1
        return ready, starting

    def tick(self, now: float) -> None:
        """One round: every autoscaled model's load observed and its count decided (the leader only)."""
        if not self.plane.leading():
            return
        models = self.models()
        for gone in [n for n in self.scalers if n not in models]:
            self.scalers.pop(gone, None)
            self.decisions.pop(gone, None)
        if not models:
            return
        own = self.plane.router.autoscale_load()
        for name, m in models.items():
            rule = self.rule(m)
            s = self.scalers.get(name)
            if s is None:
                s = self.scalers[name] = Autoscaler(rule, now)
            elif s.rule != rule:
                s.rule = rule
            ready, starting = self.replicas(name)
            parts = [RouterLoad.from_wire(own[name])] if name in own else []
            for loads in self.others.values():
                if name in loads:
                    try:
                        parts.append(RouterLoad.from_wire(loads[name]))
                    except ValueError:
                        continue
            s.observe(merge(now, parts, ready, starting))
            current = self.count(m)
            d = s.decide(now, current, pinned=self.pinned.get(name), blocked=self.plane.unplaceable.get(name))
            self.decisions[name] = d
            if d.desired != current and name not in self.pinned:
                self._change(m, d)

    def _change(self, m: ModelConfig, d: Decision) -> None:
        name = m.name
        before = self.count(m)
        self.counts[name] = d.desired
        direction = "up" if d.desired > before else "down"
        self.changes[(name, direction)] = self.changes.get((name, direction), 0) + 1
        if before == 0 and d.desired > 0:
            self.cold_starts[name] = self.cold_starts.get(name, 0) + 1
        self._save(name)
        detail = f"{before} → {d.desired}: {d.reason or d.rule} ({d.mode})"
        self.plane.guard.record("scaled", model=name, detail=detail)
        log.info("model %s scaled %s", name, detail)
        scale_event = getattr(self.plane.lifecycle, "scale_event", None)
        if scale_event is not None:
            scale_event(name, before, d.desired, d.reason or d.rule, d.mode)
        self._apply(name)

    async def run(self) -> None:
        """The rounds, every [control] autoscale_interval_s (a round's failure is logged, the next goes on)."""
        interval = self.plane.cfg.control.autoscale_interval_s
        while True:
            try:
                self.tick(trio.current_time())
            except Exception:
                log.exception("autoscale round failed; retrying")
            await trio.sleep(interval)

    # -- the admin API ------------------------------------------------------------------------------
    def view(self, name: str) -> Any:
        """Model `name`'s autoscaler as the admin API shows it (KeyError: no such model; None: it has
        no [models.autoscale])."""
        from llmgw.admin.schema_autoscale import AutoscaleView

        m = self.plane.models[name]
        if m.autoscale is None or m.deploy is None:
            return None
        a = m.autoscale
        s = self.scalers.get(name)
        d = self.decisions.get(name)
        ready, starting = self.replicas(name)
        settings = {k: v for k, v in self.rule(m).settings().items() if k not in ("min", "max", "metric", "target")}
        settings["cold_start_wait_s"] = a.cold_start_wait_s
        history = list(reversed(s.history)) if s is not None else []
        return AutoscaleView(
            model=name, min=a.min, max=a.max, metric=a.metric, target=a.target, pinned=self.pinned.get(name),
            count=self.count(m), ready=ready, starting=starting,
            cold_start_s=s.cold_start_s if s is not None else a.cold_start_s,
            cold_starts=self.cold_starts.get(name, 0), inputs=dict(d.inputs) if d is not None else {},
            decision=_decision_view(d) if d is not None else None,
            history=[_decision_view(h) for h in history], settings=settings)

    def views(self) -> list[Any]:
        return [v for name in sorted(self.models()) if (v := self.view(name)) is not None]

    # -- several routers ----------------------------------------------------------------------------
    def demand(self) -> dict[str, float]:
        """This router's load, flattened for its demand row (the share sync writes it)."""
        models = self.models()
        if not models:
            return {}
        own = self.plane.router.autoscale_load()
        return load_demand({n: own[n] for n in models if n in own})

    def others_read(self, rows: dict[str, dict[str, float]], me: str, live: set[str]) -> None:
        """The other live routers' demand rows, as the share sync read them."""
        from llmgw.fleet.autoscale import TTFT_BUCKETS
        n = len(TTFT_BUCKETS) + 1
        self.others = {rid: loads_from_demands(row, n) for rid, row in rows.items() if rid != me and rid in live}


def _decision_view(d: Decision) -> Any:
    from llmgw.admin.schema_autoscale import ScaleDecisionView

    wall = time.time() - (trio.current_time() - d.t)  # the decision's monotonic time, as Unix time
    return ScaleDecisionView(t_wall=round(wall, 3), current=d.current, ready=d.ready, starting=d.starting,
                             desired=d.desired, raw=d.raw, mode=d.mode, rule=d.rule, limited_by=list(d.limited_by),
                             reason=d.reason)
