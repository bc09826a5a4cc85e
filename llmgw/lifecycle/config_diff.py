"""The config file against what runs: what a reload (`llmgw ctl config reload`, SIGHUP) or a start
does with each difference. Pure: the shell (daemon/control/plane/config_reload.py) applies the plan.

Every difference gets one of three actions (docs/configuration.md, "Reloading the config file"):

- **apply** — at once, restarting no engine: a model's `strategy`, `pools`, `lifecycle`, `autoscale`, its deploy
  `count` (scale), `spread` and `watts` (placement policy), the counts of its prefill/decode groups
  (`deploy.roles` changed in nothing else: each group scales), adapters whose change launches no engine
  differently (vLLM on-demand adapters); `[[strategies]]`; `[facility]` (budgets, rebalancing);
  models added to or removed from the file. Also any change of a model nothing serves yet (no
  replica placed): there is nothing to check a candidate against.
- **candidate** — everything else of a model with a deploy profile: what its engines are launched
  with (engine, path, args, env, binary, GPUs, memory, selector, kv_events, nodes, keep_within, the
  adapters they load at start) and what is bound to a replica when it is routed (scrape `metrics`
  names, deploy `pool` and `weight`). The file's whole definition becomes a candidate that goes
  through eval → promote like `llmgw ctl models update`; its hot parts apply at once meanwhile.
- **restart** — what is set up once at start: `[server]`, `[admin]`, `[control]` (listen
  addresses, TLS, tokens, timeouts), `[router]`, `[[pools]]`, `[agent]`, `[sim]`, a model's static
  `replicas`, a model gaining or losing its deploy profile. Nothing of it changes until the next start.

The deploy `count` and an operator's scale: `llmgw ctl scale` on a config-file model is an
override kept (in the store) until the file's count for that model changes; then the file's new
count wins and the override is dropped (kubectl's rule for `scale` and a re-applied manifest).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from llmgw.config import Config, ModelConfig, model_to_dict, to_plain  # to_plain: the form dump_config writes

__all__ = ["Change", "ConfigPlan", "ModelPlan", "ScaleOverride", "diff_config", "diff_models",
           "RESTART_SECTIONS"]

Action = Literal["apply", "candidate", "restart"]

#: Model keys that apply at once, and why they can.
MODEL_HOT = {
    "strategy": "the model's next request is routed with it",
    "pools": "read per request",
    "lifecycle": "the control plane's own setting",
    "autoscale": "the control plane's own setting: read each autoscaler round",
}
DEPLOY_HOT = {
    "count": "a scale: replicas are placed or drained",
    "spread": "placement policy: read each reconcile round",
    "watts": "placement policy: read each reconcile round",
}
#: Model keys that wait for a start.
MODEL_RESTART = {"replicas": "static endpoints are routed at start"}
_ADAPTER_KEYS = ("adapters", "max_loaded_adapters", "max_lora_rank")
_BOUND = ("metrics", "deploy.pool", "deploy.weight")  # bound to a replica when it is routed

#: Top-level sections that wait for a start, and why.
RESTART_SECTIONS = {
    "server": "the OpenAI listener, its keys and limits are set up at start",
    "admin": "the admin API's socket, TCP listener and token are set up at start",
    "control": "the agents' listener, its TLS, the join token and the node timeouts are set up at start",
    "store": "the store is opened, and leadership's lease and polling set up, at start",
    "router": "the router's timeouts, queues, breakers, traces and prefix index are built at start",
    "pools": "pool priorities and caps are bound to each replica when it is routed",
    "agent": "the local agent's node name, labels and router are sent in its hello at start "
             "(`llmgw ctl label` changes a node's labels at once)",
    "sim": "the embedded simulated fleet is set up at start",
    "tenants": "the static and anonymous tenants, usage flushing and quota sharing are set up at start "
               "(tenants and keys themselves change at once: `llmgw ctl tenants|keys`)",
}
HOT_SECTIONS = {
    "strategies": "the router's strategies are replaced at once",
    "facility": "budgets and rebalancing are read each reconcile round",
}


@dataclass(frozen=True, slots=True)
class ScaleOverride:
    """An operator's scale of a config-file model: `count`, given while the file said `file_count`."""
    count: int
    file_count: int


@dataclass(frozen=True, slots=True)
class Change:
    section: str  # "models.NAME", "strategies", "server", ...
    key: str  # dotted, within the section ("" for the whole of it)
    action: Action
    old: Any
    new: Any
    why: str


@dataclass(slots=True)
class ModelPlan:
    """What happens to one model. `live`: its definition from now on (None: unchanged, or removed
    when `remove`); `candidate`: a definition to put beside the live one (eval → promote);
    `discard_candidate`: its pending candidate no longer matches the file; `override`: the scale
    override from now on (None: none)."""
    name: str
    live: ModelConfig | None = None
    candidate: ModelConfig | None = None
    remove: bool = False
    add: bool = False
    discard_candidate: bool = False
    override: ScaleOverride | None = None
    override_dropped: str = ""  # why, when an override was dropped


@dataclass(slots=True)
class ConfigPlan:
    changes: list[Change] = field(default_factory=list)
    models: dict[str, ModelPlan] = field(default_factory=dict)
    strategies: bool = False  # [[strategies]] changed (applied at once)
    facility: bool = False  # [facility] changed (applied at once)

    @property
    def empty(self) -> bool:
        return not self.changes


def flat(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys (arrays stay whole)."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            out.update(flat(v, key))
        else:
            out[key] = v
    return out


def _keys_differ(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    a, b = flat(old), flat(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def _with_count(m: ModelConfig, count: int) -> ModelConfig:
    return m if m.deploy is None or m.deploy.count == count else replace(m, deploy=replace(m.deploy, count=count))


def _counts_only(old: Any, new: Any) -> bool:
    """Two `deploy.roles` lists (plain) that differ in nothing but their groups' counts."""
    if not isinstance(old, list) or not isinstance(new, list) or len(old) != len(new):
        return False
    return all(isinstance(a, dict) and isinstance(b, dict) and {**a, "count": 0} == {**b, "count": 0}
               for a, b in zip(old, new, strict=True))


def _hot_merge(live: ModelConfig, file: ModelConfig, adapters_hot: bool) -> ModelConfig:
    """`live` with the file's hot keys."""
    out = replace(live, strategy=file.strategy, pools=file.pools, lifecycle=file.lifecycle)
    if adapters_hot:
        out = replace(out, adapters=file.adapters, max_loaded_adapters=file.max_loaded_adapters,
                      max_lora_rank=file.max_lora_rank)
    if out.deploy is not None and file.deploy is not None:
        out = replace(out, deploy=replace(out.deploy, count=file.deploy.count, spread=file.deploy.spread,
                                          watts=file.deploy.watts))
        if [replace(g, count=0) for g in out.deploy.roles] == [replace(g, count=0) for g in file.deploy.roles]:
            out = replace(out, deploy=replace(out.deploy, roles=file.deploy.roles))  # the groups' counts
    return out


def diff_models(file_models: tuple[ModelConfig, ...], live: Mapping[str, ModelConfig],
                sources: Mapping[str, str], *, overrides: Mapping[str, ScaleOverride],
                candidates: Mapping[str, ModelConfig], serving: set[str],
                engines_differ: Callable[[ModelConfig, ModelConfig], bool]) -> ConfigPlan:
    """The file's models against the running ones. `live`: every model in force; `sources`: where
    each came from ("config", "api", ...); `overrides`: operators' scales of config models;
    `candidates`: pending candidates' definitions; `serving`: models with replicas placed;
    `engines_differ(a, b)`: would the engines of `a` be replaced to run `b`."""
    plan = ConfigPlan()
    names = {m.name for m in file_models}
    for name in sorted(n for n, s in sources.items() if s == "config" and n not in names):
        plan.models[name] = ModelPlan(name, remove=True)
        plan.changes.append(Change(f"models.{name}", "", "apply", "defined", None,
                                   "no longer in the file: its replicas drain and stop"))
    for f in file_models:
        sec = f"models.{f.name}"
        cur = live.get(f.name)
        if cur is None:
            plan.models[f.name] = ModelPlan(f.name, live=f, add=True)
            plan.changes.append(Change(sec, "", "apply", None, "defined", "new in the file: placed at once"))
            continue
        mp = ModelPlan(f.name)
        # The count: an operator's scale lasts until the file's own count changes.
        ov = overrides.get(f.name)
        want = f
        if ov is not None and f.deploy is not None:
            if f.deploy.count == ov.file_count:
                want = _with_count(f, ov.count)
                mp.override = ov
            else:
                mp.override_dropped = (f"the file's count changed ({ov.file_count} → {f.deploy.count}): it wins "
                                       f"over the operator's scale to {ov.count}")
        diffs = _keys_differ(model_to_dict(cur), model_to_dict(want))
        if not diffs and not mp.override_dropped:
            if f.name in candidates and sources.get(f.name) == "config":
                mp.discard_candidate = True
                plan.changes.append(Change(sec, "", "apply", "candidate", None,
                                           "the file matches the live definition: its candidate is discarded"))
                plan.models[f.name] = mp
            continue
        static_change = (cur.deploy is None) != (want.deploy is None)
        adapters_hot = not engines_differ(cur, replace(cur, adapters=want.adapters,
                                                       max_loaded_adapters=want.max_loaded_adapters,
                                                       max_lora_rank=want.max_lora_rank))
        rows: list[Change] = []
        needs_candidate = needs_restart = False
        for key, old, new in diffs:
            top = key.split(".", 1)[0]
            if key == "deploy.count" and mp.override_dropped:
                rows.append(Change(sec, key, "apply", old, new, mp.override_dropped))
            elif top in MODEL_HOT:
                rows.append(Change(sec, key, "apply", old, new, MODEL_HOT[top]))
            elif top == "deploy" and not static_change and key.split(".")[1] in DEPLOY_HOT:
                rows.append(Change(sec, key, "apply", old, new, DEPLOY_HOT[key.split(".")[1]]))
            elif key == "deploy.roles" and not static_change and _counts_only(old, new):
                rows.append(Change(sec, key, "apply", old, new, "a group's count: replicas of that group are placed "
                                                                "or drained"))
            elif top in _ADAPTER_KEYS and adapters_hot:
                rows.append(Change(sec, key, "apply", old, new, "loaded on demand: no engine restarts"))
            elif top in MODEL_RESTART or static_change:
                needs_restart = True
                why = MODEL_RESTART.get(top, "a model gaining or losing [models.deploy] changes at a start")
                rows.append(Change(sec, key, "restart", old, new, why))
            elif f.name not in serving or cur.deploy is None:
                if cur.deploy is None:
                    needs_restart = True
                    rows.append(Change(sec, key, "restart", old, new,
                                       "a model without [models.deploy] has no candidate: its static replicas "
                                       "change at a start"))
                else:
                    rows.append(Change(sec, key, "apply", old, new, "no replica serves it yet: nothing to check a "
                                                                    "candidate against"))
            else:
                needs_candidate = True
                why = ("bound to a replica when it is routed" if any(key == b or key.startswith(b + ".")
                                                                      for b in _BOUND)
                       else "the engines are launched with it")
                rows.append(Change(sec, key, "candidate", old, new, why + ": a candidate is checked first"))
        if needs_restart:  # what waits for a start waits whole; the hot keys still apply
            mp.live = _hot_merge(cur, want, adapters_hot) if not static_change else None
            rows = [r if r.action != "candidate" else replace(r, action="restart", why="waits with the "
                    "definition's other changes for a start") for r in rows]
        elif needs_candidate:
            mp.live = _hot_merge(cur, want, adapters_hot)
            pending = candidates.get(f.name)
            if pending is not None and model_to_dict(pending) == model_to_dict(want):
                rows.append(Change(sec, "", "candidate", None, None, "the candidate for it is pending already"))
            else:
                mp.candidate = want
                mp.discard_candidate = pending is not None
        else:
            mp.live = want
            if f.name in candidates and sources.get(f.name) == "config":
                mp.discard_candidate = True
        if mp.live is not None and model_to_dict(mp.live) == model_to_dict(cur):
            mp.live = None
        plan.changes.extend(rows)
        plan.models[f.name] = mp
    return plan


def _section_rows(name: str, old: Any, new: Any, action: Action, why: str) -> list[Change]:
    a, b = to_plain(old), to_plain(new)
    if a == b:
        return []
    if isinstance(a, list) or isinstance(b, list):
        return [Change(name, "", action, a, b, why)]
    return [Change(name, k, action, _hidden(name, k, x), _hidden(name, k, y), why)
            for k, x, y in _keys_differ(a or {}, b or {})]


#: Keys whose values are secrets: a change is shown, never the value.
SECRET_KEYS = {("router", "traces.otlp_headers")}


def _hidden(section: str, key: str, value: Any) -> Any:
    if value is not None and any(section == s and (key == k or key.startswith(k + ".")) for s, k in SECRET_KEYS):
        return "(hidden)"
    return value


def diff_config(running: Config, file: Config, live: Mapping[str, ModelConfig], sources: Mapping[str, str], *,
                overrides: Mapping[str, ScaleOverride], candidates: Mapping[str, ModelConfig], serving: set[str],
                engines_differ: Callable[[ModelConfig, ModelConfig], bool]) -> ConfigPlan:
    """The whole file against what runs: `running` is the config the daemon runs with (its sections),
    the models are compared with those in force (diff_models)."""
    plan = diff_models(file.models, live, sources, overrides=overrides, candidates=candidates, serving=serving,
                       engines_differ=engines_differ)
    for f in fields(Config):
        if f.name == "models":
            continue
        old, new = getattr(running, f.name), getattr(file, f.name)
        if f.name in HOT_SECTIONS:
            rows = _section_rows(f.name, old, new, "apply", HOT_SECTIONS[f.name])
            setattr(plan, f.name, bool(rows))
        else:
            rows = _section_rows(f.name, old, new, "restart", RESTART_SECTIONS.get(f.name, "set up at start"))
        plan.changes.extend(rows)
    return plan


def shown(value: Any) -> str:
    """A value as one line of text (JSON; None as "-")."""
    return "-" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)
