"""The HTTP/1.1 header-field grammar (RFC 9112 §5), shared by the response parser
(``llmgw.http1.client``) and the request parser (``llmgw.http1.server``), and
``first_header``, the lookup both sides' header lists use.  Pure."""

from __future__ import annotations

import re

__all__ = ["END_OF_HEAD", "MAX_CHUNK_LINE", "TOKEN", "VALUE", "first_header", "parse_fields"]

END_OF_HEAD = re.compile(rb"\n\r?\n")
TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
VALUE = rb"[^\x00-\x08\x0a-\x1f\x7f]*"  # field content: no controls but HTAB (so no CR or LF)
MAX_CHUNK_LINE = 8192  # a chunk-size line with its extensions
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
