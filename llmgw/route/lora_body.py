"""llama.cpp's LoRA adapters per request: the explicit ``lora`` list a request to a llama.cpp
replica carries when its model declares adapters. Pure.

llama-server loads every adapter at start (off: ``--lora-scaled FILE:0``) and applies them per
request from the body's ``lora`` list, ``[{"id": 0, "scale": 1.0}, ...]`` (ids from its
``/lora-adapters``). A request *without* the list runs with whatever its slot ran last, and
reuses KV computed under that adapter: wrong output. So every request gets the whole list — the
asked adapter at its configured ``scale``, every other id at 0; a base-model request all zeros.
Only the whole list will do: llama-server compares a request's list with its slot's as given, so
an empty list after an adapter request reuses that adapter's KV like an omitted one (seen on the
real server: ``cache_n`` 690 of 691 tokens), while every id at 0 recomputes it. A replica whose
ids are not known yet therefore takes no request of such a model (``ReplicaTable.views``).

The client's body is forwarded as it came, with the list added before its closing brace: no
parse-and-serialise of a body that may be megabytes of prompt. Only a body that already has a
top-level ``lora`` key (the router's list replaces it) or is not plain UTF-8 JSON text is
serialised again, from the parsed object. The list is bounded by the replica's adapters
(``engine_answers.MAX_ADAPTERS``)."""

from __future__ import annotations

import json
from typing import Any

from .replicas import ModelEntry, Replica

__all__ = ["lora_list", "request_body", "with_lora"]

_WS = b" \t\r\n"


def lora_list(ids: tuple[int, ...], chosen: int | None, scale: float) -> list[dict[str, Any]]:
    """Every id at 0 but ``chosen`` at ``scale``."""
    return [{"id": i, "scale": scale if i == chosen else 0.0} for i in ids]


def with_lora(raw: bytes, obj: dict[str, Any], lora: list[dict[str, Any]]) -> bytes:
    """``raw`` (the JSON text of ``obj``) with its top-level ``lora`` set to ``lora``."""
    piece = json.dumps(lora, separators=(",", ":")).encode()
    if "lora" not in obj:
        end = len(raw)
        while end and raw[end - 1] in _WS:
            end -= 1
        start = 0
        while start < end and raw[start] in _WS:
            start += 1
        # UTF-16/32 or a BOM (json.loads takes them) do not begin with "{" and end with "}" bytes
        if end - start >= 2 and raw[start] == 0x7B and raw[end - 1] == 0x7D:
            sep = b"," if obj else b""
            return b"".join((memoryview(raw)[:end - 1], sep, b'"lora":', piece, memoryview(raw)[end - 1:]))
    return json.dumps({**obj, "lora": lora}, separators=(",", ":")).encode()


def request_body(raw: bytes, obj: dict[str, Any] | None, entry: ModelEntry, rep: Replica,
                 adapter: str | None) -> bytes:
    """What to send ``rep`` for a request (``raw``, parsed as ``obj``) asking for ``adapter`` of
    ``entry``'s model (None: the base model): ``raw`` unchanged unless the replica is a llama.cpp
    engine of a model with declared adapters."""
    if not entry.declared or rep.view.engine != "llamacpp" or obj is None:
        return raw
    ids = rep.lora_ids
    # The scheduler keeps only replicas whose ids are known and, for an adapter, list it: anything
    # else is a caller's bug, to fail loudly rather than answer with the wrong weights.
    if ids is None:
        raise LookupError(f"replica {rep.id}: its adapter ids are not known")
    if adapter is None:
        lora = lora_list(rep.lora_all, None, 0.0)
    elif adapter not in ids:
        raise LookupError(f"replica {rep.id} does not list adapter {adapter!r}")
    else:
        lora = lora_list(rep.lora_all, ids[adapter], entry.declared[adapter].scale)
    return with_lora(raw, obj, lora)
