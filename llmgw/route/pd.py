"""Prefill/decode disaggregation in the router's core (docs/disaggregation.md): the rules and the
wire forms; :mod:`.dispatch` runs the steps.

A model with ``[models.pd]`` has replicas by role: ``prefill`` ones compute a prompt's KV and hold
it for a decoder to pull, ``decode`` ones generate, ``both`` do either. A request is **split** —
its prefill on a prefiller, then its whole request on a decoder with the prefiller's
``kv_transfer_params`` — when the prompt its decoder would compute is long enough
(``min_prompt_tokens``: a short prefill costs less than the extra round trip; a prompt mostly
cached on the decoder it goes to is short there), it asks for no LoRA adapter (a prefiller would
need the adapter too), and a prefiller can take it now. Otherwise it goes straight to a decode (or
``both``) replica, which prefills it itself; the reason is counted (``path``).

The wire forms are vLLM's own proxy's (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``,
recorded with their source and versions in docs/vllm-pd-wire.md):

* the prefill request is the client's body with ``kv_transfer_params`` asking for a remote decode,
  ``stream`` false, ``max_tokens`` (and ``max_completion_tokens`` when given) 1, and no
  ``stream_options``, ``min_tokens`` or ``min_completion_tokens``;
* the prefiller's answer carries ``kv_transfer_params`` (``do_remote_prefill`` true, the blocks to
  pull and where) — or null when its one token ended the request (EOS or a stop string): then
  there is nothing to pull and the decoder prefills;
* the decode request is the client's body as it came, plus that ``kv_transfer_params``.

A prefiller that cannot be reached is replaced by another (nothing was sent). Every other failure
of the prefill step — no prefiller free, no other to try, a timeout, a 5xx, an answer without
usable params — falls back to the decoder prefilling itself: the client never sees
a prefill failure, only the slower path, and the trace and ``llmgw_pd_fallbacks_total`` say why.
A decoder that cannot pull the blocks recomputes them (vLLM's ``kv_load_failure_policy`` =
recompute, its default). Pure."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from .counters import Hist
from .types import EndpointView

__all__ = ["PREFILL_PARAMS", "PdStats", "role_queues", "PD_BUCKETS", "decode_body", "prefill_body",
           "read_prefill_answer", "role_views"]

# What vLLM's proxy sends a prefiller: "decode elsewhere; nothing to pull here".
PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
MAX_ANSWER_BYTES = 1 << 20  # a prefill answer is one token and the params: a bigger one is not read
PD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def role_views(views: Iterable[EndpointView], phase: str) -> list[EndpointView]:
    """The candidates of one step: prefill → ``prefill`` replicas; decode → ``decode`` and ``both``."""
    if phase == "prefill":
        return [v for v in views if v.role == "prefill"]
    return [v for v in views if v.role != "prefill"]


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill request: vLLM's proxy's form of the client's parsed ``body``."""
    out = {k: v for k, v in body.items() if k not in _DROPPED}
    out["kv_transfer_params"] = PREFILL_PARAMS
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return _encode(out)


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The decode request: the client's body, with the prefiller's ``kv_transfer_params``."""
    out = dict(body)
    out["kv_transfer_params"] = params
    return _encode(out)


def read_prefill_answer(status: int | None, data: bytes) -> tuple[dict[str, Any] | None, str, int]:
    """``(params, why_not, blocks)``: the prefiller's ``kv_transfer_params`` for the decoder, or
    None and the fallback's reason (``engine_error``, ``bad_answer``, ``no_params``); ``blocks``:
    how many blocks the decoder is to pull (0 when unknown)."""
    if status != 200:
        return None, "engine_error", 0
    try:
        doc = _decode(data)
    except (msgspec.DecodeError, ValueError):
        return None, "bad_answer", 0
    params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        # null: its one token ended the request (EOS, a stop string), or no KV connector runs there
        return None, "no_params", 0
    ids = params.get("remote_block_ids")
    blocks = 0
    if isinstance(ids, list):  # vLLM ≥ 0.11 may nest one list per KV cache group
        blocks = sum(len(x) for x in ids) if ids and all(isinstance(x, list) for x in ids) else len(ids)
    return params, "", blocks


class PdStats:
    """What disaggregation counts, per model: requests by path, fallbacks by reason, the prefill
    step's time and the decoder's time to its first byte after a transfer."""

    PATHS = ("split", "short", "cached", "adapter", "batched", "not_generation", "no_prefiller")
    FALLBACKS = ("no_prefiller", "connect", "timeout", "engine_error", "bad_answer", "no_params",
                 "decode_retry")

    def __init__(self, wall: Callable[[], float]) -> None:
        self._wall = wall
        self.paths: dict[tuple[str, str], list[float]] = {}  # (model, path) -> [n, created]
        self.fallbacks: dict[tuple[str, str], list[float]] = {}  # (model, reason)
        self.prefill: dict[tuple[str, ...], Hist] = {}  # (model,): the prefill step, seconds
        self.transfer: dict[tuple[str, ...], Hist] = {}  # (model,): decode sent → its first byte, split ones
        self.blocks: dict[tuple[str], list[float]] = {}  # (model,): blocks handed to decoders

    def _bump(self, table: dict[Any, list[float]], key: tuple[str, ...], n: float = 1) -> None:
        c = table.get(key)
        if c is None:
            c = table[key] = [0, self._wall()]
        c[0] += n

    def path(self, model: str, path: str) -> None:
        self._bump(self.paths, (model, path))

    def fallback(self, model: str, reason: str) -> None:
        self._bump(self.fallbacks, (model, reason))

    def handed(self, model: str, blocks: int) -> None:
        self._bump(self.blocks, (model,), blocks)

    def observe(self, table: dict[tuple[str, ...], Hist], model: str, seconds: float) -> None:

        h = table.get((model,))
        if h is None:
            h = table[(model,)] = Hist(len(PD_BUCKETS), self._wall())
        h.counts[bisect_left(PD_BUCKETS, seconds)] += 1
        h.sum += seconds


def role_queues(models: Iterable[Any]) -> dict[tuple[str, str], float]:
    """(model, "prefill" | "decode") -> the engines' waiting requests over the disaggregated
    models' replicas of that role, at their last scrape (``both`` replicas count as decode)."""
    out: dict[tuple[str, str], float] = {}
    for entry in models:
        if entry.pd is None:
            continue
        out[(entry.name, "prefill")] = out[(entry.name, "decode")] = 0.0
        for r in entry.replicas:
            key = (entry.name, "prefill" if r.view.role == "prefill" else "decode")
            out[key] += r.view.waiting or 0.0
    return out
