"""A throwaway PostgreSQL server for the tests: the system's `initdb` and `postgres` (found on PATH,
then in /usr/lib/postgresql/*/bin — Debian's packages; scripts/test installs them when it can),
in a fresh temporary directory, listening on a Unix socket there and on an ephemeral 127.0.0.1
port, with fsync off. As root, it runs as the `postgres` system user (else `nobody`): PostgreSQL
refuses to run as root. TCP connections need the superuser's password (random, per server), the
socket trusts local connections. `start()` raises PgUnavailable with the reason when no server
can run, and the fixtures (tests/store_backends.py) skip with it.

For a server on another host (tests/netns.py): `listen` is the address it listens on (and that
`url()` names), `hba` the networks allowed to connect over TCP (with the password), and `enter`
a function the server's processes call before they drop root (to join a network namespace)."""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

__all__ = ["PgServer", "PgUnavailable", "find_bin"]


class PgUnavailable(Exception):
    """No PostgreSQL server can run here (the message says why)."""


def find_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    cands = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return cands[-1] if cands else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    def __init__(self, *, listen: str = "127.0.0.1", hba: tuple[str, ...] = (),
                 enter: Callable[[], None] | None = None) -> None:
        self.listen = listen
        self.hba = hba
        self.enter = enter
        self.dir = ""
        self.port = 0
        self.password = secrets.token_hex(16)
        self.proc: subprocess.Popen[bytes] | None = None
        self._user: pwd.struct_passwd | None = None

    # -- what tests use
    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres:{self.password}@{self.listen}:{self.port}/{dbname}"

    def admin(self, dbname: str = "postgres") -> Any:
        """A superuser connection over the Unix socket (autocommit)."""
        import psycopg

        return psycopg.connect(host=self.dir, port=self.port, user="postgres", dbname=dbname, autocommit=True,
                               connect_timeout=5)

    def create_database(self, name: str) -> str:
        with self.admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        with self.admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    @property
    def log(self) -> str:
        try:
            return Path(self.dir, "server.log").read_text(errors="replace")
        except OSError:
            return ""

    # -- its life
    def _demote(self) -> None:
        if self.enter is not None:
            self.enter()
        if self._user is not None:
            os.setgroups([])
            os.setgid(self._user.pw_gid)
            os.setuid(self._user.pw_uid)

    def start(self, timeout: float = 60.0) -> None:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise PgUnavailable("psycopg is not installed (pip install -e '.[test]')") from None
        initdb, postgres = find_bin("initdb"), find_bin("postgres")
        if not initdb or not postgres:
            raise PgUnavailable("no PostgreSQL server here (initdb/postgres not on PATH nor in "
                                "/usr/lib/postgresql/*/bin; scripts/test installs Debian's postgresql as root)")
        if os.geteuid() == 0:
            for name in ("postgres", "nobody"):
                try:
                    self._user = pwd.getpwnam(name)
                    break
                except KeyError:
                    continue
            else:
                raise PgUnavailable("running as root and neither a `postgres` nor a `nobody` user exists to run "
                                    "PostgreSQL as")
        self.dir = tempfile.mkdtemp(prefix="llmgw-pg-")
        if self._user is not None:
            os.chown(self.dir, self._user.pw_uid, self._user.pw_gid)
        data = os.path.join(self.dir, "data")
        pwfile = os.path.join(self.dir, "pw")
        with open(pwfile, "w") as f:
            f.write(self.password + "\n")
        if self._user is not None:
            os.chown(pwfile, self._user.pw_uid, self._user.pw_gid)
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        init = subprocess.run([initdb, "-D", data, "-U", "postgres", "--pwfile", pwfile, "--auth-local=trust",
                               "--auth-host=scram-sha-256", "--encoding=UTF8", "--locale=C", "--no-sync"],
                              capture_output=True, preexec_fn=self._demote, env=env, cwd=self.dir, timeout=120)
        if init.returncode != 0:
            raise PgUnavailable(f"initdb failed: {init.stderr.decode(errors='replace').strip()[-500:]}")
        if self.hba:
            with open(os.path.join(data, "pg_hba.conf"), "a") as f:
                f.writelines(f"host all all {net} scram-sha-256\n" for net in self.hba)
        for attempt in range(5):  # the port is free when picked; another process may take it meanwhile
            self.port = _free_port()
            logf = open(os.path.join(self.dir, "server.log"), "ab")  # noqa: SIM115 — the server's stderr
            if self._user is not None:
                os.chown(logf.name, self._user.pw_uid, self._user.pw_gid)
            self.proc = subprocess.Popen(
                [postgres, "-D", data, "-p", str(self.port), "-k", self.dir, "-c", f"listen_addresses={self.listen}",
                 "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                 "-c", "max_connections=200", "-c", "shared_buffers=16MB", "-c", "log_min_messages=warning"],
                stdout=logf, stderr=logf, preexec_fn=self._demote, env=env, cwd=self.dir, start_new_session=True)
            logf.close()
            if self._wait_ready(timeout):
                return
            self.stop()
        raise PgUnavailable(f"postgres did not start: {self.log.strip()[-500:]}")

    def _wait_ready(self, timeout: float) -> bool:
        import psycopg

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with self.admin():
                    return True
            except psycopg.OperationalError:
                time.sleep(0.05)
        return False

    def pause(self) -> None:
        """SIGSTOP the postmaster and its backends: a server that answers nothing."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_all(signal.SIGCONT)

    def _signal_all(self, sig: int) -> None:
        """The postmaster and every process it forked (each backend is a process group of its own)."""
        assert self.proc is not None
        pids = [self.proc.pid]
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid == self.proc.pid:
                    pids.append(int(entry))
        for pid in (pids if sig == signal.SIGSTOP else reversed(pids)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                self.proc = proc
                self.resume()
                self.proc = None
                proc.send_signal(signal.SIGINT)  # a fast shutdown
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass

    def cleanup(self) -> None:
        self.stop()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
