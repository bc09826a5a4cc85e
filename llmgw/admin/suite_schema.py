"""The eval suites' JSON Schema, which the admin API serves beside its OpenAPI document
(``GET /api/v1/suite-schema.json``). The suites' own module defines it:
``llmgw.lifecycle.suites.suite_json_schema() -> dict``; this looks it up by name, so that the
admin API does not depend on the lifecycle code being there (None when it is not)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SUITES_MODULE", "suite_json_schema"]

SUITES_MODULE = "llmgw.lifecycle.suites"


def suite_json_schema() -> dict[str, Any] | None:
    try:
        mod = importlib.import_module(SUITES_MODULE)
    except ImportError:
        return None
    fn = getattr(mod, "suite_json_schema", None)
    schema = fn() if callable(fn) else None
    return schema if isinstance(schema, dict) else None
