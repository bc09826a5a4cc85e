"""Tier 1 shared between routers: each routing decision's prefix-tree insert as a small value
(:class:`PrefixInsert`) that another router can repeat, the bounded outbox the shell drains, and
the counts of what peers' inserts became.

Pure. Several routers in front of one fleet each keep their own prefix tree
(:mod:`.prefix_tree`); without sharing, a conversation whose turns land on different routers
finds no holder on the second one. So every committed decision's insert — the partition (base
model, adapter, cache_salt), the head bytes the tree keys on, the chosen replica, and the count
the insert added — is kept in an outbox; the shell (``llmgw.daemon.router.peer_feed``) drains
it, sends it to the other routers, and hands their inserts back to the core
(``RouterCore.peer_prefix_insert``), which records them exactly as its own decision would have:
the local tree then believes that replica holds that prefix, and its capacity model ages it out
like any other holding. Only inserts are shared: outcomes, the zero-hit alarm, admission and
breakers stay each router's own.

A peer's insert is applied only for a replica this router routes to, of the partition's model
(``unknown_replica``, ``other_model`` otherwise: counted, not applied), and its count is clamped
to ``1..max_count``: a peer cannot make one holding outweigh the count cap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["PrefixInsert", "PrefixOutbox", "PrefixShare", "PEER_OUTCOMES"]

# What a peer's insert became here: applied, or why not.
PEER_OUTCOMES = ("applied", "unknown_replica", "other_model")


class PrefixInsert(NamedTuple):
    """One decision's insert: ``replica`` was sent ``head`` under the partition (``model``,
    ``adapter``, ``salt``) and its count there grew by ``count``. ``first_block``: the request's
    first tier-2 block hash (kv_events models), so the receiver knows that engine's events about it
    are due (``KvCacheScorer.peer_sent``); None where it had none."""

    model: str
    adapter: str | None
    salt: str | None
    replica: str
    head: bytes
    count: int = 1
    first_block: int | None = None


class PrefixOutbox:
    """The inserts not yet taken by the shell, oldest first, at most ``limit`` of them: beyond
    it the oldest are dropped (and counted) — a feed that stalls costs bounded memory, and
    what it then sends is the newest, which matters most."""

    def __init__(self, limit: int = 8192) -> None:
        if limit < 1:
            raise ValueError(f"the outbox limit must be >= 1, got {limit}")
        self._q: deque[PrefixInsert] = deque()
        self.limit = limit
        self.offered = 0
        self.dropped = 0  # pushed out by newer inserts before the shell took them

    def offer(self, ins: PrefixInsert) -> None:
        q = self._q
        q.append(ins)
        self.offered += 1
        if len(q) > self.limit:
            q.popleft()
            self.dropped += 1

    def take(self, most: int | None = None) -> list[PrefixInsert]:
        """The oldest ``most`` inserts (all of them if None), taken out."""
        q = self._q
        if most is None or most >= len(q):
            out = list(q)
            q.clear()
            return out
        return [q.popleft() for _ in range(max(most, 0))]

    def __len__(self) -> int:
        return len(self._q)


class PrefixShare:
    """Routing as one, the core's face to the shell (``RouterCore.prefix_share()``): the outbox
    of this router's inserts to :meth:`take`, and :meth:`apply` for a peer's.

    ``record`` repeats an insert in the local tree (``PrefixRouting.apply_peer``); ``model_of``
    says which model a replica id serves here (None: this router does not route to it)."""

    def __init__(self, outbox: PrefixOutbox, record: Callable[[PrefixInsert, float], None],
                 model_of: Callable[[str], str | None]) -> None:
        self.outbox = outbox
        self._record = record
        self._model_of = model_of
        self.peer = dict.fromkeys(PEER_OUTCOMES, 0)  # peers' inserts by what they became

    def take(self, most: int | None = None) -> list[PrefixInsert]:
        """This router's inserts since the last take, oldest first (at most ``most``)."""
        return self.outbox.take(most)

    def pending(self) -> int:
        return len(self.outbox)

    def apply(self, ins: PrefixInsert, now: float) -> str:
        """A peer router's insert: recorded as if this router had decided it, when the replica
        is one this router routes to for the same model. Its outcome (:data:`PEER_OUTCOMES`),
        counted."""
        model = self._model_of(ins.replica)
        if model is None:
            outcome = "unknown_replica"
        elif model != ins.model:
            outcome = "other_model"
        else:
            self._record(ins, now)
            outcome = "applied"
        self.peer[outcome] += 1
        return outcome

    def counts(self) -> dict[str, int]:
        """Inserts offered and dropped from the outbox, and peers' inserts by outcome."""
        return {"offered": self.outbox.offered, "outbox_dropped": self.outbox.dropped, **self.peer}
