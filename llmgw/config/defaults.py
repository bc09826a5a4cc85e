"""The config's defaults that come from the machine: the state directory ($XDG_STATE_HOME), the
admin socket ($XDG_RUNTIME_DIR and the uid) and the node's name (the hostname). The only part of
llmgw/config/ that reads the environment.

The schema names these as the default factories of four fields (router.store, agent.state_dir,
agent.node, admin.socket), so a Config built without them asks the machine: that is why this
module is a known exception of the import contract (tests/test_import_contract.py) until those
fields are resolved by the shell instead."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from llmgw.config.fields import node_name

__all__ = ["default_admin_socket", "default_agent_state_dir", "default_node_name", "default_store_path"]


def _state_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "llmgw"


def default_store_path() -> str:
    """$XDG_STATE_HOME/llmgw/router.db (~/.local/state/llmgw/router.db)."""
    return str(_state_home() / "router.db")


def default_agent_state_dir() -> str:
    """$XDG_STATE_HOME/llmgw/agent (~/.local/state/llmgw/agent)."""
    return str(_state_home() / "agent")


def default_node_name() -> str:
    name = socket.gethostname().split(".")[0] or "localhost"
    return name if node_name(name) is None else "localhost"


def default_admin_socket() -> str:
    """$XDG_RUNTIME_DIR/llmgw-<uid>/admin.sock, or under /tmp when XDG_RUNTIME_DIR is unset."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return str(Path(base) / f"llmgw-{uid}" / "admin.sock")
