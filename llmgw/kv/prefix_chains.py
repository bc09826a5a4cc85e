"""Block hash chains of recently hashed prompts, found again by token prefix (pure: no I/O).

A conversation's next turn resends its history: its tokens begin with the tokens of the turn
before, so the blocks they share have the same hashes (a block's hash depends only on the tokens
up to its end, the engine-wide NONE_HASH, and the request's LoRA and salt). The router's tier-2
step hashes a prompt through :meth:`PrefixChains.hashes`, which takes the longest run of whole
blocks a remembered chain shares with the new tokens — compared token by token, never assumed —
and hashes only the blocks after it. The result is exactly ``ctx.hash_tokens(tokens, lora, salt)``
(tests check it on every path).

**Hashing only as far as any replica can hold** (``held_any``, the router's index's
``holds_any``): a replica's vote counts the leading blocks it holds contiguously from the first,
so once no replica holds block k-1, blocks k and later cannot add to any replica's count and
hashing them is wasted (~1 µs a block). With ``held_any``, the blocks after the remembered ones
are hashed ``chunk`` at a time (at least ``at_least`` in all), and hashing stops after a chunk
whose last block no replica holds; the result is then a prefix of the full chain (the caller
knows the prompt's full block count: the scorer's share is of that). The chain remembered is the
partial one (its tokens cut to the blocks hashed), so a later request with the same leading
tokens — the same prompt once an engine has stored it — extends it, hashing only the new blocks.

Chains are grouped by what partitions them (hash context, LoRA, salt) and their first block's
tokens: a tenant's conversations share a system prompt, so a group holds up to ``per_head`` of
them (most recent first), and a new chain that extends one replaces it. Bounded: at most
``max_chains`` chains and ``max_tokens`` tokens in all, the least recently used groups dropped
first. A chain keeps its tokens as 4-byte machine ints (compared with memcmp), and per block its
digest and event int: ~12 B per token in all (bench/bench_kv_decide.py measures it), so the
default 2^20 tokens is about 12 MB.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from .hashing import HashContext, LoRA

__all__ = ["CHUNK_BLOCKS", "MIN_BLOCKS", "Chain", "PrefixChains"]

CHUNK_BLOCKS = 16  # with held_any: blocks hashed between two looks at the index (one look ~0.2 µs a replica)
MIN_BLOCKS = 16  # ... and blocks always hashed (all there are, if fewer): the parity check's leading
# hashes (llmgw.kv.parity.ParityConfig.max_expected) and a miss's first blocks


@dataclass(slots=True)
class Chain:
    raw: bytes  # its whole blocks' tokens, as machine ints (array.tobytes): compared with memcmp
    digests: list[bytes]  # one per full block
    ints: list[int]  # the same as the events' 64-bit int form
    size: int  # tokens in its whole blocks


def _shared_blocks(a: bytes, b: bytes, step: int, most: int) -> int:
    """How many whole leading blocks (``step`` bytes each) ``a`` and ``b`` share, at most ``most``:
    one comparison when all of them match, else a binary search (memcmp, a few µs for 4k tokens)."""
    if most <= 0 or a[:step] != b[:step]:
        return 0
    if a[:most * step] == b[:most * step]:
        return most
    lo, hi = 1, most - 1  # lo blocks match; more than hi do not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo * step:mid * step] == b[lo * step:mid * step]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _int64(digest: bytes) -> int:
    # llmgw.kv.hashing.event_hash's int form: the digest's low 64 bits, big-endian
    return int.from_bytes(digest[-8:], "big")


def as_array(tokens: Sequence[int]) -> array[int]:
    """Token ids as an unsigned array ("I" when they fit 32 bits, else "Q"); raises OverflowError
    or TypeError for what is not a token id (bools pass as 0 and 1: the caller checks them)."""
    if isinstance(tokens, array) and tokens.typecode in ("I", "Q"):
        return tokens
    try:
        return array("I", tokens)
    except OverflowError:
        return array("Q", tokens)


class PrefixChains:
    def __init__(self, max_chains: int = 1024, max_tokens: int = 1 << 20, per_head: int = 4) -> None:
        self.max_chains, self.max_tokens, self.per_head = max_chains, max_tokens, per_head
        self.groups: OrderedDict[Hashable, list[Chain]] = OrderedDict()
        self.chains = 0
        self.tokens = 0  # the whole blocks' tokens the chains hold
        self.reused_blocks = 0  # counters: blocks taken from a remembered chain ...
        self.hashed_blocks = 0  # ... blocks hashed ...
        self.skipped_blocks = 0  # ... and blocks not hashed: no replica held the block before them

    def hashes(self, ctx: HashContext, tokens: Sequence[int], lora: LoRA | None = None,
               cache_salt: str | None = None, *, ids: array[int] | None = None,
               held_any: Callable[[int], bool] | None = None, chunk: int = CHUNK_BLOCKS,
               at_least: int = MIN_BLOCKS) -> tuple[int, ...]:
        """The event-form (64-bit int) hashes of the leading full blocks of ``tokens`` (ints in
        0..2^64-1): all of them without ``held_any``; with it, hashing stops where no replica can
        hold more (see the module's doc) — at least ``at_least`` blocks (or all there are) and then
        ``chunk`` blocks at a time, so the result is a prefix of the full chain, maybe shorter.
        ``ids``: the same tokens as an array (typecode I or Q) where the caller has one, saving a
        conversion; ``tokens`` is still what is hashed (a list's ints are read faster than an
        array's)."""
        if chunk < 1 or at_least < 1:
            raise ValueError("chunk and at_least must be >= 1")
        bs = ctx.block_size
        n = len(tokens) // bs
        if n == 0:
            return ()
        arr = ids if ids is not None else as_array(tokens)
        step = bs * arr.itemsize
        raw = arr.tobytes()[:n * step]
        key = (ctx.version, ctx.algo, bs, ctx.none_hash, lora, cache_salt, arr.itemsize, raw[:step])
        group = self.groups.get(key)
        best: Chain | None = None
        shared = 0
        if group is not None:
            self.groups.move_to_end(key)
            for ch in group:
                k = _shared_blocks(ch.raw, raw, step, min(n, len(ch.digests)))
                if k > shared:
                    best, shared = ch, k
                    if k == n:
                        break
        first = min(n, at_least)
        if best is not None and (shared == n or (held_any is not None and shared >= first
                                                 and not held_any(best.ints[shared - 1]))):
            # all of them remembered, or no replica holds the last one remembered: nothing to hash
            self.reused_blocks += shared
            self.skipped_blocks += n - shared
            return tuple(best.ints[:shared])
        digests = best.digests[:shared] if best is not None else []
        ints = best.ints[:shared] if best is not None else []
        done = shared
        while done < n:
            end = n if held_any is None else min(n, max(done + chunk, first))
            new = ctx.chain(digests[-1] if digests else None, tokens[done * bs:end * bs], done, lora, cache_salt)
            digests += new
            ints += map(_int64, new)
            done = end
            if held_any is not None and done < n and not held_any(ints[-1]):
                break  # no replica holds block done-1: none holds a longer run of this prompt's blocks
        self.reused_blocks += shared
        self.hashed_blocks += done - shared
        self.skipped_blocks += n - done
        self._remember(key, group, best if best is not None and shared == len(best.digests) else None,
                       Chain(raw[:done * step], digests, ints, done * bs))
        return tuple(ints)

    def _remember(self, key: Hashable, group: list[Chain] | None, extended: Chain | None, ch: Chain) -> None:
        if ch.size > self.max_tokens:
            return
        if group is None:
            group = self.groups[key] = []
        if extended is not None:  # the new chain continues it: one chain for the conversation
            group.remove(extended)
            self._forget(extended)
        group.insert(0, ch)
        self.chains += 1
        self.tokens += ch.size
        while len(group) > self.per_head:
            self._forget(group.pop())
        while self.chains > self.max_chains or self.tokens > self.max_tokens:
            _, old = self.groups.popitem(last=False)
            for c in old:
                self._forget(c)

    def _forget(self, ch: Chain) -> None:
        self.chains -= 1
        self.tokens -= ch.size

    def clear(self) -> None:
        self.groups.clear()
        self.chains = self.tokens = 0
