"""Engines the store does not know (unknown_engines.py): which are kept, which are stopped, the
bound per node, a model rebuilt from an adopted engine's spec, and the spec the hello carries."""

from __future__ import annotations

from pathlib import Path

from llmgw.config import parse_config
from llmgw.daemon.control.plane.plane import deploy_of
from llmgw.daemon.control.store.sqlite import Store
from llmgw.daemon.control.store.guard import StoreGuard
from llmgw.daemon.control.plane.unknown_engines import MAX_PER_NODE, UNKNOWN_EVENT, UnknownEngines, adopted_model
from llmgw.fleet.types import EngineReport, EngineSpec
from llmgw.fleet.wire import EngineUpdate, FrameDecoder, encode


def spec(rid: str, model: str = "m") -> EngineSpec:
    return EngineSpec(replica=rid, model=model, engine="vllm", model_path="org/m", simulate=True,
                      args=("--sim-zero-cost",), env=(("TOKEN", "s3cr3t"),), gpu_indices=(1, 3),
                      health_timeout_s=20.0, generation=2)


def report(rid: str, state: str = "ready", with_spec: bool = True, model: str = "m") -> EngineReport:
    return EngineReport(replica=rid, model=model, state=state, url="http://127.0.0.1:9",
                        spec=spec(rid, model) if with_spec else None)


def test_kept_removed_and_gone(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "r.db")) as st:
        st.record("replica removed", replica="m/old")  # an earlier router run removed it
        u = UnknownEngines(StoreGuard(st))
        u.removed("m/this-run")
        assert u.report("a", report("m/1")) is True
        assert u.report("a", report("m/old")) is False and u.report("a", report("m/this-run")) is False
        assert u.report("a", report("m/nospec", with_spec=False)) is False  # cannot be kept without its spec
        assert u.specs_for("a") == [spec("m/1")] and u.held_nodes() == {"a"} and u.by_node() == {"a": ["m/1"]}
        # its own "engine unknown" event does not make it known next time
        assert [h.event for h in st.history(replica="m/1")] == [UNKNOWN_EVENT]
        assert UnknownEngines(StoreGuard(st)).report("a", report("m/1")) is True
        assert u.report("a", report("m/1", state="stopped")) is False and u.engines == {}
        u.report("a", report("m/2"))
        u.node_gone("a", keep={"m/3"})
        assert u.engines == {}


def test_a_spec_of_another_engine_is_not_kept_and_the_count_is_bounded(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "r.db")) as st:
        u = UnknownEngines(StoreGuard(st))
        liar = report("m/1")
        liar.spec = spec("m/other")
        assert u.report("a", liar) is False  # the spec would make the agent start another engine
        for i in range(MAX_PER_NODE + 5):
            u.report("a", report(f"m/{i:04d}"))
        assert len(u.engines) == MAX_PER_NODE
        assert u.report("b", report("m/on-b")) is True  # per node


def test_an_adopted_model_matches_the_engine_it_came_from() -> None:
    cfg = parse_config("")
    m = adopted_model(spec("m/1"), 2, cfg.pools)
    assert m is not None and m.deploy is not None and m.deploy.count == 2 and m.deploy.gpus == 2
    dep = deploy_of(m)
    assert dep is not None
    assert dep.spec_for("m/1", (1, 3), 2) == spec("m/1")  # so reconcile keeps it: no "profile changed"
    bad = EngineSpec(replica="x/1", model="x", engine="not-an-engine", model_path="p")
    assert adopted_model(bad, 1, cfg.pools) is None


def test_the_hello_report_carries_the_spec_over_the_wire() -> None:
    msg = EngineUpdate(report("m/1"))
    [back] = FrameDecoder().feed(encode(msg, 1))
    assert back == msg and back.report.spec == spec("m/1")
    plain = EngineUpdate(report("m/2", with_spec=False))
    [back] = FrameDecoder().feed(encode(plain, 1))
    assert back.report.spec is None and "spec" not in plain.report.to_wire()
