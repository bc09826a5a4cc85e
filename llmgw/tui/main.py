"""`llmgw console`: attach to a daemon's admin API, over its Unix socket (the default) or TCP
with a token. Textual is imported only once the arguments are read, and only here: the daemon
and the other commands never import it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from llmgw.tui.client import AdminClient

__all__ = ["UsageError", "client_from_args", "main"]

TOKEN_ENV = "LLMGW_ADMIN_TOKEN"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmgw console",
        description="Watch and steer a running llmgw daemon: nodes, models and replicas, routing decisions "
                    "and their rationale, cache hits — live.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", help="the admin API's Unix socket (default: the config's "
                       "[admin] socket, else the daemon's default)")
    where.add_argument("--url", metavar="URL", help="the admin API over TCP, e.g. http://10.0.0.5:7071 (needs a token)")
    p.add_argument("--token", metavar="TOKEN", help=f"bearer token for --url (default: ${TOKEN_ENV}, else the "
                   "config's [admin] token)")
    p.add_argument("--config", metavar="FILE", help="read [admin] socket and token from this config file")
    return p


class UsageError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def client_from_args(argv: Sequence[str]) -> AdminClient:
    """The admin client the arguments ask for; UsageError (exit code, message) when they cannot."""
    ns = _parser().parse_args(list(argv))
    from llmgw.config import ConfigError, default_admin_socket, load_config

    socket, token = ns.socket, ns.token or os.environ.get(TOKEN_ENV) or None
    if ns.config:
        try:
            cfg = load_config(ns.config)
        except ConfigError as e:
            raise UsageError(1, str(e)) from None
        except OSError as e:
            raise UsageError(1, f"llmgw console: cannot read {ns.config}: {e.strerror}") from None
        socket = socket or cfg.admin.socket
        token = token or cfg.admin.token
    if ns.url:
        if not token:
            raise UsageError(2, f"llmgw console: --url needs a token (--token, ${TOKEN_ENV} or the config's "
                                "[admin] token)")
        return AdminClient(url=ns.url, token=token)
    return AdminClient(socket=socket or default_admin_socket())


def main(argv: Sequence[str] | None = None) -> int:
    try:
        client = client_from_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return e.code
    from llmgw.tui.app import ConsoleApp  # Textual, only now

    result = ConsoleApp(client).run()
    return result if isinstance(result, int) else 0
