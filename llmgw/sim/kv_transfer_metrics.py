"""Metrics of the simulated KV transfer (P/D), on the simulator's /metrics.

vLLM's NixlConnector exports its own (``NixlPromMetrics``, docs/vllm-pd-wire.md §6); the simulator
exports the two it models under their names — ``vllm:nixl_xfer_time_seconds`` (one observation per
pull: the modeled transfer time) and ``vllm:nixl_num_failed_transfers`` — and not the ones it has
no figures for (post time, bytes, descriptors, failed notifications). Its own, named
``llmgw_sim_kv_transfer_*``, count what no vLLM exports: blocks pulled, failures by reason, and the
prefiller's side (blocks held, reads served, holds expired)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.sim.kv_transfer import KvPins

__all__ = ["KvTransferMetrics", "FAILURE_REASONS"]

# NixlPromMetrics' transfer-time buckets (its list without the first, 0.001)
XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
# PR #26811 (merged 2025-10-28) exported them; the first release is not verified, 0.12 at the latest.
NIXL_METRICS_FROM = (0, 12)
FAILURE_REASONS = ("unreachable", "not_found", "error")


class KvTransferMetrics(Collector):
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str], version: tuple[int, ...],
                 pins: KvPins, *, nixl: bool) -> None:
        self.pins = pins
        names, values = list(labels), list(labels.values())
        self.nixl = nixl and version >= NIXL_METRICS_FROM
        if self.nixl:
            self.xfer = Histogram("vllm:nixl_xfer_time_seconds",
                                  "Histogram of transfer duration for NIXL KV Cache transfers.", names,
                                  buckets=XFER_BUCKETS, registry=registry).labels(*values)
            self.failed = Counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.",
                                  names, registry=registry).labels(*values)
        self.seconds = Histogram("llmgw_sim_kv_transfer_seconds",
                                 "Simulator only: a decoder's KV pull, side-channel read and modeled transfer.",
                                 buckets=XFER_BUCKETS, registry=registry)
        self.blocks = 0
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        registry.register(self)

    def transferred(self, blocks: int, seconds: float) -> None:
        self.blocks += blocks
        self.seconds.observe(seconds)
        if self.nixl:
            self.xfer.observe(seconds)

    def failed_transfer(self, reason: str) -> None:
        self.failures[reason] += 1
        if self.nixl:
            self.failed.inc()

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily("llmgw_sim_kv_transfer_blocks", "Simulator only: KV blocks a decoder pulled.")
        c.add_metric([], self.blocks)
        yield c
        f = CounterMetricFamily("llmgw_sim_kv_transfer_failures",
                                "Simulator only: a decoder's failed KV pulls, by reason.", labels=["reason"])
        for reason, n in self.failures.items():
            f.add_metric([reason], n)
        yield f
        yield GaugeMetricFamily("llmgw_sim_kv_transfer_pinned_blocks",
                                "Simulator only: KV blocks a prefiller holds for decoders now.",
                                value=self.pins.num_blocks)
        r = CounterMetricFamily("llmgw_sim_kv_transfer_reads", "Simulator only: a prefiller's held requests read.")
        r.add_metric([], self.pins.read_count)
        yield r
        e = CounterMetricFamily("llmgw_sim_kv_transfer_expired",
                                "Simulator only: a prefiller's held requests freed unread at the timeout.")
        e.add_metric([], self.pins.expired)
        yield e
