"""A model's deploy profile as the reconciler sees it (the engine spec template and what one
replica demands of a node; a disaggregated model's prefill and decode groups, each a unit with its
own count and template), and the error an operator's model change raises."""

from __future__ import annotations

from dataclasses import replace

from llmgw.config import ModelConfig
from llmgw.fleet.placement import Demand, Policy
from llmgw.fleet.reconcile import DeployUnit, ModelDeploy
from llmgw.fleet.spread import DEFAULT_SPREAD, SpreadRule
from llmgw.fleet.types import EngineSpec, LoraLaunch

__all__ = ["ModelError", "deploy_of", "lora_launch"]


class ModelError(Exception):
    """An operator's model change that cannot be made (the message says why)."""


def deploy_of(m: ModelConfig) -> ModelDeploy | None:
    d = m.deploy
    if d is None:
        return None
    path = d.model_path or (f"{m.name}.gguf" if d.simulate and m.engine == "llamacpp" else m.name)
    template = EngineSpec(replica="", model=m.name, engine=m.engine, model_path=path, simulate=d.simulate,
                          binary=d.binary, args=d.args,
                          env=tuple(tuple(kv.split("=", 1)) for kv in d.env),  # type: ignore[misc]
                          health_timeout_s=d.health_timeout_s, kv_events=d.kv_events, lora=lora_launch(m))
    demand = Demand(d.gpus, d.gpu_memory_mb, d.memory_mb, tuple(sorted(d.node_selector.items())))
    spread = DEFAULT_SPREAD if d.spread is None else tuple(SpreadRule(r.level, r.max_skew, r.hard) for r in d.spread)
    policy = Policy(spread=spread, watts=d.watts, nodes=d.nodes, keep_within=d.keep_within or "",
                    all_within=(m.pd.keep_within or "") if m.pd is not None and d.roles else "")
    if not d.roles:
        return ModelDeploy(m.name, d.count, demand, template, policy)
    # [[models.deploy.roles]]: one unit per group, its args and env after the profile's (`count` unused)
    units = tuple(DeployUnit(g.role, g.count, replace(
        template, role=g.role, args=template.args + g.args,
        env=template.env + tuple(tuple(kv.split("=", 1)) for kv in g.env)))  # type: ignore[operator]
        for g in d.roles)
    return ModelDeploy(m.name, sum(u.count for u in units), demand, template, policy, roles=units)


def lora_launch(m: ModelConfig) -> LoraLaunch | None:
    """What a model's engines load at start: nothing without adapters. vLLM: its limits and the
    static adapters (the others are loaded on demand, so declaring one restarts nothing);
    llama.cpp: every adapter, in declaration order (their ids)."""
    if not m.adapters:
        return None
    if m.engine == "llamacpp":
        return LoraLaunch(adapters=tuple((a.name, a.source) for a in m.adapters))
    return LoraLaunch(max_loras=m.max_loaded_adapters, max_rank=m.max_lora_rank,
                      adapters=tuple((a.name, a.source) for a in m.adapters if a.static))
