"""The router's tier-2 KV index (llmgw.kv.index.KVIndex) as the running router holds it: fed by the
agents' kv_events messages, each accepted only from the node that runs the replica (the control
plane checks that, see plane.py), and emptied for a replica that leaves routing or whose agent's
stream ends (the agent sends a full copy on its next session). Also what the feed looks like per
replica (messages, resets, the time since the last message), tier 2's parity self-check
(llmgw.kv.parity: do the engine's reported blocks carry the hashes the router computes?) with its
alarm log line, and the Prometheus metrics of all three.

Bounds: a node's kv_events are weighed against its event budget before they are decoded (the
agent sessions' gate, agent_sessions.py): over it they are dropped, counted here, and the replica's
index is emptied until a reset. The index holds at most ``max_blocks_per_replica`` blocks per replica (KVIndex's cap:
beyond it the replica is emptied and votes with nothing until a reset), and only replicas the
control plane has assigned, so an agent cannot grow it with names of its own choosing. The feed
and parity tables keep at most MAX_SERIES replicas (removed ones leave first).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import trio
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
from llmgw.kv.parity import MAX_SERIES, OUTCOMES, ParityConfig, ParityTracker

__all__ = ["BYTES_PER_BLOCK", "PARITY_TICK_S", "REFUSE_REASONS", "KvIndexMetrics", "ReplicaFeed", "RouterKvIndex"]

log = logging.getLogger("llmgw.router.kv")

# Why a kv_events message was refused (the label of llmgw_kv_events_refused_total).
REFUSE_REASONS = ("unknown_replica", "other_node")
# The index's memory per block, measured (docs/prefix-routing.md): ~41 B of set entry plus the
# hash object, ~36 B for the 64-bit int form engines send by default.
BYTES_PER_BLOCK = 77
PARITY_TICK_S = 0.25  # how often parity checks past their settle time are decided
PARITY_CAUSES = ("the engine hashes with another --prefix-caching-hash-algo than sha256_cbor, runs with "
                 "another or no PYTHONHASHSEED than the deploy profile's, uses another block size than it "
                 "reports, or is a vLLM release that hashes differently (or sends bytes hashes: "
                 "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)")


@dataclass(slots=True)
class ReplicaFeed:
    """One replica's kv_events as the router received them (counters only grow)."""

    messages: int = 0
    block_events: int = 0  # additions and removals
    resets: int = 0  # every reset (a new engine, a new session, a lost stream)
    gaps: int = 0  # resets that cleared a non-empty index: events were lost on the way (or the engine cleared its cache)
    last_at: float | None = None  # monotonic time of the last message
    event_seq: int | None = None  # the engine's event sequence number the index reaches
    removed: bool = False  # the replica's index was dropped (it left, or its agent's stream ended)
    session_reset: bool = False  # a new agent session began: its next reset resends the mirror, loses nothing


class RouterKvIndex:
    def __init__(self, max_blocks_per_replica: int = 1 << 20, *, parity: ParityConfig | None = None,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.index = KVIndex(max_blocks_per_replica)
        self.parity = ParityTracker(parity, holds=self.index.holds)
        self.clock = clock
        self.refused: Counter[str] = Counter({r: 0 for r in REFUSE_REASONS})
        self.messages = 0  # kv_events messages applied
        # what the agents counted (gaps, bad frames, replays: AGENT_COUNTS), summed over replicas,
        # and per replica while it is assigned
        self.agent_counts: Counter[str] = Counter({k: 0 for k in AGENT_COUNTS})
        self.replica_counts: dict[str, Counter[str]] = {}
        self.gaps = 0
        self.feeds: dict[str, ReplicaFeed] = {}
        self.dropped_messages = 0  # kv_events dropped undecoded for their node's event budget
        self.dropped_blocks = 0

    def apply(self, msg: KvEvents) -> bool:
        """Apply one agent's message (the caller has checked the sender runs the replica); False
        when the replica overflowed its cap (it is empty until the agent's next reset)."""
        now = self.clock()
        rid = msg.replica
        self.messages += 1
        if msg.counts:
            known = {k: n for k, n in msg.counts if k in self.agent_counts}  # a newer agent's: ignored
            self.agent_counts.update(known)
            if not (msg.reset or msg.added or msg.removed) and rid not in self.index.replicas():
                return True  # a stopped engine's last counts: its replica is not (re)created in the index
            self.replica_counts.setdefault(rid, Counter()).update(known)
        feed = self._feed(rid)
        if msg.reset:
            feed.resets += 1
            if self.index.size(rid) > 0 and not feed.session_reset:
                feed.gaps += 1
                self.gaps += 1
            feed.session_reset = False
        ok = self.index.apply_delta(rid, Delta(seq=msg.event_seq, reset=msg.reset,
                                               added=list(msg.added), removed=list(msg.removed)))
        feed.messages += 1
        feed.block_events += len(msg.added) + len(msg.removed)
        feed.last_at = now
        if msg.event_seq is not None:
            feed.event_seq = msg.event_seq
        self.parity.on_delta(rid, msg.added, reset=msg.reset, now=now)
        self._log_parity()
        return ok

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1

    def dropped(self, replica: str | None, blocks: int) -> None:
        """A kv_events message of `replica` (None: not one its node runs) was dropped undecoded for
        its node's event budget. Its changes are lost, so the replica's index can no longer follow
        the engine: it is emptied and waits for a reset (tier 1 decides for it meanwhile), as for a
        sequence gap — never a wrong index."""
        self.dropped_messages += 1
        self.dropped_blocks += blocks
        if replica is None or replica not in self.index.replicas():
            return
        feed = self._feed(replica)
        if not self.index.overflowed(replica):  # it followed the engine until now: a gap
            feed.gaps += 1
            self.gaps += 1
        self.index.suspend(replica)
        self.parity.on_delta(replica, (), reset=True, now=self.clock())  # open checks: unknown, not failed
        self._log_parity()

    def remove(self, replica: str) -> None:
        self.index.remove_replica(replica)
        self.replica_counts.pop(replica, None)
        self.parity.forget(replica)
        feed = self.feeds.get(replica)
        if feed is not None:
            feed.removed = True
        self._log_parity()

    def size(self, replica: str) -> int:
        return self.index.size(replica)

    def holds_any(self, h: int) -> bool:
        """Does any replica's engine hold block `h`? (the tokenize step's early stop, see
        llmgw.kv.prefix_chains)"""
        return self.index.holds_any(h)

    def alarmed(self, replica: str) -> bool:
        """Is the replica's parity alarm on (its engine hashes differently from the router)?"""
        rp = self.parity.replicas.get(replica)
        return rp is not None and rp.alarm

    def session_started(self, replica: str) -> None:
        """The replica's agent began a new session (a reconnect may replace a live connection, so
        the index was not dropped): its mirror's next reset is a full copy, not lost events."""
        feed = self.feeds.get(replica)
        if feed is not None:
            feed.session_reset = True

    # -- the parity self-check, from the request path --------------------------------------------
    def check_open(self, replica: str, model: str, hashes: Sequence[int], now: float) -> int | None:
        """A request with these tier-2 hashes went to `replica`: the check's id (for check_end)."""
        cid = self.parity.open(replica, model, hashes, now)
        self._log_parity()
        return cid

    def check_end(self, cid: int | None, now: float, *, ok: bool) -> None:
        if cid is not None:
            self.parity.end(cid, now, ok=ok)
            self._log_parity()

    async def run(self) -> None:
        """Decide the parity checks whose settle time is over, and log alarm changes."""
        while True:
            await trio.sleep(PARITY_TICK_S)
            self.parity.tick(self.clock())
            self._log_parity()

    def _log_parity(self) -> None:
        for ch in self.parity.take_changes():
            if ch.on:
                log.warning("tier 2 parity: replica %s (model %s): the block hashes the router computes never "
                            "appear in the KV events its engine sends (%d checks in a row) — tier 2 cannot "
                            "route to what it caches. Likely: %s. Compare `llmgw kv hash` with `llmgw kv watch`; "
                            "`llmgw ctl kv` shows every replica's parity", ch.replica, ch.model,
                            ch.failed_in_row, PARITY_CAUSES)
            elif ch.forgotten:
                log.info("tier 2 parity: replica %s (model %s): alarm cleared: its index was dropped (it left "
                         "routing, restarted, or its agent's stream ended); checked again from its next requests",
                         ch.replica, ch.model)
            else:
                log.info("tier 2 parity: replica %s (model %s): the engine's blocks match the router's "
                         "hashes again", ch.replica, ch.model)

    def _feed(self, rid: str) -> ReplicaFeed:
        feed = self.feeds.get(rid)
        if feed is None:
            if len(self.feeds) >= MAX_SERIES:
                gone = next((k for k, v in self.feeds.items() if v.removed), next(iter(self.feeds)))
                del self.feeds[gone]
            feed = self.feeds[rid] = ReplicaFeed()
        feed.removed = False
        return feed


class KvIndexMetrics(Collector):
    """llmgw_kv_index_blocks{endpoint}, llmgw_kv_events_refused_total{reason}, the index's totals,
    the feed's lag and gaps, and the parity checks and alarm."""

    def __init__(self, kv: RouterKvIndex) -> None:
        self.kv = kv

    def collect(self) -> Iterable[Metric]:
        kv = self.kv
        idx = kv.index
        g = GaugeMetricFamily("llmgw_kv_index_blocks", "KV blocks the router's tier-2 index holds per endpoint.",
                              labels=["endpoint"])
        for rid in idx.replicas():
            g.add_metric([str(rid)], float(idx.size(rid)))
        yield g
        g = GaugeMetricFamily("llmgw_kv_index_bytes", f"Estimated memory of the tier-2 index ({BYTES_PER_BLOCK} B "
                              "a block, measured).")
        g.add_metric([], float(len(idx) * BYTES_PER_BLOCK))
        yield g
        now = kv.clock()
        g = GaugeMetricFamily("llmgw_kv_events_lag_seconds", "Seconds since the endpoint's last kv_events message.",
                              labels=["endpoint"])
        for rid, feed in kv.feeds.items():
            if not feed.removed and feed.last_at is not None:
                g.add_metric([rid], max(0.0, now - feed.last_at))
        yield g
        c = CounterMetricFamily("llmgw_kv_events_refused", "kv_events messages refused: for a replica the "
                                "router does not know, or one another node runs.", labels=["reason"])
        for reason, n in sorted(kv.refused.items()):
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
                ("llmgw_kv_events_messages", "kv_events messages applied to the index.", kv.messages),
                ("llmgw_kv_events_dropped", "kv_events messages dropped undecoded: their node was over its event "
                 "budget (control.kv_events_per_s); the replica's index waits for a reset.", kv.dropped_messages),
                ("llmgw_kv_events_dropped_blocks", "Block events in the kv_events messages dropped for a node's "
                 "event budget.", kv.dropped_blocks),
                ("llmgw_kv_index_block_events", "Block additions and removals applied to the index.",
                 st.block_events),
                ("llmgw_kv_index_resets", "Replica resets (clear, then a full copy) applied.", st.resets),
                ("llmgw_kv_index_gaps", "Resets that cleared a non-empty index: events were lost between engine "
                 "and router (a sequence gap, undecodable frames, a mirror overflow) or the engine cleared its "
                 "cache.", kv.gaps),
                ("llmgw_kv_index_overflows", "Replicas emptied for exceeding the per-replica block cap.",
                 st.overflows)):
            m = CounterMetricFamily(name, doc)
            m.add_metric([], float(value))
            yield m
        checks = CounterMetricFamily("llmgw_kv_parity_checks", "Tier 2's parity checks by verdict: pass (the "
                                     "engine reported the blocks the router hashed), fail (it reported others), "
                                     "unknown (no events to tell).", labels=["endpoint", "model", "outcome"])
        alarm = GaugeMetricFamily("llmgw_kv_parity_alarm", "1 while the endpoint's engine failed the parity check "
                                  "several times in a row: its block hashes differ from the router's.",
                                  labels=["endpoint", "model"])
        for rid, rp in kv.parity.replicas.items():
            for outcome, n in zip(OUTCOMES, (rp.passed, rp.failed, rp.unknown)):
                checks.add_metric([str(rid), rp.model, outcome], float(n))
            if not rp.forgotten:
                alarm.add_metric([str(rid), rp.model], 1.0 if rp.alarm else 0.0)
        yield checks
        yield alarm
