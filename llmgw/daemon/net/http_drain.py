"""A graceful stop of the HTTP server (llmgw.daemon.net.httpserver): what a router does on
SIGTERM before it is cancelled (docs/ha.md "Behind a load balancer").

``Drain`` is handed to ``serve_tcp``/``serve_listeners`` (``drain=``); the server attaches
itself.  ``start()`` then, at once and without awaiting:

- accepts what the kernel has queued on each listening socket (those clients did connect:
  they are served, not reset), then closes the listening sockets, so a new connection is
  refused and its client (or a load balancer) goes to another router;
- closes the connections that wait idle between two requests (keep-alive): nothing is lost,
  the client opens a new one elsewhere;
- marks every other connection to close after its current response: a request being read or
  handled is answered with ``connection: close``; one whose head is out already ends with
  the response (a streamed one included);
- gives a new connection that has not sent its request yet ``FRESH_S`` to send it.

``wait()`` returns once every connection is closed; the caller bounds it (the daemon's
``[server] shutdown_grace_s``) and cancels the server after, as before: what is still in
flight then is cut."""

from __future__ import annotations

from typing import Any

import trio

__all__ = ["FRESH_S", "Drain"]

FRESH_S = 1.0  # s: a connection accepted but with no request yet gets this long to send it
_POLL = 0.05  # s: how often wait() looks (a stop, not a hot path)


# The servers are httpserver._Server (not imported: httpserver imports this module); a drain
# uses their draining flag, listening sockets, connections, stats and limits.
_Server = Any


class Drain:
    def __init__(self) -> None:
        self.servers: list[_Server] = []
        self.started = False

    def attach(self, server: _Server) -> None:
        self.servers.append(server)
        if self.started:
            _drain(server)

    @property
    def in_flight(self) -> int:
        """Requests being handled or sent now."""
        return sum(s.stats.requests_active for s in self.servers)

    @property
    def connections(self) -> int:
        return sum(len(s.conns) for s in self.servers)

    def start(self) -> int:
        """Begin the drain (idempotent); the requests in flight now."""
        if not self.started:
            self.started = True
            for s in self.servers:
                _drain(s)
        return self.in_flight

    async def wait(self) -> None:
        """Until every connection of every attached server is closed (start() first)."""
        while True:
            await trio.sleep(_POLL)  # also lets connections accepted by start() register
            if not any(s.conns for s in self.servers):
                return


def _drain(server: _Server) -> None:
    server.draining = True
    nursery = server.nursery
    for lsock, listener in server.listening:
        while nursery is not None:  # connections queued in the kernel: they are served
            try:
                sock, addr = lsock.accept()
            except OSError:  # BlockingIOError: none left
                break
            if server.limits.admit(sock):
                nursery.start_soon(server.connection, sock, addr)
        listener.socket.close()  # wakes its accept loop, which ends; new connections are refused
    server.listening.clear()
    now = trio.current_time()
    for c in list(server.conns):
        if c.handling:
            c.keep_alive = False  # "connection: close" if its head is not out yet
        elif c in server.waiting and not c.reading and not c.parser.buffered:
            if c.fresh:
                c.deadline = min(c.deadline, now + FRESH_S)
            else:  # idle between requests
                server.stats.connections_idle_closed += 1
                c.scope.cancel()
        # else: a request is being read: it is answered with "connection: close" (read_request)
