"""Facility-aware placement (pure core): domains, spread, holds, power budgets, multi-node replicas,
explanations, and the reconciler's surge-then-drain for holds and rebalancing."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.fleet.domains import DomainError, expand_key, node_domains, parse_domain
from llmgw.fleet.nodes import Node
from llmgw.fleet.placement import Demand, Placer, Policy
from llmgw.fleet.placement_explain import AT_PLACEMENT_ROWS, at_placement, explain
from llmgw.fleet.placement_group import place_groups
from llmgw.fleet.power import card_watts, node_power
from llmgw.fleet.reconcile import Assignment, Facility, Hold, ModelDeploy, reconcile
from llmgw.fleet.spread import SpreadRule
from llmgw.fleet.types import EngineReport, EngineSpec, GpuInfo, NodeFacts


def node(name: str, *, gpus: int = 0, card: str = "NVIDIA H100 80GB HBM3", state: str = "ready",
         measured: float | None = None, declared: int = 0, **facility: str) -> Node:
    labels = {f"llmgw.io/{k}": v for k, v in facility.items()}
    facts = NodeFacts(gpus=tuple(GpuInfo(i, card, 81559) for i in range(gpus)), measured_watts=measured,
                      declared_watts=declared)
    return Node(name, state, 0.0, connected=True, agent_labels=labels, facts=facts)  # type: ignore[arg-type]


def fleet(racks: int, per_rack: int, gpus: int = 8, pdus_per_rack: int = 2) -> list[Node]:
    return [node(f"n{r}-{k}", gpus=gpus, row=f"row{r // 2}", rack=f"r{r}", pdu=f"p{r}-{k % pdus_per_rack}")
            for r in range(racks) for k in range(per_rack)]


# -- domains and power ------------------------------------------------------------------------
def test_domains_short_keys_and_unknown_domains() -> None:
    assert node_domains({"llmgw.io/rack": "r1", "llmgw.io/site": "fra"}) == ("site=fra", "", "", "rack=r1", "")
    assert parse_domain("llmgw.io/rack=r1") == "rack=r1" and expand_key("pdu") == "llmgw.io/pdu"
    with pytest.raises(DomainError, match="known: rack=r1, rack=r2"):
        parse_domain("rack=r9", ["rack=r1", "rack=r2", "pdu=p1"])
    with pytest.raises(DomainError, match="LEVEL one of site, room, row, rack, pdu"):
        parse_domain("shelf=3")
    with pytest.raises(DomainError, match="value"):
        parse_domain("rack=a b")


def test_power_is_the_largest_known_and_absurd_measurements_are_ignored() -> None:
    assert card_watts("NVIDIA H100 80GB HBM3") == (70, 700) and card_watts("NVIDIA H100 PCIe") == (40, 350)
    assert card_watts("Mystery Card") is None
    p = node_power("a", node("a", gpus=8).facts)
    assert p.draw(0) == 8 * 70 and p.source == "derived"
    assert node_power("a", node("a", gpus=8, declared=3000).facts).draw(0) == 3000
    assert node_power("a", node("a", gpus=8, measured=4000.0).facts).draw(100) == 4100
    for bad in (-5.0, float("nan"), 1e9):
        q = node_power("a", node("a", gpus=8, measured=bad).facts)
        assert q.measured is None and q.warnings and q.draw(0) == 560
    assert node_power("a", node("a", card="Mystery").facts).draw(0) == 0


# -- rules and explanations -------------------------------------------------------------------
def test_a_budget_refuses_the_replica_that_would_exceed_it_and_the_explanation_says_so() -> None:
    nodes = [node("a", gpus=8, pdu="p1"), node("b", gpus=8, pdu="p2")]
    # idle 560 W per node; each 1-GPU replica adds 630 W
    p = Placer(nodes, budgets={"pdu=p1": 560 + 630 * 2, "pdu=p2": 560 + 630})
    spots, why = p.place("m", Demand(gpus=1), 4)
    assert Counter(n for n, _ in spots) == {"a": 2, "b": 1}
    assert why is not None and "2 would take a domain past its power budget" in why
    e = explain(p, "m", Demand(gpus=1))
    assert e.node is None and e.counts == {"power": 2}
    assert {c.node: c.detail for c in e.candidates} == {
        "a": "pdu=p1 would draw 2450 W of its 1820 W budget", "b": "pdu=p2 would draw 1820 W of its 1190 W budget"}


def test_holds_and_explanations_name_every_rule() -> None:
    nodes = [node("a", gpus=1, rack="r1"), node("b", gpus=1, rack="r2"), node("c", rack="r3"),
             node("d", gpus=1, rack="r4", state="not_ready")]
    p = Placer(nodes, holds={"rack=r1": "maintenance"})
    e = explain(p, "m", Demand(gpus=1))
    assert e.node == "b" and "next replica would go to b" in e.why
    verdicts = {c.node: (c.verdict, c.detail) for c in e.candidates}
    assert verdicts["a"] == ("held", "in held domain rack=r1 (maintenance)")
    assert verdicts["c"] == ("gpus", "0 free GPUs, needs 1") and verdicts["d"][0] == "not_ready"
    assert e.counts == {"chosen": 1, "held": 1, "gpus": 1, "not_ready": 1}


def test_a_placement_time_record_keeps_the_refusals_first_and_counts_every_node() -> None:
    nodes = [node("a", gpus=1, rack="r1"), node("b", gpus=1, rack="r2"), node("e", gpus=1, rack="r5"),
             node("c", rack="r3"), node("d", gpus=1, rack="r4", state="not_ready")]
    e = explain(Placer(nodes, holds={"rack=r1": "maintenance"}), "m", Demand(gpus=1))
    assert e.node == "b"
    r = at_placement(e, "e", 123.0)  # a round's second replica went to e: b, the first choice, fitted
    assert r.at == 123.0 and r.node == "e" and r.candidates[0].node == "e" and r.candidates[0].verdict == "chosen"
    assert [c.verdict for c in r.candidates[1:]] == ["gpus", "held", "not_ready", "fits"]
    assert r.counts == {"chosen": 1, "fits": 1, "held": 1, "gpus": 1, "not_ready": 1}
    assert r.why.startswith("placed on e (r") and "refused then: 1 gpus, 1 held, 1 not_ready" in r.why
    # bounded: refusals kept first, the rest counted
    many = [node(f"h{i}", gpus=1, rack="r1") for i in range(30)] + [node("ok", gpus=1, rack="r2")]
    r = at_placement(explain(Placer(many, holds={"rack=r1": ""}), "m", Demand(gpus=1)), "ok", 1.0)
    assert len(r.candidates) == AT_PLACEMENT_ROWS and r.truncated == 31 - AT_PLACEMENT_ROWS
    assert r.counts == {"chosen": 1, "held": 30} and all(c.verdict == "held" for c in r.candidates[1:])


def test_a_hard_spread_rule_refuses_and_a_soft_one_only_prefers() -> None:
    nodes = [node("a1", gpus=8, rack="r1"), node("a2", gpus=8, rack="r1"), node("b1", gpus=1, rack="r2")]
    hard = {"m": Policy(spread=(SpreadRule("rack", 1, hard=True),))}
    spots, why = Placer(nodes, policies=hard).place("m", Demand(gpus=1), 4)
    # r2 takes one (its only GPU) and is then full: it no longer holds r1 back
    assert len(spots) == 4 and why is None
    # three already in r1: the next two must go to r2, and the explanation names the rule
    nodes = [node("a1", gpus=8, rack="r1"), node("b1", gpus=8, rack="r2")]
    placed = [("a1", "m", Demand(gpus=1), (i,)) for i in range(3)]
    e = explain(Placer(nodes, placed, policies=hard), "m", Demand(gpus=1))
    assert e.node == "b1" and [(c.node, c.verdict) for c in e.candidates][1] == ("a1", "spread")
    assert "rack=r1 would hold 4 replicas of m, the least-loaded eligible rack 0 (max skew 1, hard)" in \
        e.candidates[1].detail
    spots, _ = Placer(nodes, placed, policies=hard).place("m", Demand(gpus=1), 2)
    assert [n for n, _ in spots] == ["b1", "b1"]
    soft = {"m": Policy(spread=(SpreadRule("rack", 1),))}
    spots, _ = Placer([node("a1", gpus=8, rack="r1")], policies=soft).place("m", Demand(gpus=1), 3)
    assert len(spots) == 3  # soft: one rack takes them all


def test_multi_node_replicas_are_all_or_nothing_inside_one_domain() -> None:
    nodes = [node("a1", gpus=8, rack="r1"), node("b1", gpus=8, rack="r2"), node("b2", gpus=8, rack="r2")]
    p = Placer(nodes, policies={"big": Policy(nodes=2, keep_within="rack")})
    groups, why = place_groups(p, "big", Demand(gpus=8), 2)
    assert [sorted(n for n, _ in g) for g in groups] == [["b1", "b2"]]
    assert why is not None and "no domain has 2 nodes that fit inside one rack" in why
    assert p.bins["a1"].free_gpus  # the lone node in r1 was not taken: nothing half-placed


# -- reconcile: holds with drain, rebalancing ---------------------------------------------------
def deploy(count: int, **pol: Any) -> ModelDeploy:
    return ModelDeploy("m", count, Demand(gpus=1), EngineSpec("", "m", "vllm", "m", simulate=True), Policy(**pol))


def ids() -> Any:
    c = itertools.count()
    return lambda model: f"{model}/{next(c)}"


def ready_all(asg: dict[str, Assignment]) -> None:
    for a in asg.values():
        a.report = EngineReport(a.replica, a.model, "ready")


def apply(plan: Any, asg: dict[str, Assignment]) -> None:
    for a in plan.create:
        asg[a.replica] = a
    for rid, _ in plan.drain:
        asg.pop(rid)  # drained and stopped, for the test's purpose
    for rid, why in plan.moving:
        asg[rid].moving = why


def test_a_hold_with_drain_surges_then_drains() -> None:
    nodes = {n.name: n for n in fleet(3, 2)}
    asg: dict[str, Assignment] = {}
    new = ids()
    apply(reconcile({"m": deploy(3)}, nodes, [], new_id=new, now_wall=0), asg)
    ready_all(asg)
    fac = Facility(holds={"rack=r0": Hold("maintenance", drain=True)})
    on_r0 = [a.replica for a in asg.values() if a.node.startswith("n0-")]
    assert len(on_r0) == 1
    plan = reconcile({"m": deploy(3)}, nodes, asg.values(), new_id=new, now_wall=1, facility=fac)
    assert len(plan.create) == 1 and not plan.create[0].node.startswith("n0-") and not plan.drain  # surge first
    apply(plan, asg)
    plan = reconcile({"m": deploy(3)}, nodes, asg.values(), new_id=new, now_wall=2, facility=fac)
    assert not plan  # the replacement is not ready yet: the held one keeps serving
    ready_all(asg)
    plan = reconcile({"m": deploy(3)}, nodes, asg.values(), new_id=new, now_wall=3, facility=fac)
    assert plan.drain == [(on_r0[0], "domain rack=r0 is held with drain")] and not plan.create


def test_a_hold_with_no_room_elsewhere_drains_nothing() -> None:
    nodes = {n.name: n for n in fleet(2, 1, gpus=1)}
    asg: dict[str, Assignment] = {}
    new = ids()
    apply(reconcile({"m": deploy(2)}, nodes, [], new_id=new, now_wall=0), asg)
    ready_all(asg)
    fac = Facility(holds={"rack=r0": Hold(drain=True)})
    plan = reconcile({"m": deploy(2)}, nodes, asg.values(), new_id=new, now_wall=1, facility=fac)
    assert not plan.drain and not plan.create and "in a held domain" in plan.unplaceable["m"]
    # it is the replacement that is missing, not a replica: the model still serves 2/2
    assert plan.unplaceable["m"].startswith("1 replacement for replicas to move (domain rack=r0 is held with drain) "
                                            "cannot be placed")
    assert plan.unplaceable["m"].endswith("; m still serves 2/2 ready: the replicas to move keep serving until "
                                          "their replacements are ready")
    # both racks held: two replacements; and a model short of a replica besides says both
    fac = Facility(holds={"rack=r0": Hold(drain=True), "rack=r1": Hold(drain=True)})
    plan = reconcile({"m": deploy(2)}, nodes, asg.values(), new_id=new, now_wall=2, facility=fac)
    assert plan.unplaceable["m"].startswith("2 replacements for replicas to move (domain rack=r0 is held with "
                                            "drain; domain rack=r1 is held with drain) cannot be placed")
    assert "2 are in a held domain" in plan.unplaceable["m"] and "m still serves 2/2 ready" in plan.unplaceable["m"]
    plan = reconcile({"m": deploy(3)}, nodes, asg.values(), new_id=new, now_wall=3, facility=fac)
    assert plan.unplaceable["m"].startswith("3 replicas (2 replacements for replicas to move (")
    assert "m still serves 2/3 ready" in plan.unplaceable["m"]


def test_a_late_joining_rack_gets_its_share_by_rebalancing() -> None:
    nodes = {n.name: n for n in fleet(2, 2)}
    asg: dict[str, Assignment] = {}
    new = ids()
    apply(reconcile({"m": deploy(4)}, nodes, [], new_id=new, now_wall=0), asg)
    ready_all(asg)
    nodes.update({n.name: n for n in fleet(4, 2) if n.name.startswith(("n2-", "n3-"))})
    fac = Facility(rebalance=True)
    for t in range(1, 20):
        plan = reconcile({"m": deploy(4)}, nodes, asg.values(), new_id=new, now_wall=t, facility=fac)
        if not plan:
            break
        assert len(plan.moving) <= 1
        apply(plan, asg)
        ready = sum(1 for a in asg.values() if a.engine_state == "ready" and not a.moving)
        assert ready + sum(1 for a in asg.values() if a.moving) >= 4  # never below the ready count
        ready_all(asg)
    racks = Counter(nodes[a.node].labels["llmgw.io/rack"] for a in asg.values())
    assert sorted(racks.values()) == [1, 1, 1, 1] and len(asg) == 4


# -- properties ---------------------------------------------------------------------------------
fleets = st.builds(lambda r, k, g: fleet(r, k, g), st.integers(1, 6), st.integers(1, 4), st.integers(1, 8))


@settings(max_examples=60, deadline=None)
@given(fleets, st.integers(1, 40), st.integers(500, 6000), st.sampled_from(["rack=r0", "row=row1", "pdu=p1-0", ""]))
def test_never_past_a_power_cap_and_never_in_a_held_domain(nodes: list[Node], n: int, cap: int, held: str) -> None:
    budgets = {"rack=r0": float(cap), "pdu=p1-1": float(cap) / 2, "row=row0": float(cap) * 2}
    p = Placer(nodes, holds={held: ""} if held else {}, budgets=budgets)
    before = dict(p.draw)
    spots, _ = p.place("m", Demand(gpus=1), n)
    by_name = {x.name: x for x in nodes}
    for name, _ in spots:
        assert not held or held not in node_domains(by_name[name].labels)
    for dom, cap_w in budgets.items():
        assert p.draw[dom] <= max(cap_w, before.get(dom, 0.0)) + 1e-6
        if p.draw[dom] > before.get(dom, 0.0):
            assert p.draw[dom] <= cap_w + 1e-6


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.integers(1, 3), st.integers(1, 30), st.integers(1, 2))
def test_hard_skew_stays_within_the_bound(racks: int, per_rack: int, n: int, max_skew: int) -> None:
    nodes = fleet(racks, per_rack, gpus=64)  # room everywhere: always feasible
    pol = Policy(spread=(SpreadRule("rack", max_skew, hard=True), SpreadRule("pdu", max_skew, hard=True)))
    p = Placer(nodes, policies={"m": pol})
    spots, why = p.place("m", Demand(gpus=1), n)
    assert why is None and len(spots) == n
    by_name = {x.name: x for x in nodes}
    for level, count in (("rack", racks), ("pdu", racks * min(2, per_rack))):
        c = Counter(by_name[name].labels[f"llmgw.io/{level}"] for name, _ in spots)
        counts = list(c.values()) + [0] * (count - len(c))
        assert max(counts) - min(counts) <= max_skew


@settings(max_examples=60, deadline=None)
@given(fleets, st.integers(1, 6), st.integers(2, 4), st.sampled_from(["rack", "row", "pdu"]))
def test_multi_node_replicas_stay_inside_one_domain(nodes: list[Node], n: int, size: int, level: str) -> None:
    p = Placer(nodes, policies={"m": Policy(nodes=size, keep_within=level)})
    groups, why = place_groups(p, "m", Demand(gpus=4), n)
    by_name = {x.name: x for x in nodes}
    for g in groups:
        assert len(g) == size and len({name for name, _ in g}) == size
        assert len({by_name[name].labels[f"llmgw.io/{level}"] for name, _ in g}) == 1
    assert (len(groups) == n) == (why is None)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.lists(st.tuples(st.sampled_from(["", "rack=r0", "row=row0", "pdu=p1-0"]),
                                             st.booleans(), st.integers(0, 2 ** 16)), min_size=1, max_size=12))
def test_moving_replicas_never_lowers_the_ready_count(count: int, steps: list[tuple[str, bool, int]]) -> None:
    """Holds with drain come and go and replacements become ready in any order: each round, the
    model's ready replicas that keep serving never drop below min(count, what was ready before)."""
    nodes = {n.name: n for n in fleet(3, 2, gpus=4)}
    asg: dict[str, Assignment] = {}
    new = ids()
    for t, (held, drain, ready_mask) in enumerate(steps):
        for k, a in enumerate(sorted(asg.values(), key=lambda a: a.replica)):
            if a.report is None and ready_mask >> (k % 16) & 1:
                a.report = EngineReport(a.replica, a.model, "ready")
        before = sum(1 for a in asg.values() if a.engine_state == "ready")
        fac = Facility(holds={held: Hold(drain=drain)} if held else {})
        plan = reconcile({"m": deploy(count)}, nodes, asg.values(), new_id=new, now_wall=t, facility=fac)
        apply(plan, asg)
        after = sum(1 for a in asg.values() if a.engine_state == "ready")
        assert after >= min(count, before)
        if held:  # nothing new in a held domain
            assert all(held not in node_domains(nodes[a.node].labels) for a in plan.create)
