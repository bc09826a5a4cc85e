"""The request path is one-way: the trio shell asks the router's core once per request (plan)
and twice per attempt (next, finish), and the core's answers carry everything the shell then
does. Counted by walking one request with a profiler (bench/walk_request.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "walk_request", Path(__file__).resolve().parent.parent / "bench" / "walk_request.py")
assert _spec is not None and _spec.loader is not None
walk_request = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(walk_request)


def test_one_attempt_crosses_into_the_core_three_times() -> None:
    n, landed, body = walk_request.walk(1)
    assert landed == ["dispatch.RouterCore.plan", "dispatch.RouterCore.next", "dispatch.RouterCore.finish"]
    assert n == 3 and body.endswith(b"data: [DONE]\n\n")


def test_a_retry_costs_two_more_crossings() -> None:
    n, landed, body = walk_request.walk(2)
    assert landed == ["dispatch.RouterCore.plan", "dispatch.RouterCore.next", "dispatch.RouterCore.finish",
                      "dispatch.RouterCore.next", "dispatch.RouterCore.finish"]
    assert body.endswith(b"data: [DONE]\n\n")
