"""The request head: the bytes of what an engine caches first for a request, serialised
deterministically from the OpenAI body (pure). Chat messages in order — system first — as role,
NUL, content per message; completions' prompt as text or packed token ids; embeddings' input.
It is what the prefix index matches on: tokens are not needed at that tier."""

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


def _message(m: Any) -> bytes:
    if not isinstance(m, dict):
        return _canon(m)
    role = m.get("role")
    head = (_text(role) if isinstance(role, str) else b"") + b"\0" + _content(m.get("content"))
    rest = {k: v for k, v in m.items() if k not in _KEEP and v is not None}
    if rest:  # name, tool_calls, tool_call_id...: the template renders them too
        head += b"\0" + _canon(rest)
    return head


def _prompt(p: Any) -> bytes:
    if isinstance(p, str):
        return _text(p)
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
            return _prompt(first)
    return b"" if p is None else _canon(p)


def request_head(body: Mapping[str, Any], kind: str) -> bytes:
    """The bytes an engine caches first for this request, deterministically: for chat, each
    message as ``role NUL content`` in order (separated by 0x1E), the tools' canonical JSON after
    the leading system/developer messages (where chat templates render them); for completions
    the prompt (a string as UTF-8, token ids packed 4 bytes each, a batch by its first prompt);
    for embeddings the input, likewise. Anything else: b""."""
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return b""
        parts = [_message(m) for m in msgs]
        tools = body.get("tools")
        if tools:
            k = 0
            while k < len(msgs) and isinstance(msgs[k], dict) \
                    and msgs[k].get("role") in ("system", "developer"):
                k += 1
            parts.insert(k, b"tools\0" + _canon(tools))
        return _MSG_SEP.join(parts)
    if kind == "completions":
        return _prompt(body.get("prompt"))
    if kind == "embeddings":
        return _prompt(body.get("input"))
    return b""
