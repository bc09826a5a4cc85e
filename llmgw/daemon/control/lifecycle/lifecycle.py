"""The model lifecycle in the control plane: revisions (update makes a candidate whose replicas
are placed beside the live ones; promote makes it live; rollback discards it or brings the
previous revision back), eval suites and their results, and the jobs that record each step.
The rules are pure (llmgw.lifecycle); this applies them to the plane's state and the store.

The candidate of model NAME is a deploy of its own under the routing key ``NAME#candidate``:
the reconciler places its replicas like any model's (capacity permitting: the plan's reason is
the update job's note while there is no room), the router routes them under that key, which no
client request resolves to. Promote re-keys the candidate's replicas to NAME — they take client
traffic at once — and the old replicas no longer match the definition: they drain after their
in-flight requests (plane.reconcile_once). Everything an operator starts is written to the store
before it takes effect (StoreGuard.must_write: a store that cannot write refuses it).

A router that restarts in the middle of a job: an update whose candidate is in the store resumes
(it goes on waiting for the candidate's replicas — kept in the store under the candidate's key,
their engines adopted as they answer, never restarted), and so does a rollback that brings the
previous revision back (one ``rollback`` job: placed, then promoted once ready); an eval fails
(run it again); a promote, or a rollback that discards, is done in one call and never left
half-way."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import trio

from llmgw.config import ConfigError, ModelConfig, model_from_dict, model_to_dict
from llmgw.daemon.control.lifecycle.eval_runner import EvalTarget
from llmgw.daemon.control.lifecycle.auto import auto_promote_step
from llmgw.daemon.control.lifecycle.evals import Evals
from llmgw.daemon.control.model_deploy import deploy_of
from llmgw.daemon.control.store.guard import StoreUnavailable
from llmgw.lifecycle.jobs import MAX_JOBS, Job, after_restart, job_from_dict, scale_job, scale_jobs_over
from llmgw.lifecycle.revisions import (
    LifecycleError,
    ModelRevisions,
    Revision,
    candidate_key,
    merge_definition,
    promote_problem,
    revisions_from_dict,
    rollback_action,
)
from llmgw.lifecycle.suites import Suite, parse_suite
from llmgw.config.names import CANDIDATE_SUFFIX
from llmgw.inputs.echo import echo

if TYPE_CHECKING:
    from llmgw.daemon.control.store.port import FleetStore
    from llmgw.daemon.net.upstream import UpstreamPool

log = logging.getLogger("llmgw.lifecycle")

__all__ = ["Lifecycle", "LifecycleError"]

DEFAULT_READY_TIMEOUT_S = 900.0
_FAILED_STATES = ("crashed", "failed", "crashloop")


class Lifecycle:
    def __init__(self, plane: Any) -> None:
        """`plane`: the ControlPlane (plane/plane.py) whose models, deploys and assignments it works on."""
        self.plane = plane
        self.revisions: dict[str, ModelRevisions] = {}
        self.suites: dict[str, Suite] = {}
        self.results: dict[str, dict[str, Any]] = {}  # "model/suite/revision" -> result
        self.jobs: dict[str, Job] = {}  # oldest first
        self._canary_base: dict[str, tuple[tuple[int, int, float, int], tuple[int, int, float, int]]] = {}
        self._nursery: trio.Nursery | None = None
        self._pool: UpstreamPool | None = None
        self._target: EvalTarget | None = None
        self.evals = Evals(self)  # suites, eval jobs and their results, the admin views (lifecycle/evals.py)

    # -- the store ---------------------------------------------------------------------------------
    def load(self, docs: dict[str, dict[str, dict[str, Any]]] | None = None, *, resume: bool = True) -> None:
        """Revisions, suites, results and jobs from the store (a record it cannot read is logged
        and skipped: it never stops the router); candidates are installed; running jobs resume or
        fail (jobs.after_restart) when `resume` — a router that leads. `docs`: the records as
        already read (a follower's snapshot, plane/follow.py); None reads them from the store."""
        st = self.plane.store
        if docs is None:
            docs = {k: st.docs(k) for k in ("revisions", "suite", "result", "job")}
        for name, d in docs.get("revisions", {}).items():
            try:
                self.revisions[name] = revisions_from_dict(d)
            except (KeyError, TypeError, ValueError) as e:
                log.error("stored revisions of model %s are invalid and are ignored: %s", name, e)
        for name, d in docs.get("suite", {}).items():
            try:
                self.suites[name] = parse_suite(str(d["toml"]), f"stored suite {name}", name=name)
            except (ConfigError, KeyError) as e:
                log.error("stored suite %s is invalid and is ignored: %s", name, e)
        self.results = {k: r for k, r in docs.get("result", {}).items() if isinstance(r, dict)}
        for jid, d in docs.get("job", {}).items():
            try:
                self.jobs[jid] = job_from_dict(d)
            except (KeyError, TypeError, ValueError) as e:
                log.error("stored job %s is invalid and is ignored: %s", jid, e)
        for name, revs in list(self.revisions.items()):
            if revs.candidate is not None and not self._install(name, revs.candidate):
                revs.candidate = None
        for name in self.plane.models:
            self.say_revisions(name)
        if resume:
            self._resume_jobs()

    def reload(self, docs: dict[str, dict[str, dict[str, Any]]], *, resume: bool = False) -> None:
        """Everything again from `docs` (a follower following the store, a new leader taking over):
        candidates no longer stored are uninstalled, the others installed as stored."""
        before = {name for name, revs in self.revisions.items() if revs.candidate is not None}
        self.revisions, self.suites, self.results, self.jobs = {}, {}, {}, {}
        self.load(docs, resume=resume)
        for name in before:
            revs = self.revisions.get(name)
            if revs is None or revs.candidate is None:
                self._uninstall(name)

    def _resume_jobs(self) -> None:
        now = time.time()
        for job in self.jobs.values():
            if job.trace is None or job.trace.ended is None:  # stored before traces, or still running
                job.start_trace(trio.current_time, now)  # a running one's trace goes on, on this clock
            if not job.done:
                self.plane.router.traces().add(job.trace)
                revs = self.revisions.get(job.model)
                outcome = after_restart(job, now, candidate_exists=revs is not None and revs.candidate is not None)
                log.warning("job %s (%s %s) was running when the router stopped: %s", job.id, job.kind, job.model,
                            "resumed" if outcome == "resume" else "failed")
                self._save_job(job)

    def rewrite(self, st: FleetStore) -> None:
        """Everything into `st` (the StoreGuard's write-back after the store could not write)."""
        for name, revs in self.revisions.items():
            st.put_doc("revisions", name, revs.to_dict())
        for name, s in self.suites.items():
            st.put_doc("suite", name, {"toml": s.source})
        for key, r in self.results.items():
            st.put_doc("result", key, r)
        for jid, job in self.jobs.items():
            st.put_doc("job", jid, job.to_dict())

    def _save_job(self, job: Job) -> None:
        self.plane.guard.write("put_doc", "job", job.id, job.to_dict())

    def _new_job(self, kind: str, model: str, revision_id: str = "", **params: Any) -> Job:
        job = Job(f"{kind}-{secrets.token_hex(4)}", kind, model, time.time(), revision_id=revision_id,
                  params=params)
        job.start_trace(trio.current_time, job.created_at)  # its steps as a trace's phases (kept with it)
        self.plane.router.traces().add(job.trace)  # GET /api/v1/traces lists it while it is recent
        self.jobs[job.id] = job
        done = [j for j in self.jobs.values() if j.done]
        for old in done[:max(0, len(self.jobs) - MAX_JOBS)]:
            del self.jobs[old.id]
            self.plane.guard.write("delete_doc", "job", old.id)
        return job

    def scale_event(self, model: str, from_n: int, to_n: int, reason: str, mode: str) -> Job:
        """An autoscaler changed `model`'s count: a job of kind "scale", succeeded at once, stored
        like the others (best effort: a store that cannot write gets it with the write-back), so
        `ctl jobs` and the console list it. Its trace is kept with the job (GET /traces/{id}) but
        not put in the router's ring of recent traces, which a busy autoscaler would crowd. At most
        MAX_SCALE_JOBS of a model's scale jobs are kept: the oldest go, from memory and store."""
        job = scale_job(f"scale-{secrets.token_hex(4)}", model, from_n, to_n, reason, mode, time.time())
        job.start_trace(trio.current_time, job.created_at)
        self.jobs[job.id] = job
        self._save_job(job)
        for jid in scale_jobs_over(self.jobs, model):
            self._drop_job(jid)
        done = [j.id for j in self.jobs.values() if j.done]
        for jid in done[:max(0, len(self.jobs) - MAX_JOBS)]:
            self._drop_job(jid)
        return job

    def _drop_job(self, jid: str) -> None:
        del self.jobs[jid]
        self.plane.guard.write("delete_doc", "job", jid)

    # -- the router's side -------------------------------------------------------------------------
    def attach(self, nursery: trio.Nursery, pool: UpstreamPool, target: EvalTarget) -> None:
        """Where eval runs go: the router's OpenAI port (set once the port listens)."""
        self._nursery, self._pool, self._target = nursery, pool, target

    def router_model(self, key: str) -> ModelConfig | None:
        """The router's view of a candidate (its routing key as the name; no static replicas)."""
        if not key.endswith(CANDIDATE_SUFFIX):
            return None
        revs = self.revisions.get(key[:-len(CANDIDATE_SUFFIX)])
        if revs is None or revs.candidate is None:
            return None
        m = self._model_of(revs.candidate)
        return None if m is None else replace(m, name=key, replicas=())

    def _model_of(self, rev: Revision) -> ModelConfig | None:
        try:
            return model_from_dict(rev.definition, f"revision {rev.id}", pools=self.plane.cfg.pools)
        except ConfigError as e:
            log.error("revision %s is invalid: %s", rev.id, e)
            return None

    def _install(self, name: str, rev: Revision) -> bool:
        """The candidate's deploy (under its key) and its router entry; False if it cannot be."""
        m = self._model_of(rev)
        dep = deploy_of(m) if m is not None else None
        if m is None or dep is None:
            return False
        key = candidate_key(name)
        if m.autoscale is not None:  # as many as the live model has in force (daemon/control/autoscaling.py)
            dep = replace(dep, count=self.plane.autoscaling.candidate_count(name, m))
        self.plane.deploys[key] = replace(dep, name=key)
        # its router entry waits for no cold start: it takes only the canary's share and the evals
        self.plane.router.define_model(replace(m, name=key, replicas=(), autoscale=None))
        self.plane.router.set_canary(name, rev.canary)
        self.plane.router.set_revision(key, rev.id)
        return True

    def say_revisions(self, name: str) -> None:
        """Tell the router the revision ids model `name` and its candidate serve (its requests'
        traces carry them); a model never updated serves r1."""
        revs = self.revisions.get(name)
        self.plane.router.set_revision(name, revs.live_id if revs is not None else "r1")
        cand = revs.candidate if revs is not None else None
        self.plane.router.set_revision(candidate_key(name), cand.id if cand is not None else "")

    def _uninstall(self, name: str) -> None:
        key = candidate_key(name)
        self.plane.deploys.pop(key, None)
        self.say_revisions(name)
        self.plane.router.set_canary(name, 0.0)
        self._canary_base.pop(name, None)
        if not any(a.model == key for a in self.plane.assignments.values()):
            self.plane.router.forget_model(key)

    def _candidate_replicas(self, name: str) -> list[Any]:
        key = candidate_key(name)
        return [a for a in self.plane.assignments.values() if a.model == key and a.desired == "run"]

    def _running(self, name: str, kind: str) -> Job | None:
        return next((j for j in self.jobs.values() if j.model == name and j.kind == kind and not j.done), None)

    # -- update -------------------------------------------------------------------------------------
    def update(self, name: str, change: dict[str, Any] | None, *, canary: float = 0.0,
               ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S, then_promote: bool = False,
               whole: dict[str, Any] | None = None, restored_from: str = "", from_config: str = "") -> Job:
        """Make a candidate of model `name` from its definition and `change` (None: re-roll the
        same definition; `whole`: this whole definition instead) and place its replicas beside the
        live ones. ConfigError names bad fields. `restored_from`: a rollback's (rollback()): the
        job is a ``rollback`` job, and the candidate is promoted once ready. `from_config`: what
        made it from the config file (a reload, a start: plane/config_reload.py) — its
        `[models.lifecycle]` then says whether it is promoted by itself (lifecycle/auto.py)."""
        p = self.plane
        m = p.models.get(name)
        if m is None:
            raise LifecycleError(404, f"No model {echo(name)}.")
        if p.sources.get(name) == "config" and not from_config:
            raise LifecycleError(409, f"model {name} is defined in the config file: change it there, then "
                                      "`llmgw ctl config reload` (a change to its engines becomes a candidate to "
                                      "evaluate and promote, as here)")
        if m.deploy is None:
            raise LifecycleError(409, f"model {name} has no [models.deploy] profile: its replicas are static, "
                                      "there is nothing to place a candidate with")
        job = self._running(name, "update") or self._running(name, "rollback")
        if job is not None:
            raise LifecycleError(409, f"{job.kind} job {job.id} of model {name} is running; wait for it, or "
                                      f"`llmgw ctl models rollback {name}`")
        revs = self.revisions.get(name) or ModelRevisions(name)
        if revs.candidate is not None:
            raise LifecycleError(409, f"model {name} has a candidate ({revs.candidate.id}): promote it or roll it "
                                      "back first")
        if candidate_key(name) in p.models:
            raise LifecycleError(409, f"a model named {candidate_key(name)!r} exists: that name is the "
                                      "candidate's routing key")
        if not 0.0 <= canary <= 1.0:
            raise LifecycleError(400, "canary: a share from 0 to 100%")
        definition = whole if whole is not None else merge_definition(model_to_dict(m), change)
        cm = model_from_dict(definition, "update", pools=p.cfg.pools)  # raises ConfigError naming fields
        if cm.deploy is None:
            raise LifecycleError(400, "deploy: the candidate needs a [models.deploy] profile")
        rev = Revision(revs.new_id(), model_to_dict(cm), time.time(), canary, restored_from=restored_from)
        revs.candidate = rev
        p.guard.must_write("put_doc", "revisions", name, revs.to_dict())  # first: nothing changes if it cannot
        self.revisions[name] = revs
        auto = cm.lifecycle if from_config and cm.lifecycle is not None else None
        extra: dict[str, Any] = {"restored_from": restored_from} if restored_from else {}
        if from_config:
            extra["from_config"] = from_config
        if auto is not None and auto.auto_promote:
            extra.update(auto_promote=True, require_suites=list(auto.require_suites))
        job = self._new_job("rollback" if restored_from else "update", name, rev.id, canary=canary,
                            ready_timeout_s=ready_timeout_s, then_promote=then_promote or bool(restored_from),
                            change=change or {}, **extra)
        job.step("placing candidate replicas", job.created_at,
                 f"{cm.deploy.replicas} replicas of {rev.id}{f' (restored from {restored_from})' if restored_from else ''}"
                 f" beside live {revs.live_id}")
        self._save_job(job)
        self._install(name, rev)
        if canary > 0:
            self._canary_base[name] = (p.router.request_counts(name), p.router.request_counts(candidate_key(name)))
        p.guard.record("candidate created", model=name,
                       detail=f"{rev.id}{f' restored from {restored_from}' if restored_from else ''} (job {job.id})")
        log.info("model %s: candidate %s created (job %s)", name, rev.id, job.id)
        p._wake.set()
        return job

    def tick(self) -> None:
        """Each reconcile: running update jobs move on (ready, failed with the engines' log tail,
        waiting for room, timed out)."""
        for job in [j for j in self.jobs.values() if j.kind in ("update", "rollback") and not j.done]:
            self._watch_update(job)

    def _watch_update(self, job: Job) -> None:
        p = self.plane
        revs = self.revisions.get(job.model)
        now = time.time()
        if revs is not None and revs.live_id == job.revision_id:  # an operator promoted it meanwhile
            job.succeed(now, f"{job.revision_id} was promoted by hand")
            self._save_job(job)
            return
        if revs is None or revs.candidate is None or revs.candidate.id != job.revision_id:
            job.fail(now, "the candidate was discarded")
            self._save_job(job)
            return
        reps = self._candidate_replicas(job.model)
        dep = self.plane.deploys.get(candidate_key(job.model))
        want = dep.count if dep is not None else 0
        bad = [a for a in reps if a.engine_state in _FAILED_STATES]
        ready = [a for a in reps if a.engine_state == "ready" and p.router.replica_state(a.replica) is not None]
        if bad:
            a = bad[0]
            r = a.report
            tail = "\n".join(r.log_tail[-20:]) if r is not None else ""
            why = (f"candidate replica {a.replica} on {a.node}: {a.engine_state}"
                   f"{': ' + r.detail if r is not None and r.detail else ''}" + (f"\nlog tail:\n{tail}" if tail else ""))
            self._fail_update(job, why)
        elif len(ready) >= want and job.params.get("auto_promote"):
            auto_promote_step(self, job, now)  # evals of the required suites, then promote (lifecycle/auto.py)
        elif len(ready) >= want:
            p.guard.record("candidate ready", model=job.model, detail=job.revision_id)
            if not job.params.get("then_promote"):
                job.succeed(now, f"candidate {job.revision_id} ready: {len(ready)}/{want} replicas")
                self._save_job(job)
                return
            job.note(f"candidate {job.revision_id} ready: {len(ready)}/{want} replicas")
            try:
                self.promote(job.model, [], into=job)  # the same job goes on: making it live
            except (LifecycleError, StoreUnavailable) as e:
                log.error("model %s: the rollback's promote failed (promote the candidate by hand: llmgw ctl "
                          "models promote %s): %s", job.model, job.model, e)
                job.fail(time.time(), f"the candidate is ready but its promote failed (promote it by hand: "
                                      f"llmgw ctl models promote {job.model}): {e}")
                self._save_job(job)
        elif now - job.created_at > float(job.params.get("ready_timeout_s", DEFAULT_READY_TIMEOUT_S)):
            room = p.unplaceable.get(candidate_key(job.model))
            self._fail_update(job, f"candidate {job.revision_id} not ready after "
                                   f"{job.params.get('ready_timeout_s')} s ({len(ready)}/{want} ready"
                                   f"{'; ' + room if room else ''})")
        else:
            room = p.unplaceable.get(candidate_key(job.model))
            states = ", ".join(sorted(f"{a.replica} {a.engine_state}" for a in reps)) or "none placed yet"
            note = f"{len(ready)}/{want} ready ({states})" + (f"; waiting for room: {room}" if room else "")
            if job.steps and job.steps[-1].detail != note:
                job.note(note)
                self._save_job(job)

    def _fail_update(self, job: Job, why: str) -> None:
        """The candidate is discarded (its replicas drain and stop); live traffic was never touched."""
        job.fail(time.time(), why)
        self._save_job(job)
        revs = self.revisions.get(job.model)
        if revs is not None and revs.candidate is not None and revs.candidate.id == job.revision_id:
            revs.candidate = None
            self.plane.guard.write("put_doc", "revisions", job.model, revs.to_dict())
            self._uninstall(job.model)
        self.plane.guard.record("update failed", model=job.model, detail=why[:500])
        log.warning("model %s: update %s failed: %s", job.model, job.id, why.splitlines()[0])
        self.plane._wake.set()

    # -- promote and rollback -----------------------------------------------------------------------
    def promote(self, name: str, require: list[str], *, into: Job | None = None) -> Job:
        """Make the candidate live; `into`: a rollback's job, which goes on with this step (else a
        promote job is made)."""
        p = self.plane
        if name not in p.models:
            raise LifecycleError(404, f"No model {echo(name)}.")
        for s in require:
            if s not in self.suites:
                raise LifecycleError(404, f"No suite {echo(s)}.")
        revs = self.revisions.get(name)
        reps = self._candidate_replicas(name)
        ready = sum(1 for a in reps if a.engine_state == "ready" and p.router.replica_state(a.replica) is not None)
        want = p.deploys[candidate_key(name)].count if candidate_key(name) in p.deploys else 0
        results = {s: self.evals.last_result(name, s, revs.candidate.id if revs and revs.candidate else "")
                   for s in require}
        why = promote_problem(revs, ready=ready, wanted=want, required=require, results=results)
        if why is not None:
            raise LifecycleError(409, why)
        assert revs is not None and revs.candidate is not None
        cand = revs.candidate
        cm = self._model_of(cand)
        if cm is None:
            raise LifecycleError(409, f"candidate {cand.id} is no longer a valid definition")
        now = time.time()
        job = into if into is not None else self._new_job("promote", name, cand.id, require=require)
        job.step("making the candidate live", now)
        old_live = Revision(revs.live_id, model_to_dict(p.models[name]), now, restored_from=revs.live_restored_from)
        source = p.sources.get(name, "api")
        moving = [a for a in p.assignments.values() if a.model == candidate_key(name)]
        after = replace(revs, previous=old_live, live_id=cand.id, promoted_at=now, candidate=None,
                        live_restored_from=cand.restored_from)
        # All of it in one store transaction, before anything changes: a store that cannot write
        # refuses the promote (503) and nothing changes; a restart finds it done or not begun.
        try:
            with p.store.transaction():
                p.guard.must_write("put_model", name, p.actions.model_record(name, cm, source))
                p.guard.must_write("put_doc", "revisions", name, after.to_dict())
                for a in moving:
                    p.guard.must_write("put_assignment", p._row(replace(a, model=name)))
        except p.store.faults as e:
            raise StoreUnavailable(p.store.describe(e), str(e)) from None
        self.revisions[name] = revs = after
        p._set_model(cm, source)
        self._uninstall(name)
        old = sorted(a.replica for a in p.assignments.values() if a.model == name)
        for a in moving:
            p.router.withdraw_replica(a.replica)
            a.model = name
            p._route(a)  # under the model's own name: client traffic from now on
        p.router.forget_model(candidate_key(name))
        job.step("draining the old replicas", time.time(), ", ".join(old) or "none")
        job.succeed(time.time(), f"{cand.id}{f' (restored from {cand.restored_from})' if cand.restored_from else ''}"
                                 f" is live; {len(old)} replicas of {old_live.id} drain after their in-flight requests")
        self._save_job(job)
        p.guard.record("promoted", model=name, detail=f"{cand.id} live, {old_live.id} draining (job {job.id})")
        log.info("model %s: %s is live (job %s)", name, cand.id, job.id)
        p._wake.set()
        return job

    def rollback(self, name: str) -> Job:
        p = self.plane
        if name not in p.models:
            raise LifecycleError(404, f"No model {echo(name)}.")
        revs = self.revisions.get(name)
        action = rollback_action(revs, time.time())
        assert revs is not None
        if action == "discard":
            cand = revs.candidate
            assert cand is not None
            revs.candidate = None
            p.guard.must_write("put_doc", "revisions", name, revs.to_dict())
            now = time.time()
            running = self._running(name, "update") or self._running(name, "rollback")
            if running is not None:
                running.fail(now, "rolled back by an operator")
                self._save_job(running)
            job = self._new_job("rollback", name, cand.id)
            job.step("discarding the candidate", now)
            self._uninstall(name)
            job.succeed(time.time(), f"candidate {cand.id} discarded; its replicas drain and stop; live "
                                     f"{revs.live_id} untouched")
            self._save_job(job)
            p.guard.record("candidate discarded", model=name, detail=cand.id)
            p._wake.set()
            return job
        prev = revs.previous
        assert prev is not None
        # The previous revision comes back as a candidate and is promoted once ready: no gap. Its
        # definition gets a new revision id (ids are never reused), which says whose it is.
        job = self.update(name, None, whole=prev.definition, restored_from=prev.id)
        revs.previous, revs.promoted_at = None, None
        p.guard.write("put_doc", "revisions", name, revs.to_dict())
        job.note(f"bringing back {prev.id} as {job.revision_id} (restored from {prev.id}); promoted once ready")
        self._save_job(job)
        return job

    def model_deleted(self, name: str) -> None:
        """The model is deleted: its candidate goes with it (its replicas drain), its revisions too."""
        for key in [k for k, r in self.results.items() if r.get("model") == name]:
            del self.results[key]
            self.plane.guard.write("delete_doc", "result", key)
        revs = self.revisions.pop(name, None)
        if revs is not None:
            self.plane.guard.write("delete_doc", "revisions", name)
            self._uninstall(name)
        self.plane.router.set_revision(name, "")
        now = time.time()
        for job in self.jobs.values():
            if job.model == name and job.kind in ("update", "rollback") and not job.done:
                job.fail(now, "the model was deleted")
                self._save_job(job)
