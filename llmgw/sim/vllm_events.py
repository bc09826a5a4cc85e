"""The simulated vLLM's block hashing glue and its KV events: the pool's events (llmgw.sim.blockpool)
in the shape of the impersonated version (vllm-wire.md §1), and a request's hash chain bound to the
engine core's Hasher protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmgw.kv import events as kvev
from llmgw.kv.hashing import VllmVersion, event_hash, to_event_extra_keys
from llmgw.sim.blockpool import Cleared, PoolEvent, Removed, Stored

__all__ = ["kv_event", "bind_hasher", "event_extra"]


def kv_event(ev: PoolEvent, version: tuple[int, ...], int_hashes: bool) -> kvev.KVEvent:
    """One pool event as vLLM publishes it: hashes as uint64 (``int_hashes``) or digests, and the
    fields each version has."""
    v = version
    group = 0 if v >= (0, 20) else None
    if isinstance(ev, Stored):
        return kvev.BlockStored(
            block_hashes=[event_hash(h, int_hashes) for h in ev.hashes],
            parent_block_hash=event_hash(ev.parent, int_hashes) if ev.parent is not None else None,
            token_ids=list(ev.token_ids), block_size=ev.block_size, lora_id=ev.lora_id, medium="GPU",
            lora_name=ev.lora_name if v >= (0, 14) else None,
            extra_keys=list(ev.extra_keys) if v >= (0, 17) else None, group_idx=group,
            kv_cache_spec_kind="full_attention" if v >= (0, 22) else None)
    if isinstance(ev, Removed):
        return kvev.BlockRemoved(block_hashes=[event_hash(ev.block_hash, int_hashes)], medium="GPU", group_idx=group)
    assert isinstance(ev, Cleared)
    return kvev.AllBlocksCleared()


def bind_hasher(bh: Any, block_size: int) -> Callable[[Any, list[bytes], int], None]:
    """A request's block hasher (llmgw.kv.hashing) as the engine core's Hasher."""
    def extend(tokens: Any, hashes: list[bytes], n_blocks: int) -> None:
        want = n_blocks * block_size
        if bh.num_tokens < want:
            bh.extend(tokens[bh.num_tokens:want])
    return extend


def event_extra(bh: Any, version: VllmVersion) -> Callable[[int], object]:
    """Block i's extra keys in event form."""
    return lambda i: to_event_extra_keys(bh.extra_keys[i], version)
