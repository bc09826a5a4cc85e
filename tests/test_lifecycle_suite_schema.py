"""The suites' JSON Schema (served at GET /api/v1/suite-schema.json): the shipped examples
validate against it with the project's own validator, and a bad key is caught by it too."""

from __future__ import annotations

import tomllib
from pathlib import Path

from llmgw.lifecycle.json_schema import validate
from llmgw.lifecycle.suite_json import suite_json_schema
from llmgw.lifecycle.suites import CHECK_KEYS, parse_suite

EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "suites").glob("*.toml"))


def test_the_suites_schema_names_every_check() -> None:
    schema = suite_json_schema()
    case = schema["properties"]["cases"]["items"]
    assert set(case["properties"]["checks"]["properties"]) == set(CHECK_KEYS)


def test_the_shipped_examples_parse_and_validate_against_the_schema() -> None:
    assert EXAMPLES
    for path in EXAMPLES:
        text = path.read_text()
        parse_suite(text, path.name)
        assert validate(tomllib.loads(text), suite_json_schema()) is None, path.name


def test_the_schema_refuses_what_the_parser_refuses() -> None:
    doc = tomllib.loads(EXAMPLES[0].read_text())
    doc["cases"][0]["checks"]["contanis"] = ["x"]
    assert validate(doc, suite_json_schema()) is not None
    doc = {"cases": []}
    assert validate(doc, suite_json_schema()) is not None
