"""W3C Trace Context (https://www.w3.org/TR/trace-context/, Level 1): a client's ``traceparent``
and ``tracestate`` headers read strictly, and the ``traceparent`` the router sends each engine.

``traceparent`` is ``version-traceid-parentid-flags``: 2, 32, 16 and 2 lower-case hex digits. A
malformed one is *ignored* — the request goes on with a trace of its own, never an error to the
client — and the reason is returned so the shell can count it:

=============== ========================================================================
``length``      not 55 characters (version 00), or shorter than 55 (a later version)
``format``      a separator is not ``-``, a field is not lower-case hex (``A-F`` is refused)
``version``     version ``ff`` (forbidden by the spec)
``trace_id``    all zeros
``parent_id``   all zeros
=============== ========================================================================

A *later* version (``01``–``fe``) is parsed as the spec says: its first 55 characters as version
00's fields, and a 56th character, when there is one, must be ``-`` (what follows is that
version's and is ignored). Flags: only ``sampled`` (0x01) is defined; the other bits are not
passed on (Level 1: "vendors MUST set those to zero").

``tracestate`` is kept only with a valid ``traceparent`` (the spec: a vendor that could not parse
traceparent must not use tracestate), as list members ``key=value`` joined by ``,``: at most 32
members and :data:`MAX_TRACESTATE` characters — beyond that, members over 128 characters go
first, then the last ones (the spec's truncation order). A member that is not ``key=value`` with
the spec's characters voids the whole header (it is not passed on).

Pure: the ids of a new trace and of the router's spans come from an injected ``bits(n)`` (the
shell's ``random.Random().getrandbits``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["MAX_TRACESTATE", "SAMPLED", "TraceContext", "format_traceparent", "new_span_id", "new_trace_id",
           "parse_traceparent", "parse_tracestate", "sampled"]

SAMPLED = 0x01
MAX_TRACESTATE = 512  # characters passed on (the spec: propagate at least 512)
MAX_MEMBERS = 32
_LONG_MEMBER = 128

_HEX = re.compile(r"[0-9a-f]+")
_V00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
# tracestate: key = simple-key / tenant@system; value = 0-255 of 0x20-0x7e but , and = ending non-space
_KEY = re.compile(r"[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13}")
_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A client's valid ``traceparent`` (and its ``tracestate``, "" when none or void)."""
    trace_id: str  # 32 lower-case hex digits, not all zero
    parent_id: str  # 16: the client's span, which the router's request span is the child of
    flags: int  # SAMPLED or 0
    tracestate: str = ""


def parse_traceparent(value: str | None) -> tuple[TraceContext | None, str]:
    """(the context, "") for a valid header; (None, reason) for a malformed one; (None, "") for none."""
    if value is None:
        return None, ""
    v = value.strip(" \t")  # optional whitespace around a header's value is not the value's
    m = _V00.fullmatch(v)  # the common case, in one match; the rest says why it is not
    if m is not None and m[1] != _ZERO_TRACE and m[2] != _ZERO_SPAN:
        return TraceContext(m[1], m[2], int(m[3], 16) & SAMPLED), ""
    if len(v) < 55:
        return None, "length"
    version = v[:2]
    if _HEX.fullmatch(version) is None:
        return None, "format"
    if version == "ff":
        return None, "version"
    if version == "00":
        if len(v) != 55:
            return None, "length"
    elif len(v) > 55 and v[55] != "-":
        return None, "format"
    if v[2] != "-" or v[35] != "-" or v[52] != "-":
        return None, "format"
    trace_id, parent_id, flags = v[3:35], v[36:52], v[53:55]
    if _HEX.fullmatch(trace_id) is None or _HEX.fullmatch(parent_id) is None or _HEX.fullmatch(flags) is None:
        return None, "format"
    if trace_id == _ZERO_TRACE:
        return None, "trace_id"
    if parent_id == _ZERO_SPAN:
        return None, "parent_id"
    return TraceContext(trace_id, parent_id, int(flags, 16) & SAMPLED), ""


def parse_tracestate(value: str | None) -> str:
    """The header's list members, valid and bounded, as the value to pass on ("" when none, or
    when any member is malformed or there are more than 32)."""
    if not value:
        return ""
    members = [m.strip(" \t") for m in value.split(",")]
    members = [m for m in members if m]
    if len(members) > MAX_MEMBERS:
        return ""
    seen = set()
    for m in members:
        key, eq, val = m.partition("=")
        if not eq or _KEY.fullmatch(key) is None or _VALUE.fullmatch(val) is None or key in seen:
            return ""
        seen.add(key)
    while len(",".join(members)) > MAX_TRACESTATE:
        long = next((i for i, m in enumerate(members) if len(m) > _LONG_MEMBER), None)
        members.pop(long if long is not None else -1)
    return ",".join(members)


def new_trace_id(bits: Callable[[int], int]) -> str:
    """32 hex digits, never all zero."""
    return f"{bits(128) or 1:032x}"


def new_span_id(bits: Callable[[int], int]) -> str:
    """16 hex digits, never all zero."""
    return f"{bits(64) or 1:016x}"


def format_traceparent(trace_id: str, span_id: str, flags: int) -> str:
    """The version-00 header for a span of ours."""
    return f"00-{trace_id}-{span_id}-{flags & SAMPLED:02x}"


def sampled(trace_id: str, ratio: float) -> bool:
    """A new trace's sampling by its id, as OpenTelemetry's TraceIdRatioBased sampler decides: the
    id's low 64 bits below ``ratio`` × 2^64 (the same id, the same answer, on every router)."""
    if ratio >= 1.0:
        return True
    return int(trace_id[16:], 16) < int(ratio * (1 << 64))
