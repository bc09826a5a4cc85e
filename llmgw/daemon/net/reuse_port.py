"""Listening sockets bound with SO_REUSEPORT: ``llmgw daemon --workers N`` runs N router processes
that each bind the OpenAI port this way, and the kernel spreads new connections among them (by a hash
of the connection's addresses; a process that stops listening takes only the connections queued on its
own socket with it). Linux allows it between sockets of one user only, so another user cannot join
the port; any process of the same user that sets the option can (docs/security.md).

Binding and listening are two steps: the kernel gives a socket of the group new connections only
once it listens, so a process can hold its port (and report it) and join the others later."""

from __future__ import annotations

import socket as _socket

import trio

__all__ = ["bind_reuse_port", "listen_on"]


async def bind_reuse_port(port: int, *, host: str) -> list[trio.socket.SocketType]:
    """What trio.open_tcp_listeners binds, with SO_REUSEPORT set before each bind (trio has no
    option for it); not listening yet (`listen_on`)."""
    addresses = await trio.socket.getaddrinfo(host, port, type=_socket.SOCK_STREAM, flags=_socket.AI_PASSIVE)
    socks: list[trio.socket.SocketType] = []
    try:
        for family, type_, proto, _, sockaddr in addresses:
            sock = trio.socket.socket(family, type_, proto)
            socks.append(sock)
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEPORT, 1)
            if family == _socket.AF_INET6:
                sock.setsockopt(_socket.IPPROTO_IPV6, _socket.IPV6_V6ONLY, 1)
            await sock.bind(sockaddr)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def listen_on(socks: list[trio.socket.SocketType], backlog: int | None = None) -> list[trio.SocketListener]:
    """Start listening on sockets `bind_reuse_port` bound: from now on they get connections."""
    for sock in socks:
        sock.listen(0xFFFF if backlog is None else backlog)  # the kernel caps it at somaxconn
    return [trio.SocketListener(sock) for sock in socks]
