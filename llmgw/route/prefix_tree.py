"""Cache-aware routing, tier 1: an approximate radix tree of what each replica's prefix cache holds.

Pure: no I/O, no clock; ``now`` is passed in (monotonic seconds). One tree per *partition* —
(base model, adapter, cache_salt) — because those partition an engine's cache: a block cached
under one adapter or salt is never a hit for another. The tree is over the BYTES of what the
engine caches first, the rendered request head (:func:`request_head`); tokens are not needed.

What each replica holds is *modelled*, never assumed: a replica gets a :class:`Capacity` and its
holdings are aged out as the engine would evict them —

  vLLM       a byte budget (num_gpu_blocks × block_size tokens × ~4 bytes/token), LRU over the
             tree nodes it holds, deepest first (vLLM frees a request's blocks tail first, so a
             shared prefix outlives its suffixes);
  llama.cpp  ``-np`` slots, each holding only its last prompt: a new prompt takes the slot whose
             prompt shares the longest prefix with it (if that is at least ``similarity`` of the
             new prompt), else the least recently used slot, and the old prompt's unshared tail
             is gone. With a host-RAM prompt cache (``--cache-ram``), a prompt pushed out of its
             slot is kept there, LRU within ``ram_bytes``.

So sending a replica more distinct prefixes than it can hold just overwrites them, in the tree
as in the engine.

Matching counts PARTIAL labels: a node's label is the first request that created it, so the
second request with the same system prompt diverges inside it; the shared bytes within the label
count, and an insert splits the node there.

Each node keeps a count per holder (how often that replica was sent this prefix, bounded by
halving every count of the node when one reaches ``max_count``): the scorer prefers the replica
seen MOST OFTEN, which stays stable under a randomising picker where "most recent" would flip.

Memory is bounded by ``budget_bytes`` for the whole index, enforced on an *accounted* size
(label bytes + a per-node and a per-holder cost calibrated against tracemalloc, with a margin);
least-recently-recorded leaves go first. The tests and ``bench/bench_prefix.py`` measure the
real size with tracemalloc and check it stays within the budget.

Where things live: :mod:`.prefix_capacity` (Capacity, PrefixConfig, partition_key),
:mod:`.prefix_holds` (the node and the vLLM / llama.cpp holding models), here the index itself:
matching, recording, splitting, the budget's eviction and the TTL's ageing, introspection.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple

from .prefix_capacity import (  # noqa: F401  (re-exported: the index's public names)
    BYTES_PER_TOKEN, Capacity, Partition, PrefixConfig, partition_key,
)
from .prefix_holds import _Hold, _hold_for, _Node
from .request_head import request_head  # noqa: F401  (re-exported: part of this module's API)

__all__ = [
    "Capacity", "PrefixConfig", "PrefixIndex", "Match", "request_head", "partition_key",
    "matched_fraction",
    "NODE_COST", "HOLDER_COST", "REPLICA_COST", "BYTES_PER_TOKEN",
]

# Accounted bytes per tree node (beyond its label) and per (node, replica) holding. Calibrated
# with tracemalloc on CPython 3.11 (tests/test_prefix_tree.py measures it): a node is ~430 B
# (the object, its label's bytes header, a holders dict, a children dict on inner nodes and its
# entry in the global LRU), a holding ~150 B (its entry in the node's holders dict and in the
# replica's LRU or refcount map); both carry a ~25 % margin so the measured size stays under
# the budget.
NODE_COST = 640
HOLDER_COST = 240
REPLICA_COST = 1024
_PARTITION_COST = 1024

_NOKEY = object()


def _lcp(a: bytes, b: bytes, pos: int) -> int:
    """Length of the common prefix of ``a`` and ``b[pos:]``: a binary search of C-level
    ``startswith`` checks that only copies the still-undecided half (≈ len(a) bytes in all)."""
    lo, hi = 0, min(len(a), len(b) - pos)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if b.startswith(a[lo:mid], pos + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


class Match(NamedTuple):
    matched_bytes: int  # the longest prefix of the head the tree knows (whoever holds it)
    head_bytes: int  # the head's length (after the max_head_bytes cut)
    holders: dict[str, tuple[int, int]]  # replica -> (head bytes it holds, its count there)

    def best(self) -> str | None:
        """The holder with the longest match, then the highest count, then the smallest id."""
        if not self.holders:
            return None
        return min(self.holders.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))[0]



class PrefixIndex:
    """The radix trees (one per partition), the replicas' modelled holdings, the byte budget."""

    def __init__(self, config: PrefixConfig | None = None) -> None:
        self.config = config or PrefixConfig()
        self._roots: dict[Partition, _Node] = {}
        self._root_keys: dict[_Node, Partition] = {}
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # every non-root node, oldest first
        self._holds: dict[str, _Hold] = {}
        self._caps: dict[str, Capacity] = {}
        self._names: dict[str, str] = {}  # the one str object each replica is keyed by
        self._acct = 0  # accounted bytes
        self._label_bytes = 0
        self.counts = {"records": 0, "lookups": 0, "splits": 0, "evicted_budget": 0,
                       "evicted_ttl": 0, "released_capacity": 0, "pruned": 0}

    # -- capacity and replicas ------------------------------------------------------------------
    def set_capacity(self, replica: str, capacity: Capacity) -> None:
        """What ``replica`` can hold from now on. Same kind: its holdings shrink to fit (LRU /
        least recently used slots first). Another kind (an engine swapped): forgotten."""
        self._caps[replica] = capacity
        hold = self._holds.get(replica)
        if hold is None:
            return
        if (capacity.slots is None) == (hold.kind == "bytes"):
            for nd in hold.recap(capacity):
                self._release(nd, replica)
        else:  # the next record starts a hold of the new kind
            del self._holds[replica]
            self._acct -= REPLICA_COST
            self._purge(replica, hold)

    def capacity(self, replica: str) -> Capacity:
        return self._caps.get(replica) or self.config.default_capacity

    def remove_replica(self, replica: str) -> None:
        """The replica left: no node names it any more, and its capacity is forgotten."""
        self._caps.pop(replica, None)
        self.clear_replica(replica)

    def clear_replica(self, replica: str) -> None:
        """The replica's cache was emptied (a restart, ``/reset_prefix_cache``, an
        ``AllBlocksCleared`` event): it holds nothing now; its capacity stays."""
        self._names.pop(replica, None)
        hold = self._holds.pop(replica, None)
        if hold is not None:
            self._purge(replica, hold)
            self._acct -= REPLICA_COST

    def _purge(self, replica: str, hold: _Hold) -> None:
        for nd in hold.nodes():
            if replica in nd.holders:
                self._drop_holder(nd, replica)

    def replicas(self) -> list[str]:
        return list(self._holds)

    # -- match ----------------------------------------------------------------------------------
    def match(self, partition: Partition, head: bytes, now: float, *,
              min_bytes: int = 0) -> Match:
        """What of ``head`` the tree knows, and which replicas hold how much of it (holders
        of fewer than ``min_bytes`` of it are left out). Read-only (bar expiring entries older
        than ``ttl_s``): only :meth:`record` says what was sent."""
        if self.config.ttl_s is not None:
            self._expire(now)
        self.counts["lookups"] += 1
        head = head[: self.config.max_head_bytes]
        n = len(head)
        node = self._roots.get(partition)
        if node is None or n == 0:
            return Match(0, n, {})
        pos = 0
        path: list[_Node] = []
        ends: list[int] = []
        while pos < n:
            ch = node.children
            if ch is None:
                break
            child = ch.get(head[pos])
            if child is None:
                break
            lab = child.label
            path.append(child)
            if head.startswith(lab, pos):
                pos += len(lab)
                ends.append(pos)
                node = child
                continue
            pos += _lcp(lab, head, pos)  # a partial label match counts
            ends.append(pos)
            break
        # shallow to deep, deeper entries overwriting: each replica ends with its deepest node
        holders: dict[str, tuple[int, int]] = {}
        for nd, m in zip(path, ends):
            if m >= min_bytes:
                for r, c in nd.holders.items():
                    holders[r] = (m, c)
        return Match(pos, n, holders)

    # -- record ---------------------------------------------------------------------------------
    def record(self, partition: Partition, head: bytes, replica: str, now: float, *,
               count: int = 1) -> None:
        """``replica`` was sent ``head`` (call it with the replica the picker actually chose):
        it now holds the head's path, each node's count for it grows by ``count``, and its
        capacity model releases what the engine would have evicted to make room."""
        head = head[: self.config.max_head_bytes]
        n = len(head)
        if n == 0:
            return
        if self.config.ttl_s is not None:
            self._expire(now)
        self.counts["records"] += 1
        replica = self._names.setdefault(replica, replica)  # one str object per replica
        hold = self._holds.get(replica)
        if hold is None:
            hold = self._holds[replica] = _hold_for(self.capacity(replica))
            self._acct += REPLICA_COST
        root = self._roots.get(partition)
        if root is None:
            root = self._roots[partition] = _Node(b"", 0, None)
            self._root_keys[root] = partition
            self._acct += _PARTITION_COST
        node = root
        pos = 0
        path: list[_Node] = []
        while pos < n:
            ch = node.children
            child = None if ch is None else ch.get(head[pos])
            if child is None:
                leaf = _Node(head[pos:], n, node)
                if ch is None:
                    node.children = {head[pos]: leaf}
                else:
                    ch[head[pos]] = leaf
                self._acct += NODE_COST + n - pos
                self._label_bytes += n - pos
                path.append(leaf)
                break
            lab = child.label
            if head.startswith(lab, pos):
                pos += len(lab)
                path.append(child)
                node = child
                continue
            k = _lcp(lab, head, pos)
            node = self._split(child, k)
            path.append(node)
            pos += k
        # leaf to root: every ancestor ends up more recent than its descendants
        lru = self._lru
        move = lru.move_to_end
        for nd in reversed(path):
            nd.last = now
            try:
                move(nd)
            except KeyError:
                lru[nd] = None
        cap = self.config.max_count
        new_holdings = 0
        for nd in path:
            h = nd.holders
            c = h.get(replica)
            if c is None:
                h[replica] = count
                new_holdings += 1
            else:
                c += count
                h[replica] = c
                if c >= cap:
                    for r in h:
                        h[r] = (h[r] >> 1) or 1
        self._acct += HOLDER_COST * new_holdings
        for nd in hold.touch(path):
            self._release(nd, replica)
        if self._acct > self.config.budget_bytes:
            self._evict()

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child``'s label after ``k`` bytes: a new node takes the first ``k`` and the
        same holders (each holding it too), ``child`` keeps the rest below it."""
        self.counts["splits"] += 1
        lab = child.label
        parent = child.parent
        assert parent is not None and parent.children is not None and 0 < k < len(lab)
        mid = _Node(lab[:k], child.end - len(lab) + k, parent)
        parent.children[lab[0]] = mid
        rest = lab[k:]
        child.label = rest
        child.parent = mid
        mid.children = {rest[0]: child}
        mid.holders = dict(child.holders)
        mid.last = child.last
        self._lru[mid] = None
        self._acct += NODE_COST + HOLDER_COST * len(mid.holders)
        for r in mid.holders:
            self._holds[r].split(child, mid)
        return mid

    # -- removal --------------------------------------------------------------------------------
    def _release(self, nd: _Node, replica: str) -> None:
        """The replica's capacity model says it no longer holds ``nd``."""
        if replica in nd.holders:
            self.counts["released_capacity"] += 1
            self._drop_holder(nd, replica)

    def _drop_holder(self, nd: _Node, replica: str) -> None:
        del nd.holders[replica]
        self._acct -= HOLDER_COST
        hold = self._holds.get(replica)
        if hold is not None and hold.empty():  # holds nothing: its state goes too
            del self._holds[replica]
            self._names.pop(replica, None)
            self._acct -= REPLICA_COST
        while not nd.holders and nd.children is None and nd.parent is not None:
            parent = nd.parent
            self.counts["pruned"] += 1
            self._unlink(nd)  # a leaf nobody holds routes nothing
            nd = parent

    def _unlink(self, nd: _Node) -> None:
        """Take the leaf ``nd`` out of the tree; its holders forget it."""
        parent = nd.parent
        assert parent is not None and nd.children is None
        ch = parent.children
        assert ch is not None
        del ch[nd.label[0]]
        if not ch:
            parent.children = None
        del self._lru[nd]
        self._acct -= NODE_COST + len(nd.label)
        self._label_bytes -= len(nd.label)
        if nd.holders:
            released: list[tuple[_Node, str]] = []
            holders = nd.holders
            nd.holders = {}
            for r in holders:
                hold = self._holds[r]
                released.extend((x, r) for x in hold.forget(nd))
                if hold.empty():
                    del self._holds[r]
                    self._names.pop(r, None)
                    self._acct -= REPLICA_COST
            self._acct -= HOLDER_COST * len(holders)
            for x, r in released:
                if x is not nd:
                    self._release(x, r)
        nd.parent = None
        if parent.parent is None and parent.children is None:  # maybe an empty partition
            key = self._root_keys.pop(parent, _NOKEY)
            if key is not _NOKEY:
                del self._roots[key]
                self._acct -= _PARTITION_COST

    def _evict(self) -> None:
        """Least recently recorded leaves out until the index fits its budget."""
        budget = self.config.budget_bytes
        lru = self._lru
        while self._acct > budget and lru:
            nd = next(iter(lru))
            if nd.children is not None:  # cannot happen (ancestors are more recent); be safe
                lru.move_to_end(nd)
                continue
            self.counts["evicted_budget"] += 1
            self._remove_leaf(nd)

    def _remove_leaf(self, nd: _Node) -> None:
        parent = nd.parent
        self._unlink(nd)
        # the parent may now be a leaf nobody holds
        while parent is not None and parent.parent is not None and not parent.holders \
                and parent.children is None and parent in self._lru:
            up = parent.parent
            self.counts["pruned"] += 1
            self._unlink(parent)
            parent = up

    def _expire(self, now: float) -> None:
        cut = now - (self.config.ttl_s or 0.0)
        lru = self._lru
        while lru:
            nd = next(iter(lru))
            if nd.last >= cut:
                break
            if nd.children is not None:
                lru.move_to_end(nd)
                continue
            self.counts["evicted_ttl"] += 1
            self._remove_leaf(nd)

    # -- introspection --------------------------------------------------------------------------
    @property
    def accounted_bytes(self) -> int:
        return self._acct

    def held_bytes(self, replica: str) -> int:
        """Head bytes the index believes the replica holds now (0 if it holds nothing)."""
        hold = self._holds.get(replica)
        return hold.held_bytes() if hold is not None else 0

    def stats(self, *, per_replica: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "partitions": len(self._roots), "nodes": len(self._lru),
            "bytes": self._acct, "label_bytes": self._label_bytes,
            "budget_bytes": self.config.budget_bytes, "replicas": len(self._holds),
            **self.counts,
        }
        if per_replica:
            out["held"] = {r: {"kind": h.kind, "held_bytes": h.held_bytes(),
                               "nodes": len(h.nodes()), "capacity": self.capacity(r).describe()}
                           for r, h in self._holds.items()}
        return out

    def iter_nodes(self) -> Iterator[tuple[Partition, _Node]]:
        for key, root in self._roots.items():
            stack = list((root.children or {}).values())
            while stack:
                nd = stack.pop()
                yield key, nd
                if nd.children:
                    stack.extend(nd.children.values())

    def holders_of(self, replica: str) -> int:
        """How many nodes name ``replica`` as a holder (a full scan: tests and debugging)."""
        return sum(1 for _, nd in self.iter_nodes() if replica in nd.holders)

    def check(self) -> None:
        """Assert every internal invariant (tests): structure, accounting, holdings."""
        seen: set[int] = set()
        acct = _PARTITION_COST * len(self._roots) + REPLICA_COST * len(self._holds)
        labels = 0
        holdings: dict[str, set[_Node]] = {}
        for key, root in self._roots.items():
            assert root.children, f"empty partition {key!r} kept"
            stack = [root]
            while stack:
                nd = stack.pop()
                if nd.children is not None:
                    assert nd.children, "empty children dict"
                    for b, c in nd.children.items():
                        assert c.parent is nd and c.label and c.label[0] == b, "child link"
                        assert c.end == nd.end + len(c.label), "child end"
                        stack.append(c)
                if nd is root:
                    continue
                seen.add(id(nd))
                assert nd in self._lru, "node missing from the lru"
                assert nd.holders or nd.children, "a leaf nobody holds was kept"
                acct += NODE_COST + len(nd.label) + HOLDER_COST * len(nd.holders)
                labels += len(nd.label)
                for r in nd.holders:
                    holdings.setdefault(r, set()).add(nd)
        assert len(seen) == len(self._lru), "lru holds nodes not in a tree"
        assert acct == self._acct, f"accounted {self._acct} != recomputed {acct}"
        assert labels == self._label_bytes
        for r, hold in self._holds.items():
            hold.check()
            assert set(hold.nodes()) == holdings.get(r, set()), f"holdings of {r}"
        assert set(holdings) <= set(self._holds)


def matched_fraction(m: Match, replica: str) -> float:
    """The share of the head ``replica`` holds (0..1)."""
    h = m.holders.get(replica)
    return h[0] / m.head_bytes if h and m.head_bytes else 0.0

