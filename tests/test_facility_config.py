"""Facility settings and inputs: [facility] budgets, a profile's spread/watts/nodes/keep_within,
facility label values, holds in the store, the agent's power figures. Every bad one is named."""

from __future__ import annotations

import pytest

from llmgw.admin.schema import LabelsBody
from llmgw.config import ConfigError, parse_config
from llmgw.daemon.control.model_deploy import deploy_of
from llmgw.daemon.control.store.sqlite import SCHEMA_VERSION, Store
from llmgw.fleet.facts import parse_power_draw
from llmgw.fleet.spread import DEFAULT_SPREAD, SpreadRule

DEPLOY = '[[models]]\nname = "m"\nengine = "vllm"\n[models.deploy]\n'


def errors(text: str) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(text, "f.toml")
    return str(e.value)


def test_budgets_name_a_domain_and_watts() -> None:
    cfg = parse_config('[facility.budgets]\n"pdu=p7" = 11000\n"rack=r1" = 20000.5\n')
    assert cfg.facility.budgets == {"pdu=p7": 11000.0, "rack=r1": 20000.5} and cfg.facility.rebalance
    assert "f.toml:2: facility.budgets.\"shelf=3\": domain 'shelf=3': expected LEVEL=VALUE with LEVEL one of site, room, " \
           "row, rack, pdu" in errors('[facility.budgets]\n"shelf=3" = 1\n')
    assert "budget of pdu=p7: must be > 0" in errors('[facility.budgets]\n"pdu=p7" = -5\n')
    assert "write the domain 'llmgw.io/pdu=p7' as 'pdu=p7'" in errors('[facility.budgets]\n"llmgw.io/pdu=p7" = 5\n')


def test_a_profile_s_facility_keys() -> None:
    cfg = parse_config(DEPLOY + 'watts = 700\nkeep_within = "rack"\n'
                       'spread = [{ level = "rack", max_skew = 2, hard = true }]\n')
    dep = deploy_of(cfg.models[0])
    assert dep is not None and dep.policy.spread == (SpreadRule("rack", 2, True),) and dep.policy.watts == 700
    assert deploy_of(parse_config(DEPLOY).models[0]).policy.spread == DEFAULT_SPREAD  # type: ignore[union-attr]
    text = errors(DEPLOY + 'nodes = 2\nkeep_within = "bay"\nspread = [{ level = "rack" }, { level = "rack" }]\n')
    assert "models[0].deploy.keep_within: expected one of 'site', 'room', 'row', 'rack', 'pdu'; got 'bay'" in text
    assert "models[0].deploy.spread[1].level: duplicate level 'rack'" in text


def test_multi_node_profiles_run_on_vllm_llamacpp_and_the_simulator() -> None:
    for body in ('simulate = true\nnodes = 2\nkeep_within = "rack"\n', 'nodes = 3\n'):
        text = body
        engine = "vllm" if "simulate" in body else "llamacpp"
        cfg = parse_config(DEPLOY.replace('"vllm"', f'"{engine}"') + text)
        dep = deploy_of(cfg.models[0])
        assert dep is not None and dep.policy.nodes == int(text.split("nodes = ")[1][0])
    assert deploy_of(parse_config(DEPLOY + "nodes = 2\n").models[0]).policy.nodes == 2  # type: ignore[union-attr]
    assert "models[0].deploy.args: a multi-node vLLM replica (nodes = 2) runs on Ray: " \
        "--distributed-executor-backend must be ray (or left out), got 'mp'" \
        in errors(DEPLOY + 'nodes = 2\nargs = ["--distributed-executor-backend", "mp"]\n')
    assert "got 'mp'" in errors(DEPLOY + 'nodes = 2\nargs = ["--distributed_executor_backend=mp"]\n')
    assert "models[0].deploy.nodes: must be 1..64, got 65" in errors(DEPLOY + "simulate = true\nnodes = 65\n")
    assert "models[0].deploy.nodes: must be 1..64, got 0" in errors(DEPLOY + "nodes = 0\n")


def test_multi_node_vllm_backend_is_checked_on_the_admin_api_too() -> None:
    import pytest as _pytest

    from llmgw.config import ConfigError, model_from_dict

    with _pytest.raises(ConfigError, match="deploy.args: a multi-node vLLM replica .nodes = 2. runs on Ray"):
        model_from_dict({"name": "m", "engine": "vllm",
                         "deploy": {"nodes": 2, "args": ["--distributed-executor-backend", "mp"]}})
    ok = model_from_dict({"name": "m", "engine": "vllm", "deploy": {"nodes": 2}})
    assert ok.deploy is not None and ok.deploy.nodes == 2
    assert model_from_dict({"name": "m", "engine": "llamacpp", "deploy": {"nodes": 2}}).deploy.nodes == 2  # type: ignore[union-attr]


def test_facility_label_values_are_names() -> None:
    assert "label llmgw.io/rack='r 1': a facility label's value" in \
        errors('[agent]\nlabels = { "llmgw.io/rack" = "r 1" }\n')
    assert parse_config('[agent]\nlabels = { "llmgw.io/rack" = "r1", "team" = "a b" }\n').agent.labels["team"] == "a b"
    assert [p.field for p in LabelsBody({"llmgw.io/pdu": "p=1", "x": "any thing"}).problems()] == ["labels.llmgw.io/pdu"]


def test_holds_are_kept_in_the_store() -> None:
    st = Store.memory()
    assert SCHEMA_VERSION >= 3  # holds came with 3
    st.put_hold("rack=r1", reason="swap", drain=True, now=5.0)
    st.put_hold("rack=r1", reason="swap PDU", drain=False, now=9.0)  # changes reason and drain, keeps the time
    h = st.holds()["rack=r1"]
    assert (h.reason, h.drain, h.created_at) == ("swap PDU", False, 5.0)
    assert st.delete_hold("rack=r1") and not st.delete_hold("rack=r1") and st.holds() == {}
    with pytest.raises(TypeError):
        st.put_hold("rack=r1", reason=3, drain=True)  # type: ignore[arg-type]


def test_nvidia_smi_power_draw() -> None:
    assert parse_power_draw("412.3\n[N/A]\n 88.1 \n") == 500.4
    assert parse_power_draw("[Not Supported]\n") is None and parse_power_draw("") is None
    assert parse_power_draw("-5\nnan\ninf\n") is None  # never negative: the router judges the rest


def test_a_heartbeat_may_carry_the_measured_power() -> None:
    from llmgw.fleet.wire import Heartbeat, WireProtocolError

    assert Heartbeat().to_dict() == {} and Heartbeat.from_dict({}) == Heartbeat()
    assert Heartbeat.from_dict(Heartbeat(measured_watts=412.5).to_dict()).measured_watts == 412.5
    with pytest.raises(WireProtocolError, match="heartbeat.measured_watts: expected float, got str"):
        Heartbeat.from_dict({"measured_watts": "lots"})


def test_a_hold_is_written_first_and_refused_whole() -> None:
    """Bad input or a store that cannot write: a clear error, and the holds (memory and store) unchanged."""
    from llmgw.config import FacilityConfig
    from llmgw.daemon.control.plane.facility import FacilityControl
    from llmgw.daemon.control.store.guard import StoreGuard, StoreUnavailable
    from llmgw.fleet.domains import DomainError
    from llmgw.fleet.nodes import Node

    st = Store.memory()
    fc = FacilityControl(FacilityConfig(), StoreGuard(st), st)
    nodes = [Node("a", "ready", 0.0, agent_labels={"llmgw.io/rack": "r1"})]
    with pytest.raises(DomainError, match="no node is in domain rack=r2; known: rack=r1"):
        fc.hold("rack=r2", "", False, nodes, 1.0)
    with pytest.raises(ValueError, match="printable"):
        fc.hold("rack=r1", "bad\x1b[2J", False, nodes, 1.0)
    assert fc.holds == {} and st.holds() == {}
    fc.hold("rack=r1", "swap", True, nodes, 1.0)
    assert list(st.holds()) == ["rack=r1"] and fc.round(0.0).holds["rack=r1"].drain
    # rebalancing: not in the first interval after a start, then once an interval
    assert [fc.round(t).rebalance for t in (10.0, 30.0, 31.0, 59.0, 60.5)] == [False, True, False, False, True]
    st._conn.close()  # the store fails every write from now on
    with pytest.raises(StoreUnavailable):
        fc.release("rack=r1")
    assert "rack=r1" in fc.holds  # still held: not released in memory either
    with pytest.raises(KeyError):
        fc.release("pdu=p9")
