"""The config file while the daemon runs: `llmgw ctl config check|reload`, SIGHUP, and the same
rule at a start. The pure diff (llmgw.lifecycle.config_diff) says what each difference does; this
applies it to the control plane: hot changes at once, a changed deploy profile as a lifecycle
candidate (eval → promote, or promoted by itself: lifecycle/auto.py), the rest left for a start.

A file that cannot be read or parsed changes nothing: it is refused whole, with each problem's
file:line and key. At a start the file's models are compared with those stored (the definitions
in force when the daemon stopped) by the same rule, so a restart neither undoes a reload or a
promote nor skips a candidate's checks (docs/configuration.md, "Reloading the config file")."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import trio

from llmgw.admin.schema_config import ConfigChangeView, ConfigReport
from llmgw.config import Config, ConfigError, ModelConfig, load_config, model_from_dict, model_to_dict
from llmgw.config.defaults import with_machine_defaults
from llmgw.daemon.control.model_deploy import deploy_of
from llmgw.lifecycle.config_diff import ConfigPlan, ScaleOverride, diff_config, diff_models, shown
from llmgw.lifecycle.revisions import LifecycleError

__all__ = ["ConfigReloader", "NoConfigFile", "engines_differ", "reconcile_file", "stored_override"]

log = logging.getLogger("llmgw.config")


class NoConfigFile(Exception):
    """The daemon runs without a config file (the embedded default)."""


def engines_differ(a: ModelConfig, b: ModelConfig) -> bool:
    """Would `a`'s engines be replaced to run `b` (the reconciler's own test: fleet/reconcile.py)."""
    da, db = deploy_of(a), deploy_of(b)
    if da is None or db is None:
        return (da is None) != (db is None)
    # a disaggregated model's groups: each group's template (its count is a scale)
    return (da.template != db.template or da.demand != db.demand
            or [(u.role, u.template) for u in da.roles] != [(u.role, u.template) for u in db.roles]
            or max(1, da.policy.nodes) != max(1, db.policy.nodes) or da.policy.keep_within != db.policy.keep_within)


def stored_override(rec: dict[str, Any]) -> ScaleOverride | None:
    s = rec.get("scaled")
    if rec.get("source") != "config" or not isinstance(s, dict):
        return None
    try:
        return ScaleOverride(int(s["count"]), int(s["file_count"]))
    except (KeyError, TypeError, ValueError):
        log.error("a stored scale override is invalid and is ignored: %r", s)
        return None


def load_models(plane: Any, stored: dict[str, dict[str, Any]]) -> None:
    """At a start: the stored models (config-file ones as they were in force, with their scale
    overrides), the file's models the store does not have, and the file's removed ones deleted;
    reconcile_file then compares the rest with the file."""
    config_names = {m.name for m in plane.cfg.models}
    records = {name: rec for name, rec in stored.items()
               if not (rec.get("source") == "config" and name not in config_names)}
    with plane.guard.transaction("load"):
        for m in plane.cfg.models:  # new in the file; the others: reconcile_file
            if records.get(m.name, {}).get("source") != "config":
                records[m.name] = {"source": "config", "model": model_to_dict(m)}
                plane.guard.write("put_model", m.name, records[m.name])
        for name in stored.keys() - records.keys():
            plane.guard.write("delete_model", name)
            plane.guard.record("model removed", model=name, detail="no longer in the config file")
    for name, rec in sorted(records.items()):
        try:
            m = model_from_dict(rec["model"], f"store model {name}", pools=plane.cfg.pools)
        except (ConfigError, KeyError, TypeError) as e:
            if name in config_names:  # the file's definition instead
                log.error("model %s in the store is invalid; the config file's is used: %s", name, e)
                m = next(c for c in plane.cfg.models if c.name == name)
                rec = {"source": "config"}
            else:
                log.error("model %s in the store is invalid and is ignored: %s", name, e)
                plane._unloadable[name] = rec  # kept as it is: a store re-write must not lose it
                continue
        plane._set_model(m, rec.get("source", "api"))
        if (ov := stored_override(rec)) is not None:
            plane.scale_overrides[name] = ov


def _candidates(plane: Any) -> dict[str, ModelConfig]:
    out = {}
    for name, revs in plane.lifecycle.revisions.items():
        if revs.candidate is not None:
            try:
                out[name] = model_from_dict(revs.candidate.definition, "candidate", pools=plane.cfg.pools)
            except ConfigError:
                continue
    return out


def _serving(plane: Any) -> set[str]:
    return {a.model for a in plane.assignments.values() if a.desired == "run"}


def _apply_models(plane: Any, plan: ConfigPlan, trigger: str) -> list[str]:
    """The plan's model changes, each written to the store before it takes effect; the update jobs
    started for candidates."""
    lc = plane.lifecycle
    jobs: list[str] = []
    for name, mp in plan.models.items():
        if mp.remove:
            plane.guard.must_write("delete_model", name)
            plane.guard.record("model removed", model=name, detail=f"no longer in the config file ({trigger})")
            lc.model_deleted(name)
            plane.models.pop(name, None)
            plane.sources.pop(name, None)
            plane.deploys.pop(name, None)
            plane.scale_overrides.pop(name, None)
            log.info("model %s removed: no longer in the config file (%s)", name, trigger)
            continue
        if mp.discard_candidate:
            revs = lc.revisions.get(name)
            if revs is not None and revs.candidate is not None:
                log.info("model %s: candidate %s discarded: the config file no longer asks for it", name,
                         revs.candidate.id)
                lc.rollback(name)
        if mp.override_dropped:
            plane.scale_overrides.pop(name, None)
            plane.guard.record("scale override dropped", model=name, detail=mp.override_dropped)
            log.warning("model %s: %s", name, mp.override_dropped)
        if mp.live is not None or mp.override_dropped or mp.add:
            m = mp.live if mp.live is not None else plane.models[name]
            plane.actions.save_model(m, "config")
        if mp.candidate is not None:
            try:
                job = lc.update(name, None, whole=model_to_dict(mp.candidate), from_config=trigger)
            except LifecycleError as e:
                log.error("model %s: the config file's definition could not become a candidate: %s", name, e)
                raise
            jobs.append(job.id)
            log.info("model %s: the config file's new definition is candidate %s (job %s)", name, job.revision_id,
                     job.id)
    return jobs


def _log_changes(plan: ConfigPlan, trigger: str) -> None:
    for c in plan.changes:
        level = logging.WARNING if c.action == "restart" else logging.INFO
        log.log(level, "config %s: %s%s: %s → %s: %s (%s)", trigger, c.section, f".{c.key}" if c.key else "",
                shown(c.old), shown(c.new), c.action, c.why)


def reconcile_file(plane: Any) -> None:
    """At a start: the file's models against the stored ones, by the reload's rule (a model new in
    the store was already taken as the file says; one whose engines would change becomes a
    candidate if it has replicas, else takes the file's definition)."""
    plan = diff_models(plane.cfg.models, plane.models, plane.sources, overrides=plane.scale_overrides,
                       candidates=_candidates(plane), serving=_serving(plane), engines_differ=engines_differ)
    if plan.empty:
        return
    _log_changes(plan, "start")
    try:
        _apply_models(plane, plan, "start")
    except Exception as e:  # noqa: BLE001 — the store cannot write, a candidate cannot be made: logged, never fatal
        log.error("the config file's models could not all be applied at start (llmgw ctl config reload tries "
                  "again): %s", e)


class ConfigReloader:
    """`path`: the file the daemon started with (None: the embedded default); `prepare`: what the
    daemon did to it at start (--host/--port, the embedded fleet), done to the re-read file too,
    after its empty machine defaults are filled in as at start (else they would show as changes)."""

    def __init__(self, plane: Any, path: str | None, prepare: Callable[[Config], Config]) -> None:
        self.plane, self.path, self.prepare = plane, path, prepare

    def read(self) -> Config:
        """The file as it is now; ConfigError (every problem with its line) or NoConfigFile."""
        if self.path is None:
            raise NoConfigFile("the daemon runs the embedded default (no config file): there is nothing to reload; "
                               "start it with --config FILE")
        return self.prepare(with_machine_defaults(load_config(self.path)))  # resolved as at start

    def _plan(self, cfg: Config) -> ConfigPlan:
        p = self.plane
        return diff_config(p.cfg, cfg, p.models, p.sources, overrides=p.scale_overrides, candidates=_candidates(p),
                           serving=_serving(p), engines_differ=engines_differ)

    def _report(self, plan: ConfigPlan, applied: bool, jobs: list[str]) -> ConfigReport:
        changes = [ConfigChangeView(c.section, c.key, c.action, shown(c.old), shown(c.new), c.why)
                   for c in plan.changes]
        return ConfigReport(file=self.path or "", applied=applied, changes=changes, jobs=jobs)

    def check(self) -> ConfigReport:
        return self._report(self._plan(self.read()), False, [])

    def reload(self, trigger: str = "reload") -> ConfigReport:
        """Apply what can be now (raises ConfigError or NoConfigFile before anything changes)."""
        cfg = self.read()
        p = self.plane
        plan = self._plan(cfg)
        _log_changes(plan, trigger)
        jobs = _apply_models(p, plan, trigger)
        if plan.strategies:
            p.router.set_strategies(cfg.strategies)
        if plan.facility:
            p.facility.reconfigure(cfg.facility)
        # What runs now: the reloaded models, strategies and facility; the sections that wait for a
        # start stay as they were (a later check still lists them).
        p.cfg = replace(p.cfg, models=cfg.models, strategies=cfg.strategies, facility=cfg.facility)
        p.guard.record("config reloaded", detail=f"{trigger}: {len(plan.changes)} changes, jobs {jobs or '-'}")
        log.info("config reloaded (%s) from %s: %d changes%s", trigger, self.path, len(plan.changes),
                 f"; candidates: {', '.join(jobs)}" if jobs else "")
        p._wake.set()
        return self._report(plan, True, jobs)

    async def serve_sighup(self) -> None:
        """SIGHUP does what `llmgw ctl config reload` does; what it did (or why not) is logged."""
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                try:
                    self.reload("SIGHUP")
                except ConfigError as e:
                    log.error("SIGHUP: the config file was not reloaded, nothing changed:\n%s", e)
                except NoConfigFile as e:
                    log.warning("SIGHUP: %s", e)
                except Exception as e:  # noqa: BLE001 — the store, a candidate: logged, never fatal
                    log.error("SIGHUP: the reload stopped part-way: %s: %s", type(e).__name__, e)

