"""The config file against what runs (llmgw.lifecycle.config_diff): which differences apply at once,
which make a candidate, which wait for a start; an operator's scale against the file's count."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llmgw.config import Config, ModelConfig, parse_config
from llmgw.daemon.control.plane.config_reload import engines_differ
from llmgw.lifecycle.config_diff import ScaleOverride, diff_config, diff_models

BASE = """
[[models]]
name = "m"
engine = "vllm"
[models.deploy]
count = 2
args = ["--a"]
"""


def cfg(text: str = BASE) -> Config:
    return parse_config(text)


def model(text: str = BASE) -> ModelConfig:
    return cfg(text).models[0]


def plan_for(new: str, *, live: ModelConfig | None = None, overrides: dict[str, ScaleOverride] | None = None,
             candidates: dict[str, ModelConfig] | None = None, serving: set[str] | None = None) -> Any:
    cur = live or model()
    return diff_models(cfg(new).models, {"m": cur}, {"m": "config"}, overrides=overrides or {},
                       candidates=candidates or {}, serving={"m"} if serving is None else serving,
                       engines_differ=engines_differ)


def actions(plan: Any) -> list[tuple[str, str, str]]:
    return [(c.section, c.key, c.action) for c in plan.changes]


def test_no_change_is_empty() -> None:
    assert plan_for(BASE).empty


def test_strategy_and_count_apply_at_once() -> None:
    p = plan_for(BASE.replace('engine = "vllm"', 'engine = "vllm"\nstrategy = "batch"').replace("count = 2",
                                                                                                "count = 3"))
    assert actions(p) == [("models.m", "deploy.count", "apply"), ("models.m", "strategy", "apply")]
    mp = p.models["m"]
    assert mp.candidate is None and mp.live.strategy == "batch" and mp.live.deploy.count == 3


def test_args_make_a_candidate_and_the_hot_keys_still_apply() -> None:
    p = plan_for(BASE.replace('["--a"]', '["--b"]').replace("count = 2", "count = 4"))
    assert actions(p) == [("models.m", "deploy.args", "candidate"), ("models.m", "deploy.count", "apply")]
    mp = p.models["m"]
    assert mp.candidate.deploy.args == ("--b",) and mp.candidate.deploy.count == 4
    assert mp.live.deploy.args == ("--a",) and mp.live.deploy.count == 4


def test_a_model_nothing_serves_takes_the_file_at_once() -> None:
    p = plan_for(BASE.replace('["--a"]', '["--b"]'), serving=set())
    assert actions(p) == [("models.m", "deploy.args", "apply")]
    assert p.models["m"].candidate is None and p.models["m"].live.deploy.args == ("--b",)


def test_a_pending_candidate_for_the_same_definition_is_kept() -> None:
    new = BASE.replace('["--a"]', '["--b"]')
    p = plan_for(new, candidates={"m": model(new)})
    assert p.models["m"].candidate is None and not p.models["m"].discard_candidate
    other = plan_for(BASE.replace('["--a"]', '["--c"]'), candidates={"m": model(new)})
    assert other.models["m"].candidate is not None and other.models["m"].discard_candidate
    # the file back to the live definition: the candidate it asked for is discarded
    back = plan_for(BASE, candidates={"m": model(new)})
    assert back.models["m"].discard_candidate and back.models["m"].candidate is None


def test_an_operator_scale_lasts_until_the_file_count_changes() -> None:
    scaled = replace(model(), deploy=replace(model().deploy, count=5))
    ov = {"m": ScaleOverride(5, 2)}
    assert plan_for(BASE, live=scaled, overrides=ov).empty  # the file still says 2: the override holds
    p = plan_for(BASE.replace("count = 2", "count = 3"), live=scaled, overrides=ov)
    mp = p.models["m"]
    assert mp.live.deploy.count == 3 and mp.override is None and "wins over the operator's scale to 5" in \
        mp.override_dropped
    assert actions(p) == [("models.m", "deploy.count", "apply")]


def test_static_replicas_and_listen_addresses_wait_for_a_start() -> None:
    static = '[[models]]\nname = "m"\nengine = "vllm"\n[[models.replicas]]\nurl = "http://127.0.0.1:9"\n'
    p = plan_for(static.replace(":9", ":10"), live=model(static))
    assert actions(p) == [("models.m", "replicas", "restart")]
    running = cfg()
    new = cfg('[control]\nlisten = "0.0.0.0:7070"\n' + BASE)
    p = diff_config(running, new, {"m": model()}, {"m": "config"}, overrides={}, candidates={}, serving={"m"},
                    engines_differ=engines_differ)
    assert actions(p) == [("control", "listen", "restart")]


def test_strategies_facility_added_and_removed_models() -> None:
    running = cfg(BASE + '[[models]]\nname = "gone"\nengine = "vllm"\n[models.deploy]\ncount = 1\n')
    live = {m.name: m for m in running.models}
    new = cfg(BASE + '[[models]]\nname = "new"\nengine = "vllm"\n[models.deploy]\ncount = 1\n'
              '[[strategies]]\nname = "s"\nweights = { queue = 1.0 }\n[facility]\nbudgets = { "pdu=p1" = 1000.0 }\n')
    p = diff_config(running, new, live, {"m": "config", "gone": "config"}, overrides={}, candidates={},
                    serving={"m", "gone"}, engines_differ=engines_differ)
    got = set(actions(p))
    assert ("models.gone", "", "apply") in got and ("models.new", "", "apply") in got
    assert ("strategies", "", "apply") in got and ("facility", "budgets.pdu=p1", "apply") in got
    assert p.strategies and p.facility and p.models["gone"].remove and p.models["new"].add


def test_on_demand_vllm_adapters_apply_but_static_ones_make_a_candidate() -> None:
    one = BASE + '[[models.adapters]]\nname = "x"\nsource = "org/x"\n'
    # the first adapter turns LoRA on in the engines: a candidate
    assert actions(plan_for(one)) == [("models.m", "adapters", "candidate")]
    two = one + '[[models.adapters]]\nname = "y"\nsource = "org/y"\n'
    assert actions(plan_for(two, live=model(one))) == [("models.m", "adapters", "apply")]
    static = two + "static = true\n"
    assert actions(plan_for(static, live=model(one))) == [("models.m", "adapters", "candidate")]


PD = BASE + """[models.pd]
[[models.deploy.roles]]
role = "prefill"
count = 1
args = ["--p"]
[[models.deploy.roles]]
role = "decode"
count = 2
args = ["--d"]
"""


def test_a_prefill_or_decode_groups_count_applies_and_its_args_make_a_candidate() -> None:
    live = model(PD)
    p = plan_for(PD.replace("count = 2\nargs = [\"--d\"]", "count = 3\nargs = [\"--d\"]"), live=live)
    assert actions(p) == [("models.m", "deploy.roles", "apply")]
    assert [g.count for g in p.models["m"].live.deploy.roles] == [1, 3] and p.models["m"].candidate is None
    p = plan_for(PD.replace('["--d"]', '["--e"]').replace("count = 1\n", "count = 2\n"), live=live)
    assert actions(p) == [("models.m", "deploy.roles", "candidate")]
    assert p.models["m"].candidate.deploy.roles[1].args == ("--e",)
