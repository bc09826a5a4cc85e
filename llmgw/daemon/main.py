"""`llmgw daemon`: the router, the agent, or both in one process (the embedded default).

With `--role router,agent` and no `[[models]]` configured, the local agent runs a small simulated
fleet (`[sim]`): one command gives a working OpenAI endpoint on any machine."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import secrets
import signal
import socket
import sys
from dataclasses import replace
from typing import Any

import trio

from llmgw.config import (
    Config,
    ConfigError,
    DeployConfig,
    ModelConfig,
    default_config,
    load_config,
)
from llmgw.config.defaults import with_machine_defaults
from llmgw.config.discovery import CONFIG_ENV, FILE_NAME, SYSTEM_DIR, find_config
from llmgw.daemon.store_open import (
    StartupError,
    find_error,
    forget_router,
    lock_store,
    open_store,
    open_store_again,
    startup_error,
    store_location,
    warn_lost_store,
)
from llmgw.daemon.router.stopping import drain_then_stop, stopping_begins
from llmgw.daemon.workers import WorkerSeat, listen_gate
from llmgw.daemon.gc_tuning import settle as settle_gc
from llmgw.daemon.logs import (
    FORMAT_ENV,
    FORMATS,
    LEVEL_ENV,
    LEVELS,
    LogSetupError,
    env_format,
    env_level,
    setup_logging,
)

log = logging.getLogger("llmgw.daemon")

ROLES = ("router", "agent")
DEFAULT_CONTROL_LISTEN = "127.0.0.1:7070"  # a router's [control] listen when the config has none


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="llmgw daemon", description="Run the llmgw router, agent, or both.")
    p.add_argument("--role", default="router,agent",
                   help="router, agent, or router,agent (default: both in one process, the embedded default)")
    p.add_argument("--config", metavar="FILE",
                   help=f"TOML config file (default: ${CONFIG_ENV}, else ./{FILE_NAME}, else "
                        f"$XDG_CONFIG_HOME/llmgw/{FILE_NAME}, else {SYSTEM_DIR}/{FILE_NAME}, else the embedded "
                        "default: a simulated fleet on this machine)")
    p.add_argument("--host", help="override server.host")
    p.add_argument("--port", type=int, help="override server.port (0 = ephemeral)")
    p.add_argument("--log-level", type=str.lower, choices=LEVELS, default=None,
                   help=f"the least severe messages logged (default: ${LEVEL_ENV}, else info)")
    p.add_argument("--log-format", type=str.lower, choices=FORMATS, default=None,
                   help=f"log lines as text (for people) or json (one object a line, for machines); auto: "
                        f"text when stderr is a terminal, else json (default: ${FORMAT_ENV}, else auto)")
    p.add_argument("--adopt", action="store_true",
                   help="router: adopt engines that agents run and the store does not know (after the store "
                        "was lost or replaced) as replicas, instead of leaving them running unrouted")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="run N router processes sharing the OpenAI port (SO_REUSEPORT) and the store, under a "
                        "small supervisor: N cores of request handling on one host (default 1: one process). "
                        "Worker i > 0 has its own admin socket (admin.w<i>.sock beside the configured one) "
                        "and an ephemeral control port; see docs/ha.md")
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)  # the supervisor's
    ns = p.parse_args(argv)
    roles = {r.strip() for r in ns.role.split(",") if r.strip()}
    if not roles or not roles <= set(ROLES):
        print(f"llmgw daemon: --role {ns.role!r}: expected router, agent or router,agent", file=sys.stderr)
        return 2
    from llmgw.daemon.workers import check_workers, enter_worker, for_worker, tag_logs, worker_roles

    if (problem := check_workers(ns.workers)) is not None:
        print(f"llmgw daemon: {problem}", file=sys.stderr)
        return 2
    if ns.workers > 1 and "router" not in roles:
        print("llmgw daemon: --workers is for a router (--role router or router,agent)", file=sys.stderr)
        return 2
    seat = None
    if ns.worker_index is not None:
        try:
            seat = enter_worker(ns.worker_index, ns.workers)
        except ValueError as e:
            print(f"llmgw daemon: {e}", file=sys.stderr)
            return 2
    try:
        level = ns.log_level or env_level(os.environ, "info")
        fmt = ns.log_format or env_format(os.environ)
    except LogSetupError as e:
        print(f"llmgw daemon: {e}", file=sys.stderr)
        return 2
    setup_logging(level, fmt, sys.stderr)
    if seat is not None:
        tag_logs(seat.index)
    source = None
    try:
        source = find_config(ns.config)
        cfg = with_machine_defaults(load_config(source.path) if source.path else default_config())
    except ConfigError as e:
        where = "" if source is None or source.explicit else \
            f" (found as {source.origin}; pass --config to use another)"
        print(f"{e}{where}", file=sys.stderr)
        return 2
    log.info("config: %s", source.describe())
    if "router" in roles:  # thousands of connections need thousands of descriptors
        from llmgw.daemon.net.fd_limit import raise_nofile_limit

        raise_nofile_limit()

    def prepare(c: Config) -> Config:  # also done to the file when it is reloaded (config_reload.py)
        server = c.server
        if ns.host is not None or ns.port is not None:
            server = replace(server, host=ns.host or server.host, port=server.port if ns.port is None else ns.port)
            c = replace(c, server=server)
        if "router" in roles and not c.models and "agent" in roles and c.sim.replicas > 0:
            c = replace(c, models=(embedded_model(c),))
        if seat is not None:  # what differs between the workers (daemon/workers.py)
            c = for_worker(c, seat.index, DEFAULT_CONTROL_LISTEN)
        return c

    cfg = prepare(cfg)
    if ns.adopt and "router" not in roles:
        print("llmgw daemon: --adopt is for a router (--role router or router,agent)", file=sys.stderr)
        return 2
    if ns.workers > 1 and seat is None:
        return _supervise(argv, ns.workers, cfg, roles, source.path)
    run_roles = roles if seat is None else worker_roles(roles, seat.index)  # (prepare keeps the configured roles)
    try:
        trio.run(_run, cfg, run_roles, ns.adopt, source.path, prepare, seat)
    except KeyboardInterrupt:
        pass
    except BaseException as e:  # startup errors come wrapped in the nurseries' exception groups
        err = startup_error(e)
        if err is None:
            raise
        print(f"llmgw daemon: {err}", file=sys.stderr)
        return err.code
    return 0


def _supervise(argv: list[str], count: int, cfg: Config, roles: set[str], config_path: str | None) -> int:
    """--workers N: hold the store for the workers, and keep them (daemon/supervisor.py)."""
    from llmgw.daemon.private_files import private_dir
    from llmgw.daemon.supervisor import preflight, supervise

    kind, path = store_location(cfg)
    if (problem := preflight(cfg, path if kind == "sqlite" else None)) is not None:
        print(f"llmgw daemon: {problem}", file=sys.stderr)
        return 2
    if kind != "sqlite":  # PostgreSQL: shared by design, nothing to hold
        return supervise(argv, count, cfg, roles, config_path, lambda rid: forget_router(cfg, rid))
    parent = os.path.dirname(os.path.abspath(path))
    try:
        warn_lost_store(path)
        private_dir(parent, "control.store", dedicated="llmgw" in os.path.basename(parent), log=log)
        lock = lock_store(path)
    except StartupError as e:
        print(f"llmgw daemon: {e}", file=sys.stderr)
        return e.code
    except OSError as e:
        print(f"llmgw daemon: control.store: {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    with lock:
        return supervise(argv, count, cfg, roles, config_path, lambda rid: forget_router(cfg, rid))


async def _listening(what: str, host: str, port: int, start: Any) -> Any:
    """`await start()`, which binds host:port; an address that cannot be bound (in use, not this
    machine's, not allowed) stops the daemon with one line naming it and the config key `what`."""
    try:
        return await start()
    except BaseException as e:
        found = find_error(e, (OSError,))
        if not isinstance(found, OSError) or isinstance(found, ConnectionError):
            raise
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        why = found.strerror or str(found)
        hint = " (another llmgw, or another program, is listening there)" if found.errno == errno.EADDRINUSE else ""
        raise StartupError(f"{what}: cannot listen on {addr}: {why}{hint}", code=2) from None


def embedded_model(cfg: Config) -> ModelConfig:
    """The default one-process fleet: `[sim]` replicas of a simulated engine on the local node.
    Simulated vLLM publishes KV events, so the default shows tier 2 and its parity check at work
    (llama.cpp has none)."""
    s = cfg.sim
    return ModelConfig(name=s.model, engine=s.engine,
                       deploy=DeployConfig(count=s.replicas, simulate=True, args=s.extra_args,
                                           health_timeout_s=60.0, kv_events=s.engine == "vllm"))


def _read_secret(value: str | None, path: str | None, what: str) -> str | None:
    if not path:
        return value
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as e:
        raise StartupError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if not token:
        raise StartupError(f"{what}: {path} is empty")
    return token


def _server_tls(cfg: Config, host: str) -> Any:
    """The control listener's TLS (llmgw.daemon.control.agents.tls), or None for plain TCP."""
    from llmgw.daemon.control.agents.tls import TlsSetupError, setup_control_tls

    try:
        return setup_control_tls(cfg.control, host)
    except TlsSetupError as e:
        raise StartupError(str(e)) from None


def _client_tls(cfg: Config) -> Any:
    from llmgw.daemon.agent.router_tls import AgentTlsError, agent_tls

    try:
        return agent_tls(cfg.agent)
    except AgentTlsError as e:
        raise StartupError(str(e)) from None


async def _run(cfg: Config, roles: set[str], adopt: bool = False, config_path: str | None = None,
               prepare: Any = None, seat: WorkerSeat | None = None) -> None:
    # The machine-readable line on stdout: printed as soon as the listeners are open (tests and
    # benchmarks read the ports from it); the human "serving …" line waits for replicas (ready.py).
    ready: dict[str, Any] = {"ready": True, "role": ",".join(r for r in ROLES if r in roles), "pid": os.getpid(),
                             "config": config_path}
    token: str | None = None
    control_addr: str | None = None
    control_tls: Any = None
    stopping: Any = None  # the router's (Drain, what to tell of it): a graceful stop first
    async with trio.open_nursery() as nursery:
        if "router" in roles:
            if not cfg.models and "agent" in roles and cfg.sim.replicas > 0:  # (main's prepare did it)
                cfg = replace(cfg, models=(embedded_model(cfg),))
            if cfg.control.listen is None and "agent" in roles:
                # One process, no [control] listen: its own agent dials the port it gets, so an ephemeral
                # loopback one — two such daemons on one host must not collide on the usual port.
                cfg = replace(cfg, control=replace(cfg.control, listen="127.0.0.1:0"))
            token = _read_secret(cfg.control.join_token, cfg.control.join_token_file, "control.join_token_file")
            settle = None
            if token is None and seat is not None and seat.join_token:
                token, settle = seat.join_token, 0.0  # --workers: the supervisor's, the same for all workers
            elif token is None and "agent" in roles:
                token = secrets.token_urlsafe(24)  # this process's own agent is the only one that joins
                settle = 0.0  # ... so there is no fleet to wait for
            info = await nursery.start(_router_role, cfg, token, settle, adopt, config_path, prepare, seat)
            control_tls = info.pop("_control_tls", None)
            stopping = info.pop("_drain", None)
            ready.update(info)
            control_addr = info.get("control")
        agent = None
        if "agent" in roles:
            from llmgw.daemon.agent.agent import Agent

            if "router" in roles:
                if control_addr is None:
                    raise StartupError("the local agent needs the router's control listener")
                router_addr, agent_token, tls = control_addr, token, None
                if control_tls is not None:  # its own router's CA, and nothing else
                    from llmgw.daemon.agent.router_tls import pinned_tls

                    tls = pinned_tls(control_tls.ca_pem, None if control_tls.ca_pem else cfg.control.tls_cert,
                                     control_tls.server_name)
            else:
                from llmgw.daemon.agent.credential import load_credential

                router_addr = cfg.agent.router
                agent_token = _read_secret(cfg.agent.join_token, cfg.agent.join_token_file, "agent.join_token_file")
                if agent_token is None and not load_credential(cfg.agent.state_dir, cfg.agent.node):
                    raise StartupError("agent.join_token (or join_token_file) is required to join a router "
                                        "(once joined, the node's credential in agent.state_dir is enough)")
                tls = _client_tls(cfg)
            agent = Agent(cfg.agent, router=router_addr, token=agent_token, tls=tls,
                          more_routers=() if "router" in roles else cfg.agent.routers)
            await nursery.start(agent.run)
            ready.update({"node": cfg.agent.node, "state_dir": cfg.agent.state_dir})
        settle_gc()  # started: what lives now is frozen out of the collector's scans (gc_tuning.py)
        print(json.dumps(ready), flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            if seat is not None:
                from llmgw.daemon.workers import watch_supervisor

                nursery.start_soon(watch_supervisor, seat)
            async for _ in signals:
                break
            log.info("stopping")
            if stopping is not None and cfg.server.shutdown_grace_s > 0:
                await drain_then_stop(*stopping, cfg.server.shutdown_grace_s, signals)
        if agent is not None:
            await agent.say_bye()  # then cancelling it stops its engines
        nursery.cancel_scope.cancel()


async def _router_role(cfg: Config, token: str | None, settle_s: float | None, adopt: bool,
                       config_path: str | None, prepare: Any, seat: WorkerSeat | None,
                       task_status: trio.TaskStatus[dict[str, Any]]) -> None:
    from llmgw.daemon.control.admin.server import AdminApp, AdminSetupError, serve_admin
    from llmgw.daemon.control.plane.config_reload import ConfigReloader
    from llmgw.daemon.control.lifecycle.eval_runner import EvalTarget
    from llmgw.daemon.control.plane.plane import ControlPlane
    from llmgw.daemon.control.store.sqlite import StoreCorrupt, StoreError
    from llmgw.daemon.control.autoscale_metrics import AutoscaleMetrics
    from llmgw.daemon.control.store.guard import StoreMetrics
    from llmgw.daemon.control.store.state import CORRUPT_ADVICE
    from llmgw.daemon.net.httpserver import Drain, serve_tcp
    from llmgw.daemon.net.upstream import UpstreamPool
    from llmgw.daemon.router.control_port import RouterAdapter
    from llmgw.daemon.router.proxy import Router
    from llmgw.daemon.router.ready import announce_when_ready
    from llmgw.route.readiness import readiness

    from llmgw.daemon.control.cluster import RouterInfo, is_shared, join

    store, fresh = open_store(cfg, warn_lost=seat is None)
    kind, where = store_location(cfg)
    worker = None if seat is None else seat.index
    shared = is_shared(cfg, store, worker=worker)  # several routers on one store (docs/ha.md)
    # One router per SQLite file (the lock file beside it) unless it is shared (--workers: the supervisor
    # holds the lock for all its workers); PostgreSQL is shared by design.
    lock = contextlib.nullcontext() if kind != "sqlite" or where == ":memory:" or shared else lock_store(where)
    with store, lock:
        async with UpstreamPool() as pool:
            router = Router(cfg, pool)
            router_port = RouterAdapter(router)  # all the control plane and the admin API may do to the router
            try:
                control = ControlPlane(cfg, store, router_port, token=token, settle_s=settle_s, adopt=adopt,
                                       fresh_store=fresh and where != ":memory:", shared=shared)
            except StoreCorrupt as e:
                if kind != "sqlite":
                    raise StartupError(f"store.url: {e}: restore the database from a backup, or start with "
                                        "`llmgw daemon --adopt` on an empty one to rebuild it from what the agents "
                                        "report") from None
                raise StartupError(f"control.store: {e}: {CORRUPT_ADVICE}") from None
            except StoreError as e:  # another backend's fault while loading (a server gone away)
                raise StartupError(f"store.url: {e}") from None
            control.reloader = ConfigReloader(control, config_path, prepare or (lambda c: c))
            if adopt:
                log.warning("--adopt: engines that agents run and the store does not know are adopted as replicas")
            router.metrics.registry.register(StoreMetrics(control.guard))
            router.metrics.registry.register(AutoscaleMetrics(control.autoscaling))
            if router.trace_log is not None:
                try:
                    router.trace_log.check()
                except OSError as e:
                    raise StartupError(f"router.traces.file: cannot open {router.trace_log.path} for "
                                        f"writing: {e.strerror or e}") from None
            async with trio.open_nursery() as inner:
                inner.start_soon(router.registry.scrape_loop, pool)
                inner.start_soon(router.adapters.run)  # LoRA adapter loads (vLLM, on demand)
                if router.trace_log is not None:
                    inner.start_soon(router.trace_log.run)
                if router.otlp is not None:
                    inner.start_soon(router.otlp.run)  # the SDK's own thread exports; this flushes at stop
                inner.start_soon(control.guard.run)
                inner.start_soon(router.kv.run)  # tier 2's parity verdicts and alarm
                inner.start_soon(control.reloader.serve_sighup)  # SIGHUP: llmgw ctl config reload
                inner.start_soon(control.tenants.sync.run)  # tenants' usage flush, quota shares, roll-up
                # before the listeners open: the first request after the start finds them
                await control.restore_routing(pool)
                info: dict[str, Any] = {}
                if token is not None:
                    host, _, port = (cfg.control.listen or DEFAULT_CONTROL_LISTEN).rpartition(":")
                    host = host.strip("[]")
                    tls = _server_tls(cfg, host)
                    cport = await _listening("control.listen", host, int(port), lambda: inner.start(
                        lambda task_status: control.serve(host, int(port), ssl_context=tls.context if tls else None,
                                                          task_status=task_status)))
                    control.agents.set_listener(host, cport, tls)
                    info["control"] = f"{host}:{cport}"
                    info["control_tls"] = tls is not None
                    info["_control_tls"] = tls  # for the local agent; not printed
                    from llmgw.daemon.control.agents.stream_metrics import StreamMetrics

                    router.metrics.registry.register(StreamMetrics(control.agents))
                    from llmgw.daemon.router.kv_index import KvIndexMetrics

                    router.metrics.registry.register(KvIndexMetrics(router.kv))
                else:
                    log.info("no control.join_token: agents cannot join this router")
                admin_app = AdminApp(control, router_port, token=cfg.admin.token)
                try:
                    admin = await inner.start(serve_admin, cfg.admin, admin_app)
                except BaseException as e:
                    found = find_error(e, (AdminSetupError, OSError))
                    if found is None:
                        raise
                    if str(found).startswith(("admin.socket:", "admin.tcp:")):  # a listener it cannot bind
                        raise StartupError(str(found), code=2) from None
                    raise StartupError(f"admin API ({cfg.admin.socket}): {found}") from None
                info["admin_socket"] = admin["socket"]
                if admin.get("tcp"):
                    info["admin_tcp"] = admin["tcp"]
                drain = Drain()  # SIGTERM: a graceful stop first (_run)
                port = await _listening("server.port (--port)", cfg.server.host, cfg.server.port,
                                        lambda: inner.start(lambda task_status: serve_tcp(
                                            router.handle, cfg.server.host, cfg.server.port,
                                            task_status=task_status, reuse_port=seat is not None,
                                            before_listen=listen_gate(seat, router.registry), drain=drain,
                                            **router.server_options())))
                info["_drain"] = (drain, lambda: stopping_begins(router, control))  # for _run; not printed
                url = f"http://{cfg.server.host}:{port}"
                # eval runs go through the OpenAI port, as a client on this machine (lifecycle.py)
                control.lifecycle.attach(inner, pool, EvalTarget(
                    _loopback_url(cfg.server.host, port), router.internal_token,
                    cfg.server.api_keys[0] if cfg.server.api_keys else None))
                info.update({"url": url, "port": port, "models": [m.name for m in cfg.models]})
                if seat is not None:
                    info["worker"] = seat.index
                if shared:  # its row in the store: where clients, agents and the other routers reach it
                    row = RouterInfo(worker=worker)
                    ji = control.agents.join_info()
                    row.update(url=_advertised_url(cfg.server.host, port), control=ji.router, control_ca_pem=ji.ca_pem,
                               control_server_name=ji.server_name)
                    await join(inner, cfg, control, open_store_again(store), row, admin_app, router.metrics.registry, router)
                    info["router_id"] = control.router_id
                log.info("router listening on %s", url)
                inner.start_soon(lambda: announce_when_ready(lambda: readiness(router.registry), url))
                task_status.started(info)


def _advertised_url(host: str, port: int) -> str:
    """The OpenAI port as other hosts reach it, for the router's row in the store: a wildcard
    address is this host's name (as the control address is: agents/sessions.py join_info), an
    IPv6 address is bracketed; loopback stays loopback (routers on one host)."""
    if host in ("127.0.0.1", "::1"):
        return _loopback_url(host, port)
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _loopback_url(host: str, port: int) -> str:
    """The OpenAI port as this machine reaches it (a wildcard address is dialled on loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
