"""What the HTTP server's handlers see and give: :class:`Request`, :class:`Response` and the
``*_response`` helpers, the server's counters (:class:`ServerStats`) and its options
(:class:`ServerOptions`).  Split from :mod:`llmgw.daemon.net.httpserver`, which re-exports
them all: import them from there."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypedDict
from urllib.parse import parse_qsl

from llmgw.http1.fields import first_header
from llmgw.http1.sinks import RelayBody  # types Response.body

__all__ = ["ErrorBody", "Handler", "Request", "Response", "ServerOptions", "ServerStats", "json_response",
           "openai_error_body", "text_response"]


@dataclass(slots=True)
class Request:
    method: str
    target: str  # raw request-target, e.g. "/v1/models?x=1"
    path: str  # target before "?", not percent-decoded
    query: str  # target after "?", raw
    headers: list[tuple[str, str]]  # names lowercased, in arrival order
    body: bytes
    client: tuple[str, int] | None  # None on Unix sockets
    http_version: str = "1.1"

    def header(self, name: str) -> str | None:
        """First value of header ``name`` (case-insensitive), or None."""
        return first_header(self.headers, name.lower())

    def query_params(self) -> dict[str, str]:
        """Decoded query parameters; the last of repeated keys wins."""
        return dict(parse_qsl(self.query, keep_blank_values=True))

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(slots=True)
class Response:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)  # str names and values
    # bytes -> Content-Length; async iterator -> chunked (HTTP/1.1), one write per chunk;
    # a RelayBody -> chunked, written by the body itself.
    body: bytes | AsyncIterator[bytes] | RelayBody = b""


Handler = Callable[[Request], Awaitable[Response]]
ErrorBody = Callable[[int, str, str], Any]  # (status, message, type) -> JSON-able object


def json_response(status: int, obj: Any, headers: Iterable[tuple[str, str]] = ()) -> Response:
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    return Response(status, [("content-type", "application/json"), *headers], body)


def text_response(status: int, text: str, headers: Iterable[tuple[str, str]] = (),
                  content_type: str = "text/plain; charset=utf-8") -> Response:
    return Response(status, [("content-type", content_type), *headers], text.encode())


def openai_error_body(status: int, message: str, err_type: str) -> Any:
    """OpenAI's error envelope: the default for errors the server itself produces."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


@dataclass(slots=True)
class ServerStats:
    """Plain counters bumped inline; read them from the same trio run."""
    connections_open: int = 0
    connections_total: int = 0
    requests_active: int = 0
    requests_served: int = 0  # responses written completely
    client_disconnects: int = 0  # requests cut short because the peer left
    handler_errors: int = 0  # handler or streaming body raised
    responses_aborted: int = 0  # bodies that could not be completed (BodyAborted): the connection was cut
    connections_refused: int = 0  # accepted at the cap with none to make room: 503, closed
    connections_evicted: int = 0  # closed to make room: the longest waiting for a request
    connections_idle_closed: int = 0  # no request (or no first byte of one) in time: closed
    accept_errors: int = 0  # accept() failed (EMFILE...): accepting paused
    max_connections: int = 0  # the cap (0: none)


class ServerOptions(TypedDict, total=False):
    max_body_bytes: int  # larger request bodies get 413 (default 16 MiB)
    max_head_bytes: int  # request line + headers; larger gets 431 (default 64 KiB)
    keepalive_timeout: float  # idle wait for a request's first byte (default 60 s)
    first_request_timeout: float  # ... on a new connection (default 10 s; at most keepalive_timeout)
    request_timeout: float  # first byte -> whole head + body, anti-slowloris (default 30 s)
    max_connections: int  # open connections at most (default 0: no cap); see http_limits
    error_body: ErrorBody  # envelope of server-made errors (default: openai_error_body)
    stats: ServerStats  # pass one in to read the counters
    # called with the status of each request the server answers itself, before any handler (400
    # malformed, 408 too slow, 413 body too large, 431 head too large): the router counts them
    on_rejected: Callable[[int], None]
    peer_uid: int  # Unix sockets: other users' connections get 403 (SO_PEERCRED; where the OS has it)
