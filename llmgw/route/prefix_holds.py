"""The prefix tree's node and the replicas' modelled holdings: what each replica's engine still
caches of the tree, aged out as the engine would evict it (see :mod:`.prefix_tree`'s docstring).

  :class:`_LruHold`   vLLM: an LRU byte budget over the nodes it holds, deepest first;
  :class:`_SlotHold`  llama.cpp: ``-np`` slots each holding its last prompt, plus an optional
                      host-RAM prompt cache.

Both answer ``touch`` (a path was sent: what falls out), ``split``, ``forget``, ``recap`` (a
new :class:`~.prefix_capacity.Capacity`). Private to :class:`~.prefix_tree.PrefixIndex`, which
owns the trees and the accounting; on its hot path, so change with ``bench/bench_prefix.py``.
"""

from __future__ import annotations

from collections import OrderedDict

from .prefix_capacity import Capacity


class _Node:
    __slots__ = ("label", "end", "parent", "children", "holders", "last")

    def __init__(self, label: bytes, end: int, parent: _Node | None) -> None:
        self.label = label
        self.end = end  # bytes from the partition root to the end of this label
        self.parent = parent
        self.children: dict[int, _Node] | None = None  # first byte of the child's label -> child
        self.holders: dict[str, int] = {}  # replica -> count
        self.last = 0.0  # `now` of the last record through this node


class _LruHold:
    """vLLM: the replica holds nodes within a byte capacity, least recently sent first out.
    Paths are touched leaf to root, so an ancestor is always more recent than its descendants
    and eviction takes tails before the prefixes they extend."""

    __slots__ = ("cap", "lru", "used")
    kind = "bytes"

    def __init__(self, cap: Capacity) -> None:
        self.cap = cap
        self.lru: OrderedDict[_Node, None] = OrderedDict()
        self.used = 0

    def touch(self, path: list[_Node]) -> list[_Node]:
        lru = self.lru
        move = lru.move_to_end
        for nd in reversed(path):
            try:
                move(nd)
            except KeyError:
                lru[nd] = None
                self.used += len(nd.label)
        return self._fit()

    def _fit(self) -> list[_Node]:
        out: list[_Node] = []
        limit = self.cap.bytes or 0
        lru = self.lru
        while self.used > limit and lru:
            nd, _ = lru.popitem(last=False)
            self.used -= len(nd.label)
            out.append(nd)
        return out

    def split(self, child: _Node, mid: _Node) -> None:
        # the bytes are conserved (child's label shrank by what mid took); mid must stay more
        # recent than child and less recent than its own ancestors
        lru = self.lru
        lru[mid] = None
        a = mid.parent
        while a is not None and a.parent is not None:
            if a in lru:
                lru.move_to_end(a)
            a = a.parent

    def forget(self, nd: _Node) -> list[_Node]:
        if self.lru.pop(nd, 0) is None:
            self.used -= len(nd.label)
        return []

    def recap(self, cap: Capacity) -> list[_Node]:
        self.cap = cap
        return self._fit()

    def nodes(self) -> list[_Node]:
        return list(self.lru)

    def empty(self) -> bool:
        return not self.lru

    def held_bytes(self) -> int:
        return self.used

    def check(self) -> None:
        assert self.used == sum(len(n.label) for n in self.lru), "lru used bytes"


class _SlotHold:
    """llama.cpp: ``slots`` slots, each holding the path of its last prompt; a node is held while
    a slot (or the host-RAM cache) references it."""

    __slots__ = ("cap", "term", "tick", "clock", "refs", "ram", "ram_used")
    kind = "slots"

    def __init__(self, cap: Capacity) -> None:
        self.cap = cap
        n = cap.slots or 1
        self.term: list[_Node | None] = [None] * n  # each slot's prompt: its last node
        self.tick = [0] * n
        self.clock = 0
        self.refs: dict[_Node, int] = {}
        self.ram: OrderedDict[_Node, None] = OrderedDict()  # saved prompts, by their last node
        self.ram_used = 0

    def _ref(self, t: _Node) -> None:
        refs = self.refs
        while t.parent is not None:
            refs[t] = refs.get(t, 0) + 1
            t = t.parent

    def _unref(self, t: _Node | None, out: list[_Node]) -> None:
        refs = self.refs
        while t is not None and t.parent is not None:
            c = refs.get(t)
            if c is not None:
                if c <= 1:
                    del refs[t]
                    out.append(t)
                else:
                    refs[t] = c - 1
            t = t.parent

    def touch(self, path: list[_Node]) -> list[_Node]:
        t = path[-1]
        on = set(path)
        term = self.term
        best, best_lcp = -1, 0
        for i, o in enumerate(term):
            x = o
            while x is not None and x not in on:
                x = x.parent
            if x is not None and x.end > best_lcp:
                best, best_lcp = i, x.end
        if best < 0 or best_lcp < self.cap.similarity * t.end:
            tick = self.tick
            best = term.index(None) if None in term else tick.index(min(tick))
        self.clock += 1
        self.tick[best] = self.clock
        old = term[best]
        term[best] = t
        self._ref(t)
        out: list[_Node] = []
        if old is not None:
            if self.cap.ram_bytes and old not in on:  # pushed out of its slot: into host RAM
                if old in self.ram:
                    self.ram.move_to_end(old)
                else:
                    self.ram[old] = None
                    self.ram_used += old.end
                    self._ref(old)
            self._unref(old, out)
        self._fit_ram(out)
        return out

    def _fit_ram(self, out: list[_Node]) -> None:
        limit = self.cap.ram_bytes
        while self.ram_used > limit and self.ram:
            o, _ = self.ram.popitem(last=False)
            self.ram_used -= o.end
            self._unref(o, out)

    def split(self, child: _Node, mid: _Node) -> None:
        self.refs[mid] = self.refs.get(child, 1)

    def forget(self, nd: _Node) -> list[_Node]:
        self.refs.pop(nd, None)
        up = nd.parent if nd.parent is not None and nd.parent.parent is not None else None
        self.term = [up if t is nd else t for t in self.term]
        out: list[_Node] = []
        if nd in self.ram:  # a saved prompt loses its tail: drop the entry and its references
            del self.ram[nd]
            self.ram_used -= nd.end
            self._unref(nd.parent, out)
        return out

    def recap(self, cap: Capacity) -> list[_Node]:
        out: list[_Node] = []
        n = cap.slots or 1
        if n < len(self.term):  # fewer slots: the least recently used ones go
            order = sorted(range(len(self.term)), key=self.tick.__getitem__, reverse=True)
            keep = sorted(order[:n])
            for i in order[n:]:
                self._unref(self.term[i], out)
            self.term = [self.term[i] for i in keep]
            self.tick = [self.tick[i] for i in keep]
        elif n > len(self.term):
            self.term += [None] * (n - len(self.term))
            self.tick += [0] * (n - len(self.tick))
        self.cap = cap
        self._fit_ram(out)
        return out

    def nodes(self) -> list[_Node]:
        return list(self.refs)

    def empty(self) -> bool:
        return not self.refs

    def held_bytes(self) -> int:
        return sum(len(n.label) for n in self.refs)

    def check(self) -> None:
        want: dict[_Node, int] = {}
        for t in [*self.term, *self.ram]:
            while t is not None and t.parent is not None:
                want[t] = want.get(t, 0) + 1
                t = t.parent
        assert want == self.refs, "slot refcounts"
        assert self.ram_used == sum(t.end for t in self.ram), "ram bytes"


_Hold = _LruHold | _SlotHold


def _hold_for(cap: Capacity) -> _Hold:
    return _SlotHold(cap) if cap.slots is not None else _LruHold(cap)

