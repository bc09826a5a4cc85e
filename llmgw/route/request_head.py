"""The request head: the bytes of what an engine caches first for a request, serialised
deterministically from the OpenAI body (pure). Chat messages in order — system first — as role,
NUL, content per message; completions' prompt as text or packed token ids; embeddings' input.
It is what the prefix index matches on: tokens are not needed at that tier.

The index keeps only a head's first ``max_head_bytes`` (128 KiB): with ``limit`` the head is built
only that far (the messages after it are not rendered at all, a long text is cut before it is
encoded), and the result is exactly the whole head's first ``limit`` bytes."""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from typing import Any

__all__ = ["request_head"]


_MSG_SEP = b"\x1e"  # between messages
_KEEP = ("role", "content")


def _canon(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str).encode("utf-8", "surrogatepass")


def _text(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")


def _content(c: Any, room: int | None = None) -> bytes:
    if c is None:
        return b""
    if isinstance(c, str):  # a char is 1-4 bytes: its first `room` chars hold the first `room` bytes
        return _text(c if room is None or len(c) <= room else c[:room])
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


def _message(m: Any, room: int | None = None) -> bytes:
    """A message's bytes; with ``room``, at least its first ``room`` bytes (a prefix of them)."""
    if not isinstance(m, dict):
        return _canon(m)
    role = m.get("role")
    head = (_text(role) if isinstance(role, str) else b"") + b"\0"
    head += _content(m.get("content"), None if room is None else max(0, room - len(head)))
    rest = {k: v for k, v in m.items() if k not in _KEEP and v is not None}
    if rest:  # name, tool_calls, tool_call_id...: the template renders them too
        head += b"\0" + _canon(rest)
    return head


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
        if not tools and limit is None:
            return _MSG_SEP.join([_message(m) for m in msgs])
        k = len(msgs)
        if tools:
            k = 0
            while k < len(msgs) and isinstance(msgs[k], dict) \
                    and msgs[k].get("role") in ("system", "developer"):
                k += 1
        parts: list[bytes] = []
        size = -1  # the separators: one fewer than the parts
        for j in range(len(msgs) + (1 if tools else 0)):
            if limit is not None and size >= limit:
                break
            room = None if limit is None else limit - size - 1
            if tools and j == k:
                part = b"tools\0" + _canon(tools)
            else:
                part = _message(msgs[j if not tools or j < k else j - 1], room)
            parts.append(part)
            size += len(part) + 1
        head = _MSG_SEP.join(parts)
        return head if limit is None or len(head) <= limit else head[:limit]
    if kind == "completions":
        head = _prompt(body.get("prompt"), limit)
    elif kind == "embeddings":
        head = _prompt(body.get("input"), limit)
    else:
        return b""
    return head if limit is None or len(head) <= limit else head[:limit]
