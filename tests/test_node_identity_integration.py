"""Node identity over real processes (issue 12, item 3): a router daemon, agent daemons, and
hand-driven agents (raw_agent.py) saying what a real agent never would.

- an impersonating hello (the join token, an existing node's name) is refused, and the real
  agent's connection and replicas stay;
- a revoked node is cut off, its replicas move, and it cannot join again without the join token
  (rotated, here: the old one admits nobody);
- the desired set a node receives holds only its own engines (their `env` included)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from .raw_agent import RawAgent
from .test_fleet_integration import TOKEN, Fleet, fleet_factory, sim_model  # noqa: F401  (the fixture)
from .test_router_integration import Daemon
from .test_sim_vllm import wait_for

CRED_FILE = "node-credential.json"


def ctl(f: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", str(f.tmp / "admin" / "admin.sock"),
                           *args], capture_output=True, text=True, timeout=30)


class Trap:
    """A TCP listener a rogue points replicas at: counts what reaches it (nothing should)."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_an_impersonating_hello_is_refused_and_the_real_node_keeps_serving(fleet_factory: Any,
                                                                          tmp_path: Path) -> None:
    f = fleet_factory([sim_model(count=1)])
    real = f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    [rep] = f.ready("m")
    before = f.nodes()["a"]
    assert before["connected"]
    assert (tmp_path / "agent-a" / CRED_FILE).exists()  # the first welcome issued its credential
    trap = Trap()
    try:
        # 1. A rogue speaking the protocol by hand: the join token, node a's name, a ready report
        # for node a's replica pointing at the rogue's address, and no credential.
        rogue = RawAgent(f.control_port, node="a", token=TOKEN, agent_id="rogue", engines=[
            {"replica": rep["replica"], "model": "m", "state": "ready", "url": f"http://127.0.0.1:{trap.port}"}])
        assert rogue.answer["t"] == "refused", rogue.answer
        assert "does not present its credential" in rogue.answer["reason"]
        rogue.close()
        # ... and with a made-up credential
        liar = RawAgent(f.control_port, node="a", token=TOKEN, credential="guessed", features=["credential"])
        assert liar.answer["t"] == "refused" and "wrong credential" in liar.answer["reason"]
        liar.close()
        # 2. A real agent daemon with node a's name and the join token, but its own state dir.
        impostor = Daemon(f.agent_config("a", state_dir=str(tmp_path / "impostor")), role="agent", log_level="info")
        try:
            wait_for(lambda: "does not present its credential" in f.log(impostor), 15)
        finally:
            impostor.stop()
        assert not (tmp_path / "impostor" / CRED_FILE).exists()
        # The real agent's connection, replicas and routing are untouched.
        after = f.nodes()["a"]
        assert after["connected"] and after["agent_id"] == before["agent_id"] and after["state"] == "ready"
        assert [r["replica"] for r in f.ready("m")] == [rep["replica"]]
        for _ in range(10):
            r = f.chat("m")
            assert r.status_code == 200, r.text
        assert trap.hits == 0  # no prompt went to the rogue's address
        assert "refused agent 'a'" in f.log(f.router)
        assert TOKEN not in f.log(f.router)
        assert real.proc.poll() is None
    finally:
        trap.close()


class FileTokenFleet(Fleet):
    """The router reads its join token from a file (so `ctl join-token rotate` can rewrite it)."""

    def router_config(self) -> Path:
        token_file = self.tmp / "join-token"
        if not token_file.exists():
            token_file.write_text(TOKEN + "\n")
        path = super().router_config()
        text = path.read_text().replace(f'join_token = "{TOKEN}"', f'join_token_file = "{token_file}"')
        path.write_text(text)
        return path


def test_a_revoked_node_is_cut_off_and_rejoins_only_with_the_join_token(tmp_path: Path) -> None:
    f = FileTokenFleet(tmp_path, [sim_model(count=2)], lost_after=30.0)
    try:
        agent_a = f.start_agent("a")
        f.start_agent("b")
        wait_for(lambda: len(f.ready("m")) == 2, 30)
        on_a = [r["replica"] for r in f.ready("m") if r["node"] == "a"]
        assert len(on_a) == 1
        out = ctl(f, "nodes", "revoke", "a")
        assert out.returncode == 0, out.stderr
        assert "node a revoked" in out.stdout and on_a[0] in out.stdout
        # cut off at once: gone from the nodes, its replica out of routing and placed on b
        assert "a" not in f.nodes()
        assert on_a[0] not in {r["replica"] for r in f.ready("m") if r["routable"]}
        wait_for(lambda: len(f.ready("m")) == 2 and {r["node"] for r in f.ready("m")} == {"b"}, 30)
        # its agent keeps trying with its (revoked) credential and is refused each time
        wait_for(lambda: "credential was revoked" in f.log(agent_a), 15)
        assert "a" not in f.nodes()
        assert f.chat("m").status_code == 200
        # A new join needs the join token — rotated now, so the old one (which node a knows) fails.
        out = ctl(f, "-o", "json", "join-token", "rotate")
        assert out.returncode == 0, out.stderr
        new_token = json.loads(out.stdout)["join_token"]
        assert new_token != TOKEN and (tmp_path / "join-token").read_text().strip() == new_token
        agent_a.stop()
        (tmp_path / "agent-a" / CRED_FILE).unlink()  # the operator lets the machine join afresh
        old = f.start_agent("a")
        wait_for(lambda: "wrong join token" in f.log(old), 15)
        assert "a" not in f.nodes()
        old.stop()
        fresh = f.start_agent("a", token=new_token)
        wait_for(lambda: f.nodes().get("a", {}).get("state") == "ready", 15)
        # the router marks the node ready at its hello; the agent saves its credential on the welcome
        wait_for(lambda: (tmp_path / "agent-a" / CRED_FILE).exists(), 15)
        assert fresh.proc.poll() is None
        info = json.loads(ctl(f, "-o", "json", "join-info").stdout)
        assert info["join_token"] == new_token and info["join_token_source"] == "file"
        assert ctl(f, "nodes", "revoke", "nobody").returncode == 1  # 404: an unknown node
    finally:
        f.close()


def test_a_node_receives_only_its_own_engines(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model(count=2, env=["HF_TOKEN=hf_Secret123"])])
    f.start_agent("a")
    raw = RawAgent(f.control_port, node="x", token=TOKEN, features=["credential", "report_rejected"])
    try:
        assert raw.answer["t"] == "welcome" and raw.answer["credential"]

        def mine() -> list[str]:
            return [r["replica"] for r in f.replicas("m") if r["node"] == "x"]

        wait_for(lambda: len(f.replicas("m")) == 2 and len(mine()) == 1, 20)
        desired = raw.wait_for("desired")
        while [e["replica"] for e in desired["engines"]] != mine():
            desired = raw.wait_for("desired")
        [spec] = desired["engines"]
        assert spec["env"] == [["HF_TOKEN", "hf_Secret123"]]  # its own engine's env, and no other's
    finally:
        raw.close()


@pytest.mark.parametrize("features", [[], None], ids=["no-features", "older-agent"])
def test_an_agent_that_keeps_no_credential_is_not_issued_one(fleet_factory: Any, features: Any) -> None:
    f = fleet_factory([sim_model(count=0)])
    raw = RawAgent(f.control_port, node="old", token=TOKEN, features=features)
    try:
        assert raw.answer["t"] == "welcome" and not raw.answer.get("credential")
        wait_for(lambda: "old" in f.nodes(), 10)
        assert "keeps no node credential" in f.log(f.router)
    finally:
        raw.close()
    assert httpx.get(f"{f.router.url}/v1/models").status_code == 200
