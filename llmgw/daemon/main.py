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
    ns = p.parse_args(argv)
    roles = {r.strip() for r in ns.role.split(",") if r.strip()}
    if not roles or not roles <= set(ROLES):
        print(f"llmgw daemon: --role {ns.role!r}: expected router, agent or router,agent", file=sys.stderr)
        return 2
    try:
        level = ns.log_level or env_level(os.environ, "info")
        fmt = ns.log_format or env_format(os.environ)
    except LogSetupError as e:
        print(f"llmgw daemon: {e}", file=sys.stderr)
        return 2
    setup_logging(level, fmt, sys.stderr)
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
        return c

    cfg = prepare(cfg)
    if ns.adopt and "router" not in roles:
        print("llmgw daemon: --adopt is for a router (--role router or router,agent)", file=sys.stderr)
        return 2
    try:
        trio.run(_run, cfg, roles, ns.adopt, source.path, prepare)
    except KeyboardInterrupt:
        pass
    except BaseException as e:  # startup errors come wrapped in the nurseries' exception groups
        err = _startup_error(e)
        if err is None:
            raise
        print(f"llmgw daemon: {err}", file=sys.stderr)
        return err.code
    return 0


def _lock_store(path: str) -> Any:
    """One router per store: two control planes writing one store would undo each other."""
    import fcntl

    from llmgw.daemon.private_files import open_private

    # held open for the process's lifetime; 0600 like the store beside it
    f = os.fdopen(open_private(path + ".lock", os.O_RDWR | os.O_APPEND, "control.store"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise _StartupError(f"control.store: {path} is in use by another llmgw router") from None
    return f


def _startup_error(e: BaseException) -> _StartupError | None:
    found = _find(e, (_StartupError,))
    return found if isinstance(found, _StartupError) else None


def _find(e: BaseException, types: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of `types` in e, looking inside (nested) exception groups."""
    if isinstance(e, types):
        return e
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            if (found := _find(sub, types)) is not None:
                return found
    return None


class _StartupError(Exception):
    def __init__(self, msg: str, code: int = 1) -> None:
        super().__init__(msg)
        self.code = code  # the exit status: 2 for what the config (or command line) must change


async def _listening(what: str, host: str, port: int, start: Any) -> Any:
    """`await start()`, which binds host:port; an address that cannot be bound (in use, not this
    machine's, not allowed) stops the daemon with one line naming it and the config key `what`."""
    try:
        return await start()
    except BaseException as e:
        found = _find(e, (OSError,))
        if not isinstance(found, OSError) or isinstance(found, ConnectionError):
            raise
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        why = found.strerror or str(found)
        hint = " (another llmgw, or another program, is listening there)" if found.errno == errno.EADDRINUSE else ""
        raise _StartupError(f"{what}: cannot listen on {addr}: {why}{hint}", code=2) from None


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
        raise _StartupError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if not token:
        raise _StartupError(f"{what}: {path} is empty")
    return token


def _server_tls(cfg: Config, host: str) -> Any:
    """The control listener's TLS (llmgw.daemon.control.agents.tls), or None for plain TCP."""
    from llmgw.daemon.control.agents.tls import TlsSetupError, setup_control_tls

    try:
        return setup_control_tls(cfg.control, host)
    except TlsSetupError as e:
        raise _StartupError(str(e)) from None


def _client_tls(cfg: Config) -> Any:
    from llmgw.daemon.agent.router_tls import AgentTlsError, agent_tls

    try:
        return agent_tls(cfg.agent)
    except AgentTlsError as e:
        raise _StartupError(str(e)) from None


async def _run(cfg: Config, roles: set[str], adopt: bool = False, config_path: str | None = None,
               prepare: Any = None) -> None:
    # The machine-readable line on stdout: printed as soon as the listeners are open (tests and
    # benchmarks read the ports from it); the human "serving …" line waits for replicas (ready.py).
    ready: dict[str, Any] = {"ready": True, "role": ",".join(r for r in ROLES if r in roles), "pid": os.getpid(),
                             "config": config_path}
    token: str | None = None
    control_addr: str | None = None
    control_tls: Any = None
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
            if token is None and "agent" in roles:
                token = secrets.token_urlsafe(24)  # this process's own agent is the only one that joins
                settle = 0.0  # ... so there is no fleet to wait for
            info = await nursery.start(_router_role, cfg, token, settle, adopt, config_path, prepare)
            control_tls = info.pop("_control_tls", None)
            ready.update(info)
            control_addr = info.get("control")
        agent = None
        if "agent" in roles:
            from llmgw.daemon.agent.agent import Agent

            if "router" in roles:
                if control_addr is None:
                    raise _StartupError("the local agent needs the router's control listener")
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
                    raise _StartupError("agent.join_token (or join_token_file) is required to join a router "
                                        "(once joined, the node's credential in agent.state_dir is enough)")
                tls = _client_tls(cfg)
            agent = Agent(cfg.agent, router=router_addr, token=agent_token, tls=tls,
                          more_routers=() if "router" in roles else cfg.agent.routers)
            await nursery.start(agent.run)
            ready.update({"node": cfg.agent.node, "state_dir": cfg.agent.state_dir})
        print(json.dumps(ready), flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        log.info("stopping")
        if agent is not None:
            await agent.say_bye()  # then cancelling it stops its engines
        nursery.cancel_scope.cancel()


def store_location(cfg: Config) -> tuple[str, str]:
    """("postgresql", DSN) or ("sqlite", PATH): `[store] url`, else `[control] store`'s file."""
    url = cfg.store.url
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql", url
    return "sqlite", url.removeprefix("sqlite:") if url.startswith("sqlite:") else cfg.control.store


def _open_pg_store(cfg: Config) -> tuple[Any, bool]:
    """The PostgreSQL store, and whether its schema was created now. At start there is no state
    to run from, so an unreachable or refused store stops the daemon with one line naming
    [store] url and the reason (later, a store that goes away leaves the router running from
    memory: the guard)."""
    try:
        from llmgw.daemon.control.store.postgres import PgStore
    except ImportError:
        raise _StartupError("store.url: a PostgreSQL store needs psycopg: pip install 'llmgw[postgres]'") from None
    from llmgw.daemon.control.store.rows import StoreError

    password = None
    if cfg.store.password_file:
        try:
            with open(cfg.store.password_file) as f:
                password = f.read().strip()
        except OSError as e:
            raise _StartupError(f"store.password_file: cannot read {cfg.store.password_file}: "
                                f"{e.strerror or e}") from None
        if not password:
            raise _StartupError(f"store.password_file: {cfg.store.password_file} is empty")
    try:
        store = PgStore.open(cfg.store.url, password=password, timeout_s=cfg.store.timeout_s)
    except StoreError as e:
        raise _StartupError(f"store.url: {e}") from None
    log.info("store: %s (PostgreSQL, schema %s)", store.path, "created" if store.created else "current")
    return store, store.created


def _open_store(cfg: Config) -> tuple[Any, bool]:
    """The store, and whether it was created now. A store that cannot be opened or read stops the
    daemon here with one line saying what to do; a missing one where a router has run before (its
    lock file is still there) is warned about: the fleet's engines are then kept, not stopped."""
    kind, path = store_location(cfg)
    if kind == "postgresql":
        return _open_pg_store(cfg)
    from llmgw.daemon.control.store.sqlite import Store, StoreCorrupt, StoreError
    from llmgw.daemon.control.store.faults import FAULT_ENV, FaultInjectingConnection
    from llmgw.daemon.control.store.state import CORRUPT_ADVICE

    if path == ":memory:":
        return Store.memory(), True
    fresh = not os.path.exists(path)
    if fresh and os.path.exists(path + ".lock"):
        log.warning("control.store: %s does not exist, but a router has run with it here (%s.lock is left): "
                    "if it was deleted or moved, restore it, or start with --adopt to rebuild it from what the "
                    "agents report; engines the agents run and this new store does not know are left running, "
                    "unrouted, meanwhile", path, path)
    try:
        store = Store.open(path)
    except StoreCorrupt as e:
        raise _StartupError(f"control.store: {e}: {CORRUPT_ADVICE}") from None
    except (StoreError, OSError) as e:
        raise _StartupError(f"control.store: {e}") from None
    if flag := os.environ.get(FAULT_ENV):
        log.warning("test hook %s is set: store writes fail while %s exists", FAULT_ENV, flag)
        store.wrap_connection(lambda conn: FaultInjectingConnection(conn, flag))
    return store, fresh


def _open_store_again(store: Any) -> Any:
    """A second connection to the same store, for the Leadership's calls in worker threads."""
    again = getattr(store, "open_again", None)
    if again is not None:
        return again()
    from llmgw.daemon.control.store.sqlite import Store

    return Store.open(store.path, threaded=True)


async def _router_role(cfg: Config, token: str | None, settle_s: float | None, adopt: bool,
                       config_path: str | None, prepare: Any,
                       task_status: trio.TaskStatus[dict[str, Any]]) -> None:
    from llmgw.daemon.control.admin.server import AdminApp, AdminSetupError, serve_admin
    from llmgw.daemon.control.plane.config_reload import ConfigReloader
    from llmgw.daemon.control.lifecycle.eval_runner import EvalTarget
    from llmgw.daemon.control.plane.plane import ControlPlane
    from llmgw.daemon.control.store.sqlite import StoreCorrupt, StoreError
    from llmgw.daemon.control.store.guard import StoreMetrics
    from llmgw.daemon.control.store.state import CORRUPT_ADVICE
    from llmgw.daemon.net.httpserver import serve_tcp
    from llmgw.daemon.net.upstream import UpstreamPool
    from llmgw.daemon.router.control_port import RouterAdapter
    from llmgw.daemon.router.proxy import Router
    from llmgw.daemon.router.ready import announce_when_ready
    from llmgw.route.readiness import readiness

    from llmgw.daemon.control.cluster import RouterInfo, is_shared, join

    store, fresh = _open_store(cfg)
    kind, where = store_location(cfg)
    shared = is_shared(cfg, store)  # several routers on one store (docs/ha.md)
    # One router per SQLite file (the lock file beside it) unless it is shared; PostgreSQL is shared by design.
    lock = contextlib.nullcontext() if kind != "sqlite" or where == ":memory:" or shared else _lock_store(where)
    with store, lock:
        async with UpstreamPool() as pool:
            router = Router(cfg, pool)
            router_port = RouterAdapter(router)  # all the control plane and the admin API may do to the router
            try:
                control = ControlPlane(cfg, store, router_port, token=token, settle_s=settle_s, adopt=adopt,
                                       fresh_store=fresh and where != ":memory:", shared=shared)
            except StoreCorrupt as e:
                raise _StartupError(f"control.store: {e}: {CORRUPT_ADVICE}") from None
            except StoreError as e:  # another backend's fault while loading (a server gone away)
                raise _StartupError(f"store.url: {e}") from None
            control.reloader = ConfigReloader(control, config_path, prepare or (lambda c: c))
            if adopt:
                log.warning("--adopt: engines that agents run and the store does not know are adopted as replicas")
            router.metrics.registry.register(StoreMetrics(control.guard))
            if router.trace_log is not None:
                try:
                    router.trace_log.check()
                except OSError as e:
                    raise _StartupError(f"router.traces.file: cannot open {router.trace_log.path} for "
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
                    found = _find(e, (AdminSetupError, OSError))
                    if found is None:
                        raise
                    if str(found).startswith(("admin.socket:", "admin.tcp:")):  # a listener it cannot bind
                        raise _StartupError(str(found), code=2) from None
                    raise _StartupError(f"admin API ({cfg.admin.socket}): {found}") from None
                info["admin_socket"] = admin["socket"]
                if admin.get("tcp"):
                    info["admin_tcp"] = admin["tcp"]
                port = await _listening("server.port (--port)", cfg.server.host, cfg.server.port,
                                        lambda: inner.start(lambda task_status: serve_tcp(
                                            router.handle, cfg.server.host, cfg.server.port,
                                            task_status=task_status, **router.server_options())))
                url = f"http://{cfg.server.host}:{port}"
                # eval runs go through the OpenAI port, as a client on this machine (lifecycle.py)
                control.lifecycle.attach(inner, pool, EvalTarget(
                    _loopback_url(cfg.server.host, port), router.internal_token,
                    cfg.server.api_keys[0] if cfg.server.api_keys else None))
                info.update({"url": url, "port": port, "models": [m.name for m in cfg.models]})
                if shared:  # its row in the store: where clients, agents and the other routers reach it
                    row = RouterInfo()
                    ji = control.agents.join_info()
                    row.update(url=_advertised_url(cfg.server.host, port), control=ji.router, control_ca_pem=ji.ca_pem,
                               control_server_name=ji.server_name)
                    await join(inner, cfg, control, _open_store_again(store), row, admin_app, router.metrics.registry, router)
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
