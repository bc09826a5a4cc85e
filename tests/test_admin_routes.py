"""The admin API's pure core: the route table is the whole API, the committed OpenAPI document is
generated from it, and invalid input names its field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from llmgw.admin.openapi import document, render
from llmgw.admin.routes import PREFIX, ROUTES, Resolver
from llmgw.admin.schema import LabelKeysBody, LabelsBody, ScaleBody, UpdateEvent
from llmgw.admin.validate import Invalid, from_json, query_value
from llmgw.daemon.control.admin.server import AdminApp

COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "admin-api.openapi.json"
REGENERATE = "python -m llmgw.admin.openapi > docs/admin-api.openapi.json"


def test_every_registered_handler_is_in_the_table_and_back() -> None:
    table = {r.name for r in ROUTES}
    registered = AdminApp.handler_names()
    assert registered - table == set(), f"handlers registered but not in the route table: {registered - table}"
    assert table - registered == set(), f"routes in the table without a handler: {table - registered}"
    assert len(table) == len(ROUTES), "two routes share a name"


def test_every_route_is_under_the_prefix_and_resolves_to_itself() -> None:
    resolver = Resolver()
    for r in ROUTES:
        assert r.path.startswith(PREFIX + "/")
        path = re.sub(r"\{[a-z_]+\}", "x", r.path)
        res = resolver.resolve(r.method, path)
        assert res.route is r, (r.method, r.path)
        assert set(res.params) == set(r.path_params)


def test_the_committed_document_is_fresh() -> None:
    assert COMMITTED.exists(), f"docs/admin-api.openapi.json is missing: run `{REGENERATE}`"
    committed = json.loads(COMMITTED.read_text())
    assert committed == document(), f"docs/admin-api.openapi.json is stale: run `{REGENERATE}`"
    assert COMMITTED.read_text() == render(), f"formatting differs: run `{REGENERATE}`"


def test_the_document_lists_every_route_with_its_parameters_and_types() -> None:
    doc = document()
    assert doc["openapi"].startswith("3.1")
    ops = {(m.upper(), p): op for p, item in doc["paths"].items() for m, op in item.items()}
    assert set(ops) == {(r.method, r.path) for r in ROUTES}
    schemas = doc["components"]["schemas"]
    for r in ROUTES:
        op = ops[(r.method, r.path)]
        assert op["operationId"] == r.name
        params = {(p["in"], p["name"]) for p in op.get("parameters", [])}
        assert params == {("path", p) for p in r.path_params} | {("query", q.name) for q in r.query}
        assert set(op["responses"]) == {str(s) for s in r.statuses}
        assert ("requestBody" in op) == (r.body is not None)
        assert "401" in op["responses"]
    # bodies are closed (an unknown field is a 400); answers may grow
    assert schemas["LabelsBody"]["additionalProperties"] is False
    assert schemas["ModelDefinition"]["additionalProperties"] is False
    assert schemas["ModelDefinition"]["required"] == ["name", "engine"]
    assert "additionalProperties" not in schemas["NodeView"]
    assert schemas["ScaleBody"]["properties"]["replicas"]["minimum"] == 0
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    limit = next(p for p in ops[("GET", f"{PREFIX}/decisions")]["parameters"] if p["name"] == "limit")
    assert limit["schema"] == {"type": "integer", "minimum": 1, "maximum": 10000, "default": 100}


def test_greedy_names_and_method_answers() -> None:
    r = Resolver()
    assert r.resolve("GET", f"{PREFIX}/models/org/llama-3").params == {"name": "org/llama-3"}
    assert r.resolve("GET", f"{PREFIX}/models/org%2Fllama-3").params == {"name": "org/llama-3"}
    scale = r.resolve("POST", f"{PREFIX}/models/org/llama-3/scale")
    assert scale.route is not None and scale.route.name == "scale_model" and scale.params == {"name": "org/llama-3"}
    assert r.resolve("GET", f"{PREFIX}/models/org/llama-3/scale").allow == ("POST",)
    assert r.resolve("POST", f"{PREFIX}/replicas/sim/3fa1c2/restart").params == {"id": "sim/3fa1c2"}
    assert r.resolve("POST", f"{PREFIX}/replicas/sim%2F3fa1c2/restart").params == {"id": "sim/3fa1c2"}
    assert r.resolve("DELETE", f"{PREFIX}/models").allow == ("GET", "POST")
    assert r.resolve("GET", f"{PREFIX}/nodes/a/b").route is None  # node names hold no "/"
    assert r.resolve("GET", f"{PREFIX}/nodes/a/b").allow == ()
    assert r.resolve("GET", "/api/v1").route is None


def _problems(tp: Any, data: Any) -> dict[str, str]:
    with pytest.raises(Invalid) as e:
        from_json(tp, data)
    return {p.field: p.message for p in e.value.problems}


def test_validation_names_every_bad_field() -> None:
    assert from_json(LabelsBody, {"labels": {"llmgw.io/rack": "r1"}}) == LabelsBody({"llmgw.io/rack": "r1"})
    assert _problems(LabelsBody, {"labels": {"rack": 1, "row": None}}) == {
        "labels.rack": "expected a string, got an integer", "labels.row": "expected a string, got null"}
    assert _problems(LabelsBody, {"labels": {"bad key": "x"}}) == {"labels.bad key": "not a valid label key: 'bad key'"}
    assert _problems(LabelsBody, {}) == {"labels": "required"}
    assert _problems(LabelsBody, {"labels": {}, "x": 1}) == {"x": "unknown field"}
    assert _problems(LabelKeysBody, {"keys": ["a", 2]}) == {"keys[1]": "expected a string, got an integer"}
    assert _problems(LabelKeysBody, {"keys": "a"}) == {"keys": "expected an array, got a string"}
    assert _problems(ScaleBody, {"replicas": -1}) == {"replicas": "must be >= 0, got -1"}
    assert _problems(ScaleBody, {"replicas": 1.5}) == {"replicas": "expected an integer, got a number"}
    assert _problems(ScaleBody, {"replicas": False}) == {"replicas": "expected an integer, got a boolean"}
    assert _problems(ScaleBody, []) == {"": "expected an object, got an array"}
    assert from_json(UpdateEvent, {"type": "update", "rev": 2}).nodes is None
    assert _problems(UpdateEvent, {"type": "snapshot", "rev": 2}) == {"type": "expected one of 'update', got 'snapshot'"}


def test_query_values() -> None:
    assert query_value("limit", int, "12", {"minimum": 1}) == 12
    assert query_value("w", float, "2.5", {}) == 2.5
    for tp, raw in ((int, "1.5"), (int, "x"), (int, "9" * 40), (float, "inf"), (float, "nan"), (float, "")):
        with pytest.raises(Invalid) as e:
            query_value("p", tp, raw, {})
        assert e.value.problems[0].field == "p"
    with pytest.raises(Invalid, match="must be <= 5"):
        query_value("limit", int, "6", {"maximum": 5})
