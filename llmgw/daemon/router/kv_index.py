"""The router's tier-2 KV index (llmgw.kv.index.KVIndex) as the running router holds it: fed by the
agents' kv_events messages, each accepted only from the node that runs the replica (the control
plane checks that, see plane.py), and emptied for a replica that leaves routing or whose agent's
stream ends (the agent sends a full copy on its next session). Also its Prometheus metrics.

Bounds: the index holds at most ``max_blocks_per_replica`` blocks per replica (KVIndex's cap:
beyond it the replica is emptied and votes with nothing until a reset), and only replicas the
control plane has assigned, so an agent cannot grow it with names of its own choosing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.fleet.wire import KvEvents
from llmgw.kv.index import KVIndex
from llmgw.kv.mirror import (
    AGENT_COUNTS,
    REPLAY_OUTCOMES,
    REPLAY_REASONS,
    Delta,
    replay_count,
)

__all__ = ["REFUSE_REASONS", "KvIndexMetrics", "RouterKvIndex"]

# Why a kv_events message was refused (the label of llmgw_kv_events_refused_total).
REFUSE_REASONS = ("unknown_replica", "other_node")


class RouterKvIndex:
    def __init__(self, max_blocks_per_replica: int = 1 << 20) -> None:
        self.index = KVIndex(max_blocks_per_replica)
        self.refused: Counter[str] = Counter({r: 0 for r in REFUSE_REASONS})
        self.messages = 0  # kv_events messages applied
        # what the agents counted (gaps, bad frames, replays: AGENT_COUNTS), summed over replicas,
        # and per replica while it is assigned
        self.agent_counts: Counter[str] = Counter({k: 0 for k in AGENT_COUNTS})
        self.replica_counts: dict[str, Counter[str]] = {}

    def apply(self, msg: KvEvents) -> bool:
        """Apply one agent's message (the caller has checked the sender runs the replica); False
        when the replica overflowed its cap (it is empty until the agent's next reset)."""
        self.messages += 1
        if msg.counts:
            known = {k: n for k, n in msg.counts if k in self.agent_counts}  # a newer agent's: ignored
            self.agent_counts.update(known)
            if not (msg.reset or msg.added or msg.removed) and msg.replica not in self.index.replicas():
                return True  # a stopped engine's last counts: its replica is not (re)created in the index
            self.replica_counts.setdefault(msg.replica, Counter()).update(known)
        return self.index.apply_delta(msg.replica, Delta(seq=msg.event_seq, reset=msg.reset,
                                                         added=list(msg.added), removed=list(msg.removed)))

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1

    def remove(self, replica: str) -> None:
        self.index.remove_replica(replica)
        self.replica_counts.pop(replica, None)

    def size(self, replica: str) -> int:
        return self.index.size(replica)


class KvIndexMetrics(Collector):
    """llmgw_kv_index_blocks{endpoint}, llmgw_kv_events_refused_total{reason} and the index's totals."""

    def __init__(self, kv: RouterKvIndex) -> None:
        self.kv = kv

    def collect(self) -> Iterable[Metric]:
        idx = self.kv.index
        g = GaugeMetricFamily("llmgw_kv_index_blocks", "KV blocks the router's tier-2 index holds per endpoint.",
                              labels=["endpoint"])
        for rid in idx.replicas():
            g.add_metric([str(rid)], float(idx.size(rid)))
        yield g
        c = CounterMetricFamily("llmgw_kv_events_refused", "kv_events messages refused: for a replica the "
                                "router does not know, or one another node runs.", labels=["reason"])
        for reason, n in sorted(self.kv.refused.items()):
            c.add_metric([reason], float(n))
        yield c
        ac = self.kv.agent_counts
        r = CounterMetricFamily("llmgw_kv_replays", "Agents' replays of an engine's KV events, by reason (gap: "
                                "a sequence gap; start: a new subscription) and outcome (ok, or why the mirror "
                                "could not be brought up to date that way).", labels=["reason", "outcome"])
        for reason in REPLAY_REASONS:
            for outcome in REPLAY_OUTCOMES:
                r.add_metric([reason, outcome], float(ac[replay_count(reason, outcome)]))
        yield r
        st = idx.stats
        for name, doc, value in (
                ("llmgw_kv_gaps", "Sequence gaps the agents saw in their engines' KV events.", ac["gaps"]),
                ("llmgw_kv_bad_frames", ("Undecodable KV event messages the agents received (each reset "
                                         "the engine's mirror)."), ac["bad_frames"]),
                ("llmgw_kv_events_messages", "kv_events messages applied to the index.", self.kv.messages),
                ("llmgw_kv_index_block_events", "Block additions and removals applied to the index.",
                 st.block_events),
                ("llmgw_kv_index_resets", "Replica resets (clear, then a full copy) applied.", st.resets),
                ("llmgw_kv_index_overflows", "Replicas emptied for exceeding the per-replica block cap.",
                 st.overflows)):
            m = CounterMetricFamily(name, doc)
            m.add_metric([], float(value))
            yield m
