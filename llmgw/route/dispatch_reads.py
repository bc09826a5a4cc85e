"""What the metrics exporter (``llmgw.daemon.router.metrics.MetricsSource`` and the other
collectors) and the shell read of the router's core — counters, tier 2's state, queues —, by
methods, never through its members.
:class:`~.dispatch.RouterCore` is made of it. Pure, as the core."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .counters import RouterCounters
from .kv_scorer import KvDecisionStats
from .pd import PdStats, role_queues
from .replicas import Replica
from .tier2 import Tier2

__all__ = ["ExporterReads"]


class ExporterReads:
    # what the core provides (dispatch.RouterCore.__init__ sets them)
    table: Any  # replicas.ReplicaTable
    prefix: Any  # prefix_scorer.PrefixRouting
    wait: Any  # waiting.WaitRoom
    load: Any  # load_report.LoadReport
    pd_stats: PdStats
    counters: RouterCounters
    planner: Any  # planner.Planner
    kv_cache: Any  # kv_scorer.KvCacheScorer
    tier2: Tier2

    def counts(self) -> RouterCounters:
        """The counters, to read at scrape time (the metrics exporter's; it never writes them)."""
        return self.counters

    def request_counts(self, model: str) -> tuple[int, int, float, int]:
        """`model`'s client requests so far (RouterCounters.client_counts)."""
        return self.counters.client_counts(model)

    def traceparent_invalid(self) -> dict[str, int]:
        """Clients' malformed traceparent headers (ignored), by reason (:mod:`.traceparent`)."""
        return self.planner.traceparent_invalid

    def kv_stats(self) -> KvDecisionStats:
        """Tier 2's decisions so far (the kv_cache scorer's)."""
        return self.kv_cache.stats

    def tier2_state(self) -> Tier2:
        """Tier 2's step: its outcomes, cache and hashing counts (for its metrics)."""
        return self.tier2

    def all_replicas(self) -> Iterable[Replica]:
        return self.table.all_replicas()

    def is_stale(self, rep: Replica, now: float) -> bool:
        return self.table.is_stale(rep, now)

    def prefix_metrics(self) -> dict[str, Any]:
        return self.prefix.metrics()

    def zero_hit_alarm(self, now: float) -> bool:
        return self.prefix.zero_hit_alarm(now)

    def queue_lengths(self) -> dict[str, int]:
        return self.wait.lengths()

    def queue_by_band(self) -> dict[tuple[str, str], int]:
        return self.wait.by_band()

    def queue_displaced(self) -> dict[str, int]:
        return self.wait.displaced_by_band()

    def pd_counts(self) -> PdStats:
        """Disaggregation's counters (:class:`.pd.PdStats`), read by its metrics."""
        return self.pd_stats

    def pd_queues(self) -> dict[tuple[str, str], float]:
        """(model, role) -> the engines' waiting requests over a disaggregated model's prefill and decode replicas."""
        return role_queues(list(self.table.models.values()))

    def autoscale_load(self) -> dict[str, dict[str, Any]]:
        """Per model, this router's load for the autoscaler (:mod:`.load_report`)."""
        return self.load.report()

    def queue_by_tenant(self) -> dict[str, dict[str, float]]:
        """Tenant -> {waiting, cost, share} in the wait queues now (the admin API's TenantView)."""
        return self.wait.by_tenant()
