"""`llmgw daemon --workers N` (N > 1): a small supervisor of N router processes on one host, sharing
the OpenAI port (SO_REUSEPORT) and the store (docs/ha.md "One host, several cores").

The supervisor serves nothing itself. It

- holds the store's lock (one set of routers per store) for its lifetime: the workers skip it;
- makes the one join token the embedded default's workers share (in an environment variable);
- starts worker 0 (`sys.executable -m llmgw daemon <the same arguments> --worker-index 0`), reads
  its ready line, and only then the others, with `--port` set to the port worker 0 bound (with
  `--port 0` they could not otherwise agree on one); each of those binds the port at once but
  listens only once its router can route (daemon/workers.py wait_ready);
- prints one ready line on stdout: worker 0's, with the supervisor's pid and a `workers` list (each
  worker's index, pid, admin socket and control address);
- restarts a worker that exits while it was not asked to (after a backoff: 0.5 s, doubling to 30 s,
  back to 0.5 s once a worker has served a minute), logging its exit status and the count, and
  printing a `{"worker_restarted": ...}` line on stdout with the new pid; before that, the dead
  worker's router gives back its lease if it led (another worker leads at once, not when the lease
  expires) and its row in the store's `routers` is dropped (agents stop dialing it);
- forwards SIGHUP (config reload) to every worker, and on SIGTERM or SIGINT stops them all by pid:
  SIGTERM, then SIGKILL for those still running after a grace period.

The workers run in a process group of their own, so a terminal's Ctrl-C reaches the supervisor
only, which stops them in order; a worker whose supervisor died (SIGKILL) stops itself within a
second (daemon/workers.py watch_supervisor)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

from llmgw.config import Config
from llmgw.daemon.workers import SUPERVISOR_ENV, TOKEN_ENV, WAIT_ENV

log = logging.getLogger("llmgw.daemon.supervisor")

__all__ = ["Supervisor", "migrate_advice", "port_free", "preflight", "supervise"]

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0
HEALTHY_AFTER_S = 60.0  # a worker that served this long restarts without the accumulated backoff


def preflight(cfg: Config, sqlite_path: str | None) -> str | None:
    """What stops `--workers` before any worker starts (the error line), or None. `sqlite_path`:
    the SQLite store's file, None for PostgreSQL."""
    if sqlite_path == ":memory:":
        return "--workers: control.store = \":memory:\" cannot be shared between workers; give it a file"
    if cfg.server.port and (why := port_free(cfg.server.host, cfg.server.port)) is not None:
        return (f"server.port (--port): cannot listen on {cfg.server.host}:{cfg.server.port}: {why} "
                "(another llmgw, or another program, is listening there)")
    return None


def supervise(argv: list[str], count: int, cfg: Config, roles: set[str], config_path: str | None,
              forget_router: Callable[[str], None] | None = None) -> int:
    """`--workers N`: start and keep N workers until SIGTERM/SIGINT; the exit status. The caller
    holds the store's lock meanwhile (and checked `preflight`). `forget_router(router_id)` is called
    (in a thread) for a worker that died, before it is restarted."""
    embedded_token = "agent" in roles and cfg.control.join_token is None and cfg.control.join_token_file is None
    args = [*argv, "--config", config_path] if config_path else list(argv)
    sup = Supervisor(args, count, port=cfg.server.port, grace_s=cfg.agent.stop_grace_s + 20.0,
                     join_token=embedded_token, forget_router=forget_router)
    if (advice := migrate_advice()) is not None:
        log.warning("%s", advice)
    return trio.run(sup.run)


MIGRATE_REQ = "/proc/sys/net/ipv4/tcp_migrate_req"


def migrate_advice(path: str = MIGRATE_REQ) -> str | None:
    """What to tell the operator about the kernel's tcp_migrate_req, or None when it is on. Off (the
    default), the connections a dying worker's socket had queued but not accepted are reset rather
    than handed to the other workers: a client retrying once may then fail a second time."""
    try:
        with open(path) as f:
            if f.read().strip() != "0":
                return None
    except OSError:
        return ("--workers: this kernel has no net.ipv4.tcp_migrate_req (Linux >= 5.14): the connections queued on "
                "a worker that dies are reset, not moved to the other workers (docs/ha.md)")
    return ("--workers: net.ipv4.tcp_migrate_req is 0: the connections queued on a worker that dies are reset, "
            "not moved to the other workers; set it to 1 (sysctl -w net.ipv4.tcp_migrate_req=1) so that a "
            "client retrying once never fails (docs/ha.md)")


class _WorkerFailed(Exception):
    """A worker exited before its ready line (it logged why): the supervisor exits with its status."""

    def __init__(self, index: int, status: int) -> None:
        super().__init__(f"worker {index} exited with status {status} before it was ready")
        self.index, self.status = index, status


class Supervisor:
    def __init__(self, argv: Sequence[str], count: int, *, port: int, grace_s: float,
                 join_token: bool, forget_router: Callable[[str], None] | None = None) -> None:
        """`argv`: the daemon's arguments as given (each worker gets them, then its own flags);
        `join_token`: make the embedded default's shared join token."""
        self.argv = list(argv)
        self.count = count
        self.port = port
        self.grace_s = grace_s
        self.env = dict(os.environ, **{SUPERVISOR_ENV: str(os.getpid())})
        if join_token:
            self.env[TOKEN_ENV] = secrets.token_urlsafe(24)
        self.procs: dict[int, trio.Process] = {}  # index -> the worker running now
        self.readies: dict[int, dict[str, Any]] = {}
        self.restarts = 0
        self.stopping = False
        self.forget_router = forget_router

    def command(self, index: int) -> list[str]:
        return [sys.executable, "-m", "llmgw", "daemon", *self.argv, "--port", str(self.port),
                "--worker-index", str(index)]

    async def run(self) -> int:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._signals, signals, nursery.cancel_scope)  # from the start on
                    first = await nursery.start(self._keep, 0)
                    self.port = int(first["port"])
                    async with trio.open_nursery() as starting:
                        for i in range(1, self.count):
                            starting.start_soon(nursery.start, self._keep, i)
                    print(json.dumps(self._ready_line(first)), flush=True)
                    log.info("%d workers started on %s (each serves it once it can route)", self.count, first.get("url"))
            except BaseExceptionGroup as eg:
                failed = eg.subgroup(_WorkerFailed)
                if failed is None:
                    raise
                await self._stop()
                first_failure = failed.exceptions[0]
                while isinstance(first_failure, BaseExceptionGroup):
                    first_failure = first_failure.exceptions[0]
                assert isinstance(first_failure, _WorkerFailed)
                return first_failure.status if first_failure.status > 0 else 1
        log.info("stopped (%d worker restarts)", self.restarts)
        return 0

    async def _signals(self, signals: Any, scope: trio.CancelScope) -> None:
        """SIGHUP: to every worker. SIGTERM, SIGINT: stop them all, then everything (also while the
        workers are starting)."""
        async for signum in signals:
            if signum == signal.SIGHUP:
                self._signal_all(signal.SIGHUP)
                continue
            break
        await self._stop()
        scope.cancel()

    def _ready_line(self, first: dict[str, Any]) -> dict[str, Any]:
        ready = dict(first, pid=os.getpid())
        ready.pop("worker", None)
        ready["workers"] = [self._worker_entry(i) for i in range(self.count)]
        return ready

    def _worker_entry(self, index: int) -> dict[str, Any]:
        r = self.readies[index]
        entry = {"index": index, "pid": r.get("pid"), "router_id": r.get("router_id"),
                 "admin_socket": r.get("admin_socket"), "control": r.get("control")}
        if r.get("admin_tcp"):
            entry["admin_tcp"] = r["admin_tcp"]
        return entry

    # -- one worker, kept running ------------------------------------------------------------------
    async def _keep(self, index: int, task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        backoff = BACKOFF_MIN_S
        started = False
        while not self.stopping:
            t0 = time.monotonic()
            # all but the first start of worker 0 join workers that serve the port: they listen once ready
            env = self.env if index == 0 and not started else dict(self.env, **{WAIT_ENV: "1"})
            proc = await trio.lowlevel.open_process(self.command(index), stdout=subprocess.PIPE, env=env,
                                                    process_group=0)
            self.procs[index] = proc
            try:
                status = await self._serve(index, proc, task_status if not started else None)
            finally:  # (cancelled: it may still run, and _stop must find it)
                if proc.returncode is not None and self.procs.get(index) is proc:
                    del self.procs[index]
            if not started:
                if index not in self.readies or self.readies[index].get("pid") != proc.pid:
                    if self.stopping:  # stopped while starting: _signals cancels everything next
                        await trio.sleep_forever()
                    raise _WorkerFailed(index, status)
                started = True
            if self.stopping:
                return
            self.restarts += 1
            if time.monotonic() - t0 >= HEALTHY_AFTER_S:
                backoff = BACKOFF_MIN_S
            log.warning("worker %d (pid %d) exited unexpectedly (%s); restarting it in %.1f s (restart %d)",
                        index, proc.pid, _describe_status(status), backoff, self.restarts)
            await self._forget(index, proc.pid)
            # (systemd's stop signals every process of the unit at once: a worker may exit just before
            # the supervisor reads its own SIGTERM; the backoff leaves it the time to, and none restarts)
            await trio.sleep(backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def _serve(self, index: int, proc: trio.Process,
                     task_status: trio.TaskStatus[dict[str, Any]] | None) -> int:
        """Read the worker's ready line, then pass on what else it prints, until it exits."""
        assert proc.stdout is not None
        lines = _Lines(proc.stdout)
        line = await lines.next()
        if line is not None:
            try:
                ready = json.loads(line)
            except ValueError:
                ready = None
            if isinstance(ready, dict) and ready.get("ready"):
                ready["pid"] = proc.pid
                self.readies[index] = ready
                if task_status is not None:
                    task_status.started(ready)
                else:
                    print(json.dumps({"worker_restarted": index, "pid": proc.pid, "restarts": self.restarts,
                                      "router_id": ready.get("router_id"), "admin_socket": ready.get("admin_socket"),
                                      "control": ready.get("control")}), flush=True)
            else:
                print(line, flush=True)
            while (line := await lines.next()) is not None:
                print(line, flush=True)
        return await proc.wait()

    async def _forget(self, index: int, pid: int) -> None:
        """The dead worker's router: its lease given back, its row dropped (see supervise)."""
        ready = self.readies.get(index) or {}
        rid = ready.get("router_id")
        if self.forget_router is None or not rid or ready.get("pid") != pid:
            return
        forget = self.forget_router
        try:
            with trio.move_on_after(10):
                await trio.to_thread.run_sync(lambda: forget(rid), abandon_on_cancel=True)
        except Exception as e:  # noqa: BLE001 — the row ages out and the lease expires by themselves
            log.warning("worker %d's router %s: could not be forgotten in the store: %s", index, rid, e)
        else:
            log.info("worker %d's router %s: its lease (if it led) given back and its row dropped", index, rid)

    # -- stopping ----------------------------------------------------------------------------------
    def _signal_all(self, signum: int) -> None:
        for proc in list(self.procs.values()):
            if proc.returncode is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    async def _stop(self) -> None:
        """SIGTERM to every worker; SIGKILL to those still running after the grace period."""
        self.stopping = True
        procs = list(self.procs.values())
        log.info("stopping %d workers", len(procs))
        self._signal_all(signal.SIGTERM)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.grace_s):
                for proc in procs:
                    await proc.wait()
            for proc in procs:
                if proc.returncode is None:
                    log.warning("worker pid %d did not stop within %.0f s: killed", proc.pid, self.grace_s)
                    proc.kill()
                    await proc.wait()


class _Lines:
    """Lines of a trio stream (a worker's stdout), without the newline; None at EOF."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = b""
        self.eof = False

    async def next(self) -> str | None:
        while b"\n" not in self.buf:
            if self.eof:
                break
            data = await self.stream.receive_some(65536)
            if not data:
                self.eof = True
            self.buf += data
        if not self.buf:
            return None
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace")


def _describe_status(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def port_free(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on by a new set of workers (another program, or another
    llmgw's workers, listens there), or None. A plain bind: one without SO_REUSEPORT fails while any
    socket listens on the port, where the workers' own binds would join a stranger's."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return str(e.strerror or e)
    for family, type_, proto, _, addr in infos:
        with socket.socket(family, type_, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                return str(e.strerror or e)
    return None
