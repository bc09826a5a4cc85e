"""What the admin API reads off its dataclasses: each field's type, whether a body must carry it,
its documentation and its value constraints. Shared by the validator and the OpenAPI generator, so
that what is documented is exactly what is enforced."""

from __future__ import annotations

import types
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from functools import cache
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

__all__ = ["CONSTRAINTS", "FieldSpec", "Shape", "annotated_shape", "prop", "spec_fields", "unwrap_optional"]

# JSON Schema keywords the validator enforces too; nothing else may go into prop(**constraints).
CONSTRAINTS = frozenset({"minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems"})


@dataclass(frozen=True, slots=True)
class Shape:
    """``Annotated[dict[str, Any], Shape(SomeDataclass, "Name")]``: a free-form object on the
    wire, validated elsewhere, documented as SomeDataclass's fields under component ``Name``;
    ``refine`` adds JSON Schema keywords to top-level fields, ``example`` shows a whole one."""

    of: type
    name: str
    doc: str = ""
    refine: dict[str, dict[str, Any]] = field(default_factory=dict)
    example: dict[str, Any] | None = None
    nulls: bool = False  # its fields may be null (JSON bodies); False: a TOML table's, which has none


@dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    type: Any  # the resolved annotation (may be Annotated)
    required: bool  # no default: a body must carry it
    default: Any  # MISSING when there is none, or a factory builds it
    doc: str
    constraints: dict[str, Any]


def prop(doc: str = "", default: Any = MISSING, *, factory: Any = MISSING, **constraints: Any) -> Any:
    """A documented dataclass field, with JSON Schema constraints (see CONSTRAINTS)."""
    unknown = set(constraints) - CONSTRAINTS
    if unknown:
        raise TypeError(f"unsupported constraints: {sorted(unknown)}")
    return field(default=default, default_factory=factory, metadata={"doc": doc, "constraints": constraints})


@cache
def spec_fields(cls: type) -> tuple[FieldSpec, ...]:
    if not is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = get_type_hints(cls, include_extras=True)
    out = []
    for f in fields(cls):
        if not f.init:
            continue
        meta = f.metadata
        required = f.default is MISSING and f.default_factory is MISSING
        out.append(FieldSpec(f.name, hints[f.name], required, _plain_default(f), meta.get("doc", ""),
                             dict(meta.get("constraints", {}))))
    return tuple(out)


def _plain_default(f: Field[Any]) -> Any:
    d = f.default
    if d is MISSING or isinstance(d, (str, int, float, bool)) or d is None:
        return d
    if d == ():
        return []
    return MISSING


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` → (X, True); anything else → (tp, False). Unions of several types stay whole."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) < len(get_args(tp)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True  # noqa: UP007
    return tp, False


def annotated_shape(tp: Any) -> Shape | None:
    if get_origin(tp) is Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, Shape)), None)
    return None
