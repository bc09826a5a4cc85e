"""The request path's forms on the wire (the shell's half of :mod:`.proxy`): request ids, the
errors the router and its HTTP server answer in OpenAI's envelope, how an upstream error counts
for the breaker, and the header values taken from an engine's answer or a replica's name."""

from __future__ import annotations

import functools
import hmac
import json
import logging
import random
import re
from typing import Any
from urllib.parse import quote

from llmgw.daemon.net.httpserver import Request, Response
from llmgw.daemon.net.upstream import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from llmgw.route.breaker import FailureKind
from llmgw.route.openai_req import ApiError, error_body

__all__ = ["JSON", "AdapterMissing", "consteq", "content_type", "error_response", "failure_of", "header_value",
           "id_bits", "request_id", "server_error_body", "tracestate"]

log = logging.getLogger("llmgw.router")

JSON = "application/json"
# Request ids: 32 random hex digits like uuid4().hex at a sixth of its cost (no getrandom()
# syscall and UUID object a request); not a secret, only unique in practice.
id_bits = random.Random().getrandbits
# A client's request id is echoed in the answer, sent to the engine, logged and kept in the
# decision ring: visible ASCII, at most 128 characters, or the router makes its own.
_CLIENT_RID = re.compile(r"[\x21-\x7e]{1,128}")
# An engine's Content-Type goes to the client only as a valid header value (visible ASCII with
# inner spaces, bounded); anything else is replaced by what the answer must be.
_CONTENT_TYPE = re.compile(r"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*")
_MAX_CONTENT_TYPE = 256


# What the HTTP server answers itself, before the router's handler: OpenAI's envelope, with a
# string code (or null) like every error the router makes.
_SERVER_CODES = {400: "invalid_request", 408: "request_timeout", 413: "request_too_large",
                 431: "headers_too_large", 503: "server_busy"}


def request_id(given: str | None) -> str:
    """The client's request id when it is a valid one, else a new one."""
    return given if given is not None and _CLIENT_RID.fullmatch(given) is not None else f"{id_bits(128):032x}"


def server_error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    return error_body(message, err_type, None, _SERVER_CODES.get(status))


def error_response(e: ApiError, rid: str, rid_header: str) -> Response:
    headers = [("content-type", JSON), (rid_header, rid), *e.headers]
    return Response(e.status, headers, json.dumps(e.body()).encode())


class AdapterMissing(UpstreamError):
    """A replica answered 404 for an adapter the router's book says it holds (its engine
    restarted on the same URL): not the engine's fault (the breaker does not count it); the
    request is tried again (AdapterRouting.missing)."""

    public = "answered 404: it no longer holds the adapter (its engine restarted?)"


def failure_of(e: UpstreamError) -> FailureKind:
    if isinstance(e, AdapterMissing):
        return FailureKind.CLIENT_4XX
    if isinstance(e, UpstreamConnectError):
        return FailureKind.CONNECT
    if isinstance(e, UpstreamTimeout):
        return FailureKind.TIMEOUT
    if isinstance(e, UpstreamClosed):
        return FailureKind.RESET
    return FailureKind.HTTP_5XX


def content_type(resp: UpstreamResponse, stream: bool) -> str:
    """The engine's Content-Type if it is a valid header value, else what the answer must be."""
    ct = resp.header("content-type")
    if ct is not None and len(ct) <= _MAX_CONTENT_TYPE and _CONTENT_TYPE.fullmatch(ct) is not None:
        return ct
    if ct is not None:
        log.debug("replaced an invalid content-type from %s: %r", resp.url, ct[:_MAX_CONTENT_TYPE])
    return "text/event-stream" if stream and resp.status == 200 else JSON


@functools.lru_cache(maxsize=4096)
def header_value(text: str) -> str:
    """A replica id as a header value: as it is when it can be one (nearly always), else
    percent-encoded (a model name may be any text)."""
    return text if _CONTENT_TYPE.fullmatch(text) is not None else quote(text, safe="/")


def tracestate(req: Request) -> str | None:
    """The client's tracestate: several such header lines are one list (RFC 9110's combining)."""
    values = [v for k, v in req.headers if k == "tracestate"]
    return ",".join(values) if values else None


def consteq(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
