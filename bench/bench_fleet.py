"""Reconciliation and placement at fleet scale: 500 nodes and 2,000 replicas (target: under 1 s),
and the router's memory per node and per replica.

Simulated agents in one process: the control plane is the real one (ControlPlane over a real
SQLite store in WAL mode and a real Router), and each agent's hello and engine reports go through
the same methods a connection calls, without the sockets. Phases, each timed:

  place      one reconcile from nothing: 2,000 replicas placed on 500 nodes, written to the store
  ready      2,000 engine reports "ready": each replica enters the scheduler
  steady     one reconcile with nothing to do (the every-second cost)
  lose       10 nodes lost at once: their replicas written off and placed elsewhere
  restart    a new control plane loading everything from the store, then all 500 hellos
             (the router-restart path: nothing is re-placed)

Then (unless --no-facility) bench/bench_facility.py: facility-aware placement of 10,000 replicas on
2,000 nodes in 5 levels of domains with budgets and holds (full placement, steady reconcile, a
hold with drain of one row planned), against issue 16's targets.

    .venv/bin/python bench/bench_fleet.py [--nodes 500] [--replicas 2000] [--models 50]
"""

from __future__ import annotations

import argparse
import gc
import logging
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import trio

from llmgw.config import Config, ControlConfig, DeployConfig, ModelConfig
from llmgw.daemon.control.plane.plane import ControlPlane
from llmgw.daemon.router.control_port import RouterAdapter
from llmgw.daemon.router.proxy import Router
from llmgw.daemon.control.store.sqlite import Store
from llmgw.daemon.net.upstream import UpstreamPool
from llmgw.fleet.types import EngineReport, GpuInfo, NodeFacts


def config(store: str, models: int, replicas: int) -> Config:
    per = replicas // models
    ms = tuple(ModelConfig(name=f"model-{i}", engine="vllm",
                           deploy=DeployConfig(count=per, gpus=1 if i % 2 else 2, gpu_memory_mb=20000))
               for i in range(models))
    return Config(control=ControlConfig(store=store, lost_after_s=30.0), models=ms)


def facts() -> NodeFacts:
    return NodeFacts(cpus=64, memory_mb=512000, gpus=tuple(GpuInfo(i, "H100", 81559) for i in range(8)))


def hello(cp: ControlPlane, i: int, now: float) -> None:
    name = f"node-{i:03d}"
    labels = {"llmgw.io/site": "fra", "llmgw.io/row": f"row-{i // 80}", "llmgw.io/rack": f"rack-{i // 16}",
              "llmgw.io/pdu": f"pdu-{i // 8}"}
    cp.nodes.connected(name, f"agent-{i}", labels=labels, facts=facts(), now=now)
    cp.store.upsert_node(name, agent_labels=labels, facts=facts().to_wire(), seen_at=time.time())


def report_ready(cp: ControlPlane) -> None:
    for k, a in enumerate(list(cp.assignments.values())):
        cp._on_report(a.node, EngineReport(a.replica, a.model, "ready", spec_hash=a.spec.spec_hash(),
                                           url=f"http://10.{k // 65536}.{k // 256 % 256}.{k % 256}:8000", pid=k))


def timed(label: str, fn: Any, results: dict[str, float]) -> Any:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    results[label] = time.perf_counter() - t0
    return out


def memory(cfg: Config, pool: UpstreamPool, nodes: int, db: str) -> tuple[int, int]:
    """Bytes held after the hellos, and after placement and readiness (a separate, untimed run:
    tracemalloc slows everything down severalfold)."""
    from dataclasses import replace

    cfg = replace(cfg, control=replace(cfg.control, store=db))
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cp = ControlPlane(cfg, Store.open(db), RouterAdapter(Router(cfg, pool)), token="t", settle_s=0.0)
    now = trio.current_time()
    for i in range(nodes):
        hello(cp, i, now)
    after_nodes = tracemalloc.get_traced_memory()[0] - base
    cp.reconcile_once()
    report_ready(cp)
    after_all = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    cp.store.close()
    return after_nodes, after_all


async def run(ns: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "router.db")
        cfg = config(db, ns.models, ns.replicas)
        results: dict[str, float] = {}
        async with UpstreamPool() as pool:
            mem_nodes, mem_all = memory(cfg, pool, ns.nodes, str(Path(tmp) / "mem.db"))
            router = Router(cfg, pool)
            cp = ControlPlane(cfg, Store.open(db), RouterAdapter(router), token="t", settle_s=0.0)
            now = trio.current_time()
            for i in range(ns.nodes):
                hello(cp, i, now)
            timed("place", cp.reconcile_once, results)
            placed = len(cp.assignments)
            if placed != ns.replicas:
                raise SystemExit(f"only {placed} of {ns.replicas} replicas were placed: the figures would mean nothing")
            timed("ready", lambda: report_ready(cp), results)
            timed("steady", cp.reconcile_once, results)
            for i in range(10):
                cp.nodes.nodes[f"node-{i:03d}"].state = "lost"
            moved = sum(1 for a in cp.assignments.values() if a.node < "node-010")
            timed("lose", cp.reconcile_once, results)
            cp.store.close()

            def restart() -> ControlPlane:
                cp2 = ControlPlane(cfg, Store.open(db), RouterAdapter(Router(cfg, pool)), token="t", settle_s=0.0)
                t = trio.current_time()
                for i in range(10, ns.nodes):
                    hello(cp2, i, t)
                report_ready(cp2)
                cp2.reconcile_once()
                return cp2

            cp2 = timed("restart", restart, results)
            replaced = sum(1 for h in cp2.store.history(limit=100000) if h.event == "replica placed")
            cp2.store.close()
        print(f"fleet: {ns.nodes} nodes × 8 GPUs, {ns.models} models, {placed} replicas placed "
              f"(target {ns.replicas})")
        for k in ("place", "ready", "steady", "lose", "restart"):
            print(f"  {k:8s} {results[k] * 1000:8.1f} ms")
        print(f"  lose moved {moved} replicas; after restart {len(cp2.assignments)} assignments, "
              f"{replaced - placed - moved} placed anew")
        total = results["place"] + results["ready"]
        print(f"place + ready for {placed} replicas on {ns.nodes} nodes: {total * 1000:.0f} ms "
              f"({'under' if total < 1 else 'OVER'} the 1 s target)")
        per_node = mem_nodes / ns.nodes
        per_replica = (mem_all - mem_nodes) / max(1, placed)
        print(f"router memory: {per_node / 1024:.1f} KiB per node, {per_replica / 1024:.1f} KiB per replica "
              f"(tracemalloc, Python objects only)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=500)
    p.add_argument("--replicas", type=int, default=2000)
    p.add_argument("--models", type=int, default=50)
    p.add_argument("--no-facility", action="store_true", help="skip the facility-aware placement phases")
    logging.basicConfig(level=logging.ERROR)
    ns = p.parse_args()
    trio.run(run, ns)
    if not ns.no_facility:
        import bench_facility  # bench/ is on the path when this file runs as a script

        bench_facility.run()


if __name__ == "__main__":
    main()
