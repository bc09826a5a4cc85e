"""An agent's engine reports, checked before the router dials what they name (llmgw.fleet.report_url
has the rules): a URL that is malformed or not on the node's own address is refused for that
report only — the engine counts as failed, the agent is told, the connection and the node's other
engines go on.

One checker per connection: it knows the peer's address and caches what host names resolve to
(bounded, for the connection's lifetime)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import replace

import trio

from llmgw.fleet.report_url import BadReportUrl, IPAddress, IPNetwork, host_problem, parse_report_url
from llmgw.fleet.types import EngineReport

__all__ = ["ReportChecker", "peer_address", "rejected_report"]

RESOLVE_TIMEOUT_S = 2.0
MAX_NAMES = 64  # host names cached per connection
MAX_ADDRESSES = 16  # of one name's answers, the first these many are checked


def peer_address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return None


def rejected_report(report: EngineReport, why: str) -> EngineReport:
    """The report as the router keeps it: no URL, and a ready engine counts as failed."""
    return replace(report, url=None, state="failed" if report.state == "ready" else report.state,
                   detail=f"report refused by the router: {why}")


class ReportChecker:
    def __init__(self, peer: IPAddress | None, networks: tuple[IPNetwork, ...]) -> None:
        self.peer = peer
        self.networks = networks
        self._resolved: dict[str, tuple[IPAddress, ...]] = {}

    async def problem(self, report: EngineReport) -> str | None:
        """Why the router must not use this report's URL, or None (no URL is fine: not listening yet)."""
        if report.url is None:
            return None
        try:
            url = parse_report_url(report.url)
        except BadReportUrl as e:
            return f"url: {e}"
        resolved = None if url.ip is not None else await self._resolve(url.host)
        why = host_problem(url, self.peer, self.networks, resolved)
        return None if why is None else f"url: {why}"

    async def _resolve(self, name: str) -> tuple[IPAddress, ...]:
        if name in self._resolved:
            return self._resolved[name]
        addrs: list[IPAddress] = []
        with trio.move_on_after(RESOLVE_TIMEOUT_S):
            try:
                infos = await trio.socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError):
                infos = []
            for info in infos[:MAX_ADDRESSES]:
                a = peer_address(str(info[4][0]))
                if a is not None and a not in addrs:
                    addrs.append(a)
        if len(self._resolved) >= MAX_NAMES:
            self._resolved.pop(next(iter(self._resolved)))
        self._resolved[name] = tuple(addrs)
        return self._resolved[name]
