"""The router's view of its nodes: ready, not ready, lost — and the timeouts between them.

A node is *ready* while its agent is connected and heard from. Silence (a closed stream or late
heartbeats) makes it *not ready* at once: nothing new is placed there, but its replicas keep
serving, since the data path to its engines does not go through the agent. Only after
`lost_after_s` of being not ready is it *lost*, and only then do its replicas move. A short blip
therefore reschedules nothing.

When many nodes fall silent together, the likelier story is that the router itself is cut off.
The partition guard (:meth:`NodeRegistry.tick`; the rule and why are in docs/architecture.md,
"The partition guard") weighs only the nodes that matter — nodes that are ready, and silent nodes
that hold replicas — so names that hold nothing (ghosts registered with the join token) can
neither trigger it nor hold it shut; it judges each failure domain (the node's path down to its
rack) apart, and in a domain that looks cut off it slows the losses to one per
`partition_lost_interval_s` instead of stopping them for good. Only when the router reaches no
node that matters at all is nothing declared lost. A router that has just started treats nodes it
knows from its store the same way: not ready until their agents reconnect, lost only after the
timeout.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from llmgw.fleet.types import NodeFacts

__all__ = ["FACILITY_KEYS", "Node", "NodeRegistry", "NodeState", "NodeTimeouts", "Transition", "failure_domain",
           "location"]

NodeState = Literal["ready", "not_ready", "lost"]

# The facility hierarchy, outermost first; a node's location is the path of the ones it has.
FACILITY_KEYS = ("llmgw.io/site", "llmgw.io/room", "llmgw.io/row", "llmgw.io/rack", "llmgw.io/pdu")


def location(labels: dict[str, str]) -> str:
    return "/".join(labels[k] for k in FACILITY_KEYS if labels.get(k))


def failure_domain(labels: dict[str, str]) -> str:
    """The domain the partition guard judges a node in: its location down to the rack (a rack's
    switch is what cuts its nodes off together); "" for nodes without facility labels."""
    return "/".join(labels[k] for k in FACILITY_KEYS[:-1] if labels.get(k))


@dataclass(frozen=True)
class NodeTimeouts:
    not_ready_after_s: float = 5.0
    lost_after_s: float = 30.0
    max_lost_fraction: float = 0.5
    partition_lost_interval_s: float = 60.0  # in a domain that looks cut off: one node lost per this


@dataclass
class Node:
    name: str
    state: NodeState
    since: float  # when it entered `state` (router's monotonic clock)
    connected: bool = False
    last_seen: float | None = None
    agent_id: str | None = None
    agent_labels: dict[str, str] = field(default_factory=dict)
    operator_labels: dict[str, str] = field(default_factory=dict)  # override the agent's own
    facts: NodeFacts = field(default_factory=NodeFacts)
    reason: str = ""  # why it is in its state

    @property
    def labels(self) -> dict[str, str]:
        return {**self.agent_labels, **self.operator_labels}

    @property
    def schedulable(self) -> bool:
        return self.state == "ready"


@dataclass(frozen=True)
class Transition:
    node: str
    old: NodeState | None  # None: first seen
    new: NodeState
    reason: str


class NodeRegistry:
    def __init__(self, timeouts: NodeTimeouts, now: float) -> None:
        self.t = timeouts
        self.nodes: dict[str, Node] = {}
        self.partition_suspected = False
        self.cut_off = False  # no node answers while silent ones hold replicas: nothing is lost
        self.disrupted: dict[str, str] = {}  # failure domain -> why the guard holds its losses back
        self._disrupted_since: dict[str, float] = {}  # domain -> since when (or its last loss since)
        self._started = now

    def remember(self, name: str, *, agent_labels: dict[str, str], operator_labels: dict[str, str],
                 facts: NodeFacts, now: float) -> None:
        """A node known from the store: not ready until its agent reconnects."""
        if name not in self.nodes:
            self.nodes[name] = Node(name, "not_ready", now, agent_labels=dict(agent_labels),
                                    operator_labels=dict(operator_labels), facts=facts,
                                    reason="not connected since the router started")

    def connected(self, name: str, agent_id: str, *, labels: dict[str, str], facts: NodeFacts,
                  now: float) -> list[Transition]:
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = Node(name, "ready", now, reason="joined")
            out = [Transition(name, None, "ready", "joined")]
        else:
            out = self._move(node, "ready", "agent connected", now)
        node.connected, node.last_seen, node.agent_id = True, now, agent_id
        node.agent_labels, node.facts = dict(labels), facts
        return out

    def heard(self, name: str, agent_id: str, now: float) -> list[Transition]:
        node = self.nodes.get(name)
        if node is None or node.agent_id != agent_id:
            return []
        node.last_seen = now
        if node.state != "ready" and node.connected:
            return self._move(node, "ready", "heartbeats resumed", now)
        return []

    def disconnected(self, name: str, agent_id: str, reason: str, now: float) -> list[Transition]:
        """The stream of `agent_id` ended (a newer connection for the node may have replaced it)."""
        node = self.nodes.get(name)
        if node is None or node.agent_id != agent_id or not node.connected:
            return []
        node.connected = False
        return self._move(node, "not_ready", reason, now)

    def set_operator_labels(self, name: str, labels: dict[str, str]) -> None:
        if name in self.nodes:
            self.nodes[name].operator_labels = dict(labels)

    def forget(self, name: str) -> bool:
        return self.nodes.pop(name, None) is not None

    def tick(self, now: float, holding: Collection[str] | None = None) -> list[Transition]:
        """Apply the timeouts: late heartbeats → not ready; not ready too long → lost, as the
        partition guard allows. `holding`: the nodes that hold replicas (None: count every node
        as holding some — the cautious view)."""
        out: list[Transition] = []
        for node in self.nodes.values():
            if node.state == "ready" and node.last_seen is not None \
                    and now - node.last_seen > self.t.not_ready_after_s:
                out += self._move(node, "not_ready", f"no heartbeat for {now - node.last_seen:.1f}s", now)
        holds = (lambda n: True) if holding is None else (lambda n: n in holding)  # noqa: E731
        due = sorted((n for n in self.nodes.values()
                      if n.state == "not_ready" and now - n.since >= self.t.lost_after_s),
                     key=lambda n: (n.since, n.name))
        # A silent node holding nothing moves nothing when lost: no guard needed (ghosts end here).
        for node in [n for n in due if not holds(n.name)]:
            out += self._move(node, "lost", f"not ready for {now - node.since:.0f}s", now)
        # Per failure domain, the nodes holding replicas and how many of them are silent: only
        # these matter to the fractions (a name holding nothing cannot tilt them either way).
        total: dict[str, int] = {}
        silent: dict[str, int] = {}
        for n in self.nodes.values():
            if n.state != "lost" and holds(n.name):
                d = failure_domain(n.labels)
                total[d] = total.get(d, 0) + 1
                silent[d] = silent.get(d, 0) + (n.state == "not_ready")
        # Cut off: silent holders, and no node at all answering that could take their replicas.
        cut_off = any(silent.values()) and not any(n.state == "ready" for n in self.nodes.values())
        disrupted: dict[str, str] = {}
        if cut_off:  # nothing to act on, nowhere to move to
            disrupted = {d: "no node that could take its replicas is reachable" for d, s in silent.items() if s}
        else:
            for d, k in total.items():
                s = silent[d]
                # A domain's holders all silent while some node answers is that domain's failure (acted
                # on at once); a large part of them silent, not all, is likelier the router's own network.
                if 0 < s < k and k >= 3 and s / k > self.t.max_lost_fraction:
                    disrupted[d] = f"{s} of its {k} nodes holding replicas silent"
        for d in list(self._disrupted_since):
            if d not in disrupted:
                del self._disrupted_since[d]
        for d in disrupted:
            self._disrupted_since.setdefault(d, now)
        self.disrupted, self.cut_off = disrupted, cut_off
        self.partition_suspected = bool(disrupted)
        for node in [n for n in due if holds(n.name)]:
            d = failure_domain(node.labels)
            if cut_off:
                continue
            if d in disrupted:  # slowed, not stopped: one node per interval in this domain
                if now - self._disrupted_since[d] < self.t.partition_lost_interval_s:
                    continue
                self._disrupted_since[d] = now
                reason = f"not ready for {now - node.since:.0f}s (its domain looks cut off: {disrupted[d]}; " \
                         f"one node lost per {self.t.partition_lost_interval_s:.0f}s)"
            else:
                reason = f"not ready for {now - node.since:.0f}s"
            out += self._move(node, "lost", reason, now)
        return out

    def _move(self, node: Node, new: NodeState, reason: str, now: float) -> list[Transition]:
        if node.state == new:
            return []
        old = node.state
        node.state, node.since, node.reason = new, now, reason
        return [Transition(node.name, old, new, reason)]

    def ready_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.state == "ready"]
