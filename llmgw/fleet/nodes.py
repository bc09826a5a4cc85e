"""The router's view of its nodes: ready, not ready, lost — and the timeouts between them.

A node is *ready* while its agent is connected and heard from. Silence (a closed stream or late
heartbeats) makes it *not ready* at once: nothing new is placed there, but its replicas keep
serving, since the data path to its engines does not go through the agent. Only after
`lost_after_s` of being not ready is it *lost*, and only then do its replicas move. A short blip
therefore reschedules nothing.

When many nodes fall silent together, the likelier story is that the router itself is cut off:
above `max_lost_fraction` of the known nodes silent, no node is declared lost (and this is
reported) until enough of them return. A router that has just started treats nodes it knows from
its store the same way: not ready until their agents reconnect, lost only after the timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from llmgw.fleet.types import NodeFacts

__all__ = ["FACILITY_KEYS", "Node", "NodeRegistry", "NodeState", "NodeTimeouts", "Transition", "location"]

NodeState = Literal["ready", "not_ready", "lost"]

# The facility hierarchy, outermost first; a node's location is the path of the ones it has.
FACILITY_KEYS = ("llmgw.io/site", "llmgw.io/room", "llmgw.io/row", "llmgw.io/rack", "llmgw.io/pdu")


def location(labels: dict[str, str]) -> str:
    return "/".join(labels[k] for k in FACILITY_KEYS if labels.get(k))


@dataclass(frozen=True)
class NodeTimeouts:
    not_ready_after_s: float = 5.0
    lost_after_s: float = 30.0
    max_lost_fraction: float = 0.5


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

    def tick(self, now: float) -> list[Transition]:
        """Apply the timeouts: late heartbeats → not ready; not ready too long → lost."""
        out: list[Transition] = []
        for node in self.nodes.values():
            if node.state == "ready" and node.last_seen is not None \
                    and now - node.last_seen > self.t.not_ready_after_s:
                out += self._move(node, "not_ready", f"no heartbeat for {now - node.last_seen:.1f}s", now)
        candidates = [n for n in self.nodes.values()
                      if n.state == "not_ready" and now - n.since >= self.t.lost_after_s]
        # Lost nodes are out of the count: decommissioned ones must not hold the guard shut.
        known = sum(1 for n in self.nodes.values() if n.state != "lost")
        silent = sum(1 for n in self.nodes.values() if n.state == "not_ready")
        # One node (or two) going silent is just that; a majority at once is our own cut-off.
        self.partition_suspected = known >= 3 and silent / known > self.t.max_lost_fraction
        if not self.partition_suspected:
            for node in candidates:
                out += self._move(node, "lost", f"not ready for {now - node.since:.0f}s", now)
        return out

    def _move(self, node: Node, new: NodeState, reason: str, now: float) -> list[Transition]:
        if node.state == new:
            return []
        old = node.state
        node.state, node.since, node.reason = new, now, reason
        return [Transition(node.name, old, new, reason)]

    def ready_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.state == "ready"]
