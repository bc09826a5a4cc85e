"""`llmgw daemon --workers N`, a worker's side: what differs between the N router processes of one
host (docs/ha.md "One host, several cores"; the supervisor that starts them is daemon/supervisor.py).

Every worker runs today's router on the same config and the same store, and binds the OpenAI port
with SO_REUSEPORT. What cannot be shared is derived from the config by the worker's index; worker 0
keeps every configured value, so `llmgw ctl` and agents find it where they found the single router:

- `[admin] socket`: worker i > 0 listens at the same path with `.w<i>` before its extension
  (admin.sock -> admin.w1.sock; a name without one gets `.w<i>` appended);
- `[admin] tcp`: worker 0 only (a port per worker would collide with whatever the next ports are);
- `[control] listen`: worker 0 as configured; the others on an ephemeral port of the same host
  (agents learn every router's address from the welcome's `routers` list);
- `[router.traces] file`: per worker, named like the admin socket (traces.w1.jsonl);
- `[ha] feed_listen`: worker 0 as configured; the others on an ephemeral port of the same host (a
  port in `feed_advertise` is dropped for them: they advertise the host with their own port);
- the embedded agent (role router,agent) runs in worker 0 only: the others are routers;
- the store's lock (one router per store) is held by the supervisor: workers do not take it.

The supervisor hands a worker what is shared but secret (the embedded default's join token) in an
environment variable, which the worker reads and removes at once: never on the command line, which
`ps` shows to every user."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from llmgw.config import Config
from llmgw.config.fields import host_port

__all__ = ["JOIN_WAIT_S", "MAX_WORKERS", "SUPERVISOR_ENV", "TOKEN_ENV", "WAIT_ENV", "WorkerSeat", "check_workers", "enter_worker", "wait_ready",
           "for_worker", "listen_gate", "tag_logs", "watch_supervisor", "worker_path", "worker_roles"]

MAX_WORKERS = 64
SUPERVISOR_ENV = "LLMGW_WORKER_OF"  # the supervisor's pid: a worker's parent must be it
TOKEN_ENV = "LLMGW_WORKER_JOIN_TOKEN"  # the embedded default's join token, one for all workers
WAIT_ENV = "LLMGW_WORKER_WAIT_READY"  # set: other workers serve the port already (see wait_ready)
JOIN_WAIT_S = 30.0  # a worker that cannot route yet joins the port after this anyway
WATCH_S = 1.0  # how often a worker checks that its supervisor still runs

log = logging.getLogger("llmgw.daemon")


@dataclass(frozen=True, slots=True)
class WorkerSeat:
    """This process is worker `index` of `count`, started by the supervisor `supervisor`."""
    index: int
    count: int
    supervisor: int
    join_token: str | None = None  # the shared embedded join token, if the supervisor made one
    wait_ready: bool = False  # other workers serve the port: listen only once this one can route


def check_workers(n: int) -> str | None:
    """The problem with `--workers n`, or None."""
    if not 1 <= n <= MAX_WORKERS:
        return f"--workers {n}: expected 1 to {MAX_WORKERS} router processes (1: no supervisor, one process)"
    return None


def worker_path(path: str, index: int) -> str:
    """`path` for worker `index`: unchanged for worker 0, else `.w<index>` before the extension."""
    if index == 0:
        return path
    head, name = os.path.split(path)
    stem, dot, ext = name.rpartition(".")
    name = f"{stem}.w{index}.{ext}" if dot and stem else f"{name}.w{index}"
    return os.path.join(head, name)


def for_worker(cfg: Config, index: int, default_control_listen: str) -> Config:
    """`cfg` as worker `index` runs it (see the module's docstring)."""
    if index == 0:
        return cfg
    admin = replace(cfg.admin, socket=worker_path(cfg.admin.socket, index), tcp=None)
    host = (cfg.control.listen or default_control_listen).rpartition(":")[0]
    control = replace(cfg.control, listen=f"{host}:0")
    traces = cfg.router.traces
    router = cfg.router if traces.file is None else \
        replace(cfg.router, traces=replace(traces, file=worker_path(traces.file, index)))
    ha = cfg.ha  # the peer feed: an ephemeral port of the configured host; a port advertised is worker 0's
    advertise = ha.feed_advertise.rpartition(":")[0] if ha.feed_advertise and host_port(ha.feed_advertise) is None \
        else ha.feed_advertise
    ha = replace(ha, feed_listen=f"{ha.feed_listen.rpartition(':')[0]}:0", feed_advertise=advertise)
    return replace(cfg, admin=admin, control=control, router=router, ha=ha)


def worker_roles(roles: set[str], index: int) -> set[str]:
    """The agent runs once, in worker 0; the other workers are routers."""
    return set(roles) if index == 0 else {"router"}


def enter_worker(index: int, count: int) -> WorkerSeat:
    """Become worker `index` of `count`: check that the supervisor started this process (it holds the
    store's lock the worker skips) and take the shared secrets out of the environment. Raises
    ValueError with the message to print."""
    parent = os.getppid()
    if os.environ.get(SUPERVISOR_ENV) != str(parent):
        raise ValueError("--worker-index is internal to --workers: only the supervisor starts workers")
    if not 0 <= index < count:
        raise ValueError(f"--worker-index {index}: expected 0 to {count - 1}")
    os.environ.pop(SUPERVISOR_ENV, None)  # not inherited by the engines the agent starts
    token = os.environ.pop(TOKEN_ENV, None)
    wait = os.environ.pop(WAIT_ENV, None) == "1"
    return WorkerSeat(index=index, count=count, supervisor=parent, join_token=token, wait_ready=wait)


async def watch_supervisor(seat: WorkerSeat) -> None:
    """Stop this worker (as SIGTERM would: in order) once its supervisor is gone, e.g. SIGKILLed.
    (Not the kernel's PR_SET_PDEATHSIG: trio starts processes from a worker thread, and that signal
    fires when the starting *thread* ends.)"""
    import trio

    while os.getppid() == seat.supervisor:
        await trio.sleep(WATCH_S)
    log.warning("worker %d: the supervisor (pid %d) is gone: stopping", seat.index, seat.supervisor)
    os.kill(os.getpid(), signal.SIGTERM)


async def wait_ready(seat: WorkerSeat, ready: Callable[[], bool], *, timeout_s: float = JOIN_WAIT_S,
                     poll_s: float = 0.1) -> None:
    """Before a worker listens on the port the others serve already (any worker but the first start of
    worker 0: one started later, or restarted): wait until its router can route (`ready`: a replica
    of every model serves, as its agents report them), at most `timeout_s`. Until it listens, the
    kernel gives every new connection to the others, so a client never meets a router that has no
    replica yet and would answer 503."""
    import trio

    with trio.move_on_after(timeout_s) as waited:
        while not ready():
            await trio.sleep(poll_s)
    if waited.cancelled_caught:
        log.warning("worker %d: cannot route yet after %.0f s: serving the port anyway (GET /ready says why)",
                    seat.index, timeout_s)
    else:
        log.info("worker %d: ready: serving the port", seat.index)


def listen_gate(seat: WorkerSeat | None, registry: Any) -> Callable[[], Awaitable[None]] | None:
    """What the OpenAI listener awaits before it listens (serve_tcp's before_listen): `wait_ready`
    for a worker that joins others on the port; None (listen at once) otherwise."""
    if seat is None or not seat.wait_ready:
        return None
    from llmgw.route.readiness import readiness

    return lambda: wait_ready(seat, lambda: readiness(registry).ready)


class _WorkerTag(logging.Filter):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.index
        return True


def tag_logs(index: int) -> None:
    """Every line this worker logs says `worker=<index>` (the workers share the supervisor's stderr)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_WorkerTag(index))
