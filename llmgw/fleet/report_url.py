"""Where an agent says its engine listens: the URL of an engine report, checked before the router
ever dials it.

An engine report's `url` comes from the agent, and the router sends real prompts there and scrapes
it. So it must be a plain ``http(s)://host:port`` (no user info, path, query or fragment: agents
write ``http://<advertise_host>:<port>``), and its host must be the node's own: the address the
agent's connection comes from, an address in the operator's ``[control] engine_networks``, or —
for an agent on the router's own machine — a loopback address. A host name is allowed when every
address it resolves to is (the router resolves it; :func:`host_problem` takes the answer).

Pure: parsing and address arithmetic only; resolving a name is the caller's I/O.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["BadReportUrl", "ReportUrl", "address_allowed", "host_problem", "is_loopback_host",
           "parse_networks", "parse_report_url"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_URL = 2048
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_AUTHORITY = re.compile(r"(?P<host>\[[^\]/@]*\]|[^:/@\[\]]*)(?::(?P<port>[0-9]{1,5}))?")


class BadReportUrl(ValueError):
    """The URL is not one the router may dial (the message says why, without the URL's secrets)."""


@dataclass(frozen=True, slots=True)
class ReportUrl:
    scheme: str
    host: str  # without brackets; lower case for names
    port: int
    ip: IPAddress | None  # the host as an address, when it is one

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if self.ip is not None and self.ip.version == 6 else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_report_url(url: str) -> ReportUrl:
    """Check `url` strictly; raise :class:`BadReportUrl` for anything but ``http(s)://host:port``
    (a trailing ``/`` is allowed)."""
    if len(url) > MAX_URL:
        raise BadReportUrl(f"{len(url)} chars, at most {MAX_URL}")
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
        raise BadReportUrl("not an ASCII URL without spaces or control characters")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("http", "https"):
        raise BadReportUrl(f"scheme must be http or https, got {scheme!r}" if sep else "not an http(s) URL")
    if rest.endswith("/"):
        rest = rest[:-1]
    if any(c in rest for c in "/?#"):
        raise BadReportUrl("only http(s)://host:port: no path, query or fragment")
    if "@" in rest:
        raise BadReportUrl("no user info allowed")
    m = _AUTHORITY.fullmatch(rest)
    if m is None:
        raise BadReportUrl("malformed host or port")
    host, port = m.group("host"), m.group("port")
    if port is None:
        raise BadReportUrl("the port is missing")
    if not 1 <= int(port) <= 65535:
        raise BadReportUrl(f"port {int(port)} is out of range")
    if host.startswith("["):
        try:
            ip: IPAddress | None = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise BadReportUrl("not an IPv6 address in brackets") from None
        if ip.scope_id is not None:  # type: ignore[union-attr]
            raise BadReportUrl("no IPv6 zone allowed")
        host = str(ip)
    else:
        ip = _ipv4(host)
        if ip is None:
            host = host.lower()
            if not _is_dns_name(host):
                raise BadReportUrl("the host is neither an IP address nor a DNS name")
    return ReportUrl(scheme, host, int(port), ip)


def _ipv4(host: str) -> ipaddress.IPv4Address | None:
    if not re.fullmatch(r"[0-9.]+", host):
        return None
    try:
        return ipaddress.IPv4Address(host)
    except ValueError:
        raise BadReportUrl(f"not an IPv4 address: {host[:40]!r}") from None


def _is_dns_name(host: str) -> bool:
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > 253:
        return False
    labels = name.split(".")
    # A final label of digits only would read as an IPv4 address to some resolvers.
    return all(_LABEL.fullmatch(x) for x in labels) and not labels[-1].isdigit()


def is_loopback_host(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1, and IPv4-mapped 127.x)."""
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost."):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return _plain(ip).is_loopback


def _plain(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def parse_networks(specs: Iterable[str]) -> tuple[IPNetwork, ...]:
    """CIDRs (``10.1.0.0/16``, ``fd00::/8``); a bare address is a /32 or /128. ValueError names a bad one."""
    out = []
    for spec in specs:
        try:
            out.append(ipaddress.ip_network(spec.strip(), strict=False))
        except ValueError:
            raise ValueError(f"not a network (CIDR) or address: {spec!r}") from None
    return tuple(out)


def address_allowed(addr: IPAddress, peer: IPAddress | None, networks: Sequence[IPNetwork] = ()) -> bool:
    """May a node whose connection comes from `peer` run engines at `addr`?"""
    a = _plain(addr)
    if a.is_unspecified or a.is_multicast:
        return False
    if peer is not None:
        p = _plain(peer)
        if a == p or (a.is_loopback and p.is_loopback):
            return True
    return any(a.version == n.version and a in n for n in networks)


def host_problem(url: ReportUrl, peer: IPAddress | None, networks: Sequence[IPNetwork] = (),
                 resolved: Sequence[IPAddress] | None = None) -> str | None:
    """Why the router may not dial `url` for a node connected from `peer`, or None if it may.
    For a host name, `resolved` is what it resolves to (None or empty: it did not resolve)."""
    where = "the node's own address" + (" or [control] engine_networks" if networks else "")
    if url.ip is not None:
        if address_allowed(url.ip, peer, networks):
            return None
        return f"host {url.host} is not {where} ({peer if peer is not None else 'unknown'})"
    if not resolved:
        return f"host {url.host} does not resolve"
    bad = [a for a in resolved if not address_allowed(a, peer, networks)]
    if bad:
        return f"host {url.host} resolves to {bad[0]}, which is not {where} ({peer})"
    return None
