"""The request head: the bytes of what an engine caches first for a request, serialised
deterministically from the OpenAI body (pure). Chat messages in order — system first — as role,
NUL, content per message; completions' prompt as text or packed token ids; embeddings' input.
It is what the prefix index matches on: tokens are not needed at that tier.

The index keeps only a head's first ``max_head_bytes`` (128 KiB): with ``limit`` the head is built
only that far (the messages after it are not rendered at all, a long prompt is cut before it is
encoded), and the result is exactly the whole head's first ``limit`` bytes."""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from typing import Any

__all__ = ["request_head"]


_MSG_SEP = b"\x1e"  # between messages
_KEEP = ("role", "content")
_TOOLS = object()  # where the tools go among the messages
_NO_LIMIT = 1 << 62  # no head is this long


def _canon(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str).encode("utf-8", "surrogatepass")


def _text(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")


def _content(c: Any) -> bytes:
    if c is None:
        return b""
    if isinstance(c, str):
        return _text(c)
    if isinstance(c, list):  # content parts: text as is, anything else (images...) canonical
        out = []
        for p in c:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                out.append(_text(p["text"]))
            elif isinstance(p, str):
                out.append(_text(p))
            else:
                out.append(_canon(p))
        return b"\x1f".join(out)
    return _canon(c)


def _message(m: Any, out: list[bytes]) -> int:
    """Append a message's pieces to ``out`` (joined once by the caller: no copy per message) and
    return their length."""
    if not isinstance(m, dict):
        b = _canon(m)
        out.append(b)
        return len(b)
    role = m.get("role")
    r = _text(role) if isinstance(role, str) else b""
    c = _content(m.get("content"))
    out += (r, b"\0", c)
    n = len(r) + 1 + len(c)
    rest = {k: v for k, v in m.items() if k not in _KEEP and v is not None}
    if rest:  # name, tool_calls, tool_call_id...: the template renders them too
        x = _canon(rest)
        out += (b"\0", x)
        n += 1 + len(x)
    return n


def _prompt(p: Any, limit: int | None = None) -> bytes:
    if isinstance(p, str):
        return _text(p if limit is None or len(p) <= limit else p[:limit])
    if isinstance(p, list) and p:
        first = p[0]
        if isinstance(first, int) and not isinstance(first, bool):
            try:
                a = array("I", p)  # token ids, 4 bytes each (≈ the 4 bytes/token of text)
            except (OverflowError, TypeError):
                return _canon(p)
            if a.itemsize != 4:  # pragma: no cover - no mainstream platform
                a = array("L", p)
            return a.tobytes()
        if isinstance(first, (str, list)):  # a batch: the engine caches each; route on the first
            return _prompt(first, limit)
    return b"" if p is None else _canon(p)


def request_head(body: Mapping[str, Any], kind: str, limit: int | None = None) -> bytes:
    """The bytes an engine caches first for this request, deterministically: for chat, each
    message as ``role NUL content`` in order (separated by 0x1E), the tools' canonical JSON after
    the leading system/developer messages (where chat templates render them); for completions
    the prompt (a string as UTF-8, token ids packed 4 bytes each, a batch by its first prompt);
    for embeddings the input, likewise. Anything else: b"". ``limit``: only the first ``limit``
    bytes of that (built no further than needed)."""
    if limit is not None and limit < 0:
        raise ValueError("limit must be >= 0")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return b""
        tools = body.get("tools")
        seq: list[Any] = msgs
        if tools:
            k = 0
            while k < len(msgs) and isinstance(msgs[k], dict) \
                    and msgs[k].get("role") in ("system", "developer"):
                k += 1
            seq = [*msgs[:k], _TOOLS, *msgs[k:]]
        out: list[bytes] = []
        size = -1  # the head's length so far: one separator fewer than the messages
        cut = _NO_LIMIT if limit is None else limit
        for m in seq:
            if size >= cut:  # the messages past the limit are not rendered at all
                break
            if out:
                out.append(_MSG_SEP)
            if m is _TOOLS:
                t = b"tools\0" + _canon(tools)
                out.append(t)
                size += len(t) + 1
            else:
                size += _message(m, out) + 1
        head = b"".join(out)
        return head if limit is None or len(head) <= limit else head[:limit]
    if kind == "completions":
        head = _prompt(body.get("prompt"), limit)
    elif kind == "embeddings":
        head = _prompt(body.get("input"), limit)
    else:
        return b""
    return head if limit is None or len(head) <= limit else head[:limit]
