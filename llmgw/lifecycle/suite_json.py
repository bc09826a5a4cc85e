"""The eval suites' file format as a JSON Schema document (draft 2020-12), which the admin API
serves beside its OpenAPI document (``GET /api/v1/suite-schema.json``) for editors and CI linters.

Built from the same constants the parser checks (llmgw.lifecycle.suites), and written in the
JSON Schema subset llmgw.lifecycle.json_schema validates, so the shipped examples are checked
against it by the project's own validator. The parser stays the authority: it also checks what a
schema cannot say (a case has a prompt or messages, not both; a case name is unique).
Pure."""

from __future__ import annotations

from typing import Any

from llmgw.lifecycle import suites as s

__all__ = ["suite_json_schema"]


def suite_json_schema() -> dict[str, Any]:
    text = {"type": "string", "maxLength": s.MAX_TEXT}
    strings = {"type": "array", "items": text, "maxItems": 64}
    ms = {"type": "number", "minimum": 0}
    param_types = {int: {"type": "integer"}, float: {"type": "number"}, list: strings}
    checks = {
        "contains": {**strings, "description": "every string must occur in the answer"},
        "not_contains": {**strings, "description": "no string may occur in the answer"},
        "regex": {"type": "string", "maxLength": s.MAX_PATTERN, "description": "a Python regex the answer must match (search)"},
        "equals": {**text, "description": "the whole answer, stripped"},
        "json": {"type": "boolean", "description": "the answer parses as JSON"},
        "json_schema": {"type": "object", "description": "the answer parses as JSON and validates (a subset: type, "
                        "properties, required, additionalProperties, items, enum, const, min/maxLength, "
                        "minimum/maximum, min/maxItems)"},
        "max_tokens": {"type": "integer", "minimum": 1, "description": "completion tokens at most"},
        "max_ttft_ms": {**ms, "description": "time to the first token at most"},
        "max_latency_ms": {**ms, "description": "time to the last byte at most"},
    }
    assert set(checks) == set(s.CHECK_KEYS), "suite_json_schema out of step with CHECK_KEYS"
    message = {"type": "object", "additionalProperties": False, "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": list(s.ROLES)}, "content": text}}
    case = {
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 200},
            "prompt": {**text, "description": "one user message (or give messages)"},
            "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": s.MAX_MESSAGES},
            "params": {"type": "object", "additionalProperties": False,
                       "properties": {k: param_types[t] for k, t in s.PARAM_KEYS.items()},
                       "description": "sampling parameters sent with the case's request"},
            "checks": {"type": "object", "additionalProperties": False, "properties": checks},
        },
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "llmgw:eval-suite",
        "title": "llmgw eval suite",
        "description": "A TOML file of cases run by `llmgw ctl eval` (docs/lifecycle.md).",
        "type": "object", "additionalProperties": False, "required": ["cases"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 64},
            "description": text,
            "pass_threshold": {"type": "number", "minimum": 0, "maximum": 1},
            "concurrency": {"type": "integer", "minimum": 1, "maximum": s.MAX_CONCURRENCY},
            "timeout_s": {"type": "number", "minimum": 0.1, "maximum": s.MAX_TIMEOUT_S},
            "cases": {"type": "array", "items": case, "minItems": 1, "maxItems": s.MAX_CASES},
        },
    }
