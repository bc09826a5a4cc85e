"""The autoscaler's Prometheus series (registered on the router's registry, so they appear on its
`/metrics`; docs/autoscaling.md):

- ``llmgw_autoscale_desired_replicas{model}``: the count in force (the autoscaler's, or a pin);
- ``llmgw_autoscale_ready_replicas{model}``, ``llmgw_autoscale_starting_replicas{model}``: what runs;
- ``llmgw_autoscale_decisions_total{model,direction}``: decisions that changed the count, up or down;
- ``llmgw_cold_starts_total{model}``: wakes from zero replicas;
- ``llmgw_cold_start_waits_total{model}``: requests that waited for a cold start at this router.

The gauges come from the leader's decisions; a follower shows the counts in force it read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["AutoscaleMetrics"]


class AutoscaleMetrics(Collector):
    """`autoscaling` is the plane's Autoscaling (daemon/control/autoscaling.py)."""

    def __init__(self, autoscaling: Any) -> None:
        self.a = autoscaling

    def collect(self) -> Iterator[Any]:
        a = self.a
        models = a.models()
        desired = GaugeMetricFamily("llmgw_autoscale_desired_replicas",
                                    "Autoscaled models: the replica count in force (the autoscaler's, or a pin).",
                                    labels=["model"])
        ready = GaugeMetricFamily("llmgw_autoscale_ready_replicas", "Autoscaled models: replicas ready.",
                                  labels=["model"])
        starting = GaugeMetricFamily("llmgw_autoscale_starting_replicas",
                                     "Autoscaled models: replicas placed and not ready yet.", labels=["model"])
        for name, m in sorted(models.items()):
            r, s = a.replicas(name)
            desired.add_metric([name], a.count(m))
            ready.add_metric([name], r)
            starting.add_metric([name], s)
        yield desired
        yield ready
        yield starting
        changes = CounterMetricFamily("llmgw_autoscale_decisions", "Autoscaler decisions that changed a count.",
                                      labels=["model", "direction"])
        for (name, direction), n in sorted(a.changes.items()):
            changes.add_metric([name, direction], n)
        yield changes
        cold = CounterMetricFamily("llmgw_cold_starts", "Autoscaled models woken from zero replicas.",
                                   labels=["model"])
        for name in sorted(models):
            cold.add_metric([name], a.cold_starts.get(name, 0))
        yield cold
        waits = CounterMetricFamily("llmgw_cold_start_waits", "Requests that waited for a cold start here.",
                                    labels=["model"])
        for name, d in sorted(a.plane.router.autoscale_load().items()):
            if name in models:
                waits.add_metric([name], d.get("cold_waits", 0))
        yield waits
