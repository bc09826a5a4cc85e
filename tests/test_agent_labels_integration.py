"""An agent's `[agent] labels` take the short facility keys as `ctl label` does (rack → llmgw.io/rack),
over real processes; and the config refuses what ctl would refuse."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from llmgw.config import ConfigError, parse_config
from llmgw.fleet.domains import expand_labels, label_clash

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for


def test_short_facility_keys_in_an_agents_config_put_the_node_in_that_rack(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=0)])
    f.start_agent("a", labels={"site": "lab", "rack": "r12", "gpu-kind": "none"})
    wait_for(lambda: "a" in f.nodes(), 20)
    node = f.nodes()["a"]
    assert node["location"] == "lab/r12", node
    assert node["labels"] == {"llmgw.io/site": "lab", "llmgw.io/rack": "r12", "gpu-kind": "none"}, node
    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", str(f.tmp / "admin" / "admin.sock"),
                          "nodes", "--domain", "rack=r12"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "a" in out.stdout.split() and "lab/r12" in out.stdout, out.stdout + out.stderr


def test_agent_labels_are_checked_as_ctl_checks_them() -> None:
    cfg = parse_config('[agent]\nlabels = { rack = "r1", "llmgw.io/pdu" = "p2", zone = "z" }\n')
    assert cfg.agent.labels == {"llmgw.io/rack": "r1", "llmgw.io/pdu": "p2", "zone": "z"}
    with pytest.raises(ConfigError, match=r"agent\.labels.*llmgw.io/rack=.r 1.: a facility label's value"):
        parse_config('[agent]\nlabels = { rack = "r 1" }\n')
    with pytest.raises(ConfigError, match=r"agent\.labels.*'rack' and 'llmgw.io/rack' are the same label"):
        parse_config('[agent]\nlabels = { rack = "r1", "llmgw.io/rack" = "r2" }\n')


def test_one_expansion_and_one_clash_rule() -> None:
    assert expand_labels({"rack": "r1", " pdu": "p", "zone": "z", "llmgw.io/site": "s"}) == {
        "llmgw.io/rack": "r1", "llmgw.io/pdu": "p", "zone": "z", "llmgw.io/site": "s"}
    assert label_clash(["rack", "site", "zone"]) is None
    assert "are the same label (llmgw.io/row)" in (label_clash(["llmgw.io/row", "row"]) or "")
