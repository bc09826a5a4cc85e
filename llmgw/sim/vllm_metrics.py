"""vLLM's Prometheus metrics for the simulator: the names, types, labels and buckets of vLLM's
PrometheusStatLogger (vllm-wire.md §3), fed by the engine core's stats hooks.

State gauges and counters are read from the core at scrape time (a custom collector), so the hot
path only pays for histogram observations. One registry per simulator instance."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from llmgw.sim.engine import EngineCore, SimRequest

__all__ = ["VllmMetrics"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class VllmMetrics(Collector):
    def __init__(self, core: EngineCore, model_name: str, version: tuple[int, ...], *,
                 show_hidden_old: bool = False, lora_enabled: bool = False, max_loras: int = 1,
                 cache_info: dict[str, str] | None = None, wall: Callable[[], float] = time.time) -> None:
        self.core = core
        self.wall = wall  # the wall clock of the LoRA info gauge's value
        self.labels = {"model_name": model_name, "engine": "0"}
        self.version = version
        # vllm:gpu_* names: always up to 0.10.x, in 0.11 only behind --show-hidden-metrics-for-version.
        self.old_names = version < (0, 11) or (version < (0, 12) and show_hidden_old)
        self.lora_enabled = lora_enabled
        self.max_loras = max_loras
        self.cache_info = cache_info or {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        names = list(self.labels)
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**self.labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        itl_name = "vllm:inter_token_latency_seconds" if version >= (0, 10, 2) else \
            "vllm:time_per_output_token_seconds"
        self.itl = hist(itl_name, "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.success = {r_: 0 for r_ in FINISH_REASONS}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._lora_updated = wall()

    # -- StatsSink -------------------------------------------------------------------------
    def request_started(self, req: SimRequest, now: float) -> None:
        self.queue.observe(now - req.arrival)

    def tokens(self, req: SimRequest, n_new: int, now: float) -> None:
        self.generation_tokens += n_new
        if len(req.output) == n_new:
            self.ttft.observe(now - req.arrival)
            self.prompt_tokens += len(req.prompt)
        elif req.last_token is not None:  # the core updates last_token after this call
            self.itl.observe(now - req.last_token)

    def request_finished(self, req: SimRequest, now: float) -> None:
        reason = req.finish_reason or "abort"
        self.success[reason] = self.success.get(reason, 0) + 1
        if reason != "abort":
            self.e2e.observe(now - req.arrival)
        self._lora_updated = self.wall()

    # -- scrape ----------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterable[Metric]:
        core, names, values = self.core, list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    core.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", core.num_waiting)
        usage = core.kv_usage()
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      core.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      core.prefix_hits)
        if self.version >= (0, 12):  # the KV connector's cache; zero without --kv-transfer-config
            yield counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
                          "cross-instance cache sharing, in terms of number of queried tokens.", core.ext_queries)
            yield counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                          "cross-instance cache sharing, in terms of number of cached tokens.", core.ext_hits)
        if self.old_names:
            yield gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", usage)
            yield counter("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of tokens.",
                          core.prefix_queries)
            yield counter("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of tokens.",
                          core.prefix_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      core.num_preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens)
        ok = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                 labels=[*names, "finished_reason"])
        for reason, n in self.success.items():
            ok.add_metric([*values, reason], n)
        yield ok
        if self.cache_info:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                     labels=[*sorted(self.cache_info), "engine"])
            info.add_metric([self.cache_info[k] for k in sorted(self.cache_info)] + ["0"], 1.0)
            yield info
        if self.lora_enabled:
            # No model_name/engine labels, value = time of the update (vllm-wire.md §3).
            lo = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            lo.add_metric([str(self.max_loras), ",".join(sorted(core.waiting_loras())),
                           ",".join(sorted(core.running_loras()))], self._lora_updated)
            yield lo
