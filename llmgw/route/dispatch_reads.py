"""What the metrics exporter (``llmgw.daemon.router.metrics.MetricsSource`` and the other
collectors) reads of the router's core, by methods — never through its members.
:class:`~.dispatch.RouterCore` is made of it. Pure, as the core."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .pd import PdStats, role_queues
from .replicas import Replica

__all__ = ["ExporterReads"]


class ExporterReads:
    # what the core provides (dispatch.RouterCore.__init__ sets them)
    table: Any  # replicas.ReplicaTable
    prefix: Any  # prefix_scorer.PrefixRouting
    wait: Any  # waiting.WaitRoom
    load: Any  # load_report.LoadReport
    pd_stats: PdStats

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
