"""Block hash chains of recently hashed prompts, found again by token prefix (pure: no I/O).

A conversation's next turn resends its history: its tokens begin with the tokens of the turn
before, so the blocks they share have the same hashes (a block's hash depends only on the tokens
up to its end, the engine-wide NONE_HASH, and the request's LoRA and salt). The router's tier-2
step hashes a prompt through :meth:`PrefixChains.hashes`, which takes the longest run of whole
blocks a remembered chain shares with the new tokens — compared token by token, never assumed —
and hashes only the blocks after it. The result is exactly ``ctx.hash_tokens(tokens, lora, salt)``
(tests check it on every path).

Chains are grouped by what partitions them (hash context, LoRA, salt) and their first block's
tokens: a tenant's conversations share a system prompt, so a group holds up to ``per_head`` of
them (most recent first), and a new chain that extends one replaces it. Bounded: at most
``max_chains`` chains and ``max_tokens`` tokens in all, the least recently used groups dropped
first. Measured (bench/bench_kv_decide.py): ~36 B per token (the caller's token list is kept, not
copied: its pointers and int objects) plus ~110 B per block (its digest and event int), so the
default 2^19 tokens is about 20 MB.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .hashing import HashContext, LoRA

__all__ = ["Chain", "PrefixChains"]


@dataclass(slots=True)
class Chain:
    tokens: Sequence[int]  # at least len(digests) * block_size tokens
    digests: list[bytes]  # one per full block
    ints: list[int]  # the same as the events' 64-bit int form


def _shared_blocks(a: Sequence[int], b: Sequence[int], bs: int, most: int) -> int:
    """How many whole leading blocks ``a`` and ``b`` share (at most ``most``): one C-level
    comparison when all of them match, else a binary search."""
    if most <= 0 or a[:bs] != b[:bs]:
        return 0
    if a[:most * bs] == b[:most * bs]:
        return most
    lo, hi = 1, most - 1  # lo blocks match; more than hi do not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo * bs:mid * bs] == b[lo * bs:mid * bs]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _size(ch: Chain) -> int:
    return len(ch.tokens)


def _int64(digest: bytes) -> int:
    # llmgw.kv.hashing.event_hash's int form: the digest's low 64 bits, big-endian
    return int.from_bytes(digest[-8:], "big")


class PrefixChains:
    def __init__(self, max_chains: int = 1024, max_tokens: int = 1 << 19, per_head: int = 4) -> None:
        self.max_chains, self.max_tokens, self.per_head = max_chains, max_tokens, per_head
        self.groups: OrderedDict[Hashable, list[Chain]] = OrderedDict()
        self.chains = 0
        self.tokens = 0  # the whole blocks' tokens the chains hold
        self.reused_blocks = 0  # counters: blocks taken from a remembered chain ...
        self.hashed_blocks = 0  # ... and blocks hashed

    def hashes(self, ctx: HashContext, tokens: Sequence[int], lora: LoRA | None = None,
               cache_salt: str | None = None) -> tuple[int, ...]:
        """The event-form (64-bit int) hashes of every full block of ``tokens``."""
        bs = ctx.block_size
        n = len(tokens) // bs
        if n == 0:
            return ()
        key = (ctx.version, ctx.algo, bs, ctx.none_hash, lora, cache_salt, tuple(tokens[:bs]))
        group = self.groups.get(key)
        best: Chain | None = None
        shared = 0
        if group is not None:
            self.groups.move_to_end(key)
            for ch in group:
                k = _shared_blocks(ch.tokens, tokens, bs, min(n, len(ch.digests)))
                if k > shared:
                    best, shared = ch, k
                    if k == n:
                        break
        if best is not None and shared == n and len(best.digests) >= n:
            self.reused_blocks += n
            return tuple(best.ints[:n])
        digests = best.digests[:shared] if best is not None else []
        ints = best.ints[:shared] if best is not None else []
        new = ctx.chain(digests[-1] if digests else None, tokens[shared * bs:n * bs], shared, lora, cache_salt)
        digests += new
        ints += map(_int64, new)
        self.reused_blocks += shared
        self.hashed_blocks += len(new)
        self._remember(key, group, best if best is not None and shared == len(best.digests) else None,
                       Chain(tokens, digests, ints))
        return tuple(ints)

    def _remember(self, key: Hashable, group: list[Chain] | None, extended: Chain | None, ch: Chain) -> None:
        if _size(ch) > self.max_tokens:
            return
        if group is None:
            group = self.groups[key] = []
        if extended is not None:  # the new chain continues it: one chain for the conversation
            group.remove(extended)
            self._forget(extended)
        group.insert(0, ch)
        self.chains += 1
        self.tokens += _size(ch)
        while len(group) > self.per_head:
            self._forget(group.pop())
        while self.chains > self.max_chains or self.tokens > self.max_tokens:
            _, old = self.groups.popitem(last=False)
            for c in old:
                self._forget(c)

    def _forget(self, ch: Chain) -> None:
        self.chains -= 1
        self.tokens -= _size(ch)

    def clear(self) -> None:
        self.groups.clear()
        self.chains = self.tokens = 0
