"""A router on PostgreSQL, over real processes: `[store] url` (with `password_file`) makes the
daemon keep the fleet's state in the database — an operator's label lands in its `nodes` table and
is there after a restart — and a store that cannot be reached at start stops the daemon with one
line naming `store.url` and the reason, never the password."""

from __future__ import annotations

import pytest

psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL store's tests need psycopg (the test extra)")

import json
import subprocess
import sys
from pathlib import Path


from tests.pg_server import PgServer, _free_port
from tests.test_router_integration import Daemon


def pg_config(tmp: Path, url: str, password_file: Path | None = None, timeout_s: float = 5.0) -> Path:
    lines = ["[server]", 'host = "127.0.0.1"',
             "[control]", f"store = {json.dumps(str(tmp / 'router.db'))}",
             "[store]", f"url = {json.dumps(url)}", f"timeout_s = {timeout_s}", "lease_s = 10.0",
             "[admin]", f"socket = {json.dumps(str(tmp / 'admin' / 'admin.sock'))}"]
    if password_file is not None:
        lines.append(f"[store]\npassword_file = {json.dumps(str(password_file))}".split("\n", 1)[1])
        lines.insert(lines.index("[admin]"), lines.pop())
    path = tmp / "llmgw.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def ctl(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", str(tmp / "admin" / "admin.sock"), *args],
                          capture_output=True, text=True, timeout=60)


def test_a_router_keeps_its_state_in_postgresql(pg_server: PgServer, pg_url: str, tmp_path: Path) -> None:
    secret = tmp_path / "pg-password"
    secret.write_text(pg_server.password + "\n")
    bare = pg_url.replace(f":{pg_server.password}@", "@")
    config = pg_config(tmp_path, bare, secret)
    d = Daemon(config, log_level="info")
    try:
        r = ctl(tmp_path, "label", "box-1", "team=infer")
        assert r.returncode == 0, r.stderr
        with psycopg.connect(pg_url) as conn:
            row = conn.execute("SELECT operator_labels FROM nodes WHERE name = 'box-1'").fetchone()
        assert row is not None and json.loads(row[0]) == {"team": "infer"}
        status = ctl(tmp_path, "-o", "json", "status")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["store"]["path"] == bare
        assert pg_server.password not in status.stdout + status.stderr + "".join(d.err)
    finally:
        d.stop()
    assert not (tmp_path / "router.db").exists()  # no SQLite file was made
    d = Daemon(config, log_level="info")  # a restart reads it back
    try:
        r = ctl(tmp_path, "-o", "json", "nodes")
        assert r.returncode == 0, r.stderr
        assert "team" in r.stdout and "infer" in r.stdout
    finally:
        d.stop()


def test_an_unreachable_store_at_start_is_one_line(tmp_path: Path) -> None:
    url = f"postgresql://llmgw:hunter2@127.0.0.1:{_free_port()}/fleet"
    done = subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config",
                           str(pg_config(tmp_path, url, timeout_s=1.0)), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "hunter2" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("llmgw daemon: store.url: store postgresql://llmgw@127.0.0.1:"), last
    assert "(unreachable)" in last, last
