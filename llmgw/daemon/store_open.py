"""Opening the store the daemon runs on (docs/architecture.md "The store", docs/ha.md "The store"):
where `[store] url` or `[control] store` points, the SQLite file's lock (one router per file,
unless routers share it), PostgreSQL with its password file, and a second connection for the
Leadership's calls. What cannot be opened stops the daemon with one line (StartupError)."""

from __future__ import annotations

import logging
import os
from typing import Any

from llmgw.config import Config

log = logging.getLogger("llmgw.daemon")

__all__ = ["StartupError", "find_error", "forget_router", "lock_store", "open_store", "open_store_again",
           "startup_error", "store_location", "warn_lost_store"]


def startup_error(e: BaseException) -> StartupError | None:
    found = find_error(e, (StartupError,))
    return found if isinstance(found, StartupError) else None


def find_error(e: BaseException, types: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of `types` in e, looking inside (nested) exception groups."""
    if isinstance(e, types):
        return e
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            if (found := find_error(sub, types)) is not None:
                return found
    return None


class StartupError(Exception):
    def __init__(self, msg: str, code: int = 1) -> None:
        super().__init__(msg)
        self.code = code  # the exit status: 2 for what the config (or command line) must change


def forget_router(cfg: Config, router_id: str) -> None:
    """A worker died (its supervisor reaped it): give back its lease now, if it held it, so that
    another worker leads at once rather than when the lease expires, and drop its row, so that
    agents stop dialing it. Both are unfenced store ops (docs/ha.md)."""
    store, _ = open_store(cfg, warn_lost=False)
    with store:
        store.release_lead(router_id)
        store.forget_router(router_id)


def warn_lost_store(path: str) -> None:
    if not os.path.exists(path) and os.path.exists(path + ".lock"):
        log.warning("control.store: %s does not exist, but a router has run with it here (%s.lock is left): "
                    "if it was deleted or moved, restore it, or start with --adopt to rebuild it from what the "
                    "agents report; engines the agents run and this new store does not know are left running, "
                    "unrouted, meanwhile", path, path)


def lock_store(path: str) -> Any:
    """One router per store: two control planes writing one store would undo each other."""
    import fcntl

    from llmgw.daemon.private_files import open_private

    # held open for the process's lifetime; 0600 like the store beside it
    f = os.fdopen(open_private(path + ".lock", os.O_RDWR | os.O_APPEND, "control.store"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise StartupError(f"control.store: {path} is in use by another llmgw router") from None
    return f


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
        raise StartupError("store.url: a PostgreSQL store needs psycopg: pip install 'llmgw[postgres]'") from None
    from llmgw.daemon.control.store.rows import StoreError

    password = None
    if cfg.store.password_file:
        try:
            with open(cfg.store.password_file) as f:
                password = f.read().strip()
        except OSError as e:
            raise StartupError(f"store.password_file: cannot read {cfg.store.password_file}: "
                                f"{e.strerror or e}") from None
        if not password:
            raise StartupError(f"store.password_file: {cfg.store.password_file} is empty")
    try:
        store = PgStore.open(cfg.store.url, password=password, timeout_s=cfg.store.timeout_s)
    except StoreError as e:
        raise StartupError(f"store.url: {e}") from None
    log.info("store: %s (PostgreSQL, schema %s)", store.path, "created" if store.created else "current")
    return store, store.created


def open_store(cfg: Config, warn_lost: bool = True) -> tuple[Any, bool]:
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
    if warn_lost:  # (not a worker's: its supervisor said it, before taking the lock)
        warn_lost_store(path)
    try:
        store = Store.open(path)
    except StoreCorrupt as e:
        raise StartupError(f"control.store: {e}: {CORRUPT_ADVICE}") from None
    except (StoreError, OSError) as e:
        raise StartupError(f"control.store: {e}") from None
    if flag := os.environ.get(FAULT_ENV):
        log.warning("test hook %s is set: store writes fail while %s exists", FAULT_ENV, flag)
        store.wrap_connection(lambda conn: FaultInjectingConnection(conn, flag))
    return store, fresh


def open_store_again(store: Any) -> Any:
    """A second connection to the same store, for the Leadership's calls in worker threads."""
    again = getattr(store, "open_again", None)
    if again is not None:
        return again()
    from llmgw.daemon.control.store.sqlite import Store

    return Store.open(store.path, threaded=True)
