"""The JSON Schema subset eval checks use: `type` (object, array, string, number, integer,
boolean, null, or a list of them), `properties`, `required`, `additionalProperties` (false or a
schema), `items`, `enum`, `const`, `minLength`/`maxLength`, `minimum`/`maximum`,
`minItems`/`maxItems`. Anything else in a schema is refused when the suite is parsed (so a
check never silently passes on a keyword it ignores). Nesting is bounded. Pure."""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_DEPTH", "SUPPORTED", "schema_problems", "validate"]

MAX_DEPTH = 16
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
SUPPORTED = {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "minLength",
             "maxLength", "minimum", "maximum", "minItems", "maxItems", "description", "title"}


def schema_problems(s: Any, at: tuple[str | int, ...] = (), depth: int = 0) -> list[tuple[tuple[str | int, ...],
                                                                                           str]]:
    """What is wrong with a schema, as (key path within it, message)."""
    if depth > MAX_DEPTH:
        return [(at, f"nested deeper than {MAX_DEPTH}")]
    if not isinstance(s, dict):
        return [(at, "a schema must be a table")]
    out: list[tuple[tuple[str | int, ...], str]] = []
    for k, v in s.items():
        here = at + (k,)
        if k not in SUPPORTED:
            out.append((here, f"unsupported keyword (supported: {', '.join(sorted(SUPPORTED))})"))
        elif k == "type":
            names = v if isinstance(v, list) else [v]
            if not names or not all(isinstance(n, str) and n in _TYPES for n in names):
                out.append((here, f"must be one of {', '.join(sorted(_TYPES))} or a list of them"))
        elif k == "properties":
            if not isinstance(v, dict):
                out.append((here, "must be a table of schemas"))
            else:
                for name, sub in v.items():
                    out += schema_problems(sub, here + (name,), depth + 1)
        elif k == "required":
            if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
                out.append((here, "must be a list of property names"))
        elif k == "additionalProperties":
            if not isinstance(v, bool):
                out += schema_problems(v, here, depth + 1)
        elif k == "items":
            out += schema_problems(v, here, depth + 1)
        elif k == "enum":
            if not isinstance(v, list) or not v:
                out.append((here, "must be a non-empty list"))
        elif k in ("minLength", "maxLength", "minItems", "maxItems"):
            if type(v) is not int or v < 0:
                out.append((here, "must be a whole number from 0"))
        elif k in ("minimum", "maximum"):
            if type(v) not in (int, float):
                out.append((here, "must be a number"))
        elif k in ("description", "title") and not isinstance(v, str):
            out.append((here, "must be a string"))
    return out


def _type_ok(value: Any, t: str) -> bool:
    if t == "object":
        return isinstance(value, dict)
    if t == "array":
        return isinstance(value, list)
    if t == "string":
        return isinstance(value, str)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "null":
        return value is None
    if t == "integer":
        return type(value) is int or (type(value) is float and value.is_integer())
    return type(value) in (int, float)  # number


def validate(value: Any, s: dict[str, Any], at: str = "$") -> str | None:
    """The first way `value` fails schema `s` (one checked by schema_problems), or None."""
    if "type" in s:
        names = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_type_ok(value, t) for t in names):
            return f"{at}: expected {' or '.join(names)}, got {_kind(value)}"
    if "const" in s and value != s["const"]:
        return f"{at}: must equal {s['const']!r}"
    if "enum" in s and value not in s["enum"]:
        return f"{at}: not one of the enum values"
    if isinstance(value, str) and not s.get("minLength", 0) <= len(value) <= s.get("maxLength", len(value)):
        return f"{at}: length {len(value)} out of bounds"
    if type(value) in (int, float):
        if "minimum" in s and value < s["minimum"]:
            return f"{at}: below the minimum {s['minimum']}"
        if "maximum" in s and value > s["maximum"]:
            return f"{at}: above the maximum {s['maximum']}"
    if isinstance(value, list):
        if len(value) < s.get("minItems", 0) or len(value) > s.get("maxItems", len(value)):
            return f"{at}: {len(value)} items out of bounds"
        if isinstance(s.get("items"), dict):
            for i, item in enumerate(value):
                if (why := validate(item, s["items"], f"{at}[{i}]")) is not None:
                    return why
    if isinstance(value, dict):
        for name in s.get("required", []):
            if name not in value:
                return f"{at}: missing required property {name!r}"
        props = s.get("properties", {})
        extra = s.get("additionalProperties", True)
        for name, v in value.items():
            if name in props:
                if (why := validate(v, props[name], f"{at}.{name}")) is not None:
                    return why
            elif extra is False:
                return f"{at}: unexpected property {name!r}"
            elif isinstance(extra, dict) and (why := validate(v, extra, f"{at}.{name}")) is not None:
                return why
    return None


def _kind(v: Any) -> str:
    for t in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _type_ok(v, t) and not (t == "integer" and isinstance(v, bool)):
            return t
    return type(v).__name__
