"""`llmgw console`: attach to a daemon's admin API, over its Unix socket (the default) or TCP
with a token — chosen by llmgw.admin_client.target, as for `llmgw ctl`. Textual is imported only
once the arguments are read, and only here: the daemon and the other commands never import it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llmgw.admin_client.target import TOKEN_ENV, TargetError, add_target_arguments, resolve_target
from llmgw.tui.client import AdminClient

__all__ = ["TOKEN_ENV", "UsageError", "client_from_args", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmgw console",
        description="Watch and steer a running llmgw daemon: nodes, models and replicas, routing decisions "
                    "and their rationale, cache hits — live.")
    add_target_arguments(p)
    return p


class UsageError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def client_from_args(argv: Sequence[str]) -> AdminClient:
    """The admin client the arguments ask for; UsageError (exit code, message) when they cannot."""
    ns = _parser().parse_args(list(argv))
    try:
        target = resolve_target(url=ns.url, socket=ns.socket, token=ns.token, config=ns.config)
    except TargetError as e:
        raise UsageError(2 if e.usage else 1, f"llmgw console: {e}") from None
    if target.url:
        return AdminClient(url=target.url, token=target.token)
    return AdminClient(socket=target.socket)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        client = client_from_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return e.code
    from llmgw.tui.app import ConsoleApp  # Textual, only now

    result = ConsoleApp(client).run()
    return result if isinstance(result, int) else 0
