"""Unix-socket helpers of the HTTP server (``httpserver.serve_unix`` and its connections).

``_peer_uid``: who is on the other end of an accepted Unix socket (SO_PEERCRED), for the
``peer_uid`` option that refuses other users.  ``_remove_stale_socket``: clear a socket
file left by a crashed run before binding, refusing to touch one a live server answers on.
"""

from __future__ import annotations

import errno
import os
import socket as _socket
import stat
import struct

import trio

__all__: list[str] = []  # internal to llmgw.daemon.net.httpserver


def _peer_uid(sock: _socket.socket | trio.socket.SocketType) -> int | None:
    """The uid of a Unix socket's peer; None elsewhere or where the OS has no SO_PEERCRED (not
    Linux: the socket's 0700 directory is the guard there)."""
    opt = getattr(_socket, "SO_PEERCRED", None)
    if opt is None or sock.family != _socket.AF_UNIX:
        return None
    try:
        return struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, opt, struct.calcsize("3i")))[1]
    except OSError:
        return -1  # unknown where it should be known: nobody's uid, so refused


def _remove_stale_socket(path: str) -> None:
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return  # not ours to delete; bind() will fail with EADDRINUSE
    except FileNotFoundError:
        return
    with _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as probe:
        probe.setblocking(False)  # a live server with a full backlog must not hang us
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # nobody listening: left over from a crashed run
            return
        except BlockingIOError:
            pass
    raise OSError(errno.EADDRINUSE, "a server is already listening on this socket", path)
