"""An agent whose TLS setting does not match the router's control port says the likely cause in its
own log (both directions), over real processes — not just "peer closed the connection"."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for


def test_a_plaintext_agent_dialing_a_tls_router_says_the_router_expects_tls(fleet_factory: Any,  # noqa: F811
                                                                             tmp_path: Path) -> None:
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    f = fleet_factory([sim_model(count=0)], control={"tls": True, "tls_dir": str(tmp_path / "ca")})
    plain = f.start_agent("p", tls=False)
    wait_for(lambda: "the router expects TLS" in f.log(plain), 15)
    line = next(x for x in f.log(plain).splitlines() if "the router expects TLS" in x)
    assert "agent.tls" in line and "tls_ca" in line and "join-info" in line, line
    assert "p" not in f.nodes()


def test_a_tls_agent_dialing_a_plaintext_router_says_it_is_not_tls(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=0)])  # loopback: plain TCP
    tls = f.start_agent("t", tls=True)
    wait_for(lambda: "not TLS" in f.log(tls), 15)
    line = next(x for x in f.log(tls).splitlines() if "not TLS" in x)
    assert "agent.tls" in line and "control.tls" in line, line
    assert "t" not in f.nodes()
