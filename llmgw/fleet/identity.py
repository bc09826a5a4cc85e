"""Node identity: who may speak for a node name on the agent stream — the decision, as pure data.

The join token admits *new* nodes. At its first join a node gets a credential (a random secret the
router issues in its welcome; the router keeps only its hash, the agent keeps the secret in its
state directory) and from then on only a hello presenting that credential speaks for the node:

- a hello with the node's credential is admitted; one without it, or with another, is refused —
  whatever join token it carries;
- a credential is *pending* from its issue until the agent first uses it (its first message after
  the welcome, which it sends only once the credential is saved, or a hello presenting it). A
  pending credential may not have reached the agent's disk, so until then a join-token hello may
  still claim the node (and gets a new one);
- a revoked node's credential is refused with a reason saying so; a join-token hello without it
  joins as a new node (deleting the agent's credential file is the operator's decision);
- a node with no credential record (a new node, a node an older router knew, a node of an older
  agent that does not keep credentials, or a store that was lost) joins with the join token;
- a live connection is never replaced by another identity, and by the same identity only when it
  is the same agent process reconnecting or the old connection has gone silent (a half-open TCP
  connection after a network blip); otherwise the hello is refused with `retry`.

Also here: whether the control stream runs TLS (:func:`control_tls_wanted`,
:func:`agent_tls_wanted`). Pure: the caller hashes nothing secret itself and brings the clock.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

from llmgw.fleet.report_url import is_loopback_host

__all__ = ["Admission", "CredentialRecord", "LiveSession", "admit", "agent_tls_wanted", "control_tls_wanted",
           "credential_hash"]

RefusalKind = Literal["", "wrong_token", "wrong_credential", "no_credential", "revoked", "already_connected"]


def credential_hash(secret: str) -> str:
    """What the router stores of a credential. The secret is 256 random bits, so a plain SHA-256
    (no salt, no stretching) cannot be reversed or guessed; it only keeps the store from holding
    something that would let its reader speak for a node."""
    return hashlib.sha256(b"llmgw node credential\0" + secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class CredentialRecord:
    hash: str
    confirmed: bool  # the agent has used it: it surely has it
    revoked: bool


@dataclass(frozen=True, slots=True)
class LiveSession:
    """The node's connection that is up now, as the admission sees it."""
    agent_id: str
    silent_s: float  # since the router last heard it
    peer: str


@dataclass(frozen=True, slots=True)
class Admission:
    ok: bool
    reason: str = ""  # why refused (for the agent and the log; never a secret)
    kind: RefusalKind = ""  # the refusal's kind, for the metric
    retry: bool = False  # refused for now: the agent retries with its usual backoff
    issue: bool = False  # admit and issue a new credential in the welcome
    confirm: bool = False  # admitted with a pending credential: it is confirmed now
    replace: bool = False  # admitted: the node's live connection is to be closed


def admit(*, node: str, token_ok: bool, presented: str, keeps_credentials: bool,
          record: CredentialRecord | None, live: LiveSession | None, agent_id: str,
          stale_after_s: float) -> Admission:
    """Decide on a hello for `node` (its protocol version already checked).

    token_ok: the hello's join token is the router's. presented: the credential it presents,
    hashed with :func:`credential_hash` ("" for none). keeps_credentials: the agent lists the
    credential feature (an older agent would lose an issued credential). stale_after_s: silence
    after which the node's live connection counts as dead.
    """
    proven = bool(presented) and record is not None and hmac.compare_digest(presented, record.hash)
    if record is not None and record.revoked:
        if proven:
            return _refuse("revoked", f"node {node}'s credential was revoked by an operator; to join again, "
                                      "delete the agent's credential file (it then joins with the join token)")
        record = None  # a new join under the same name
        proven = False
    if record is not None and not proven:
        if record.confirmed or not token_ok:
            if presented:
                return _refuse("wrong_credential",
                               f"wrong credential for node {node}: the agent presents one this router did not "
                               "issue or no longer holds (its store restored or replaced, or the agent's state "
                               f"directory from another router?); `llmgw ctl nodes revoke {node}` and deleting the "
                               "agent's node-credential.json, then restarting the agent, let it join again with the join token")
            return _refuse("no_credential",
                           f"node {node} has joined before and this agent does not present its credential "
                           f"(a new state directory?); `llmgw ctl nodes revoke {node}` lets it join again "
                           "with the join token")
        record = None  # pending and never used: the agent may not have kept it; join again
    if record is None and not token_ok:
        return _refuse("wrong_token", "wrong join token")
    replace = False
    if live is not None:
        if live.agent_id != agent_id and live.silent_s <= stale_after_s:
            return Admission(False, f"node {node} is connected (from {live.peer}, heard "
                                    f"{live.silent_s:.1f}s ago); a second connection is refused",
                             kind="already_connected", retry=True)
        replace = True
    if proven:
        assert record is not None
        return Admission(True, confirm=not record.confirmed, replace=replace)
    return Admission(True, issue=keeps_credentials, replace=replace)


def _refuse(kind: RefusalKind, reason: str) -> Admission:
    return Admission(False, reason, kind=kind)


# --------------------------------------------------------------------------- TLS on the stream

def control_tls_wanted(listen_host: str, tls: bool | None, has_cert: bool = False) -> bool:
    """The router's control listener runs TLS when `[control] tls` says so, and by default
    (None) when it has a certificate of the operator's or listens beyond loopback — a wildcard
    address included."""
    if tls is not None:
        return tls
    return has_cert or not is_loopback_host(listen_host)


def agent_tls_wanted(router_host: str, tls: bool | None, has_ca: bool) -> bool:
    """The agent dials TLS when `[agent] tls` says so, and by default (None) when it was given a
    CA to pin or dials a router beyond loopback."""
    if tls is not None:
        return tls
    return has_ca or not is_loopback_host(router_host)
