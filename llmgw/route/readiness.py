"""Is the router ready to serve? What ``GET /ready`` answers and what the daemon's "serving …"
line waits for.

Ready means every model that should have replicas has at least one that can take a request now:
routed in (the control plane routes a placed replica in once its engine answers; a static one is
routed from the start), not draining, and its breaker not open. A model "should have replicas"
when its config asks for some (static ``[[models.replicas]]`` or a ``[models.deploy] count`` above
0) or when it has some routed anyway (adopted) — except an autoscaled model whose minimum is 0:
its requests wait for a cold start, so it is never waited for. A candidate revision's replicas
(llmgw.lifecycle) are not waited for: they take no client traffic. A router with no such model is ready: there is
nothing to wait for. A router that is stopping (SIGTERM: draining its requests in flight, docs/ha.md
"Behind a load balancer") is not ready, whatever its replicas: a load balancer that checks ``/ready``
sends it nothing new. Pure: reads the replica table, changes nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .breaker import OPEN
from llmgw.config.names import is_candidate_key
from .replicas import ModelEntry, Replica, ReplicaTable

__all__ = ["ModelReadiness", "Readiness", "readiness"]


@dataclass(frozen=True, slots=True)
class ModelReadiness:
    model: str
    serving: int  # replicas that can take a request now
    routed: int  # replicas in the router's table (draining ones included)
    wanted: int  # replicas the config asks for

    @property
    def ready(self) -> bool:
        return self.serving > 0

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "ready": self.ready, "serving": self.serving, "routed": self.routed,
                "wanted": self.wanted}


@dataclass(frozen=True, slots=True)
class Readiness:
    models: tuple[ModelReadiness, ...]  # the models that should have replicas, by name
    draining: bool = False  # the router is stopping: not ready, whatever its models

    @property
    def ready(self) -> bool:
        return not self.draining and all(m.ready for m in self.models)

    @property
    def missing(self) -> list[str]:
        return [m.model for m in self.models if not m.ready]

    def to_dict(self) -> dict[str, Any]:
        status = "draining" if self.draining else "ready" if self.ready else "not_ready"
        return {"status": status, "missing": self.missing,
                "models": [m.to_dict() for m in self.models]}

    def summary(self, url: str) -> str:
        """``serving m at URL (2/2 replicas)``; with several models ``serving a (1/2 replicas), b (…)
        at URL``."""
        if not self.models:
            return f"listening at {url}: no model has replicas"
        counts = [f"({m.serving}/{max(m.wanted, m.routed)} replicas)" for m in self.models]
        if len(self.models) == 1:
            return f"serving {self.models[0].model} at {url} {counts[0]}"
        return "serving " + ", ".join(f"{m.model} {c}" for m, c in zip(self.models, counts)) + f" at {url}"


def _can_serve(rep: Replica) -> bool:
    # a prefill replica only prefills (route/pd.py): a model with no decode replica serves nothing
    return not rep.draining and rep.breaker.state != OPEN and rep.view.role != "prefill"


def _of(entry: ModelEntry) -> ModelReadiness:
    return ModelReadiness(entry.name, sum(1 for r in entry.replicas if _can_serve(r)), len(entry.replicas),
                          entry.wanted)


def readiness(table: ReplicaTable, *, draining: bool = False) -> Readiness:
    """The router's readiness now: each model that should have replicas, and whether one serves;
    ``draining``: the router is stopping."""
    return Readiness(tuple(_of(e) for name, e in sorted(table.models.items())
                           if (e.wanted > 0 or (e.replicas and e.cold_wait_s is None))
                           and not is_candidate_key(name)), draining)
