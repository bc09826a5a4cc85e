"""[models.autoscale]: how many replicas a model gets, decided from its load (docs/autoscaling.md).

The rule itself is llmgw.fleet.autoscale's; this section holds its settings. A model with it needs a
``[models.deploy]`` profile (the autoscaler sets that profile's count, which it then ignores)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from llmgw.config.fields import in_range, one_of, opt, positive

__all__ = ["AUTOSCALE_METRICS", "AutoscaleConfig", "autoscale_problems"]

#: concurrency: requests in flight or waiting per replica; queue: requests waiting per replica (the
#: engines' queues and the router's); kv_usage: the replicas' mean KV cache use, 0–1; ttft_p90: seconds.
AUTOSCALE_METRICS = ("concurrency", "queue", "kv_usage", "ttft_p90")


@dataclass(frozen=True, kw_only=True)
class AutoscaleConfig:
    min: int = opt(1, check=in_range(0, 10_000))
    max: int = opt(4, check=in_range(1, 10_000))
    metric: str = opt("concurrency", check=one_of(*AUTOSCALE_METRICS))
    target: float = opt(4.0, check=positive)  # per replica (concurrency, queue), 0–1 (kv_usage), seconds (ttft_p90)
    window_s: float = opt(60.0, check=positive)  # the stable window the recommendation averages over
    panic_window_s: float = opt(6.0, check=positive)  # the short window a burst is seen in
    panic_threshold: float = opt(2.0, check=in_range(1.0))  # the short window asks this × ready: scale up at once
    up_delay_s: float = opt(0.0, check=in_range(0.0))  # a higher count must be asked this long
    down_delay_s: float = opt(120.0, check=in_range(0.0))  # a lower count must be asked this long
    tolerance: float = opt(0.1, check=in_range(0.0, 0.9))  # queue, ttft_p90: the band around the target
    max_scale_up_rate: float = opt(2.0, check=in_range(1.0))  # at most × this (+1) per decision
    idle_to_zero_s: float = opt(0.0, check=in_range(0.0))  # min = 0: no request this long → no replica
    cold_start_s: float = opt(30.0, check=positive)  # placed → ready, until one is measured
    cold_start_wait_s: float = opt(120.0, check=positive)  # a request waits this long for a cold start


def autoscale_problems(models: Any) -> Iterator[tuple[tuple[Any, ...], str]]:
    """The cross checks of each model's [models.autoscale] (config file and admin API alike)."""
    for i, m in enumerate(models):
        a = m.autoscale
        if a is None:
            continue
        at = ("models", i, "autoscale")
        if m.deploy is None:
            yield at, "needs a [models.deploy] profile: only placed replicas can be scaled"
        if a.max < a.min:
            yield (*at, "max"), f"must be at least min ({a.min}), got {a.max}"
        if a.metric == "kv_usage" and a.target > 1:
            yield (*at, "target"), f"kv_usage is a fraction of the KV cache (0–1], got {a.target}"
        if a.min == 0 and a.idle_to_zero_s <= 0:
            yield (*at, "idle_to_zero_s"), "min = 0 needs idle_to_zero_s > 0 (how long without requests before the last replica stops)"
        if a.min > 0 and a.idle_to_zero_s > 0:
            yield (*at, "idle_to_zero_s"), f"scale to zero needs min = 0, got min = {a.min}"
