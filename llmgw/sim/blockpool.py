"""The simulator's KV block pool: a prefix cache that behaves as vLLM v1's BlockPool does.

What a router can see of vLLM's cache is which block hashes are stored and removed (KV events),
how full the pool is (kv_cache_usage_perc) and how many prompt tokens hit (prefix cache
counters). This pool reproduces the mechanism behind all three:

- a fixed number of blocks, one of them the reserved null block (so usable = total - 1);
- a free queue in eviction order; a freed block goes to its tail, a cache hit takes it out;
- blocks keep their hash while free, so they can still be hit until they are reused;
- a request's blocks are freed tail first, so its prefix outlives its suffix;
- one BlockStored per call for the blocks that just became full, one BlockRemoved per evicted hash;
- the same hash may be held by several blocks (two requests filled it concurrently), as in vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["BlockPool", "Stored", "Removed", "Cleared", "PoolEvent", "ReqBlocks"]


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[object, ...]  # event form, one entry per block


@dataclass(frozen=True, slots=True)
class Removed:
    block_hash: bytes


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


PoolEvent = Stored | Removed | Cleared


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass(slots=True)
class ReqBlocks:
    """The blocks one request holds, and how many of them are already cached (full and hashed)."""

    blocks: list[_Block] = field(default_factory=list)
    num_cached: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (one is the null block)")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.caching = caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Block 0 is vLLM's null block: never allocated, never free.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[bytes, dict[int, _Block]] = {}
        self._events: list[PoolEvent] = []

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_hashes(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free / self.num_usable

    def lookup(self, hashes: Sequence[bytes], max_blocks: int) -> list[_Block]:
        """The longest cached prefix of `hashes`, at most `max_blocks` long."""
        if not self.caching:
            return []
        hit: list[_Block] = []
        for h in hashes[:max_blocks]:
            holders = self._cached.get(h)
            if not holders:
                break
            hit.append(next(iter(holders.values())))
        return hit

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    # -- mutations -------------------------------------------------------------------------
    def touch(self, blocks: Sequence[_Block]) -> None:
        """Take hit blocks into use: out of the free queue if no one held them."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def num_evictable_for(self, hit: Sequence[_Block]) -> int:
        """Free blocks available once `hit` blocks (some may sit in the free queue) are touched."""
        return self.num_free - sum(1 for b in hit if b.ref_cnt == 0)

    def allocate(self, n: int) -> list[_Block] | None:
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            b = self._blocks[block_id]
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def cache_full_blocks(
        self,
        req: ReqBlocks,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
        *,
        lora_id: int | None,
        lora_name: str | None,
        event_extra_keys: Sequence[object],
    ) -> None:
        """Hash the request's blocks that just became full; one BlockStored event for them all."""
        n_full = min(len(hashes), len(req.blocks))
        if not self.caching or n_full <= req.num_cached:
            return
        start = req.num_cached
        new_hashes = []
        for i in range(start, n_full):
            b = req.blocks[i]
            h = hashes[i]
            b.block_hash = h
            self._cached.setdefault(h, {})[b.block_id] = b
            new_hashes.append(h)
        bs = self.block_size
        self._events.append(
            Stored(
                hashes=tuple(new_hashes),
                parent=hashes[start - 1] if start > 0 else None,
                token_ids=tuple(tokens[start * bs : n_full * bs]),
                block_size=bs,
                lora_id=lora_id,
                lora_name=lora_name,
                extra_keys=tuple(event_extra_keys[start:n_full]),
            )
        )
        req.num_cached = n_full

    def free(self, req: ReqBlocks) -> None:
        # Tail first: the end of a sequence is evicted before its shared prefix.
        for b in reversed(req.blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = None
        req.blocks.clear()
        req.num_cached = 0

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: only when no block is in use."""
        if self.num_free != self.num_usable:
            return False
        for holders in self._cached.values():
            for b in holders.values():
                b.block_hash = None
        self._cached.clear()
        self._events.append(Cleared())
        return True

    def take_events(self) -> list[PoolEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, b: _Block) -> None:
        h = b.block_hash
        if h is None:
            return
        holders = self._cached.get(h)
        if holders is not None:
            holders.pop(b.block_id, None)
            if not holders:
                del self._cached[h]
        b.block_hash = None
        self._events.append(Removed(h))
