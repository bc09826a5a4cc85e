"""The admin API's OpenAPI 3.1 document, generated from the route table and the types' fields.

Regenerate the committed copy after changing a route or a type:

    python -m llmgw.admin.openapi > docs/admin-api.openapi.json
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import MISSING, is_dataclass
from typing import Any, Literal, Union, get_args, get_origin

from llmgw.admin.routes import API_VERSION, ROUTES, Route
from llmgw.admin.schema import ErrorBody
from llmgw.admin.typeinfo import Shape, annotated_shape, spec_fields, unwrap_optional

__all__ = ["document", "main", "render"]

_JSON, _NDJSON = "application/json", "application/x-ndjson"
_REASONS = {200: "OK", 201: "Created", 202: "Accepted", 204: "No Content", 400: "Invalid input: the error "
            "names each bad field or parameter", 401: "Missing or wrong token (TCP listener only)",
            403: "Refused: the Unix socket's peer is another user", 404: "No such route or resource",
            409: "Conflicts with the current state (e.g. a model the config file owns)",
            503: "The router's store cannot write (or read), e.g. a full disk: nothing was changed; the "
                 "message names the reason, Retry-After says when to try again"}
_PRIMITIVES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_INFO = ("The llmgw daemon's admin API: nodes, models, replicas, routing decisions, cache hits and a live "
         "event stream. Served on a Unix socket (owner only, no token) and, when configured, on TCP with "
         "a bearer token. Undeclared methods answer 405 with an Allow header. See docs/admin-api.md.")


class _Components:
    def __init__(self, closed: set[type]) -> None:
        self.schemas: dict[str, Any] = {}
        self.closed = closed  # dataclasses a request body reaches: unknown fields are refused
        self._owner: dict[str, Any] = {}

    def ref(self, name: str, owner: Any, build: Any) -> dict[str, Any]:
        if self._owner.setdefault(name, owner) is not owner:
            raise ValueError(f"two types are named {name} in the admin API")
        if name not in self.schemas:
            self.schemas[name] = {}  # placeholder: a type may refer to itself
            self.schemas[name] = build()
        return {"$ref": f"#/components/schemas/{name}"}

    def schema(self, tp: Any, *, nulls: bool = True) -> dict[str, Any]:
        """``nulls=False`` under a Shape: config tables come from TOML, which has no null."""
        inner, nullable = unwrap_optional(tp)
        if nullable and not nulls:
            return self.schema(inner, nulls=False)
        if nullable:
            s = self.schema(inner)
            if set(s) == {"type"} and isinstance(s["type"], str):
                return {"type": [s["type"], "null"]}
            return {"anyOf": [s, {"type": "null"}]}
        if (shape := annotated_shape(tp)) is not None:
            return self.ref(shape.name, shape, lambda: self.shape(shape))
        if tp is Any:
            return {}
        if tp in _PRIMITIVES:
            return {"type": _PRIMITIVES[tp]}
        if is_dataclass(tp):
            cls: type = tp  # type: ignore[assignment]
            return self.ref(cls.__name__, cls, lambda: self.object(cls, closed=cls in self.closed, nulls=nulls))
        origin, args = get_origin(tp), get_args(tp)
        if origin is Literal:
            kinds = {_PRIMITIVES[type(a)] for a in args}
            out: dict[str, Any] = {"const": args[0]} if len(args) == 1 else {"enum": list(args)}
            return {"type": kinds.pop(), **out} if len(kinds) == 1 else out
        if origin in (list, tuple):
            return {"type": "array", "items": self.schema(args[0], nulls=nulls)}
        if origin is dict:
            return {"type": "object", "additionalProperties": self.schema(args[1], nulls=nulls)}
        if origin in (Union, types.UnionType):
            return {"oneOf": [self.schema(a, nulls=nulls) for a in args]}
        raise TypeError(f"no JSON Schema for {tp!r}")

    def shape(self, shape: Shape) -> dict[str, Any]:
        out = self.object(shape.of, closed=True, doc=shape.doc, nulls=shape.nulls)
        for name, extra in shape.refine.items():
            out["properties"][name].update(extra)
        if shape.example is not None:
            out["examples"] = [shape.example]
        return out

    def object(self, cls: type, *, closed: bool, doc: str = "", nulls: bool = True) -> dict[str, Any]:
        props: dict[str, Any] = {}
        required = []
        for f in spec_fields(cls):
            s = dict(self.schema(f.type, nulls=nulls))
            if f.doc:
                s["description"] = f.doc
            s.update(f.constraints)
            if f.default is not MISSING and (nulls or f.default is not None):
                s["default"] = f.default
            props[f.name] = s
            if f.required:
                required.append(f.name)
        out: dict[str, Any] = {"type": "object"}
        if doc := doc or _docstring(cls):
            out["description"] = doc
        out["properties"] = props
        if required:
            out["required"] = required
        if closed:
            out["additionalProperties"] = False
        return out


def _docstring(cls: type) -> str:
    d = cls.__doc__ or ""
    return "" if d.startswith(f"{cls.__name__}(") else " ".join(d.split())  # dataclass's made-up one


def _reachable(tp: Any, seen: set[type]) -> None:
    """Dataclasses a type refers to, transitively (a Shape's own type included)."""
    inner, _ = unwrap_optional(tp)
    if (shape := annotated_shape(inner)) is not None:
        inner = shape.of
    if is_dataclass(inner):
        if inner in seen:
            return
        seen.add(inner)  # type: ignore[arg-type]
        for f in spec_fields(inner):  # type: ignore[arg-type]
            _reachable(f.type, seen)
        return
    for a in get_args(inner):
        if a is not Ellipsis and not isinstance(a, (str, int, bool, Shape)):
            _reachable(a, seen)


def _operation(r: Route, c: _Components) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": r.name, "summary": r.summary}
    if r.tag:
        op["tags"] = [r.tag]
    if r.description:
        op["description"] = r.description
    params: list[dict[str, Any]] = []
    for p in r.path_params:
        param: dict[str, Any] = {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
        if p in r.greedy:
            param["description"] = "may contain '/': send it as %2F (or as is)"
        params.append(param)
    for q in r.query:
        s: dict[str, Any] = {"type": _PRIMITIVES[q.type], **q.constraints}
        if q.default is not None:
            s["default"] = q.default
        params.append({"name": q.name, "in": "query", "required": False, "description": q.doc, "schema": s})
    if params:
        op["parameters"] = params
    if r.body is not None:
        op["requestBody"] = {"required": not r.body_optional, "content": {_JSON: {"schema": c.schema(r.body)}}}
    responses: dict[str, Any] = {}
    for status in r.statuses:
        if status == r.status:
            ok: dict[str, Any] = {"description": _REASONS[status]}
            if r.response is not None:
                media = _NDJSON if r.stream else _JSON
                ok["content"] = {media: {"schema": c.schema(r.response)}}
                if r.stream:
                    ok["description"] = "One JSON object a line (each one of the schema's shapes)"
            if r.links:
                ok["links"] = {ln.operation: {"operationId": ln.operation,
                                              "parameters": {ln.param: f"$response.body#/{ln.field}"}}
                               for ln in r.links}
            responses[str(status)] = ok
        else:
            responses[str(status)] = {"description": _REASONS[status],
                                      "content": {_JSON: {"schema": c.schema(ErrorBody)}}}
    op["responses"] = responses
    return op


def document(routes: tuple[Route, ...] = ROUTES) -> dict[str, Any]:
    closed: set[type] = set()
    for r in routes:
        if r.body is not None:
            _reachable(r.body, closed)
    c = _Components(closed)
    paths: dict[str, Any] = {}
    for r in routes:
        paths.setdefault(r.path, {})[r.method.lower()] = _operation(r, c)
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmgw admin API", "version": API_VERSION, "description": _INFO},
        "security": [{"bearerAuth": []}],
        "paths": paths,
        "components": {
            "schemas": dict(sorted(c.schemas.items())),
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": "admin.token; required on the TCP listener. The Unix socket needs none: "
                               "only its owner can reach it."}},
        },
    }


def render(routes: tuple[Route, ...] = ROUTES) -> str:
    return json.dumps(document(routes), indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
