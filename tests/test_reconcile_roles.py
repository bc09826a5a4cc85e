"""A disaggregated model's prefill and decode groups in the pure reconciler: each group a unit
(counted, matched, created, scaled, moved on its own), spread apart, under holds and power
budgets like any replica, and kept inside one domain with [models.pd] keep_within."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from llmgw.config import parse_config
from llmgw.daemon.control.model_deploy import deploy_of
from llmgw.fleet.nodes import Node
from llmgw.fleet.placement import Placer
from llmgw.fleet.placement_explain import explain
from llmgw.fleet.reconcile import Assignment, Facility, Hold, ModelDeploy, reconcile
from llmgw.fleet.types import EngineReport, EngineSpec, GpuInfo, NodeFacts

from tests.test_facility_placement import apply, ids, ready_all

PRODUCER = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
CONSUMER = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'


def model(prefill: int = 1, decode: int = 2, *, keep_within: str = "", decode_args: str = CONSUMER,
          watts: int = 0, roles: bool = True) -> ModelDeploy:
    pd = f'[models.pd]\n{f"keep_within = {keep_within!r}" if keep_within else ""}\n' if roles else ""
    groups = f"""
[[models.deploy.roles]]
role = "prefill"
count = {prefill}
args = ["--kv-transfer-config", '{PRODUCER}']
env = ["ROLE=p"]
[[models.deploy.roles]]
role = "decode"
count = {decode}
args = ["--kv-transfer-config", '{decode_args}']
""" if roles else ""
    cfg = parse_config(f"""
[[models]]
name = "m"
engine = "vllm"
{pd}
[models.deploy]
simulate = true
gpus = 1
count = 3
watts = {watts}
args = ["--max-num-seqs", "64"]
env = ["A=1"]
{groups}
""")
    dep = deploy_of(cfg.models[0])
    assert dep is not None
    return dep


def node(name: str, *, gpus: int = 2, **facility: str) -> Node:
    labels = {f"llmgw.io/{k}": v for k, v in facility.items()}
    facts = NodeFacts(gpus=tuple(GpuInfo(i, "NVIDIA H100 80GB HBM3", 81559) for i in range(gpus)))
    return Node(name, "ready", 0.0, connected=True, agent_labels=labels, facts=facts)  # type: ignore[arg-type]


def fleet(racks: int, per_rack: int, gpus: int = 2) -> dict[str, Node]:
    return {f"n{r}-{k}": node(f"n{r}-{k}", gpus=gpus, rack=f"r{r}", pdu=f"p{r}-{k}")
            for r in range(racks) for k in range(per_rack)}


def roles(asg: dict[str, Assignment] | list[Assignment]) -> Counter[str]:
    return Counter(a.spec.role for a in (asg.values() if isinstance(asg, dict) else asg))


def rack(nodes: dict[str, Node], a: Assignment) -> str:
    return nodes[a.node].labels["llmgw.io/rack"]


# -- the deploy and its units -------------------------------------------------------------------
def test_deploy_of_has_one_unit_per_group_with_its_args_and_env_after_the_profiles() -> None:
    m = model(1, 2)
    assert m.count == 3 and [(u.role, u.count) for u in m.units] == [("prefill", 1), ("decode", 2)]
    p, d = m.units
    assert p.template.args == ("--max-num-seqs", "64", "--kv-transfer-config", PRODUCER)
    assert d.template.args == ("--max-num-seqs", "64", "--kv-transfer-config", CONSUMER)
    assert p.template.env == (("A", "1"), ("ROLE", "p")) and d.template.env == (("A", "1"),)
    assert (p.template.role, d.template.role) == ("prefill", "decode")
    plain = model(roles=False)
    assert [(u.role, u.count) for u in plain.units] == [("", 3)] and plain.units[0].template is plain.template
    assert plain.template.role == "" and not plain.roles


def test_the_role_is_carried_on_the_wire_and_an_old_spec_reads_as_none() -> None:
    spec = replace(model().units[0].spec_for("m/1", (0,)))
    assert EngineSpec.from_wire(spec.to_wire()) == spec and spec.to_wire()["role"] == "prefill"
    old = model(roles=False).spec_for("m/2", (1,))
    wire = old.to_wire()
    assert "role" not in wire  # an engine without a role hashes as before: nothing restarts
    assert EngineSpec.from_wire(wire).role == "" and EngineSpec.from_wire(wire).spec_hash() == old.spec_hash()
    assert replace(old, role="decode").spec_hash() != old.spec_hash()


# -- reconcile ----------------------------------------------------------------------------------
def test_groups_are_placed_with_their_counts_and_args_then_the_round_is_quiet() -> None:
    nodes, asg, new = fleet(3, 1), {}, ids()
    plan = reconcile({"m": model(1, 2)}, nodes, [], new_id=new, now_wall=0)
    apply(plan, asg)
    assert roles(asg) == {"prefill": 1, "decode": 2} and not plan.unplaceable
    for a in asg.values():
        assert a.spec.args[-1] == (PRODUCER if a.spec.role == "prefill" else CONSUMER)
    # each group spreads on its own, and apart from the other: three racks, one replica each
    assert sorted(rack(nodes, a) for a in asg.values()) == ["r0", "r1", "r2"]
    ready_all(asg)
    assert not reconcile({"m": model(1, 2)}, nodes, asg.values(), new_id=new, now_wall=1)


def test_each_group_spreads_over_the_racks() -> None:
    nodes, asg = fleet(2, 2), {}
    apply(reconcile({"m": model(2, 2)}, nodes, [], new_id=ids(), now_wall=0), asg)
    for role in ("prefill", "decode"):  # a lost rack never takes all of one role
        assert sorted(rack(nodes, a) for a in asg.values() if a.spec.role == role) == ["r0", "r1"]


def test_scaling_one_group_never_touches_the_other() -> None:
    nodes, asg, new = fleet(3, 2), {}, ids()
    apply(reconcile({"m": model(1, 2)}, nodes, [], new_id=new, now_wall=0), asg)
    ready_all(asg)
    decoders = {r for r, a in asg.items() if a.spec.role == "decode"}
    plan = reconcile({"m": model(3, 2)}, nodes, asg.values(), new_id=new, now_wall=1)
    assert roles(plan.create) == {"prefill": 2} and not plan.drain
    apply(plan, asg)
    ready_all(asg)
    plan = reconcile({"m": model(3, 1)}, nodes, asg.values(), new_id=new, now_wall=2)
    assert not plan.create and len(plan.drain) == 1
    [(rid, why)] = plan.drain
    assert rid in decoders and why == "decode group scaled to 1"
    apply(plan, asg)
    plan = reconcile({"m": model(0, 1)}, nodes, asg.values(), new_id=new, now_wall=3)
    assert {asg[r].spec.role for r, _ in plan.drain} == {"prefill"} and len(plan.drain) == 3


def test_a_changed_groups_args_replace_only_that_group() -> None:
    nodes, asg, new = fleet(3, 2), {}, ids()
    apply(reconcile({"m": model(1, 2)}, nodes, [], new_id=new, now_wall=0), asg)
    ready_all(asg)
    changed = model(1, 2, decode_args='{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_consumer"}')
    # the stored spec of a replica is compared as it reads back from the store (a fresh object)
    stored = [replace(a, spec=EngineSpec.from_wire(a.spec.to_wire()), _match=None) for a in asg.values()]
    plan = reconcile({"m": changed}, nodes, stored, new_id=new, now_wall=1)
    assert {asg[r].spec.role for r, _ in plan.drain} == {"decode"} and len(plan.drain) == 2
    assert {why for _, why in plan.drain} == {"model m's decode group changed"}
    assert roles(plan.create) == {"decode": 2} and all("LMCache" in a.spec.args[-1] for a in plan.create)
    # the group gone: its replicas drain, the other group stays
    only_prefill = replace(changed, roles=changed.roles[:1], count=1)
    plan = reconcile({"m": only_prefill}, nodes, stored, new_id=new, now_wall=2)
    assert sorted(why for _, why in plan.drain) == ["model m has no decode group any more"] * 2


def test_a_hold_with_drain_moves_group_replicas_surge_first() -> None:
    nodes, asg, new = fleet(3, 2), {}, ids()
    m = model(1, 2)
    apply(reconcile({"m": m}, nodes, [], new_id=new, now_wall=0), asg)
    ready_all(asg)
    [held] = [a for a in asg.values() if a.spec.role == "decode" and rack(nodes, a) == "r2"] or \
        [a for a in asg.values() if a.spec.role == "decode"][:1]
    fac = Facility(holds={f"rack={rack(nodes, held)}": Hold("maintenance", drain=True)})
    plan = reconcile({"m": m}, nodes, asg.values(), new_id=new, now_wall=1, facility=fac)
    [repl] = plan.create
    assert repl.spec.role == "decode" and rack(nodes, repl) != rack(nodes, held) and not plan.drain  # surge
    apply(plan, asg)
    assert not reconcile({"m": m}, nodes, asg.values(), new_id=new, now_wall=2, facility=fac)  # not ready yet
    ready_all(asg)
    plan = reconcile({"m": m}, nodes, asg.values(), new_id=new, now_wall=3, facility=fac)
    assert plan.drain == [(held.replica, f"domain rack={rack(nodes, held)} is held with drain")]
    assert not plan.create


def test_a_group_with_no_room_to_move_says_which_group_and_what_still_serves() -> None:
    nodes = fleet(2, 1, gpus=2)
    asg, new = {}, ids()
    m = model(2, 2)
    apply(reconcile({"m": m}, nodes, [], new_id=new, now_wall=0), asg)
    ready_all(asg)
    plan = reconcile({"m": m}, nodes, asg.values(), new_id=new, now_wall=1,
                     facility=Facility(holds={"rack=r0": Hold(drain=True)}))
    why = plan.unplaceable["m"]
    assert why.startswith("prefill: 1 replacement for replicas to move (domain rack=r0 is held with drain) cannot "
                          "be placed") and "; decode: 1 replacement" in why
    assert "m's prefill group still serves 2/2 ready" in why and not plan.drain


def test_a_power_budget_blocks_group_replicas_as_any() -> None:
    nodes = fleet(1, 2, gpus=4)
    # idle 2 × 4 × 70 W = 560 W; room for one more replica of 700 W declared, not two
    plan = reconcile({"m": model(1, 1, watts=700)}, nodes, [], new_id=ids(), now_wall=0,
                     facility=Facility(budgets={"rack=r0": 560 + 700 + 100}))
    assert roles(plan.create) == {"prefill": 1}
    assert plan.unplaceable["m"].startswith("decode: 1 replica cannot be placed (each needs 1 GPU): of the nodes, "
                                            "2 would take a domain past its power budget")


def test_keep_within_keeps_every_replica_in_one_rack() -> None:
    nodes, asg, new = fleet(3, 2), {}, ids()
    m = model(1, 2, keep_within="rack")
    plan = reconcile({"m": m}, nodes, [], new_id=new, now_wall=0)
    apply(plan, asg)
    assert roles(asg) == {"prefill": 1, "decode": 2} and len({rack(nodes, a) for a in asg.values()}) == 1
    home = rack(nodes, next(iter(asg.values())))
    # more of both follow into the same rack (2 nodes × 2 GPUs: room for one more)
    plan = reconcile({"m": model(2, 2, keep_within="rack")}, nodes, asg.values(), new_id=new, now_wall=1)
    assert [rack(nodes, a) for a in plan.create] == [home] and not plan.unplaceable
    apply(plan, asg)
    # full: the reason says so, and nothing goes to another rack
    plan = reconcile({"m": model(2, 4, keep_within="rack")}, nodes, asg.values(), new_id=new, now_wall=2)
    assert not plan.create
    assert plan.unplaceable["m"] == (f"decode: 2 replicas cannot be placed (each needs 1 GPU): keep_within rack: "
                                     f"rack={home} has no room: of its 2 nodes, 2 have too few free GPUs")


def test_keep_within_follows_the_most_of_the_models_replicas() -> None:
    nodes = fleet(3, 2)
    m = model(1, 3, keep_within="rack")
    asg, new = {}, ids()
    for rid, n, role in (("m/a", "n0-0", "decode"), ("m/b", "n1-0", "prefill"), ("m/c", "n1-1", "decode")):
        u = m.unit(role)
        assert u is not None
        asg[rid] = Assignment(rid, "m", n, u.spec_for(rid, (0,)), m.demand)
    plan = reconcile({"m": m}, nodes, asg.values(), new_id=new, now_wall=0)
    assert [(a.spec.role, rack(nodes, a)) for a in plan.create] == [("decode", "r1")]
    # the explanation says why the other racks are out
    live = list(asg.values())
    p = Placer(nodes.values(), ((a.node, a.model, a.demand, a.spec.gpu_indices, a.spec.role) for a in live),
               policies={"m": m.policy})
    e = explain(p, "m", m.demand)
    assert e.node is not None and e.node.startswith("n1-")
    out = [c for c in e.candidates if c.verdict == "keep_within"]
    assert {c.node for c in out} == {"n0-0", "n0-1", "n2-0", "n2-1"}
    assert out[0].detail == "outside rack=r1, where the model's replicas are kept (keep_within rack)"


def test_keep_within_needs_labelled_nodes() -> None:
    nodes = {n: node(n) for n in ("a", "b")}
    plan = reconcile({"m": model(1, 1, keep_within="rack")}, nodes, [], new_id=ids(), now_wall=0)
    assert not plan.create
    assert "prefill: 1 replica cannot be placed (each needs 1 GPU): keep_within rack: no ready node has a rack label" \
        in plan.unplaceable["m"]


def test_a_model_without_roles_is_as_before() -> None:
    nodes, asg, new = fleet(3, 1), {}, ids()
    m = model(roles=False)
    apply(reconcile({"m": m}, nodes, [], new_id=new, now_wall=0), asg)
    assert roles(asg) == {"": 3} and all(a.spec.args == ("--max-num-seqs", "64") for a in asg.values())
    ready_all(asg)
    assert not reconcile({"m": m}, nodes, asg.values(), new_id=new, now_wall=1)
    plan = reconcile({"m": replace(m, count=1)}, nodes, asg.values(), new_id=new, now_wall=2)
    assert [why for _, why in plan.drain] == ["scaled to 1", "scaled to 1"]
    # a model gaining groups replaces its replicas (their profile changed)
    plan = reconcile({"m": model(1, 1)}, nodes, asg.values(), new_id=new, now_wall=3)
    assert {why for _, why in plan.drain} == {"model m's profile changed"} and roles(plan.create) == \
        {"prefill": 1, "decode": 1}


def test_keep_within_a_whole_domain_held_with_drain_moves_the_whole_model_together() -> None:
    nodes, asg, new = fleet(3, 2), {}, ids()
    m = model(1, 2, keep_within="rack")
    apply(reconcile({"m": m}, nodes, [], new_id=new, now_wall=0), asg)
    ready_all(asg)
    home = rack(nodes, next(iter(asg.values())))
    fac = Facility(holds={f"rack={home}": Hold(drain=True)})
    plan = reconcile({"m": m}, nodes, asg.values(), new_id=new, now_wall=1, facility=fac)
    assert roles(plan.create) == {"prefill": 1, "decode": 2} and not plan.drain  # surge first
    assert len({rack(nodes, a) for a in plan.create}) == 1 and rack(nodes, plan.create[0]) != home
    apply(plan, asg)
    ready_all(asg)
    plan = reconcile({"m": m}, nodes, asg.values(), new_id=new, now_wall=2, facility=fac)
    apply(plan, asg)
    assert not plan.create and len(plan.drain) == 3 and len({rack(nodes, a) for a in asg.values()}) == 1


def test_the_model_view_counts_each_role_and_the_static_endpoints_with_one() -> None:
    from llmgw.daemon.control.plane.views import model_views

    cfg = parse_config(f"""
[[models]]
name = "m"
engine = "vllm"
[models.pd]
[[models.replicas]]
url = "http://127.0.0.1:9"
role = "prefill"
[models.deploy]
simulate = true
[[models.deploy.roles]]
role = "prefill"
count = 1
args = ["--kv-transfer-config", '{PRODUCER}']
[[models.deploy.roles]]
role = "decode"
count = 2
""")
    dep = deploy_of(cfg.models[0])
    assert dep is not None
    asg = [Assignment(f"m/{i}", "m", "a", u.spec_for(f"m/{i}", ()), dep.demand)
           for i, u in enumerate((dep.units[0], dep.units[1], dep.units[1]))]
    asg[0].report = asg[1].report = EngineReport("m/x", "m", "ready")
    [view] = model_views({"m": cfg.models[0]}, {}, asg, {})
    assert (view.desired_replicas, view.replicas, view.ready) == (3, 3, 2)
    assert [(g.role, g.ready, g.replicas, g.desired, g.static) for g in view.groups] == \
        [("prefill", 1, 1, 1, 1), ("decode", 1, 2, 2, 0)]
