"""The router's node credentials and join token (the rules are llmgw.fleet.identity's).

:class:`NodeIdentities` keeps every node's credential record in memory (loaded from the store at
start, so a hello is checked without touching the disk) and writes each change through to the
store: a credential issued, confirmed, revoked. A credential that cannot be written is not issued
(the hello is refused with `retry`), so no agent ever holds a credential the router would forget.

:class:`JoinToken` is the join token in force: inline in the config, read from
`join_token_file` (read again whenever the file changes, so rotating it needs no restart), or
made by the one-process mode for its own agent. `rotate()` writes a new random one to the file.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.rows import CredentialRow
from llmgw.fleet.identity import Admission, CredentialRecord, LiveSession, admit, credential_hash
from llmgw.fleet.wire import FEATURE_CREDENTIAL, Hello

log = logging.getLogger("llmgw.control")

__all__ = ["IdentityStoreError", "JoinToken", "NodeIdentities", "RotateError"]


class IdentityStoreError(Exception):
    """The store could not record a credential change (the message says why)."""


class RotateError(Exception):
    """The join token cannot be rotated here (the message says what to do instead)."""


class JoinToken:
    """The join token in force. `source` is "config" (inline), "file", "generated" or "none"."""

    def __init__(self, value: str | None, *, path: str | None = None, generated: bool = False) -> None:
        self._value = value
        self.path = path
        self.source = "file" if path else "generated" if generated else "config" if value else "none"
        self._stat: tuple[int, int, int] | None = self._file_stat() if path else None

    def _file_stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # type: ignore[arg-type]
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def current(self) -> str | None:
        """The token now; a file is read again when it changed (a rotation by hand)."""
        if self.path:
            st = self._file_stat()
            if st != self._stat:
                self._stat = st
                try:
                    with open(self.path) as f:
                        value = f.read().strip()
                except OSError as e:
                    log.error("control.join_token_file: cannot read %s: %s; keeping the token in force",
                              self.path, e.strerror or e)
                else:
                    if value and value != self._value:
                        log.info("control.join_token_file changed: the new join token is in force")
                        self._value = value
                    elif not value:
                        log.error("control.join_token_file %s is empty; keeping the token in force", self.path)
        return self._value

    def matches(self, given: str) -> bool:
        token = self.current()
        return token is not None and hmac.compare_digest(given.encode(), token.encode())

    def rotate(self) -> str:
        """A new random token, in force at once; written to the token file (0600, atomically)."""
        if self.source == "config":
            raise RotateError("the join token is set inline (control.join_token): change it in the config file "
                              "and restart the router, or use control.join_token_file, which `rotate` can rewrite")
        if self.source == "generated":
            raise RotateError("this router made its join token itself for its own agent (one-process mode, no "
                              "control.join_token_file); set control.join_token_file to manage one")
        if self.source == "none":
            raise RotateError("this router has no join token (control.join_token_file is not set): agents cannot "
                              "join it")
        assert self.path is not None
        token = secrets.token_urlsafe(32)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise RotateError(f"cannot write control.join_token_file {self.path}: {e.strerror or e}") from None
        self._value = token
        self._stat = self._file_stat()
        return token


@dataclass(frozen=True, slots=True)
class Verdict:
    """An admission and, when it issues one, the new credential's secret (for the welcome only)."""
    admission: Admission
    secret: str = ""
    presented_hash: str = ""


class NodeIdentities:
    def __init__(self, store: FleetStore, token: JoinToken, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.token = token
        self.clock = clock
        try:
            rows = store.credentials()
        except store.faults as e:  # a store that cannot be read must not stop agents' sessions
            log.error("store: cannot read node credentials (%s); nodes without one must join again", e)
            rows = {}
        self.records: dict[str, CredentialRow] = rows
        self.issued = 0  # counters for the metrics
        self.revoked = 0

    def record(self, node: str) -> CredentialRecord | None:
        row = self.records.get(node)
        if row is None:
            return None
        return CredentialRecord(row.hash, row.confirmed_at is not None, row.revoked_at is not None)

    def check(self, hello: Hello, live: LiveSession | None, stale_after_s: float) -> Verdict:
        """Decide on a hello; when the admission issues a credential it is made and stored here."""
        presented = credential_hash(hello.credential) if hello.credential else ""
        adm = admit(node=hello.node, token_ok=self.token.matches(hello.token), presented=presented,
                    keeps_credentials=hello.has(FEATURE_CREDENTIAL), record=self.record(hello.node), live=live,
                    agent_id=hello.agent_id, stale_after_s=stale_after_s)
        if not adm.ok or not adm.issue:
            return Verdict(adm, presented_hash=presented)
        secret = secrets.token_urlsafe(32)
        digest, now = credential_hash(secret), self.clock()
        # First writer wins: written only if the store still holds what this decision saw (another
        # router sharing the store may have issued one to the same node meanwhile).
        known = self.records.get(hello.node)
        replacing = None if known is None or known.revoked_at is not None else known.hash
        try:
            written = self.store.put_credential(hello.node, digest, issued_at=now, replacing=replacing)
        except self.store.faults as e:
            raise IdentityStoreError(f"cannot record node {hello.node}'s credential in the store: {e}") from None
        if written is False:
            try:
                if (row := self.store.credentials().get(hello.node)) is not None:
                    self.records[hello.node] = row  # what the other router issued: the agent's retry meets it
            except self.store.faults:
                pass
            raise IdentityStoreError(f"node {hello.node} was given a credential by another router at the same "
                                     "moment; this hello is refused for now and the agent retries")
        self.records[hello.node] = CredentialRow(hello.node, digest, now, None, None)
        self.issued += 1
        return Verdict(adm, secret=secret, presented_hash=digest)

    def confirm(self, node: str, digest: str) -> None:
        """The agent has the credential with this hash (it used it): no longer pending."""
        row = self.records.get(node)
        if row is None or row.hash != digest or row.confirmed_at is not None or row.revoked_at is not None:
            return
        now = self.clock()
        self.records[node] = CredentialRow(node, digest, row.issued_at, now, None)
        try:
            self.store.confirm_credential(node, digest, at=now)
        except self.store.faults as e:  # kept in memory; written again by the next confirmation after a restart
            log.error("store: cannot record that node %s confirmed its credential: %s", node, e)

    def revoke(self, node: str) -> tuple[bool, str | None]:
        """Refuse the node's credential from now on: (whether it had one in force, why the store
        could not record it — None when it did). The revocation holds in memory either way."""
        row = self.records.get(node)
        if row is None or row.revoked_at is not None:
            return False, None
        now = self.clock()
        self.records[node] = CredentialRow(node, row.hash, row.issued_at, row.confirmed_at, now)
        self.revoked += 1
        try:
            self.store.revoke_credential(node, at=now)
        except self.store.faults as e:
            log.error("store: cannot record the revocation of node %s (%s): it holds until the router "
                      "restarts; revoke it again then", node, e)
            return True, str(e)
        return True, None
