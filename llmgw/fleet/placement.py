"""Placement v1: which node runs a new replica.

A replica fits a node when the node is ready, carries the model's selector labels, has enough
free GPUs with enough memory each, and enough host memory. Among the nodes it fits, a model's
replicas spread: fewest of this model on the node, then fewest of it in the node's rack, then
the least-loaded node, then the name (so placement is deterministic). GPUs are taken best-fit:
the smallest free ones that are large enough, so large GPUs stay free for large models.

A lazy heap keeps placing many replicas cheap: a popped node whose key has gone up since it was
pushed (a sibling in its rack took a replica) is pushed back instead of taken.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from llmgw.fleet.nodes import Node

__all__ = ["RACK_KEY", "Demand", "Placer"]

RACK_KEY = "llmgw.io/rack"


@dataclass(frozen=True)
class Demand:
    gpus: int = 0
    gpu_memory_mb: int = 0  # on each GPU
    memory_mb: int = 0
    selector: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        parts = []
        if self.gpus:
            parts.append(f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}"
                         + (f" of ≥{self.gpu_memory_mb} MB" if self.gpu_memory_mb else ""))
        if self.memory_mb:
            parts.append(f"{self.memory_mb} MB of memory")
        if self.selector:
            parts.append("labels " + ",".join(f"{k}={v}" for k, v in self.selector))
        return ", ".join(parts) or "nothing"

    def to_wire(self) -> dict[str, Any]:
        """As the store keeps it, next to the assignment's spec (``spec["demand"]``)."""
        return {"gpus": self.gpus, "gpu_memory_mb": self.gpu_memory_mb, "memory_mb": self.memory_mb,
                "selector": [list(kv) for kv in self.selector]}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Demand:
        return cls(int(d.get("gpus", 0)), int(d.get("gpu_memory_mb", 0)), int(d.get("memory_mb", 0)),
                   tuple(tuple(kv) for kv in d.get("selector", ())))  # type: ignore[misc]


@dataclass
class _Bin:
    name: str
    labels: dict[str, str]
    rack: str
    free_gpus: dict[int, int]  # index -> memory MB
    memory_free: int | None  # None: the node did not say
    per_model: Counter[str] = field(default_factory=Counter)
    total: int = 0

    def misfit(self, d: Demand) -> str | None:
        for k, v in d.selector:
            if self.labels.get(k) != v:
                return "selector"
        if d.gpus:
            big = sum(1 for m in self.free_gpus.values() if m >= d.gpu_memory_mb)
            if len(self.free_gpus) < d.gpus:
                return "gpus"
            if big < d.gpus:
                return "gpu_memory"
        if d.memory_mb and self.memory_free is not None and self.memory_free < d.memory_mb:
            return "memory"
        return None

    def take(self, d: Demand, model: str) -> tuple[int, ...]:
        gpus: tuple[int, ...] = ()
        if d.gpus:
            big = sorted((m, i) for i, m in self.free_gpus.items() if m >= d.gpu_memory_mb)
            gpus = tuple(sorted(i for _, i in big[:d.gpus]))
            for i in gpus:
                del self.free_gpus[i]
        if d.memory_mb and self.memory_free is not None:
            self.memory_free -= d.memory_mb
        self.per_model[model] += 1
        self.total += 1
        return gpus


_WHY = {"selector": "lack the selector labels", "gpus": "have too few free GPUs",
        "gpu_memory": "have too few free GPUs with enough memory", "memory": "have too little free memory"}


class Placer:
    """Capacity of the ready nodes for one reconciliation round; `place` consumes it."""

    def __init__(self, nodes: Iterable[Node],
                 placed: Iterable[tuple[str, str, Demand, tuple[int, ...]]] = ()) -> None:
        """nodes: all known nodes; placed: (node, model, demand, gpu indices) already there."""
        self.bins: dict[str, _Bin] = {}
        self.not_ready = 0
        for n in nodes:
            if not n.schedulable:
                self.not_ready += 1
                continue
            labels = n.labels
            self.bins[n.name] = _Bin(n.name, labels, labels.get(RACK_KEY, ""),
                                     {g.index: g.memory_mb for g in n.facts.gpus},
                                     n.facts.memory_mb or None)
        self.rack_count: dict[str, Counter[str]] = {}  # model -> rack -> replicas
        for node, model, d, gpus in placed:
            b = self.bins.get(node)
            if b is None:
                continue
            for i in gpus:
                b.free_gpus.pop(i, None)
            if d.memory_mb and b.memory_free is not None:
                b.memory_free -= d.memory_mb
            b.per_model[model] += 1
            b.total += 1
            self.rack_count.setdefault(model, Counter())[b.rack] += 1

    def place(self, model: str, d: Demand, n: int) -> tuple[list[tuple[str, tuple[int, ...]]], str | None]:
        """Up to n placements as (node, gpu indices); and why not all, when not all fit."""
        racks = self.rack_count.setdefault(model, Counter())

        def key(b: _Bin) -> tuple[int, int, int, str]:
            return (b.per_model[model], racks[b.rack] if b.rack else 0, b.total, b.name)

        heap = [(key(b), b.name) for b in self.bins.values() if b.misfit(d) is None]
        heapq.heapify(heap)
        out: list[tuple[str, tuple[int, ...]]] = []
        while len(out) < n and heap:
            k, name = heapq.heappop(heap)
            b = self.bins[name]
            now = key(b)
            if now != k:  # stale: its rack gained a replica since it was pushed
                heapq.heappush(heap, (now, name))
                continue
            out.append((name, b.take(d, model)))
            racks[b.rack] += 1
            if b.misfit(d) is None:
                heapq.heappush(heap, (key(b), name))
        return out, (None if len(out) == n else self.why_not(d, n - len(out)))

    def why_not(self, d: Demand, missing: int) -> str:
        counts = Counter(b.misfit(d) for b in self.bins.values())
        parts = [f"{c} {_WHY[r]}" for r, c in sorted(counts.items(), key=lambda rc: -rc[1]) if r]
        if self.not_ready:
            parts.append(f"{self.not_ready} not ready")
        head = f"{missing} replica{'s' if missing > 1 else ''} cannot be placed (each needs {d.describe()})"
        if not self.bins and not self.not_ready:
            return head + ": no nodes have joined"
        return head + ": of the nodes, " + "; ".join(parts) if parts else head
