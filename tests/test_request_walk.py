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


def test_tier_2s_step_is_asked_by_next_and_answered_with_tokenized() -> None:
    """A kv_events model: next asks for the engine's release, then the prompt's tokens (the
    shell makes each HTTP call, the core hashes); the same request again has its hashes cached
    and walks plan, next, finish. What else it crosses is tier 2's parity check (kv/parity.py)."""
    n, landed, body = walk_request.walk(1, tier2=True)
    steps = [x for x in landed if x.startswith("dispatch.")]
    assert steps == ["dispatch.RouterCore.plan", "dispatch.RouterCore.next", "dispatch.RouterCore.tokenized",
                     "dispatch.RouterCore.next", "dispatch.RouterCore.tokenized", "dispatch.RouterCore.next",
                     "dispatch.RouterCore.finish"]
    assert all(x.startswith(("dispatch.", "parity.")) for x in landed) and body.endswith(b"data: [DONE]\n\n")
    n, landed, _ = walk_request.walk(1, tier2=True, repeat=True)
    assert [x for x in landed if x.startswith("dispatch.")] == \
        ["dispatch.RouterCore.plan", "dispatch.RouterCore.next", "dispatch.RouterCore.finish"]
