"""An engine's KV blocks as the agent knows them: a pure mirror fed with decoded event batches.

The agent keeps one :class:`BlockMirror` per engine (per data-parallel rank) and feeds it every
``EventBatch`` from the engine's publisher with its ZMQ sequence number (:meth:`BlockMirror.apply`).
The mirror holds the set of block hashes the engine stores, per medium (``None`` when the release
does not say: vLLM < 0.10.2), and the **net changes** since the router last heard from it
(:meth:`BlockMirror.take_delta`): a block stored then removed before the next take never travels.

Sequence numbers: the first batch after construction or :meth:`reset` is accepted whatever its
number; then ``seq == last + 1`` is applied, ``seq <= last`` is a duplicate (ignored, counted),
``seq > last + 1`` is a **gap**: nothing is applied and :class:`Outcome.GAP` tells the caller to
replay ``last + 1 .. seq`` through the engine's DEALER (feeding the replies to ``apply``) or, when
the engine no longer has them, to :meth:`reset` and carry on (the agent does this:
llmgw/daemon/agent/kv_subscriber.py; :data:`REPLAY_OUTCOMES` names how a replay can end).

A reset (AllBlocksCleared, an unrecoverable gap, an engine restart, an overflow) empties the mirror
and marks the next delta ``reset=True``: the router clears that replica before applying it, so a
router never keeps blocks the mirror dropped. :meth:`resend_all` does the same for a router that
has not seen this mirror (new stream, router restart) while keeping the blocks: they all become
pending additions and travel in bounded deltas — a full copy in chunks. :meth:`full_copy` returns
them at once for callers that prefer one snapshot.

Bounds: at most ``max_blocks`` blocks (an engine's KV block count, all media together); a store
beyond it does not grow the mirror — it resets itself (:class:`Outcome.OVERFLOW`, counted). The
pending changes are at most ``2 × max_blocks`` (additions are held blocks; removals are blocks
the router was sent). A block hash of bytes longer than ``max_hash_bytes`` is refused (counted):
vLLM's digests are 32 bytes. Memory: see docs/prefix-routing.md (measured by
tests/test_kv_mirror.py and bench/bench_kv_index.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from llmgw.kv.events import (
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, ExternalBlockHash,
)

__all__ = ["AGENT_COUNTS", "REPLAY_OUTCOMES", "REPLAY_REASONS", "Outcome", "Delta", "Snapshot", "MirrorStats",
           "BlockMirror", "Medium", "replay_count"]

Medium = str | None
_ADD, _DEL = 1, -1

#: Why the agent asked an engine's replay ROUTER: a sequence gap, or the start of a subscription
#: (the SUB only sees what is published after it joins; the replay brings what came before).
REPLAY_REASONS = ("gap", "start")
#: How a replay ended. ``ok``: every missing batch arrived and was applied. ``missed``: the engine no
#: longer has the first missing batch (its buffer starts later, is empty, or has a hole): for a gap
#: the mirror resets; at the start the mirror keeps what the buffer covered (a subset of the engine's
#: blocks). ``timeout``, ``bad`` (an undecodable reply), ``overflow`` (more than the cap of replayed
#: messages, or of SUB messages held meanwhile): the mirror resets. ``throttled`` (a gap sooner than
#: the minimum interval after the last replay) and ``unavailable`` (no replay endpoint): a reset
#: without asking.
REPLAY_OUTCOMES = ("ok", "missed", "timeout", "bad", "overflow", "throttled", "unavailable")


def replay_count(reason: str, outcome: str) -> str:
    """The name of a replay counter in a kv_events message's ``counts``."""
    return f"replay_{reason}_{outcome}"


#: The counters an agent sends up in kv_events messages (increments, each sent once): sequence gaps
#: seen on the SUB, undecodable SUB messages, and replays by reason and outcome.
AGENT_COUNTS = ("gaps", "bad_frames",
                *(replay_count(r, o) for r in REPLAY_REASONS for o in REPLAY_OUTCOMES))


class Outcome(enum.Enum):
    APPLIED = "applied"      # the batch is in the mirror
    DUPLICATE = "duplicate"  # seq <= last seen: ignored
    GAP = "gap"              # seq > last + 1: nothing applied; replay or reset
    OVERFLOW = "overflow"    # more blocks than max_blocks: the mirror reset itself


@dataclass(slots=True)
class Delta:
    """Net changes since the previous take. ``reset``: clear the replica first, then apply."""

    seq: int | None
    reset: bool = False
    added: list[tuple[Medium, ExternalBlockHash]] = field(default_factory=list)
    removed: list[tuple[Medium, ExternalBlockHash]] = field(default_factory=list)
    more: bool = False  # changes remain for the next take

    def __len__(self) -> int:
        return len(self.added) + len(self.removed)

    @property
    def empty(self) -> bool:
        return not self.reset and not self.added and not self.removed


@dataclass(slots=True)
class Snapshot:
    """Every block the mirror holds, per medium, as of ``seq``."""

    seq: int | None
    blocks: dict[Medium, frozenset[ExternalBlockHash]]

    def __len__(self) -> int:
        return sum(len(s) for s in self.blocks.values())


@dataclass(slots=True)
class MirrorStats:
    batches: int = 0            # batches applied
    events: int = 0             # events applied
    block_events: int = 0       # block hashes stored or removed, as listed in applied events
    duplicates: int = 0         # batches with seq <= last, ignored
    gaps: int = 0               # batches refused for a sequence gap
    resets: int = 0             # clears: AllBlocksCleared, reset(), overflow
    overflows: int = 0          # resets because the engine reported more blocks than the cap
    unknown_events: int = 0     # event types this codec does not know: counted, not applied
    unknown_removals: int = 0   # removals of a block the mirror did not hold
    bad_hashes: int = 0         # hashes refused (bytes longer than max_hash_bytes)


class BlockMirror:
    def __init__(self, max_blocks: int, *, max_hash_bytes: int = 64) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self.max_hash_bytes = max_hash_bytes
        self.stats = MirrorStats()
        self.last_seq: int | None = None
        self._blocks: dict[Medium, set[ExternalBlockHash]] = {}
        self._count = 0
        # net pending change per (medium, hash): +1 added, -1 removed since the last take
        self._pending: dict[tuple[Medium, ExternalBlockHash], int] = {}
        self._reset_pending = False

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return self._count

    def holds(self, h: ExternalBlockHash, medium: Medium = None) -> bool:
        s = self._blocks.get(medium)
        return s is not None and h in s

    def blocks(self) -> dict[Medium, set[ExternalBlockHash]]:
        """A copy of the held blocks per medium (for tests and debugging)."""
        return {m: set(s) for m, s in self._blocks.items() if s}

    @property
    def pending(self) -> int:
        return len(self._pending) + (1 if self._reset_pending else 0)

    # ------------------------------------------------------------------ feeding
    def apply(self, seq: int, batch: EventBatch) -> Outcome:
        last = self.last_seq
        if last is not None:
            if seq <= last:
                self.stats.duplicates += 1
                return Outcome.DUPLICATE
            if seq > last + 1:
                self.stats.gaps += 1
                return Outcome.GAP
        self.last_seq = seq
        self.stats.batches += 1
        st = self.stats
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                st.events += 1
                st.block_events += len(ev.block_hashes)
                if not self._store(ev.medium, ev.block_hashes):
                    return Outcome.OVERFLOW
            elif isinstance(ev, BlockRemoved):
                st.events += 1
                st.block_events += len(ev.block_hashes)
                self._remove(ev.medium, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                st.events += 1
                self._clear()
            else:
                st.unknown_events += 1
        return Outcome.APPLIED

    def _ok(self, h: ExternalBlockHash) -> bool:
        if type(h) is bytes and len(h) > self.max_hash_bytes:
            self.stats.bad_hashes += 1
            return False
        return True

    def _store(self, medium: Medium, hashes: list[ExternalBlockHash]) -> bool:
        s = self._blocks.get(medium)
        if s is None:
            s = self._blocks[medium] = set()
        pending = self._pending
        for h in hashes:
            if h in s or not self._ok(h):
                continue
            if self._count >= self.max_blocks:
                self.stats.overflows += 1
                self._clear()
                return False
            s.add(h)
            self._count += 1
            key = (medium, h)
            if pending.pop(key, 0) != _DEL:  # removed then re-added before a take: no change
                pending[key] = _ADD
        return True

    def _remove(self, medium: Medium, hashes: list[ExternalBlockHash]) -> None:
        s = self._blocks.get(medium)
        pending = self._pending
        for h in hashes:
            if s is None or h not in s:
                self.stats.unknown_removals += 1
                continue
            s.remove(h)
            self._count -= 1
            key = (medium, h)
            if pending.pop(key, 0) != _ADD:  # added then removed before a take: no change
                pending[key] = _DEL

    def _clear(self) -> None:
        self.stats.resets += 1
        self._blocks.clear()
        self._count = 0
        self._pending.clear()
        self._reset_pending = True

    def reset(self) -> None:
        """Forget everything (an unrecoverable gap, an engine restart): the next batch is accepted
        whatever its sequence number, and the next delta tells the router to clear."""
        self._clear()
        self.last_seq = None

    # ------------------------------------------------------------------ for the router
    def take_delta(self, max_items: int) -> Delta:
        """Up to ``max_items`` net changes (oldest first) since the previous take; the rest stays."""
        if max_items < 1:
            raise ValueError("max_items must be >= 1")
        d = Delta(seq=self.last_seq, reset=self._reset_pending)
        self._reset_pending = False
        pending = self._pending
        if len(pending) <= max_items:
            items = list(pending.items())
            pending.clear()
        else:
            items = []
            it = iter(pending)
            keys = [next(it) for _ in range(max_items)]
            for k in keys:
                items.append((k, pending.pop(k)))
            d.more = True
        add, rem = d.added.append, d.removed.append
        for k, v in items:
            (add if v == _ADD else rem)(k)
        return d

    def resend_all(self) -> None:
        """For a router that has not seen this mirror: the next deltas carry ``reset`` and then
        every held block as an addition (a full copy in bounded chunks)."""
        self._pending = {(m, h): _ADD for m, s in self._blocks.items() for h in s}
        self._reset_pending = True

    def full_copy(self) -> Snapshot:
        """Every held block at once; the pending changes are covered by it and dropped."""
        self._pending.clear()
        self._reset_pending = False
        return Snapshot(self.last_seq, {m: frozenset(s) for m, s in self._blocks.items() if s})
