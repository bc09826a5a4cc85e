"""The HTTP/1.1 header-field grammar (RFC 9112 §5), shared by the response parser
(``llmgw.http1.client``) and the request parser (``llmgw.http1.server``), and
``first_header``, the lookup both sides' header lists use.  ``_content_length`` and
``_token_set`` read a Content-Length and a token list the way both the request parser
and the response-head serializer (``llmgw.http1.response_head``) need.  Pure."""

from __future__ import annotations

import re

from llmgw.http1.errors import RemoteProtocolError

__all__ = ["END_OF_HEAD", "MAX_CHUNK_LINE", "TOKEN", "VALUE", "first_header", "parse_fields"]

END_OF_HEAD = re.compile(rb"\n\r?\n")
TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
VALUE = rb"[^\x00-\x08\x0a-\x1f\x7f]*"  # field content: no controls but HTAB (so no CR or LF)
MAX_CHUNK_LINE = 8192  # a chunk-size line with its extensions
_MAX_LENGTH_DIGITS = 20  # as h11: a Content-Length of up to 10**20 - 1 parses (then 413s)
# Anchored at line starts, one match covers exactly one whole line: as many matches as
# lines means every line is a valid field.  Matched on the latin-1 decoded block.
_FIELD = re.compile(("^(" + TOKEN.decode() + "):[ \t]*(" + VALUE.decode() + ")\r?\n"), re.MULTILINE)
_FOLDED = re.compile(rb"(?:(?:" + TOKEN + rb":|[ \t])" + VALUE + rb"\r?\n)*")


def parse_fields(block: bytes | bytearray) -> list[tuple[str, str]] | None:
    """Header lines (each ending in LF) -> [(lowercased name, value)], values stripped;
    None when a line is malformed (each caller raises its RemoteProtocolError)."""
    text = block.decode("latin-1")
    fields = _FIELD.findall(text)
    if len(fields) != text.count("\n"):
        if _FOLDED.fullmatch(block) is None or block[:1] in b" \t":
            return None
        # obs-fold (RFC 9112 §5.2): a continuation line joins the previous value with a space
        fields = _FIELD.findall(re.sub(r"\r?\n[ \t]+", " ", text))
    return [(n.lower(), v.rstrip(" \t")) for n, v in fields]


def first_header(headers: list[tuple[str, str]], name: str) -> str | None:
    """First value of header ``name`` in lowercased ``(name, value)`` pairs, or None."""
    for k, v in headers:
        if k == name:
            return v
    return None


def _token_set(value: str) -> set[str]:
    """A comma-separated header value as a set of lowercased, stripped, non-empty tokens."""
    return {t for part in value.lower().split(",") if (t := part.strip(" \t"))}


def _content_length(value: str) -> str:
    """A Content-Length value as h11 normalizes it: its digits ("5, 5" is "5")."""
    if not (value.isdigit() and value.isascii()):
        parts = {p.strip(" \t") for p in value.split(",")}
        if len(parts) != 1:
            raise RemoteProtocolError("conflicting Content-Length values")
        value = parts.pop()
        if not (value.isdigit() and value.isascii()):
            raise RemoteProtocolError(f"invalid Content-Length {value[:40]!r}")
    if len(value) > _MAX_LENGTH_DIGITS:
        raise RemoteProtocolError("Content-Length too large")
    return value
