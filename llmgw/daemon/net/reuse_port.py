"""Listening sockets bound with SO_REUSEPORT: ``llmgw daemon --workers N`` runs N router processes
that each bind the OpenAI port this way, and the kernel spreads new connections among them (by a hash
of the connection's addresses; a process that stops listening takes only the connections queued on its
own socket with it). Linux allows it between sockets of one user only, so another user cannot join
the port; any process of the same user that sets the option can (docs/security.md)."""

from __future__ import annotations

import socket as _socket

import trio

__all__ = ["open_reuse_port_listeners"]


async def open_reuse_port_listeners(port: int, *, host: str, backlog: int | None = None) -> list[trio.SocketListener]:
    """trio.open_tcp_listeners, with SO_REUSEPORT set before each bind (trio has no option for it)."""
    addresses = await trio.socket.getaddrinfo(host, port, type=_socket.SOCK_STREAM, flags=_socket.AI_PASSIVE)
    listeners: list[trio.SocketListener] = []
    try:
        for family, type_, proto, _, sockaddr in addresses:
            sock = trio.socket.socket(family, type_, proto)
            try:
                sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
                sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEPORT, 1)
                if family == _socket.AF_INET6:
                    sock.setsockopt(_socket.IPPROTO_IPV6, _socket.IPV6_V6ONLY, 1)
                await sock.bind(sockaddr)
                sock.listen(0xFFFF if backlog is None else backlog)  # the kernel caps it at somaxconn
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    return listeners
