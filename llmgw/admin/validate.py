"""JSON → typed values for the admin API, collecting every problem with the field it is in
(``labels.rack: expected a string``), so that a 400 can name them all at once.

Types understood: dataclasses (closed: unknown fields are problems), ``str``, ``int`` (not bool),
``float`` (ints accepted), ``bool``, ``None``, ``X | None``, ``list[X]``, ``dict[str, X]``,
``Literal[...]``, ``Any`` and ``Annotated[dict[str, Any], Shape(...)]`` (checked as an object only:
its owner validates the rest). A dataclass may define ``problems() -> list[Problem]`` for checks
beyond types; it runs once the types are right. Query parameters are strings; ``query_value``
converts one."""

from __future__ import annotations

import math
import re
from dataclasses import is_dataclass
from typing import Any, Literal, get_args, get_origin

from llmgw.admin.schema import Problem
from llmgw.admin.typeinfo import annotated_shape, spec_fields, unwrap_optional
from llmgw.inputs.echo import echo

__all__ = ["Invalid", "from_json", "query_value"]

_INT = re.compile(r"[+-]?\d{1,18}")


class Invalid(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(map(str, problems)))


def from_json(tp: Any, data: Any, *, where: str = "") -> Any:
    """``data`` (parsed JSON) as a value of ``tp``; Invalid lists every problem found."""
    problems: list[Problem] = []
    out = _convert(tp, data, where, problems)
    if problems:
        raise Invalid(problems)
    return out


def query_value(name: str, tp: type, raw: str, constraints: dict[str, Any]) -> Any:
    """A query parameter's string as ``tp`` (str, int, float or bool); Invalid names the parameter."""
    value: Any
    if tp is int:
        if not _INT.fullmatch(raw):
            raise Invalid([Problem(name, f"expected an integer, got {echo(raw)}")])
        value = int(raw)
    elif tp is float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise Invalid([Problem(name, f"expected a number, got {echo(raw)}")])
    elif tp is bool:
        if raw not in ("true", "false"):
            raise Invalid([Problem(name, f"expected true or false, got {echo(raw)}")])
        value = raw == "true"
    else:
        value = raw
    problems: list[Problem] = []
    _check(value, name, constraints, problems)
    if problems:
        raise Invalid(problems)
    return value


_BAD = object()
_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", type(None): "null",
          list: "an array", dict: "an object"}


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return _NAMES.get(type(v), type(v).__name__)


def _at(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    key = echo(key, quote="")  # a client's field name: bounded
    return f"{where}.{key}" if where else key


def _convert(tp: Any, v: Any, where: str, problems: list[Problem]) -> Any:
    tp, nullable = unwrap_optional(tp)
    if v is None:
        if nullable or tp is Any or tp is type(None):
            return None
        problems.append(Problem(where, f"expected {_describe(tp)}, got null"))
        return _BAD
    if annotated_shape(tp) is not None:
        if not isinstance(v, dict):
            problems.append(Problem(where, f"expected an object, got {_type_name(v)}"))
            return _BAD
        return v
    if tp is Any:
        return v
    if is_dataclass(tp):
        return _dataclass(tp, v, where, problems)
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if v not in choices or isinstance(v, bool) != any(isinstance(c, bool) for c in choices):
            got = echo(v) if isinstance(v, str) else repr(v)
            problems.append(Problem(where, f"expected one of {', '.join(map(repr, choices))}, got {got}"))
            return _BAD
        return v
    if origin is list:
        if not isinstance(v, list):
            problems.append(Problem(where, f"expected an array, got {_type_name(v)}"))
            return _BAD
        (elem,) = get_args(tp)
        items = [_convert(elem, x, _at(where, i), problems) for i, x in enumerate(v)]
        return _BAD if any(x is _BAD for x in items) else items
    if origin is dict:
        if not isinstance(v, dict):
            problems.append(Problem(where, f"expected an object, got {_type_name(v)}"))
            return _BAD
        elem = get_args(tp)[1]
        conv = {k: _convert(elem, x, _at(where, k), problems) for k, x in v.items()}
        return _BAD if any(x is _BAD for x in conv.values()) else conv
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if tp in (str, int, float, bool):
        if not isinstance(v, tp) or (isinstance(v, bool) and tp is not bool):
            problems.append(Problem(where, f"expected {_NAMES[tp]}, got {_type_name(v)}"))
            return _BAD
        return v
    raise TypeError(f"the admin validator does not know type {tp!r}")  # a programming error


def _describe(tp: Any) -> str:
    if is_dataclass(tp) or annotated_shape(tp) is not None or get_origin(tp) is dict:
        return "an object"
    if get_origin(tp) is list:
        return "an array"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(map(repr, get_args(tp)))
    return _NAMES.get(tp, "a value")


def _dataclass(cls: type, v: Any, where: str, problems: list[Problem]) -> Any:
    if not isinstance(v, dict):
        problems.append(Problem(where, f"expected an object, got {_type_name(v)}"))
        return _BAD
    specs = spec_fields(cls)
    known = {f.name for f in specs}
    before = len(problems)
    for key in v:
        if key not in known:
            problems.append(Problem(_at(where, key), "unknown field"))
    values: dict[str, Any] = {}
    for f in specs:
        at = _at(where, f.name)
        if f.name not in v:
            if f.required:
                problems.append(Problem(at, "required"))
            continue
        x = _convert(f.type, v[f.name], at, problems)
        if x is not _BAD:
            _check(x, at, f.constraints, problems)
            values[f.name] = x
    if len(problems) > before:
        return _BAD
    out = cls(**values)
    extra = getattr(out, "problems", None)
    if callable(extra):
        found = extra()
        for p in found:
            p.field = f"{where}.{p.field}" if where and p.field else p.field or where
        problems.extend(found)
        if found:
            return _BAD
    return out


def _check(v: Any, where: str, c: dict[str, Any], problems: list[Problem]) -> None:
    if not c or v is None:  # a nullable field given null: its constraints are on a value
        return
    if (lo := c.get("minimum")) is not None and v < lo:
        problems.append(Problem(where, f"must be >= {lo}, got {v}"))
    if (hi := c.get("maximum")) is not None and v > hi:
        problems.append(Problem(where, f"must be <= {hi}, got {v}"))
    if (n := c.get("minLength", c.get("minItems"))) is not None and len(v) < n:
        problems.append(Problem(where, f"must have at least {n} {'characters' if isinstance(v, str) else 'items'}"))
    if (n := c.get("maxLength", c.get("maxItems"))) is not None and len(v) > n:
        problems.append(Problem(where, f"must have at most {n} {'characters' if isinstance(v, str) else 'items'}"))
