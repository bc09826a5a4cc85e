"""The agent's engine processes: start them, health-check them, restart them on a crash with backoff,
stop them, and account for each in an EngineReport.

Each engine runs in its own session (its own process group, so its workers are signalled with it),
with stdout+stderr appended to `state_dir/logs/<id>.log` (engine_logs.py: a file, not a pipe, so the
engine survives an agent crash). A state record `state_dir/engines/<id>.json` (llmgw.fleet.engine_record)
exists while we own a live engine process; the /proc checks that recognise it later are in processes.py.
The state_dir, engines/ and logs/ are 0700 and every file in them 0600 (private_files.py): a record
holds its engine's `env`, secrets included, and a log may hold prompts.

Agent crash vs agent stop: engines survive an agent crash (SIGKILL, or `run` cancelled without
`stop_all`). The next agent run calls `adopt_leftovers` first: an engine whose recorded pid is alive,
still leads its recorded process group, started when recorded and has the recorded command line is
adopted (reported `starting`, then `ready` once its health answers, with adopted=True); a later
`apply` keeps it if its replica and spec_hash are still desired and stops it otherwise. Leftovers that
do not match are killed (the group's survivors when the leader is gone; a live non-matching pid is a
reused pid, never ours, and is left alone). A graceful agent stop (`stop_all`) always stops every
engine: an engine never outlives a stopped agent.

Restart/replace (generation bump, spec change) report `stopping` then `starting`; `stopped` means the
engine is gone and it leaves reports() right after that report."""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import trio

from llmgw.daemon.agent.engine_files import EngineFiles, safe_id
from llmgw.daemon.agent.engine_logs import EngineLog
from llmgw.daemon.agent.processes import (
    dial_host,
    find_ray,
    find_rpc_server,
    free_port,
    group_exists,
    host_port,
    is_same_process,
    pid_alive,
    process_starttime,
    ray_port_of,
    signal_group,
)
from llmgw.fleet.engine_cmd import build_command, build_env, health_path, probes_tcp, ray_group
from llmgw.fleet.engine_record import EngineRecord
from llmgw.fleet.lifecycle import RestartPolicy
from llmgw.fleet.types import RUNNING_STATES, EngineReport, EngineSpec

__all__ = ["EngineSupervisor", "safe_id"]

UNHEALTHY_AFTER = 3  # consecutive failed checks of a ready engine

_log = logging.getLogger("llmgw.agent.engines")


@dataclass(eq=False)
class _Engine:
    spec: EngineSpec  # of the current (or last) process
    policy: RestartPolicy
    target: EngineSpec | None  # what apply() wants; None: stop
    logfile: EngineLog  # its output, and our tail of it
    changed: trio.Event = field(default_factory=trio.Event)  # target changed: the task re-evaluates
    done: trio.Event = field(default_factory=trio.Event)
    state: str = "starting"
    detail: str = ""
    log_tail: tuple[str, ...] = ()
    restarts: int = 0
    adopted: bool = False
    running: bool = False  # a process of ours (or adopted) exists
    proc: trio.Process | None = None  # None when adopted: not our child
    pid: int | None = None
    pgid: int | None = None
    port: int | None = None
    group_port: int | None = None  # a vLLM multi-node head's Ray port (reported: its workers join it)
    next_start: float | None = -math.inf  # trio time of the next start (at once); None: wait for the operator
    after_crash: bool = False
    life_started: float = 0.0


class EngineSupervisor:
    def __init__(self, state_dir: Path, host: str, on_report: Callable[[EngineReport], None], *,
                 python: str = sys.executable, policy_factory: Callable[[], RestartPolicy] = RestartPolicy,
                 grace_s: float = 10.0, health_interval_s: float = 0.5, log: logging.Logger = _log) -> None:
        self._state_dir = Path(state_dir)
        self.files = EngineFiles(self._state_dir, log)
        self._host = host
        self._on_report = on_report
        self._python = python
        self._policy_factory = policy_factory
        self._grace_s = grace_s
        self._interval = health_interval_s
        self._probe_timeout = max(1.0, 2 * health_interval_s)
        self._log = log
        self._engines: dict[str, _Engine] = {}
        self._nursery: trio.Nursery | None = None
        self._pending: list[_Engine] = []  # engines waiting for run() to give them a task
        self._closed = False

    # ---- public API ------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own one task per engine until cancelled. Cancelling leaves the processes running (as an
        agent crash would); call stop_all first for a graceful stop."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                pending, self._pending = self._pending, []
                for eng in pending:
                    nursery.start_soon(self._engine_task, eng)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def apply(self, desired: list[EngineSpec]) -> None:
        """Reconcile to `desired`: start, stop, replace (spec_hash changed) or restart (generation up)."""
        if self._closed:
            self._log.warning("engine supervisor is stopped; ignoring apply()")
            return
        want = {s.replica: s for s in desired}
        for rid, eng in self._engines.items():
            target = want.get(rid)
            if target != eng.target:
                eng.target = target
                eng.changed.set()
        for rid, spec in want.items():
            if rid not in self._engines:
                eng = _Engine(spec=spec, policy=self._policy_factory(), target=spec, logfile=self.files.logfile(rid))
                self._engines[rid] = eng
                self._launch(eng)

    def reports(self) -> list[EngineReport]:
        """Every engine's report, with its whole spec (the hello's: a router that lost its store
        keeps or adopts the engines by it)."""
        return [replace(self._report(e), spec=e.spec) for e in self._engines.values()]

    async def stop_all(self) -> None:
        """Stop every engine (TERM the group, grace_s, KILL) and remove their records. Shielded: it
        finishes even when the caller is being cancelled."""
        self._closed = True
        with trio.CancelScope(shield=True):
            for eng in self._engines.values():
                eng.target = None
                eng.changed.set()
            pending, self._pending = self._pending, []
            async with trio.open_nursery() as nursery:
                for eng in list(self._engines.values()):
                    nursery.start_soon(self._engine_task if eng in pending else self._stop_after_task, eng)

    async def _stop_after_task(self, eng: _Engine) -> None:
        await eng.done.wait()
        if self._engines.get(eng.spec.replica) is eng:  # its task was cancelled with run(): stop it here
            if eng.running:
                await self._terminate(eng)
            self._finish(eng)

    async def adopt_leftovers(self) -> list[EngineReport]:
        """Adopt engines a previous agent run left running (see the module docstring), clean up the
        rest. Call before the first apply()."""
        adopted: list[EngineReport] = []
        self.files.private_dirs()
        for path, rec in self.files.records():
            spec, pid, pgid, port = rec.spec, rec.pid, rec.pgid, rec.port
            if spec.replica in self._engines:  # called late: this record is of an engine we run
                continue
            if is_same_process(pid, pgid, rec.cmd, rec.starttime):
                eng = _Engine(spec=spec, policy=self._policy_factory(), target=spec,
                              logfile=self.files.logfile(spec.replica), adopted=True, running=True, pid=pid, pgid=pgid,
                              port=port, group_port=ray_port_of(rec.cmd), life_started=trio.current_time())
                eng.logfile.follow()
                self._engines[spec.replica] = eng
                self._log.info("adopted engine %s (pid %d, port %d)", spec.replica, pid, port)
                self._set(eng, "starting")
                adopted.append(self._report(eng))
                self._launch(eng)
                continue
            if not pid_alive(pid) and group_exists(pgid):
                self._log.warning("killing leftover process group %d of engine %s", pgid, spec.replica)
                signal_group(pgid, signal.SIGKILL)
            path.unlink(missing_ok=True)
        return adopted

    # ---- one task per engine ---------------------------------------------------------------------

    def _launch(self, eng: _Engine) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._engine_task, eng)
        else:
            self._pending.append(eng)

    async def _engine_task(self, eng: _Engine) -> None:
        try:
            while True:
                action = self._take_target(eng)
                if action == "stop":
                    if eng.running:
                        await self._terminate(eng)
                        continue  # it may have been wanted again meanwhile
                    break
                if action in ("replace", "restart"):
                    if eng.running:
                        await self._terminate(eng)
                        continue  # the old spec's process is gone; re-read the target
                    assert eng.target is not None
                    eng.spec = eng.target
                    if action == "replace":
                        eng.policy = self._policy_factory()
                    else:
                        eng.policy.reset()
                    eng.restarts, eng.after_crash, eng.next_start = 0, False, trio.current_time()
                if eng.running:
                    outcome = await self._watch(eng)
                    if outcome is not None:
                        self._on_death(eng, *outcome)
                    continue
                if eng.next_start is None:  # crash loop: only an operator's change helps
                    await eng.changed.wait()
                    continue
                with trio.move_on_at(eng.next_start) as waited:
                    await eng.changed.wait()
                if not waited.cancelled_caught:
                    continue
                if eng.after_crash:
                    eng.restarts += 1
                    eng.after_crash = False
                error = await self._spawn(eng)
                if error is not None:
                    self._on_death(eng, "failed", error)
            self._finish(eng)
        finally:
            eng.logfile.close()
            eng.done.set()

    def _take_target(self, eng: _Engine) -> str:
        eng.changed = trio.Event()
        t = eng.target
        if t is None:
            return "stop"
        if t.spec_hash() != eng.spec.spec_hash():
            return "replace"
        if t.generation > eng.spec.generation:
            return "restart"
        eng.spec = t  # same process; a generation that did not go up changes nothing
        return "none"

    def _finish(self, eng: _Engine) -> None:
        self._set(eng, "stopped")
        if self._engines.get(eng.spec.replica) is eng:
            del self._engines[eng.spec.replica]

    def _on_death(self, eng: _Engine, state: str, detail: str) -> None:
        """The process is gone (crashed, or killed for a missed health deadline): ask the policy."""
        now = trio.current_time()
        delay = eng.policy.record_crash(now, random.random())
        tail = tuple(eng.logfile.ring)
        if delay is None:
            self._set(eng, state, detail, tail)
            first = eng.policy.first_crash_at or now
            self._set(eng, "crashloop",
                      f"crash loop: {eng.policy.crashes} crashes in {now - first:.1f}s (last: {detail}); "
                      f"an operator must restart it by bumping generation", tail)
            eng.next_start = None
        else:
            self._set(eng, state, f"{detail}; restarting in {delay:.2f}s", tail)
            eng.next_start = now + delay
            eng.after_crash = True

    # ---- a process's life ------------------------------------------------------------------------

    async def _spawn(self, eng: _Engine) -> str | None:
        """Start the engine's process; an error message if it could not be started."""
        spec = eng.spec
        eng.logfile.ring.clear()
        eng.adopted = False
        cmd = [spec.binary or spec.engine]
        try:
            eng.port = free_port(self._host, eng.port)
            ray = ray_group(spec)
            eng.group_port = free_port(self._host, eng.group_port, avoid=eng.port) \
                if ray and not spec.is_worker else None
            cmd = build_command(spec, self._host, eng.port, self._python, self.files.kv_endpoints(spec),
                                rpc_server=find_rpc_server(spec) if probes_tcp(spec) and not ray else None,
                                ray=find_ray(spec) if ray else None, ray_port=eng.group_port)
            with eng.logfile.open_for_engine(cmd) as out:
                proc = await trio.lowlevel.open_process(cmd, env=build_env(spec, dict(os.environ)),
                                                        stdin=subprocess.DEVNULL, stdout=out,
                                                        stderr=subprocess.STDOUT, start_new_session=True)
        except (OSError, ValueError) as e:
            eng.logfile.close()
            return f"cannot start {cmd[0]}: {e}"
        eng.proc, eng.pid, eng.pgid, eng.running = proc, proc.pid, proc.pid, True
        eng.life_started = trio.current_time()
        try:
            self._write_record(eng, cmd)
        except OSError as e:  # it still runs; only adoption after an agent crash is lost
            self._log.error("cannot write the state record of %s: %s", spec.replica, e)
        self._set(eng, "starting")
        return None

    async def _watch(self, eng: _Engine) -> tuple[str, str] | None:
        """Until the process exits ("crashed", why), misses its health deadline ("failed", why; it is
        killed) or the target changes (None; still running)."""
        outcome: list[tuple[str, str] | None] = []

        async with trio.open_nursery() as nursery:
            def finish(o: tuple[str, str] | None) -> None:
                if not outcome:
                    outcome.append(o)
                nursery.cancel_scope.cancel()

            async def exited() -> None:
                finish(("crashed", await self._wait_exit(eng)))

            async def health() -> None:
                finish(("failed", await self._health(eng)))

            async def changed() -> None:
                await eng.changed.wait()
                finish(None)

            for fn in (exited, health, changed):
                nursery.start_soon(fn)
            nursery.start_soon(eng.logfile.tail, self._interval)
        result = outcome[0]
        if result is None:
            return None
        if result[0] == "failed":
            with trio.CancelScope(shield=True):
                await self._kill(eng, grace=0.0)
        else:
            if eng.pgid is not None and group_exists(eng.pgid):
                signal_group(eng.pgid, signal.SIGKILL)  # orphaned workers would hold the GPUs
            self._gone(eng)
        return result

    async def _wait_exit(self, eng: _Engine) -> str:
        if eng.proc is not None:
            rc = await eng.proc.wait()
            if rc < 0:
                try:
                    return f"killed by signal {signal.Signals(-rc).name}"
                except ValueError:
                    return f"killed by signal {-rc}"
            return f"exited with status {rc}"
        assert eng.pid is not None
        while pid_alive(eng.pid):  # adopted: not our child, so poll
            await trio.sleep(self._interval)
        return "exited (adopted process: status unknown)"

    async def _health(self, eng: _Engine) -> str:
        """Poll until healthy (→ ready), then watch; returns only when the start deadline passes."""
        timeout = eng.spec.health_timeout_s
        deadline = eng.life_started + timeout
        while not await self._probe(eng):
            if trio.current_time() >= deadline:
                return f"not healthy after {timeout:g}s"
            await trio.sleep_until(min(deadline, trio.current_time() + self._interval))
        self._set(eng, "ready")
        eng.policy.record_healthy(trio.current_time())
        failures = 0
        while True:
            await trio.sleep(5 * self._interval)
            if await self._probe(eng):
                failures = 0
                eng.policy.record_healthy(trio.current_time())
                if eng.state == "unhealthy":
                    self._set(eng, "ready")
            else:
                failures += 1
                if failures >= UNHEALTHY_AFTER and eng.state == "ready":
                    self._set(eng, "unhealthy", f"health check failed {failures} times in a row")

    async def _probe(self, eng: _Engine) -> bool:
        """GET /health answers 200. A minimal raw request: all we need is the status line."""
        host = dial_host(self._host)
        req = (f"GET {health_path(eng.spec)} HTTP/1.1\r\nHost: {host_port(self._host, eng.port)}\r\n"
               f"Connection: close\r\n\r\n").encode()
        with trio.move_on_after(self._probe_timeout):
            try:
                if probes_tcp(eng.spec) and eng.state in ("ready", "unhealthy"):
                    # llama.cpp's RPC server serves one client (its head) at a time with a backlog
                    # of 1: once it is up, connecting would queue and fail. Its process is its
                    # liveness then (an exit is a crash, watched apart).
                    return True
                stream = await trio.open_tcp_stream(host, eng.port or 0)
                async with stream:
                    if probes_tcp(eng.spec):
                        return True  # it accepts connections: up
                    await stream.send_all(req)
                    buf = b""
                    while b"\r\n" not in buf and len(buf) < 4096:
                        chunk = await stream.receive_some(4096)
                        if not chunk:
                            break
                        buf += chunk
                parts = buf.split(b" ", 2)
                return len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1] == b"200"
            except (OSError, trio.BrokenResourceError):
                return False
        return False

    async def _terminate(self, eng: _Engine) -> None:
        """Stop on purpose: report stopping, TERM, grace, KILL; the record goes."""
        self._set(eng, "stopping")
        await self._kill(eng, grace=self._grace_s)

    async def _kill(self, eng: _Engine, grace: float) -> None:
        """TERM the group, wait up to `grace` for it to go, KILL what is left, reap the leader."""
        assert eng.pgid is not None
        pgid = eng.pgid
        if grace > 0:
            signal_group(pgid, signal.SIGTERM)
            with trio.move_on_after(grace):
                await self._wait_leader(eng)
                while group_exists(pgid):
                    await trio.sleep(0.05)
        if group_exists(pgid):
            signal_group(pgid, signal.SIGKILL)
        with trio.move_on_after(max(grace, 5.0)):
            await self._wait_leader(eng)
        eng.logfile.drain(final=True)
        self._gone(eng)

    async def _wait_leader(self, eng: _Engine) -> None:
        if eng.proc is not None:
            await eng.proc.wait()
            return
        while eng.pid is not None and pid_alive(eng.pid):
            await trio.sleep(0.05)

    def _gone(self, eng: _Engine) -> None:
        """The process no longer exists: forget it and its record."""
        eng.logfile.drain(final=True)
        eng.logfile.close()
        eng.running, eng.proc, eng.pid = False, None, None
        self.files.remove_record(eng.spec.replica)

    # ---- state, reports, records -----------------------------------------------------------------

    def _set(self, eng: _Engine, state: str, detail: str = "", log_tail: tuple[str, ...] = ()) -> None:
        eng.state, eng.detail, eng.log_tail = state, detail, log_tail
        report = self._report(eng)
        self._log.info("engine %s: %s%s", eng.spec.replica, state, f" ({detail})" if detail else "")
        try:
            self._on_report(report)
        except Exception:  # noqa: BLE001 — a bad callback must not stop the supervision
            self._log.exception("on_report failed for %s", eng.spec.replica)

    def _report(self, eng: _Engine) -> EngineReport:
        live = eng.state in RUNNING_STATES and eng.running
        return EngineReport(replica=eng.spec.replica, model=eng.spec.model, state=eng.state,
                            spec_hash=eng.spec.spec_hash(), generation=eng.spec.generation,
                            url=self._url(eng) if live else None, pid=eng.pid if live else None,
                            restarts=eng.restarts, detail=eng.detail, log_tail=eng.log_tail,
                            adopted=eng.adopted, group_port=eng.group_port if live else None,
                            **self.files.kv_report(eng.spec, live))

    def _url(self, eng: _Engine) -> str:
        return f"http://{host_port(self._host, eng.port)}"

    def _write_record(self, eng: _Engine, cmd: list[str]) -> None:
        assert eng.pid is not None and eng.pgid is not None and eng.port is not None
        self.files.write_record(EngineRecord(spec=eng.spec, pid=eng.pid, pgid=eng.pgid, port=eng.port, cmd=cmd,
                                             url=self._url(eng), started_at=time.time(),
                                             starttime=process_starttime(eng.pid)))
