"""The router's KV index: per replica, the block hashes its engine holds (pure, no I/O).

Fed only with what the agents' mirrors (:mod:`llmgw.kv.mirror`) send: :meth:`KVIndex.apply_delta`
(net changes; ``reset`` clears the replica first), :meth:`KVIndex.replace` (a full copy) and
:meth:`KVIndex.remove_replica` (the replica is gone). Which agent may write which replica is the
caller's check (an agent writes only the replicas its node runs), not this module's.

:meth:`KVIndex.leading_blocks` answers the kv scorer's question: for a request's block hashes, how
many of the leading ones each replica holds contiguously from the first (any medium);
:meth:`KVIndex.holds_any` whether any replica holds a block (where hashing a prompt may stop).

Bounds: a replica holds at most ``max_blocks_per_replica`` blocks (its engine's KV block count, or
a generous default). A delta or snapshot that would exceed it does not grow the index: the replica
is emptied and marked **overflowed** — it votes with 0 blocks (the request falls back to tier 1)
until a ``reset`` delta or a :meth:`replace` within the cap. :meth:`KVIndex.suspend` does the same
for a replica whose events were dropped on the way. Never a wrong index, at worst an empty one.
Memory per indexed block: see docs/prefix-routing.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from llmgw.kv.events import ExternalBlockHash
from llmgw.kv.mirror import Delta, Medium, Snapshot

__all__ = ["KVIndex", "IndexStats"]

Replica = Hashable


@dataclass(slots=True)
class IndexStats:
    deltas: int = 0
    snapshots: int = 0
    resets: int = 0
    block_events: int = 0        # additions and removals applied
    overflows: int = 0           # replicas emptied for exceeding the cap
    unknown_removals: int = 0    # removals of a block the replica did not hold


class _Replica:
    __slots__ = ("media", "count", "overflowed", "seq")

    def __init__(self) -> None:
        self.media: dict[Medium, set[ExternalBlockHash]] = {}
        self.count = 0
        self.overflowed = False
        self.seq: int | None = None


class KVIndex:
    def __init__(self, max_blocks_per_replica: int = 1 << 20) -> None:
        if max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be >= 1")
        self.max_blocks_per_replica = max_blocks_per_replica
        self.stats = IndexStats()
        self._replicas: dict[Replica, _Replica] = {}
        self._caps: dict[Replica, int] = {}

    # ------------------------------------------------------------------ shape
    def set_capacity(self, replica: Replica, max_blocks: int) -> None:
        """A tighter cap for one replica (its engine's block count)."""
        self._caps[replica] = max(1, min(max_blocks, self.max_blocks_per_replica))

    def _cap(self, replica: Replica) -> int:
        return self._caps.get(replica, self.max_blocks_per_replica)

    def replicas(self) -> list[Replica]:
        return list(self._replicas)

    def size(self, replica: Replica) -> int:
        r = self._replicas.get(replica)
        return 0 if r is None else r.count

    def overflowed(self, replica: Replica) -> bool:
        r = self._replicas.get(replica)
        return r is not None and r.overflowed

    def holds(self, replica: Replica, h: ExternalBlockHash) -> bool:
        """Does the replica hold block `h` (any medium)?"""
        r = self._replicas.get(replica)
        if r is not None:
            for s in r.media.values():
                if h in s:
                    return True
        return False

    def holds_any(self, h: ExternalBlockHash) -> bool:
        """Does any replica hold block `h` (any medium)? O(replicas). The tokenize step asks it to
        stop hashing a prompt where no replica's leading run can reach (PrefixChains.hashes)."""
        for r in self._replicas.values():
            for s in r.media.values():
                if h in s:
                    return True
        return False

    def blocks(self, replica: Replica) -> dict[Medium, set[ExternalBlockHash]]:
        r = self._replicas.get(replica)
        return {} if r is None else {m: set(s) for m, s in r.media.items() if s}

    def __len__(self) -> int:
        return sum(r.count for r in self._replicas.values())

    # ------------------------------------------------------------------ feeding
    def _get(self, replica: Replica) -> _Replica:
        r = self._replicas.get(replica)
        if r is None:
            r = self._replicas[replica] = _Replica()
        return r

    def _overflow(self, r: _Replica) -> None:
        self.stats.overflows += 1
        r.media.clear()
        r.count = 0
        r.overflowed = True

    def apply_delta(self, replica: Replica, delta: Delta) -> bool:
        """Apply a mirror's net changes; False when the replica overflowed (now empty)."""
        self.stats.deltas += 1
        r = self._get(replica)
        if delta.reset:
            self.stats.resets += 1
            r.media.clear()
            r.count = 0
            r.overflowed = False
        r.seq = delta.seq
        if r.overflowed:
            return False  # waits for a reset: applying changes on a partial view would be wrong
        media = r.media
        for m, h in delta.removed:
            s = media.get(m)
            if s is None or h not in s:
                self.stats.unknown_removals += 1
                continue
            s.remove(h)
            r.count -= 1
        cap = self._cap(replica)
        for m, h in delta.added:
            s = media.get(m)
            if s is None:
                s = media[m] = set()
            if h in s:
                continue
            if r.count >= cap:
                self._overflow(r)
                return False
            s.add(h)
            r.count += 1
        self.stats.block_events += len(delta.added) + len(delta.removed)
        return True

    def replace(self, replica: Replica, snapshot: Snapshot) -> bool:
        """Take a full copy; False (replica empty, overflowed) when it exceeds the cap."""
        self.stats.snapshots += 1
        r = self._get(replica)
        r.seq = snapshot.seq
        n = len(snapshot)
        if n > self._cap(replica):
            self._overflow(r)
            return False
        r.media = {m: set(s) for m, s in snapshot.blocks.items() if s}
        r.count = n
        r.overflowed = False
        self.stats.block_events += n
        return True

    def suspend(self, replica: Replica) -> None:
        """Events of the replica were lost before they reached the index (dropped for its node's
        budget): empty it, and ignore its deltas until a reset, as after an overflow."""
        r = self._replicas.get(replica)
        if r is not None:
            r.media.clear()
            r.count = 0
            r.overflowed = True

    def remove_replica(self, replica: Replica) -> None:
        self._replicas.pop(replica, None)
        self._caps.pop(replica, None)

    # ------------------------------------------------------------------ asking
    def leading_blocks(self, hashes: Sequence[ExternalBlockHash]) -> dict[Replica, int]:
        """For every known replica, how many of ``hashes`` it holds contiguously from the first."""
        out: dict[Replica, int] = {}
        for name, r in self._replicas.items():
            sets = [s for s in r.media.values() if s]
            n = 0
            if len(sets) == 1:
                s = sets[0]
                for h in hashes:
                    if h not in s:
                        break
                    n += 1
            elif sets:
                for h in hashes:
                    if not any(h in s for s in sets):
                        break
                    n += 1
            out[name] = n
        return out
