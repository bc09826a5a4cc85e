"""The upstream client's errors (:mod:`llmgw.daemon.net.upstream` re-exports them).

Every failure of a request to an upstream is an :class:`UpstreamError` with a ``received``
flag (any response byte had arrived: the router may retry another replica while it is
False and nothing went to its client) and the ``url``; the subclass says what happened.
The message may name the upstream's address (for the log); ``public`` says what happened
without it, for clients.
``_Stale`` is internal: a reused connection found dead before any response byte, which the
exchange resends once on a fresh one.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["Phase", "UpstreamClosed", "UpstreamConnectError", "UpstreamError", "UpstreamProtocolError",
           "UpstreamTimeout"]

Phase = Literal["connect", "first_byte", "idle"]


class UpstreamError(Exception):
    """A request to an upstream failed.  ``received``: any response byte had arrived."""

    public = "upstream request failed"  # what happened, without addresses (for clients)

    def __init__(self, message: str, *, received: bool = False, url: str | None = None) -> None:
        super().__init__(message)
        self.received = received
        self.url = url


class UpstreamConnectError(UpstreamError):
    """Could not connect (refused, unreachable, DNS failure, an unusable URL).  Nothing was sent."""

    public = "connection failed"


class UpstreamTimeout(UpstreamError):
    """A deadline passed.  ``phase``: "connect", "first_byte" (from sending the
    request to the first response byte) or "idle" (a gap between received bytes)."""

    def __init__(self, phase: Phase, message: str | None = None, *, received: bool = False,
                 url: str | None = None) -> None:
        super().__init__(message or f"upstream {phase.replace('_', '-')} timeout", received=received, url=url)
        self.phase = phase
        self.public = f"{phase.replace('_', '-')} timeout"


class UpstreamProtocolError(UpstreamError):
    """The upstream sent something that is not valid HTTP/1.1 (or too large)."""

    public = "invalid response"


class UpstreamClosed(UpstreamError):
    """The connection was reset or closed before the response was complete."""

    public = "connection closed before the response was complete"


class _Stale(Exception):
    """A reused connection was found dead before any response byte: resend once."""
