"""The agent's side of TLS on the control stream: which CA it trusts and which name it verifies.

TLS is on when `[agent] tls` says so and, by default, when the agent is given a CA to pin
(`tls_ca`, a PEM file, or `tls_ca_pem`, the PEM inline as `llmgw ctl join-info` prints it) or
dials a router beyond loopback (llmgw.fleet.identity.agent_tls_wanted). Without a CA it trusts
the system's CAs (a router certificate from a public or company CA). The name it verifies is
`tls_server_name` when set (a router's generated certificate carries `llmgw-control`), otherwise
the router's host.
"""

from __future__ import annotations

import ssl

from llmgw.config import AgentConfig
from llmgw.fleet.identity import agent_tls_wanted
from llmgw.fleet.types import RouterAddr

__all__ = ["AgentTlsError", "RouterTls", "agent_tls", "listed_tls", "pinned_tls"]


class AgentTlsError(Exception):
    """The agent's TLS settings cannot be used (the message names the setting)."""


class RouterTls:
    """How the agent dials the router over TLS."""

    def __init__(self, context: ssl.SSLContext, server_name: str | None) -> None:
        self.context = context
        self.server_name = server_name


def _context(cafile: str | None = None, cadata: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=cafile, cadata=cadata)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def agent_tls(a: AgentConfig) -> RouterTls | None:
    host = a.router.rpartition(":")[0].strip("[]")
    if not agent_tls_wanted(host, a.tls, bool(a.tls_ca or a.tls_ca_pem)):
        return None
    try:
        if a.tls_ca_pem:
            ctx = _context(cadata=a.tls_ca_pem)
        elif a.tls_ca:
            ctx = _context(cafile=a.tls_ca)
        else:
            ctx = _context()
    except (OSError, ssl.SSLError, ValueError) as e:
        key = "agent.tls_ca_pem" if a.tls_ca_pem else "agent.tls_ca"
        raise AgentTlsError(f"{key}: {e}") from None
    return RouterTls(ctx, a.tls_server_name)


def pinned_tls(ca_pem: str | None, cafile: str | None, server_name: str | None) -> RouterTls:
    """The one-process mode's agent: it trusts exactly its own router's CA."""
    return RouterTls(_context(cafile=cafile, cadata=ca_pem), server_name)


def listed_tls(a: AgentConfig, r: RouterAddr) -> RouterTls | None:
    """How the agent dials a router another router listed: TLS by the rule above (its listed CA,
    or an address beyond loopback), trusting exactly the CA the list gives — or, where it gives
    none, the agent's own CA settings (the system's CAs without them) — and verifying the listed
    server name (the address's host when none). Raises ssl.SSLError/ValueError for an unusable CA."""
    host = r.control.rpartition(":")[0].strip("[]")
    if not agent_tls_wanted(host, None, bool(r.ca_pem)):
        return None
    if r.ca_pem:
        ctx = _context(cadata=r.ca_pem)
    else:
        ctx = _context(cadata=a.tls_ca_pem, cafile=None if a.tls_ca_pem else a.tls_ca)
    return RouterTls(ctx, r.server_name or None)
