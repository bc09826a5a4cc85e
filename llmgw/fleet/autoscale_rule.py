"""The autoscaler's settings (:class:`Rule`) and what one decision says (:class:`Decision`).

The rule itself — how a decision is made from these — is stated in llmgw.fleet.autoscale's
docstring. Pure: no clock, no I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

__all__ = ["METRICS", "MODES", "Rule", "Decision"]

METRICS = ("concurrency", "queue", "kv_usage", "ttft_p90")
MODES = ("stable", "panic", "cold", "idle", "pinned")


@dataclass(frozen=True)
class Rule:
    """One model's autoscaling settings: ``[models.autoscale]`` (AutoscaleConfig, the same names and
    defaults). Bad values raise ValueError naming the field; every config AutoscaleConfig accepts is
    accepted here (the shell builds one each round)."""
    min: int = 1
    max: int = 4
    metric: str = "concurrency"
    target: float = 4.0  # concurrency: requests in flight or waiting per replica; queue: waiting per
    # replica; kv_usage: mean KV cache use 0–1; ttft_p90: seconds
    window_s: float = 60.0
    panic_window_s: float = 6.0  # one longer than window_s is taken as window_s
    panic_threshold: float = 2.0
    up_delay_s: float = 0.0
    down_delay_s: float = 120.0
    tolerance: float = 0.1
    max_scale_up_rate: float = 2.0
    idle_to_zero_s: float = 0.0  # 0: never to zero
    cold_start_s: float = 30.0  # the prior for placed → ready until one is measured

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "metric":
                if v not in METRICS:
                    raise ValueError(f"autoscale.metric must be one of {', '.join(METRICS)}, got {v!r}")
            elif f.name in ("min", "max"):
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"autoscale.{f.name} must be an integer ≥ 0, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"autoscale.{f.name} must be a finite number ≥ 0, got {v!r}")
        if self.max < max(self.min, 1):
            raise ValueError(f"autoscale.max must be ≥ min and ≥ 1, got max {self.max} with min {self.min}")
        if self.target <= 0 or (self.metric == "kv_usage" and self.target > 1):
            raise ValueError(f"autoscale.target must be > 0{' and ≤ 1 for kv_usage' if self.metric == 'kv_usage' else ''}"
                             f", got {self.target!r}")
        for name in ("window_s", "panic_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"autoscale.{name} must be > 0, got {getattr(self, name)!r}")
        if self.panic_threshold < 1:
            raise ValueError(f"autoscale.panic_threshold must be ≥ 1, got {self.panic_threshold!r}")
        if self.tolerance >= 1:
            raise ValueError(f"autoscale.tolerance must be < 1, got {self.tolerance!r}")
        if self.max_scale_up_rate < 1:
            raise ValueError(f"autoscale.max_scale_up_rate must be ≥ 1, got {self.max_scale_up_rate!r}")
        if (self.min == 0) != (self.idle_to_zero_s > 0):
            raise ValueError("autoscale.idle_to_zero_s > 0 needs min = 0, and min = 0 needs idle_to_zero_s > 0 "
                             f"(got min {self.min}, idle_to_zero_s {self.idle_to_zero_s:g})")

    @classmethod
    def from_config(cls, c: object) -> Rule:
        """From anything with these attributes (AutoscaleConfig); one it lacks takes the default."""
        return cls(**{f.name: getattr(c, f.name, f.default) for f in fields(cls)})

    def settings(self) -> dict[str, float | int | str]:
        """Every field by name (for the admin view)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Decision:
    """One decision for one model: what the count becomes and why."""
    t: float
    current: int  # the count in force (ready + starting: coming capacity counts)
    ready: int
    starting: int
    desired: int  # what the count becomes
    raw: int  # the rule's recommendation before delays and bounds
    mode: str  # one of MODES
    rule: str  # one sentence: the metric, the figure, the target, the arithmetic
    inputs: dict[str, float | None] = field(default_factory=dict)
    limited_by: tuple[str, ...] = ()
    reason: str = ""  # why it changes ("" when it does not)

    def changed(self) -> bool:
        return self.desired != self.current

    @property
    def direction(self) -> str:
        """"up", "down" or "none" (for the decisions counter's label)."""
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "none"
