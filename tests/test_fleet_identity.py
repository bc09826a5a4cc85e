"""Node identity's rules (llmgw.fleet.identity): who may speak for a node name, and when the control
stream runs TLS. Pure: every case is a table row."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.fleet.identity import (
    Admission,
    CredentialRecord,
    LiveSession,
    admit,
    agent_tls_wanted,
    control_tls_wanted,
    credential_hash,
)

GOOD = credential_hash("the-node-secret")
OTHER = credential_hash("another-secret")
CONFIRMED = CredentialRecord(GOOD, confirmed=True, revoked=False)
PENDING = CredentialRecord(GOOD, confirmed=False, revoked=False)
REVOKED = CredentialRecord(GOOD, confirmed=True, revoked=True)
FRESH = LiveSession("agent-1", silent_s=0.2, peer="10.0.0.7:40000")  # the node's connection, heard just now
STALE = LiveSession("agent-1", silent_s=9.0, peer="10.0.0.7:40000")


def decide(**kw: Any) -> Admission:
    args: dict[str, Any] = {"node": "gpu-1", "token_ok": True, "presented": "", "keeps_credentials": True,
                            "record": None, "live": None, "agent_id": "agent-2", "stale_after_s": 2.0}
    return admit(**(args | kw))


def test_a_new_node_joins_with_the_join_token_and_gets_a_credential() -> None:
    assert decide() == Admission(True, issue=True)
    assert decide(token_ok=False) == Admission(False, "wrong join token", kind="wrong_token")
    # an older agent that would lose a credential is admitted without one
    assert decide(keeps_credentials=False) == Admission(True, issue=False)


@pytest.mark.parametrize("token_ok", [True, False])
def test_a_known_node_needs_its_credential_whatever_the_token(token_ok: bool) -> None:
    assert decide(record=CONFIRMED, presented=GOOD, token_ok=token_ok) == Admission(True)
    wrong = decide(record=CONFIRMED, presented=OTHER, token_ok=token_ok)
    assert not wrong.ok and wrong.kind == "wrong_credential" and not wrong.retry
    none = decide(record=CONFIRMED, token_ok=token_ok)  # the impersonation of issue 12: token, no credential
    assert not none.ok and none.kind == "no_credential" and "llmgw ctl nodes revoke gpu-1" in none.reason


def test_a_pending_credential_is_confirmed_by_use_and_may_be_reissued_until_then() -> None:
    assert decide(record=PENDING, presented=GOOD) == Admission(True, confirm=True)
    # the agent may never have saved it: the join token claims the node again, with a new one
    assert decide(record=PENDING) == Admission(True, issue=True)
    assert decide(record=PENDING, presented=OTHER) == Admission(True, issue=True)
    assert decide(record=PENDING, token_ok=False).kind == "no_credential"


def test_a_revoked_credential_is_refused_and_the_name_joins_again_only_as_a_new_node() -> None:
    r = decide(record=REVOKED, presented=GOOD)
    assert not r.ok and r.kind == "revoked" and "delete the agent's credential file" in r.reason
    assert decide(record=REVOKED) == Admission(True, issue=True)  # its file deleted: a new join
    assert decide(record=REVOKED, token_ok=False).kind == "wrong_token"  # ... which needs the join token


def test_a_live_connection_is_never_replaced_by_another_identity() -> None:
    # Another process, even with the right credential, while the node's connection is heard from:
    r = decide(record=CONFIRMED, presented=GOOD, live=FRESH)
    assert not r.ok and r.retry and r.kind == "already_connected" and "10.0.0.7:40000" in r.reason
    # ... and a join-token hello for a connected node without a credential (an older agent's node)
    assert decide(live=FRESH).kind == "already_connected"
    # the wrong identity is refused as such, live connection or not
    assert decide(record=CONFIRMED, live=STALE).kind == "no_credential"


def test_the_same_identity_replaces_its_own_reconnect_or_a_stale_connection() -> None:
    # the same agent process reconnecting after a blip: at once
    assert decide(record=CONFIRMED, presented=GOOD, live=FRESH, agent_id="agent-1") == Admission(True, replace=True)
    # another process of the node (restarted agent) once the old connection went silent
    assert decide(record=CONFIRMED, presented=GOOD, live=STALE) == Admission(True, replace=True)
    assert decide(live=STALE) == Admission(True, issue=True, replace=True)


def test_the_credential_hash_is_stable_and_never_the_secret() -> None:
    assert credential_hash("s") == credential_hash("s") != credential_hash("t")
    assert "s3cret" not in credential_hash("s3cret") and len(credential_hash("x")) == 64


@pytest.mark.parametrize(("host", "tls", "cert", "want"), [
    ("127.0.0.1", None, False, False),
    ("127.0.0.2", None, False, False),
    ("::1", None, False, False),
    ("localhost", None, False, False),
    ("0.0.0.0", None, False, True),  # a wildcard listens beyond loopback
    ("::", None, False, True),
    ("10.0.0.1", None, False, True),
    ("router.example", None, False, True),
    ("127.0.0.1", None, True, True),  # the operator's certificate: TLS
    ("10.0.0.1", False, False, False),  # the explicit opt-out
    ("127.0.0.1", True, False, True),
])
def test_control_tls_is_on_by_default_beyond_loopback(host: str, tls: bool | None, cert: bool, want: bool) -> None:
    assert control_tls_wanted(host, tls, cert) is want


@pytest.mark.parametrize(("host", "tls", "ca", "want"), [
    ("127.0.0.1", None, False, False),
    ("10.0.0.1", None, False, True),
    ("router.example", None, False, True),
    ("127.0.0.1", None, True, True),  # a pinned CA means TLS
    ("10.0.0.1", False, False, False),
    ("127.0.0.1", True, False, True),
])
def test_agent_tls_follows_the_router_address_and_the_ca(host: str, tls: bool | None, ca: bool, want: bool) -> None:
    assert agent_tls_wanted(host, tls, ca) is want
