"""The config's defaults that come from the machine: the state directory ($XDG_STATE_HOME), the
admin socket ($XDG_RUNTIME_DIR and the uid) and the node's name (the hostname). The only part of
llmgw/config/ that reads the environment, and the shell's: no core module (nor
``llmgw.config``'s ``__init__``) imports it; the shell imports it by its own name.

The schema keeps four fields empty ("" = this machine's default): control.store, agent.state_dir,
agent.node and admin.socket, so the config the core sees is pure data. ``with_machine_defaults``
fills the empty ones; the shell calls it wherever it builds a Config to use (the daemon at start
and at a reload, the admin client's target)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from llmgw.config.fields import node_name
from llmgw.config.schema import AdminConfig, Config

__all__ = ["default_admin_socket", "default_agent_state_dir", "default_node_name", "default_store_path",
           "with_machine_defaults", "with_default_socket"]


def _state_home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "llmgw"


def default_store_path(env: Mapping[str, str] | None = None) -> str:
    """$XDG_STATE_HOME/llmgw/router.db (~/.local/state/llmgw/router.db)."""
    return str(_state_home(env) / "router.db")


def default_agent_state_dir(env: Mapping[str, str] | None = None) -> str:
    """$XDG_STATE_HOME/llmgw/agent (~/.local/state/llmgw/agent)."""
    return str(_state_home(env) / "agent")


def default_node_name() -> str:
    name = socket.gethostname().split(".")[0] or "localhost"
    return name if node_name(name) is None else "localhost"


def default_admin_socket(env: Mapping[str, str] | None = None) -> str:
    """$XDG_RUNTIME_DIR/llmgw-<uid>/admin.sock, or under /tmp when XDG_RUNTIME_DIR is unset."""
    base = (os.environ if env is None else env).get("XDG_RUNTIME_DIR") or "/tmp"
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return str(Path(base) / f"llmgw-{uid}" / "admin.sock")


def with_default_socket(admin: AdminConfig, env: Mapping[str, str] | None = None) -> AdminConfig:
    """``admin`` with an empty socket replaced by this machine's default."""
    return admin if admin.socket else replace(admin, socket=default_admin_socket(env))


def with_machine_defaults(cfg: Config, env: Mapping[str, str] | None = None) -> Config:
    """``cfg`` with its empty machine-dependent fields (control.store, agent.node, agent.state_dir,
    admin.socket) set to this machine's defaults, read from ``env`` (default: the process's
    environment), the uid and the hostname. A value the file gave is kept; applying it twice
    changes nothing."""
    control, agent = cfg.control, cfg.agent
    if not control.store:
        control = replace(control, store=default_store_path(env))
    if not agent.node:
        agent = replace(agent, node=default_node_name())
    if not agent.state_dir:
        agent = replace(agent, state_dir=default_agent_state_dir(env))
    admin = with_default_socket(cfg.admin, env)
    if (control, agent, admin) == (cfg.control, cfg.agent, cfg.admin):
        return cfg
    return replace(cfg, control=control, agent=agent, admin=admin)
