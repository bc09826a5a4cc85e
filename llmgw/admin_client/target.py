"""Which daemon `llmgw ctl` and `llmgw console` talk to, decided in one place.

Each setting comes from the first of these that gives it:

1. the command line: ``--url URL`` or ``--socket PATH``, and ``--token TOKEN``;
2. the environment: ``LLMGW_ADMIN_URL`` or ``LLMGW_ADMIN_SOCKET``, and ``LLMGW_ADMIN_TOKEN``;
3. the daemon's config file: its ``[admin] socket`` and ``[admin] token`` — ``--config FILE``, else
   the file the daemon itself would find (``$LLMGW_CONFIG``, ``./llmgw.toml``,
   ``$XDG_CONFIG_HOME/llmgw/llmgw.toml``, ``/etc/llmgw/llmgw.toml``: llmgw.config.discovery);
4. the default: the local daemon's socket, ``$XDG_RUNTIME_DIR/llmgw-<uid>/admin.sock``.

Where to connect is decided as a whole, by the first level that names a place: ``--socket`` wins
over ``$LLMGW_ADMIN_URL``, and ``$LLMGW_ADMIN_SOCKET`` over the config file. One level naming both a
URL and a socket is an error. The token is looked up on its own, so ``--url`` can take its token
from the environment or the config file. A URL needs a token (the TCP admin API always asks for
one); over the socket none is sent (the daemon checks the caller's uid instead). The config's
``[admin] tcp`` is the daemon's listen address, not a URL, and is not used here. A ``--config`` file
that cannot be read or is invalid is an error even when a higher level decides everything; a file
found by looking is read only when it decides something, and is an error then.

Pure but for its defaults: the environment and the config reader are parameters.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmgw.config import ConfigError, load_config
from llmgw.config.defaults import default_admin_socket, with_default_socket
from llmgw.config.discovery import ConfigSource, find_config

if TYPE_CHECKING:
    from llmgw.config import AdminConfig

__all__ = ["SOCKET_ENV", "TOKEN_ENV", "URL_ENV", "AdminTarget", "TargetError", "add_target_arguments",
           "resolve_target"]

URL_ENV = "LLMGW_ADMIN_URL"
SOCKET_ENV = "LLMGW_ADMIN_SOCKET"
TOKEN_ENV = "LLMGW_ADMIN_TOKEN"


@dataclass(frozen=True, slots=True)
class AdminTarget:
    """Where the admin API is: a URL with its token, or a Unix socket."""

    url: str | None = None
    socket: str | None = None
    token: str | None = None  # only with url
    origin: str = ""  # what chose the place, for messages: "--socket", "$LLMGW_ADMIN_URL", ...


class TargetError(Exception):
    """The flags, environment and config file do not make a target; str() says what to do.
    ``usage`` is True when the arguments themselves cannot work (exit code 2 for the console),
    False when the config file cannot be read."""

    def __init__(self, message: str, *, usage: bool) -> None:
        super().__init__(message)
        self.usage = usage


def _admin_section(path: str) -> AdminConfig:
    return with_default_socket(load_config(path).admin)


def _discover(env: Mapping[str, str]) -> ConfigSource:
    return find_config(None, env=env)


def resolve_target(*, url: str | None = None, socket: str | None = None, token: str | None = None,
                   config: str | None = None, env: Mapping[str, str] | None = None,
                   read_config: Callable[[str], AdminConfig] = _admin_section,
                   default_socket: Callable[[], str] = default_admin_socket,
                   discover: Callable[[Mapping[str, str]], ConfigSource] = _discover) -> AdminTarget:
    """The target the flags (``url``, ``socket``, ``token``, ``config``) ask for, filled in from
    ``env`` (default: the process's) and the config file (``config``, else the one ``discover``
    finds); TargetError when there is none."""
    env = os.environ if env is None else env
    admin: AdminConfig | None = None
    name = config
    if config:
        try:
            admin = read_config(config)
        except ConfigError as e:
            raise TargetError(str(e), usage=False) from None

    def config_admin() -> AdminConfig | None:
        nonlocal admin, name
        if admin is None and not config:
            try:
                found = discover(env)
            except ConfigError as e:
                raise TargetError(str(e), usage=False) from None
            if found.path is not None:
                try:
                    admin = read_config(found.path)
                except ConfigError as e:
                    raise TargetError(f"{e} (found as {found.origin}; pass --config or --socket to choose)",
                                      usage=False) from None
                name = f"{found.path} ({found.origin})"
        return admin

    if url and socket:
        raise TargetError("--url and --socket name two daemons: give one of them", usage=True)
    env_url, env_socket = env.get(URL_ENV) or None, env.get(SOCKET_ENV) or None
    token = token or env.get(TOKEN_ENV) or None
    if url or socket:  # 1. flags
        origin = "--url" if url else "--socket"
    elif env_url or env_socket:  # 2. environment
        if env_url and env_socket:
            raise TargetError(f"${URL_ENV} and ${SOCKET_ENV} are both set: unset one, or choose with --url "
                              "or --socket", usage=True)
        url, socket, origin = env_url, env_socket, f"${URL_ENV}" if env_url else f"${SOCKET_ENV}"
    elif (found := config_admin()) is not None:  # 3. the config file
        if found.socket:
            return AdminTarget(socket=found.socket, origin=f"[admin] socket of {name}")
        return AdminTarget(socket=default_socket(), origin=f"the default socket ({name} names none)")
    else:  # 4. the default
        return AdminTarget(socket=default_socket(), origin="the default socket")
    if socket:
        return AdminTarget(socket=socket, origin=origin)
    if not token and (found := config_admin()) is not None:
        token = found.token or None
    if not token:
        raise TargetError(f"{origin} needs a token: pass --token, set ${TOKEN_ENV}, or give --config the "
                          f"daemon's config file with its [admin] token (the TCP admin API at {url} always "
                          "requires it)", usage=True)
    return AdminTarget(url=url, token=token, origin=origin)


HELP = {
    "socket": f"the daemon's admin Unix socket (default: ${SOCKET_ENV}, else the config's [admin] socket, "
              "else the local daemon's)",
    "url": f"the admin API over TCP, e.g. http://10.0.0.5:7071, with a token (default: ${URL_ENV})",
    "token": f"the bearer token for a URL (default: ${TOKEN_ENV}, else the config's [admin] token)",
    "config": "the daemon's config file, for its [admin] socket and token (flags and environment "
              "variables come first; default: the file the daemon finds: $LLMGW_CONFIG, ./llmgw.toml, "
              "$XDG_CONFIG_HOME/llmgw/llmgw.toml, /etc/llmgw/llmgw.toml)",
}


def add_target_arguments(parser: argparse.ArgumentParser, default: Any = None) -> None:
    """--socket, --url, --token and --config, the same for every command (``default``:
    argparse.SUPPRESS for a subcommand's copy that must not overwrite the top level's value)."""
    parser.add_argument("--socket", metavar="PATH", default=default, help=HELP["socket"])
    parser.add_argument("--url", metavar="URL", default=default, help=HELP["url"])
    parser.add_argument("--token", metavar="TOKEN", default=default, help=HELP["token"])
    parser.add_argument("--config", metavar="FILE", default=default, help=HELP["config"])
