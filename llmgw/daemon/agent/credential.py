"""The node credential the router issued this agent, kept in `state_dir/node-credential.json`.

The file is the node's identity on the agent stream: whoever holds it speaks for the node. It is
written 0600 (in a 0700 directory), atomically (a temporary file, fsync, rename), and names the
node it was issued for: an agent renamed to another node does not present it. Deleting it (or the
state directory) makes the agent join as a new node with the join token — which the router
refuses for a node name that still has a credential, until an operator revokes it
(`llmgw ctl nodes revoke NODE`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("llmgw.agent")

__all__ = ["FILE_NAME", "load_credential", "save_credential"]

FILE_NAME = "node-credential.json"
MAX_BYTES = 16 << 10


def load_credential(state_dir: str | Path, node: str) -> str:
    """The credential saved for `node`, or "" (none, unreadable, or another node's)."""
    path = Path(state_dir) / FILE_NAME
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return ""
    except OSError as e:
        log.error("cannot read the node credential %s: %s; joining with the join token", path, e.strerror or e)
        return ""
    try:
        if len(raw) > MAX_BYTES:
            raise ValueError("too large")
        data = json.loads(raw)
        saved_node, credential = data["node"], data["credential"]
        if not isinstance(saved_node, str) or not isinstance(credential, str):
            raise ValueError("node and credential must be strings")
    except (ValueError, KeyError, TypeError) as e:
        log.error("the node credential %s is damaged (%s); joining with the join token", path, e)
        return ""
    if saved_node != node:
        log.warning("the node credential in %s is node %s's, not %s's: not presenting it", path, saved_node, node)
        return ""
    return credential


def save_credential(state_dir: str | Path, node: str, credential: str) -> None:
    """Keep the credential for `node`; raises OSError if it could not be written durably."""
    d = Path(state_dir)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = d / FILE_NAME
    tmp = d / f".{FILE_NAME}.{os.getpid()}.tmp"
    data = json.dumps({"node": node, "credential": credential}).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # O_CREAT's mode is only for a new file
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself, durably
        finally:
            os.close(dfd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
