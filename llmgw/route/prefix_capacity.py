"""The prefix index's settings and what a replica can hold: :class:`Capacity` (vLLM's byte
budget or llama.cpp's slots, in head bytes), :class:`PrefixConfig` (the whole index's budget,
head cut, count cap, TTL) and :func:`partition_key` (what an engine never shares cache across).

Pure data with validation; the index itself is :mod:`.prefix_tree`, the capacity models that
age a replica's holdings out are :mod:`.prefix_holds`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["Capacity", "PrefixConfig", "Partition", "partition_key", "BYTES_PER_TOKEN", "MAX_HEAD_BYTES"]

BYTES_PER_TOKEN = 4.0  # rendered text is ~4 bytes per token; token-id prompts pack 4 bytes each
MAX_HEAD_BYTES = 128 << 10  # heads are cut here: only the start decides the route (the planner
# renders a request's head no further: request_head's limit)

Partition = Hashable


def partition_key(model: str, adapter: str | None = None,
                  cache_salt: str | None = None) -> tuple[str, str | None, str | None]:
    """The cache partition of a request: what an engine never shares cache blocks across."""
    return (model, adapter, cache_salt)


# --------------------------------------------------------------------------- capacity

@dataclass(frozen=True, slots=True)
class Capacity:
    """What one replica can hold of request heads, in head bytes (≈ tokens × 4).

    Exactly one of ``bytes`` (an LRU byte budget: vLLM's KV cache) or ``slots`` (llama.cpp's
    ``-np`` slots, each holding its last prompt; ``ram_bytes`` adds its host-RAM prompt cache)."""

    bytes: int | None = None
    slots: int | None = None
    ram_bytes: int = 0
    similarity: float = 0.1  # llama.cpp --slot-prompt-similarity: reuse a slot sharing >= this

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.slots is None):
            raise ValueError("a Capacity has exactly one of bytes (vLLM) or slots (llama.cpp)")
        if self.bytes is not None and self.bytes < 0:
            raise ValueError(f"capacity bytes must be >= 0, got {self.bytes}")
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.ram_bytes < 0 or (self.ram_bytes and self.slots is None):
            raise ValueError("ram_bytes must be >= 0 and only goes with slots (llama.cpp)")
        if not 0.0 <= self.similarity <= 1.0:
            raise ValueError(f"similarity must be in [0, 1], got {self.similarity}")

    @classmethod
    def vllm(cls, num_gpu_blocks: int, block_size: int, *,
             bytes_per_token: float = BYTES_PER_TOKEN, fraction: float = 1.0) -> Capacity:
        """From ``vllm:cache_config_info`` (num_gpu_blocks, block_size labels). ``fraction`` is
        the share of the KV cache left to cached prefixes (running requests' working sets and
        their outputs occupy the rest)."""
        return cls(bytes=int(num_gpu_blocks * block_size * bytes_per_token * fraction))

    @classmethod
    def tokens(cls, tokens: int, *, bytes_per_token: float = BYTES_PER_TOKEN) -> Capacity:
        """An LRU capacity of so many tokens (e.g. ``ScrapeResult.kv_capacity_tokens``)."""
        return cls(bytes=int(tokens * bytes_per_token))

    @classmethod
    def llamacpp(cls, slots: int, *, ram_tokens: int = 0, similarity: float = 0.1,
                 bytes_per_token: float = BYTES_PER_TOKEN) -> Capacity:
        """``-np`` slots; ``ram_tokens`` is how many prompt tokens its host-RAM cache keeps
        (``--cache-ram`` MiB ÷ the model's KV bytes per token)."""
        return cls(slots=slots, ram_bytes=int(ram_tokens * bytes_per_token),
                   similarity=similarity)

    def describe(self) -> str:
        if self.slots is not None:
            return f"{self.slots} slots" + (f" + {self.ram_bytes} B ram" if self.ram_bytes else "")
        return f"{self.bytes} B lru"


@dataclass(frozen=True, slots=True)
class PrefixConfig:
    budget_bytes: int = 64 << 20  # the whole index (accounted; measured in tests and the bench)
    default_capacity: Capacity = field(default_factory=lambda: Capacity(bytes=4 << 20))
    max_head_bytes: int = MAX_HEAD_BYTES  # heads are cut here: only the start decides the route
    max_count: int = 1024  # a holder count reaching this halves every count of its node
    ttl_s: float | None = None  # forget what was not recorded again within this long

    def __post_init__(self) -> None:
        if self.budget_bytes < 4096:
            raise ValueError(f"budget_bytes must be >= 4096, got {self.budget_bytes}")
        if self.max_head_bytes < 1 or self.max_count < 2:
            raise ValueError("max_head_bytes must be >= 1 and max_count >= 2")
        if self.ttl_s is not None and not (self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise ValueError(f"ttl_s must be > 0 or None, got {self.ttl_s}")

