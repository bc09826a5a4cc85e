"""The candidate nodes of one `Placer.place` call as a tree of domains, for the best node in
O(depth × log) per replica instead of O(nodes).

A replica goes down the tree: at each spread level, into the child domain with the fewest of the
model's replicas, then the fewest replicas of any model (the least loaded), then the name; at the
bottom, to the node with the fewest of the model, then the fewest at all, then the name. Each
level keeps a heap of its children, built when first read. Keys only grow while placing (counts
and loads go up, a node that fills up leaves), so a heap's top is re-checked and re-sifted when
stale ("lazy"). A branch with nothing left is dropped from its parent's heap; a node that comes
back (deferred by a hard spread rule, then let) is pushed again along its path.

A prefill/decode group's replica (UnitTree) ranks by the fewest of its group first, then of the
model, then the load: each group spreads on its own, and apart from the other where it can.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from typing import Any

__all__ = ["DomainTree", "Skeleton", "UnitTree"]

Key = tuple[Any, ...]


class _Level:
    __slots__ = ("children", "dom_index")

    def __init__(self, dom_index: int | None) -> None:
        self.dom_index = dom_index  # the LEVELS index its children are domains of; None: children are nodes
        self.children: dict[str, Any] = {}  # domain (or node name) -> _Level | placement._Bin


class Skeleton:
    """The fitting nodes grouped by their domain path: the same for every model with the same
    demand in a round (the Placer caches it); each model's DomainTree keeps its own heaps."""

    def __init__(self, leaves: Iterable[Any], levels: list[int]) -> None:
        self.levels = levels
        self.root = _Level(levels[0] if levels else None)
        self.bins: dict[str, Any] = {}
        for b in leaves:
            self.bins[b.name] = b
            node = self.root
            for depth, i in enumerate(levels):
                dom = b.domains[i]
                child = node.children.get(dom)
                if child is None:
                    child = node.children[dom] = _Level(levels[depth + 1] if depth + 1 < len(levels) else None)
                node = child
            node.children[b.name] = b


class DomainTree:
    def __init__(self, skel: Skeleton, counts: list[Counter[str]], load: Counter[str], model: str) -> None:
        """counts: the model's replicas per domain, per level; load: every replica per domain."""
        self.skel = skel
        self.levels = skel.levels
        self.counts = counts
        self.load = load
        self.model = model
        self.gone: set[str] = set()  # leaves out of the running (full, or deferred for now)
        self.heaps: dict[int, list[tuple[Key, str]]] = {}  # id(level) -> its heap, built when first read

    def _entry(self, lv: _Level, name: str) -> Key | None:
        if lv.dom_index is None:
            if name in self.gone:
                return None
            b = lv.children[name]
            return (b.per_model[self.model], b.total, name)
        if not name:
            return (0, 0, name)
        return (self.counts[lv.dom_index][name], self.load[name], name)

    def _heap(self, lv: _Level) -> list[tuple[Key, str]]:
        h = self.heaps.get(id(lv))
        if h is None:
            h = [(k, name) for name in lv.children if (k := self._entry(lv, name)) is not None]
            heapq.heapify(h)
            self.heaps[id(lv)] = h
        return h

    def best(self, lv: _Level | None = None) -> str | None:
        """The node a replica goes to next: at each level the child domain with the fewest of the
        model's replicas (then the fewest replicas at all, then the name), down to the node."""
        lv = lv or self.skel.root
        h = self._heap(lv)
        while h:
            k, name = h[0]
            cur = self._entry(lv, name)
            if cur is None:
                heapq.heappop(h)
            elif cur != k:
                heapq.heapreplace(h, (cur, name))
            elif lv.dom_index is None:
                return name
            else:
                below = self.best(lv.children[name])
                if below is not None:
                    return below
                heapq.heappop(h)  # nothing left below it (restore pushes it back)
        return None

    def remove(self, name: str) -> None:
        self.gone.add(name)

    def restore(self, name: str) -> None:
        """A removed node is back: its branch is pushed again along its path (where heaps exist)."""
        if name not in self.gone:
            return
        self.gone.discard(name)
        b = self.skel.bins[name]
        path = [self.skel.root]
        for i in self.levels:
            path.append(path[-1].children[b.domains[i]])
        for depth, lv in enumerate(path):
            h = self.heaps.get(id(lv))
            if h is None:
                continue  # built later, with it
            child = name if depth == len(path) - 1 else b.domains[self.levels[depth]]
            k = self._entry(lv, child)
            if k is not None:
                heapq.heappush(h, (k, child))


class UnitTree(DomainTree):
    """A DomainTree for one group of a disaggregated model: `unit_counts` are the group's replicas
    per domain, per level (they only grow while placing, as the model's do), `unit` its key in a
    node's ``per_unit``."""

    def __init__(self, skel: Skeleton, counts: list[Counter[str]], load: Counter[str], model: str,
                 unit_counts: list[Counter[str]], unit: tuple[str, str]) -> None:
        super().__init__(skel, counts, load, model)
        self.unit_counts = unit_counts
        self.unit = unit

    def _entry(self, lv: _Level, name: str) -> Key | None:
        if lv.dom_index is None:
            if name in self.gone:
                return None
            b = lv.children[name]
            return (b.per_unit[self.unit], b.per_model[self.model], b.total, name)
        if not name:
            return (0, 0, 0, name)
        i = lv.dom_index
        return (self.unit_counts[i][name], self.counts[i][name], self.load[name], name)
