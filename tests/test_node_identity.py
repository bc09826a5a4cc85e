"""The shell of node identity, without a network: the router's credential records and join token
(llmgw.daemon.control.agents.identity), the agent's credential file, and the control listener's
generated CA (llmgw.daemon.control.agents.tls)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import ssl
import stat
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.config import parse_config
from llmgw.daemon.agent.credential import FILE_NAME, load_credential, save_credential
from llmgw.daemon.control.agents.tls import SERVER_NAME, ca_fingerprint, setup_control_tls
from llmgw.daemon.control.agents.identity import IdentityStoreError, JoinToken, NodeIdentities, RotateError
from llmgw.daemon.control.store.sqlite import Store
from llmgw.fleet.identity import credential_hash
from llmgw.fleet.types import NodeFacts
from llmgw.fleet.wire import AGENT_FEATURES, Hello

TOKEN = "join-Token-7"


def hello(node: str = "gpu-1", *, token: str = TOKEN, credential: str = "", agent_id: str = "a1",
          features: tuple[str, ...] = AGENT_FEATURES) -> Hello:
    return Hello(token=token, node=node, agent_id=agent_id, versions=(1,), labels={}, facts=NodeFacts(), engines=(),
                 credential=credential, features=features)


# -- the router's records ------------------------------------------------------------------------------
def test_issue_confirm_and_survive_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "router.db")
    with Store.open(path) as store:
        ids = NodeIdentities(store, JoinToken(TOKEN), clock=lambda: 100.0)
        v = ids.check(hello(), None, 2.0)
        assert v.admission.ok and v.admission.issue and len(v.secret) >= 40
        assert store.credentials()["gpu-1"].hash == credential_hash(v.secret) != v.secret  # only the hash is kept
        ids.confirm("gpu-1", v.presented_hash)
        secret = v.secret
    with Store.open(path) as store:
        ids = NodeIdentities(store, JoinToken("a-rotated-token"))
        assert ids.check(hello(token="stale", credential=secret), None, 2.0).admission.ok  # the credential suffices
        refused = ids.check(hello(token="a-rotated-token"), None, 2.0).admission  # the token does not
        assert not refused.ok and refused.kind == "no_credential"
        assert ids.check(hello("gpu-2", token="a-rotated-token"), None, 2.0).admission.issue  # new nodes: the token


def test_revoke_holds_in_memory_even_when_the_store_cannot_write() -> None:
    class Failing(Store):
        def revoke_credential(self, node: str, *, at: float) -> bool:
            raise sqlite3.OperationalError("database or disk is full")

        def put_credential(self, node: str, hash_: str, *, issued_at: float, replacing: object = ...) -> bool:
            raise sqlite3.OperationalError("database or disk is full")

    store = Failing(sqlite3.connect(":memory:", isolation_level=None), ":memory:")
    store._migrate()
    Store.put_credential(store, "gpu-1", credential_hash("s"), issued_at=1.0)  # written before the disk filled
    ids = NodeIdentities(store, JoinToken(TOKEN))
    had, error = ids.revoke("gpu-1")
    assert had and error is not None and "disk is full" in error
    assert ids.check(hello(credential="s"), None, 2.0).admission.kind == "revoked"
    with pytest.raises(IdentityStoreError, match="cannot record node gpu-2's credential"):
        ids.check(hello("gpu-2"), None, 2.0)  # never hand out a credential the router would forget


def test_two_routers_issuing_to_one_new_node_at_once_the_second_is_refused_for_now(tmp_path: Path) -> None:
    """Two routers on one store decide on hellos for the same new node before either has written:
    the first writer's credential stands, the second's hello is refused with retry (sessions.py
    turns IdentityStoreError into a `retry` refusal), and its retry meets the first's record."""
    path = str(tmp_path / "router.db")
    with Store.open(path) as a_store, Store.open(path) as b_store:
        a, b = NodeIdentities(a_store, JoinToken(TOKEN)), NodeIdentities(b_store, JoinToken(TOKEN))
        first = a.check(hello(agent_id="x"), None, 2.0)
        assert first.admission.issue
        with pytest.raises(IdentityStoreError, match="another router at the same moment"):
            b.check(hello(agent_id="y"), None, 2.0)
        assert b_store.credentials()["gpu-1"].hash == first.presented_hash
        assert b.records["gpu-1"].hash == first.presented_hash
        # The retry: first's credential is pending and unused, so a join-token hello may claim the
        # node again (the existing rule), replacing exactly that one.
        again = b.check(hello(agent_id="y"), None, 2.0)
        assert again.admission.issue and b_store.credentials()["gpu-1"].hash == again.presented_hash


# -- the join token --------------------------------------------------------------------------------
def test_a_token_file_is_read_again_when_it_changes_and_rotate_rewrites_it(tmp_path: Path) -> None:
    f = tmp_path / "join-token"
    f.write_text(TOKEN + "\n")
    jt = JoinToken(TOKEN, path=str(f))
    assert jt.matches(TOKEN) and not jt.matches("x")
    f.write_text("by-hand-rotated\n")
    os.utime(f, ns=(1, 1))  # a different mtime whatever the clock's resolution
    assert jt.matches("by-hand-rotated") and not jt.matches(TOKEN)
    new = jt.rotate()
    assert jt.matches(new) and not jt.matches("by-hand-rotated")
    assert f.read_text().strip() == new and stat.S_IMODE(f.stat().st_mode) == 0o600
    f.write_text("")  # an emptied file keeps the token in force
    os.utime(f, ns=(2, 2))
    assert jt.matches(new)


@pytest.mark.parametrize(("token", "kw", "message"), [
    (TOKEN, {}, "set inline"),
    (TOKEN, {"generated": True}, "made its join token itself"),
    (None, {}, "has no join token"),
])
def test_rotate_refuses_a_token_it_cannot_rewrite(token: str | None, kw: dict, message: str) -> None:
    with pytest.raises(RotateError, match=message):
        JoinToken(token, **kw).rotate()


# -- the agent's credential file -----------------------------------------------------------------------
def test_the_agent_keeps_its_credential_private_and_per_node(tmp_path: Path) -> None:
    d = tmp_path / "agent"
    assert load_credential(d, "gpu-1") == ""
    save_credential(d, "gpu-1", "s3cret")
    f = d / FILE_NAME
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert load_credential(d, "gpu-1") == "s3cret"
    assert load_credential(d, "gpu-2") == ""  # another node's name: not presented
    save_credential(d, "gpu-1", "n3w")
    assert load_credential(d, "gpu-1") == "n3w" and [p.name for p in d.iterdir()] == [FILE_NAME]
    f.write_text("{not json")
    assert load_credential(d, "gpu-1") == ""


# -- the generated CA --------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_the_router_makes_its_ca_once_and_an_agent_pinning_it_connects(tmp_path: Path) -> None:
    cfg = parse_config(f'[control]\nstore = "{tmp_path / "router.db"}"\nlisten = "0.0.0.0:7070"\n').control
    tls = setup_control_tls(cfg, "0.0.0.0")  # not loopback: TLS without being asked
    assert tls is not None and tls.generated and tls.server_name == SERVER_NAME and tls.ca_pem
    d = tmp_path / "tls"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.glob("*.key")} == {"ca.key": 0o600, "server.key": 0o600}
    again = setup_control_tls(cfg, "0.0.0.0")
    assert again is not None and again.ca_pem == tls.ca_pem  # made once
    assert len(ca_fingerprint(tls.ca_pem).split(":")) == 32
    assert setup_control_tls(cfg, "127.0.0.1") is None  # loopback: plain unless asked

    async def handshake() -> str:
        client = ssl.create_default_context(cadata=tls.ca_pem)
        a, b = trio.testing.memory_stream_pair()
        server = trio.SSLStream(b, tls.context, server_side=True)
        agent = trio.SSLStream(a, client, server_hostname=SERVER_NAME)
        async with trio.open_nursery() as n:
            n.start_soon(server.do_handshake)
            await agent.do_handshake()
        return agent.version() or ""

    assert trio.run(handshake).startswith("TLS")
