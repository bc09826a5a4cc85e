"""The admin API's autoscaling answers (GET /api/v1/autoscale, GET /api/v1/models/{name}/autoscale;
docs/autoscaling.md): per autoscaled model its rule, the count in force, the replicas ready and
starting, the latest decision with the inputs it read, what limited it, and the decisions that
changed the count. The control plane's autoscaling shell fills them from the pure core's
``Decision`` (llmgw.fleet.autoscale); ``t_wall`` is Unix time."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.admin.typeinfo import prop

__all__ = ["AutoscaleView", "ScaleDecisionView"]

MODES = ("stable", "panic", "cold", "idle", "pinned")


@dataclass(slots=True)
class ScaleDecisionView:
    """One decision of a model's autoscaler."""
    t_wall: float = prop("when it was made (Unix time)")
    current: int = prop("the count in force before it: replicas ready + starting (coming capacity counts)")
    ready: int = prop("replicas in routing, not draining")
    starting: int = prop("replicas placed and meant to run, not ready yet")
    desired: int = prop("what the count becomes")
    raw: int = prop("the rule's recommendation before delays and bounds")
    mode: str = prop("stable, panic (a burst: scale up at once, never down), cold (demand while at 0), idle "
                     "(scaled to zero after idle_to_zero_s) or pinned (an operator's `llmgw ctl scale`)")
    rule: str = prop("the rule in one sentence: the metric, its figure, the target, the arithmetic")
    limited_by: list[str] = prop("what held the count back from the recommendation, e.g. `max 4`, `down delay 120s`, "
                                 "`pinned at 3 (llmgw ctl scale)`, `placement: <the placer's reason>`")
    reason: str = prop("why the count changes, in a few words (empty when it does not)")


@dataclass(slots=True)
class AutoscaleView:
    """A model's autoscaler: its rule, where it stands, and why."""
    model: str
    min: int = prop("the fewest replicas it keeps (0: it may scale to zero)")
    max: int = prop("the most replicas it may have")
    metric: str = prop("what it scales on: concurrency, queue, kv_usage or ttft_p90")
    target: float = prop("the metric's target per replica (ttft_p90: seconds; kv_usage: 0–1)")
    pinned: int | None = prop("the count an operator pinned with `llmgw ctl scale` (the autoscaler holds it until "
                              "`llmgw ctl scale MODEL --release`); null: not pinned")
    count: int = prop("the count in force: what the reconciler places")
    ready: int = prop("replicas in routing, not draining")
    starting: int = prop("replicas placed and meant to run, not ready yet")
    cold_start_s: float = prop("placed → ready as the autoscaler uses it: the median of the last measured (the "
                               "config's cold_start_s before one is measured)")
    cold_starts: int = prop("times the model woke from zero replicas (llmgw_cold_starts_total)")
    inputs: dict[str, float | None] = prop("the figures the latest decision read: concurrency (over the window), "
                                           "concurrency_panic, concurrency_predicted, arrival_rate, ttft_p90_s, "
                                           "queue_per_replica, kv_usage, slope_per_s, cold_start_s, "
                                           "capacity_per_replica, idle_s, raw_panic (the panic window's "
                                           "recommendation); null: unknown")
    decision: ScaleDecisionView | None = prop("the latest decision; null before the first")
    history: list[ScaleDecisionView] = prop("the last decisions that changed the count, newest first")
    settings: dict[str, float | str] = prop("the rest of the rule: window_s, panic_window_s, panic_threshold, "
                                                  "up_delay_s, down_delay_s, tolerance, max_scale_up_rate, "
                                                  "idle_to_zero_s, cold_start_s, cold_start_wait_s")
