"""Bounded nesting of untrusted structured input: admin JSON bodies, config files, eval suites,
`ctl --set` values and profile files. Pure.

Python's parsers recurse once per level: ``tomllib`` fails with a RecursionError near 400 levels
of arrays or inline tables, ``json`` near 1,000, and below that every recursive walker of ours
(validation, ``json.dumps`` into the store) would be next. So the text is scanned first — strings
and comments skipped, brackets counted, no recursion — and refused past :data:`MAX_DEPTH` levels
before a parser sees it; what a parser builds without recursing (TOML's dotted keys and table
headers: ``a.b.c… = 1``) is measured after, iteratively. Either way the error names the field
and the limit (:class:`TooDeep`, a ValueError), never a traceback.

A level is one table/object or array, the document itself counting as the first: ``{"a": [1]}``
is 2 deep. 64 is far beyond any real config, suite or admin body (a suite's JSON Schema, itself
bounded to 16 schema levels, nests about 35)."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

__all__ = ["MAX_DEPTH", "TooDeep", "deepest", "json_loads", "render_path", "toml_loads", "toml_prescan"]

MAX_DEPTH = 64
_MAX_SHOWN = 80  # characters of a field's path shown before it is cut with "…"

Path = tuple[str | int, ...]


class TooDeep(ValueError):
    """Nested deeper than ``limit`` levels at ``where`` (a rendered field path; "" is the whole
    input) — on ``line`` of a TOML text when known."""

    def __init__(self, where: str, limit: int, line: int | None = None, path: Path | None = None) -> None:
        self.where, self.limit, self.line, self.path = where, limit, line, path
        self.message = f"nested deeper than {limit} levels"
        super().__init__(f"{where}: {self.message}" if where else self.message)


def render_path(path: Path) -> str:
    """``("cases", 0, "params", "stop", 0, 0)`` → ``cases[0].params.stop``: the field, without the
    array indices that only go deeper into the same value; long paths cut with "…"."""
    end = len(path)
    while end and isinstance(path[end - 1], int):
        end -= 1
    out = ""
    for p in path[:end]:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
        if len(out) > _MAX_SHOWN:
            return out[:_MAX_SHOWN] + "…"
    return out


def deepest(obj: Any, limit: int = MAX_DEPTH) -> Path | None:
    """The path of the first table/array nested more than ``limit`` levels in ``obj`` (``obj``
    itself is level 1), or None. Iterative: no recursion whatever the depth."""
    if not isinstance(obj, (dict, list)):
        return None
    stack: list[tuple[Any, Path]] = [(obj, ())]
    while stack:
        o, path = stack.pop()
        if len(path) >= limit:
            return path
        items = o.items() if isinstance(o, dict) else enumerate(o)
        stack.extend((v, (*path, k)) for k, v in items if isinstance(v, (dict, list)))
    return None


def _check(obj: Any, limit: int) -> Any:
    if (path := deepest(obj, limit)) is not None:
        raise TooDeep(render_path(path), limit, path=path)
    return obj


# -- JSON -------------------------------------------------------------------------------------------
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:,]', re.S)


def json_loads(raw: bytes | str, limit: int = MAX_DEPTH) -> Any:
    """``json.loads``, refusing more than ``limit`` levels with :class:`TooDeep` naming the field
    (other faults: ``json``'s own ValueError)."""
    data = raw.encode() if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") > limit:  # else it cannot be too deep: no scan
        _json_prescan(data, limit)
    return _check(json.loads(raw), limit)


def _json_prescan(data: bytes, limit: int) -> None:
    # one entry per open container: [key or index, expecting a key (objects only)]
    stack: list[list[Any]] = []
    for m in _JSON_TOKEN.finditer(data):
        tok = m.group()
        if tok in (b"{", b"["):
            if len(stack) >= limit:
                raise TooDeep(render_path(tuple(e[0] for e in stack if e[0] is not None)), limit)
            stack.append([None, True] if tok == b"{" else [0, False])
        elif tok in (b"}", b"]"):
            if stack:
                stack.pop()
        elif not stack:
            continue
        elif tok == b",":
            top = stack[-1]
            if isinstance(top[0], int):
                top[0] += 1
            else:
                top[1] = True
        elif tok == b":":
            stack[-1][1] = False
        elif stack[-1][1]:  # a string where an object expects its key
            try:
                stack[-1][0] = json.loads(tok)
            except ValueError:
                stack[-1][0] = tok.decode(errors="replace")[1:-1]


# -- TOML -------------------------------------------------------------------------------------------
_TOML_TOKEN = re.compile(r'"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'|#[^\n]*|[\[\]{}\n=]',
                         re.S)


def toml_prescan(text: str, limit: int = MAX_DEPTH) -> None:
    """Refuse arrays and inline tables nested more than ``limit`` levels, before ``tomllib`` (which
    recurses on them) sees the text. :class:`TooDeep` names the key the value is under (with its
    table, best effort) and the line. Counting brackets only can never exceed the true depth, so
    nothing within the limit is refused here."""
    if text.count("[") + text.count("{") <= limit:
        return
    depth, line, line_start, table, key = 0, 1, 0, "", ""
    aot: dict[str, int] = {}  # array-of-tables headers seen, by name: their index
    header_until = -1  # inside a [table] / [[array]] header up to this offset
    for m in _TOML_TOKEN.finditer(text):
        tok, at = m.group(), m.start()
        if at < header_until:
            continue
        if tok.startswith(('"', "'")):
            line += tok.count("\n")
            continue
        if tok == "\n":
            line, line_start = line + 1, at + 1
        elif tok == "=" and depth == 0:
            key = text[line_start:at].strip()
        elif tok in "[{":
            if depth == 0 and tok == "[" and not text[line_start:at].strip():  # a table header
                table, header_until = _header(text, at, aot)
                continue
            if depth >= limit:
                raise TooDeep(".".join(p for p in (table, key) if p), limit, line)
            depth += 1
        elif tok in "]}":
            depth = max(0, depth - 1)


def _header(text: str, at: int, aot: dict[str, int]) -> tuple[str, int]:
    """The table a ``[a.b]`` / ``[[a]]`` header at ``at`` opens (arrays of tables with their index),
    and where the header ends."""
    array = text.startswith("[[", at)
    end = text.find("\n", at)
    end = len(text) if end < 0 else end
    body = text[at:end].split("#", 1)[0].strip().strip("[]").strip()
    parts = [p.strip() for p in body.split(".")]
    name = ".".join(parts)
    if array:
        aot[name] = aot.get(name, -1) + 1
    shown = []
    for n in range(1, len(parts) + 1):
        prefix = ".".join(parts[:n])
        shown.append(f"{parts[n - 1]}[{aot[prefix]}]" if prefix in aot else parts[n - 1])
    return ".".join(shown), end


def toml_loads(text: str, limit: int = MAX_DEPTH) -> dict[str, Any]:
    """``tomllib.loads``, refusing more than ``limit`` levels with :class:`TooDeep` (other faults:
    ``tomllib.TOMLDecodeError``)."""
    toml_prescan(text, limit)
    return _check(tomllib.loads(text), limit)
