"""The routing names, in one place: the scorers a strategy may weight, the pickers that turn
weighted totals into a choice, and the strategy presets.

Plain tuples, no imports, for everything that validates or lists these names: the config (a
``[[strategies]]`` picker, its ``weights`` table, a model's ``strategy``), the presets in
:mod:`.strategies`, the router's error messages, the docs. The implementations are keyed by
the same names — :data:`.scorers.SCORERS` (plus ``prefix``, which :mod:`.prefix_scorer` adds
when cache-aware routing is on), :data:`.pickers.PICKERS`, :data:`.strategies.PRESETS` — and
``tests/test_route_names.py`` checks that all of them, and docs/router.md, agree.

A new scorer, picker or preset: add its name here, then its implementation.
"""

from __future__ import annotations

__all__ = ["CANDIDATE_SUFFIX", "SCORER_NAMES", "PICKER_NAMES", "PRESET_NAMES", "DEFAULT_PICKER", "candidate_key",
           "is_candidate_key"]

SCORER_NAMES = ("load", "queue", "kv", "inflight", "weight", "session", "prefix", "kv_cache")
PICKER_NAMES = ("max-score", "power-of-two", "softmax", "round-robin")
PRESET_NAMES = ("chat", "batch", "long-context", "load-balance", "prefill", "decode")

DEFAULT_PICKER = "max-score"  # a strategy that names no picker


# A model's candidate revision is routed under its own key (llmgw.lifecycle.revisions): no client
# request resolves to it (ReplicaTable.resolve), only the eval runner's and the canary share.
CANDIDATE_SUFFIX = "#candidate"


def candidate_key(model: str) -> str:
    return model + CANDIDATE_SUFFIX


def is_candidate_key(name: str) -> bool:
    return name.endswith(CANDIDATE_SUFFIX)
