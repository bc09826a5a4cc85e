"""What the router reads of an engine's answers besides /metrics (:mod:`.contract` reads that):
the LoRA adapters it serves (``/v1/models``; llama.cpp's ids and files, ``/lora-adapters``) and
llama.cpp's slot count (``/slots``); and whether two scrapes of its /metrics show that it
restarted (:func:`restarted`). Pure.

An engine's answer is input like a client's: the size of each is capped where it is read
(``MAX_*_BYTES``, the shell's read limit), and anything of the wrong shape is a
:class:`BadAnswer` naming what is wrong, never another exception. What is kept is bounded
too: at most ``MAX_ADAPTERS`` adapter names of at most ``MAX_NAME`` characters."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_ADAPTERS", "MAX_LORA_BYTES", "MAX_METRICS_BYTES", "MAX_MODELS_BYTES", "MAX_NAME", "MAX_PATH",
           "MAX_SLOTS_BYTES", "BadAnswer", "adapters_of", "lora_adapters_of", "restarted", "slot_count_of"]

# Read limits, one per answer: far above what a real engine sends (vLLM's /metrics is ~100 KB,
# /v1/models ~300 bytes a model or adapter; llama.cpp's /slots carries each slot's prompt).
MAX_METRICS_BYTES = 4 << 20
MAX_MODELS_BYTES = 1 << 20
MAX_SLOTS_BYTES = 4 << 20
MAX_LORA_BYTES = 1 << 20  # llama.cpp's /lora-adapters: ~100 bytes an adapter
MAX_ADAPTERS = 1024  # per replica
MAX_NAME = 256  # characters of an adapter's name
MAX_PATH = 4096  # characters of an adapter's file path (llama.cpp)


class BadAnswer(ValueError):
    """An engine's answer that cannot be used; the message says why."""


def _json(body: bytes, what: str) -> Any:
    try:
        return json.loads(body)
    except RecursionError:
        raise BadAnswer(f"{what}: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
        raise BadAnswer(f"{what}: not JSON ({e})") from None


def adapters_of(body: bytes) -> set[str]:
    """The LoRA adapters in a ``/v1/models`` answer: the ids of entries with a ``parent``."""
    obj = _json(body, "/v1/models")
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        raise BadAnswer("/v1/models: no \"data\" list")
    out: set[str] = set()
    for d in data:
        if not isinstance(d, dict) or not d.get("parent"):
            continue
        name = d.get("id")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise BadAnswer(f"/v1/models: an adapter's \"id\" is not a name of 1 to {MAX_NAME} characters")
        out.add(name)
        if len(out) > MAX_ADAPTERS:
            raise BadAnswer(f"/v1/models: more than {MAX_ADAPTERS} adapters")
    return out


def slot_count_of(body: bytes) -> int:
    """The number of slots in a llama.cpp ``/slots`` answer (a list, one entry a slot)."""
    obj = _json(body, "/slots")
    if not isinstance(obj, list) or not obj:
        raise BadAnswer("/slots: not a list of slots")
    return len(obj)


def lora_adapters_of(body: bytes) -> dict[str, int]:
    """llama.cpp's ``/lora-adapters`` (``[{"id", "path", "scale", ...}]``) as file path → id. Ids
    are distinct ints from 0 to the count, paths distinct strings of at most ``MAX_PATH``
    characters, at most ``MAX_ADAPTERS`` of them: anything else is a :class:`BadAnswer`."""
    obj = _json(body, "/lora-adapters")
    if not isinstance(obj, list):
        raise BadAnswer("/lora-adapters: not a list of adapters")
    if len(obj) > MAX_ADAPTERS:
        raise BadAnswer(f"/lora-adapters: more than {MAX_ADAPTERS} adapters")
    out: dict[str, int] = {}
    ids: set[int] = set()
    for a in obj:
        ident = a.get("id") if isinstance(a, dict) else None
        path = a.get("path") if isinstance(a, dict) else None
        if type(ident) is not int or not 0 <= ident < len(obj) or ident in ids:
            raise BadAnswer("/lora-adapters: an adapter's \"id\" is not a distinct int from 0 to the count")
        if not isinstance(path, str) or not path or len(path) > MAX_PATH or path in out:
            raise BadAnswer(f"/lora-adapters: an adapter's \"path\" is not a distinct text of 1 to {MAX_PATH} "
                            "characters")
        ids.add(ident)
        out[path] = ident
    return out


def restarted(prev: Any, cur: Any) -> bool:
    """Do two scrapes of an engine's /metrics (:class:`~.contract.ScrapeResult`) show that it
    restarted in between? A cumulative counter (requests finished, prefix-cache queries or hits)
    went backwards: a new process counts from zero. A restart between scrapes that finishes as
    many requests as the old one had is not seen here (the engine's 404s for an adapter are)."""
    if prev is None:
        return False
    for name in ("finished_total", "prefix_queries_total", "prefix_hits_total"):
        a, b = getattr(prev, name), getattr(cur, name)
        if a is not None and b is not None and b < a:
            return True
    return False
