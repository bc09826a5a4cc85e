"""Facility-aware placement at fleet scale (issue 16's targets), the pure core without I/O:
10,000 replicas on 2,000 nodes in 5 levels of domains (2 sites × 2 rooms × 5 rows × 5 racks ×
2 PDUs, 20 nodes of 8 H100s a rack), with power budgets on every rack and PDU and a hold on one
rack. Phases, each timed:

  place    one reconcile from nothing: every replica placed (targets: < 2 s)
  steady   one reconcile with nothing to do (< 50 ms)
  drain    a hold with drain on one row: the surge-then-drain plan (< 200 ms)
  explain  the explanation of one replica's placement (every node's verdict)

Run by bench/bench_fleet.py (``--facility``) or alone:  python bench/bench_facility.py
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Callable
from typing import Any

from llmgw.fleet.nodes import Node
from llmgw.fleet.placement import Demand, Placer, Policy
from llmgw.fleet.placement_explain import explain
from llmgw.fleet.reconcile import Facility, Hold, ModelDeploy, reconcile
from llmgw.fleet.spread import DEFAULT_SPREAD
from llmgw.fleet.types import EngineReport, EngineSpec, GpuInfo, NodeFacts

TARGETS = {"place": 2.0, "steady": 0.05, "drain": 0.2}


def nodes(n: int) -> dict[str, Node]:
    facts = NodeFacts(cpus=64, memory_mb=512000, gpus=tuple(GpuInfo(i, "NVIDIA H100 80GB HBM3", 81559)
                                                          for i in range(8)))
    out = {}
    for i in range(n):
        rack = i // 20
        labels = {"llmgw.io/site": f"s{rack // 50}", "llmgw.io/room": f"room{rack // 25}",
                  "llmgw.io/row": f"row{rack // 5}", "llmgw.io/rack": f"rack{rack}", "llmgw.io/pdu": f"pdu{i // 10}"}
        out[f"node-{i:04d}"] = Node(f"node-{i:04d}", "ready", 0.0, connected=True, agent_labels=labels, facts=facts)
    return out


def models(count: int, replicas: int) -> dict[str, ModelDeploy]:
    per = replicas // count
    out = {}
    for i in range(count):
        name = f"model-{i}"
        # a third of the models with hard spread rules on racks and PDUs
        spread = DEFAULT_SPREAD if i % 3 else tuple(type(r)(r.level, 2, hard=r.level in ("rack", "pdu"))
                                                    for r in DEFAULT_SPREAD)
        out[name] = ModelDeploy(name, per, Demand(gpus=2 if i % 3 == 1 else 1, gpu_memory_mb=20000),
                                EngineSpec("", name, "vllm", name, simulate=True), Policy(spread=spread))
    return out


CPU: dict[str, float] = {}  # phase -> process CPU seconds (the wall figure on a busy machine is more)


def timed(fn: Callable[[], Any], label: str = "") -> tuple[Any, float]:
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    CPU[label] = time.process_time() - c0
    return out, time.perf_counter() - t0


def run(n_nodes: int = 2000, n_replicas: int = 10000, n_models: int = 100) -> dict[str, float]:
    fleet = nodes(n_nodes)
    ms = models(n_models, n_replicas)
    # budgets: every PDU (10 nodes) and rack (20) capped a little under all-GPUs-busy
    budgets = {f"pdu=pdu{p}": 10 * 8 * 700 * 0.97 for p in range(n_nodes // 10)}
    budgets.update({f"rack=rack{r}": 20 * 8 * 700 * 0.95 for r in range(n_nodes // 20)})
    fac = Facility(holds={"rack=rack7": Hold("maintenance")}, budgets=budgets)
    ids = itertools.count()

    def new_id(model: str) -> str:
        return f"{model}/{next(ids)}"

    plan, t_place = timed(lambda: reconcile(ms, fleet, [], new_id=new_id, now_wall=0.0, facility=fac), "place")
    asg = {a.replica: a for a in plan.create}
    for a in asg.values():
        a.report = EngineReport(a.replica, a.model, "ready")
    reconcile(ms, fleet, asg.values(), new_id=new_id, now_wall=1.0, facility=fac)  # as every round after the first
    steady, t_steady = timed(lambda: reconcile(ms, fleet, asg.values(), new_id=new_id, now_wall=1.0, facility=fac),
                             "steady")
    held = dict(fac.holds)
    held["row=row3"] = Hold("row 3 maintenance", drain=True)
    fac2 = Facility(holds=held, budgets=budgets)
    drain, t_drain = timed(lambda: reconcile(ms, fleet, asg.values(), new_id=new_id, now_wall=2.0, facility=fac2),
                           "drain")
    one = next(iter(asg.values()))

    def explain_one() -> Any:
        others = [a for a in asg.values() if a.replica != one.replica]
        p = Placer(fleet.values(), ((a.node, a.model, a.demand, a.spec.gpu_indices) for a in others),
                   holds={d: h.reason for d, h in fac.holds.items()}, budgets=budgets,
                   policies={k: m.policy for k, m in ms.items()})
        return explain(p, one.model, one.demand, replica=one.replica, node=one.node)

    e, t_explain = timed(explain_one, "explain")
    print(f"facility: {n_nodes} nodes × 8 GPUs in 5 levels ({n_nodes // 20} racks, {n_nodes // 10} PDUs, "
          f"{len(budgets)} budgets, 1 rack held), {n_models} models")
    print("  phase       wall ms    cpu ms")
    print(f"  place    {t_place * 1000:8.1f} {CPU['place'] * 1000:8.1f}  {len(plan.create)} of {n_replicas} replicas placed"
          + (f"; {len(plan.unplaceable)} models short" if plan.unplaceable else ""))
    print(f"  steady   {t_steady * 1000:8.1f} {CPU['steady'] * 1000:8.1f}  {'nothing to do' if not steady else 'PLAN NOT EMPTY'}")
    print(f"  drain    {t_drain * 1000:8.1f} {CPU['drain'] * 1000:8.1f}  row3 held with drain: {len(drain.create)} replacements placed "
          f"(surge first; {len(drain.drain)} drained now)")
    print(f"  explain  {t_explain * 1000:8.1f} {CPU['explain'] * 1000:8.1f}  {len(e.candidates)} rows, {e.counts}")
    figures = {"place": t_place, "steady": t_steady, "drain": t_drain}
    for k, limit in TARGETS.items():
        print(f"  {k:8s} {'under' if figures[k] < limit else 'OVER'} its {limit * 1000:.0f} ms target "
              f"(cpu {'under' if CPU[k] < limit else 'OVER'})")
    return figures


if __name__ == "__main__":
    run()
