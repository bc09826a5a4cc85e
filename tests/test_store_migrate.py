"""`llmgw store migrate --from sqlite:PATH --to postgresql://…`, over real processes: the SQLite
store a real router wrote (plus every other kind of row, through the Store API) arrives in
PostgreSQL whole — every read of the PostgreSQL store answers as the SQLite one did — and a
router on it finds it; a running router's store, a non-empty target (without --force) and bad
flags are refused with one line."""

from __future__ import annotations

import pytest

psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL store's tests need psycopg (the test extra)")

import subprocess
import sys
from pathlib import Path
from typing import Any

from llmgw.config import DeployConfig, ModelConfig
from llmgw.config.load import model_to_dict
from llmgw.daemon.control.store.postgres import PgStore
from llmgw.daemon.control.store.rows import AssignmentRow
from llmgw.daemon.control.store.sqlite import Store
from llmgw.fleet.types import EngineSpec
from tests.pg_server import PgServer
from tests.test_router_integration import Daemon, write_config
from tests.test_store_pg_daemon import ctl, pg_config


def migrate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "store", "migrate", *args], capture_output=True,
                          text=True, timeout=120)


def everything(st: Any) -> dict[str, Any]:
    return {"models": st.models(), "nodes": st.nodes(), "assignments": st.assignments(),
            "history": st.history(limit=10_000), "credentials": st.credentials(), "holds": st.holds(),
            **{f"docs:{k}": st.docs(k) for k in ("revisions", "suite", "result", "job")}}


def test_store_migrate_copies_a_routers_store_into_postgresql(pg_server: PgServer, pg_url: str,
                                                              tmp_path: Path) -> None:
    router_dir = tmp_path / "router"
    router_dir.mkdir()
    config = write_config(router_dir, [])
    db = router_dir / "router.db"
    d = Daemon(config)
    try:
        r = ctl(router_dir, "label", "box-1", "team=infer", "llmgw.io/rack=r7")
        assert r.returncode == 0, r.stderr
        busy = migrate("--from", f"sqlite:{db}", "--to", pg_url)
        assert busy.returncode == 1 and "in use by a running llmgw router: stop it first" in busy.stderr
    finally:
        d.stop()
    with Store.open(str(db)) as st:  # every other kind of row a fleet has
        model = ModelConfig(name="m", engine="vllm", deploy=DeployConfig(model_path="org/m", simulate=True))
        st.put_model("m", {"source": "admin", "model": model_to_dict(model)}, now=5.0)
        spec = EngineSpec(replica="m-0", model="m", engine="vllm", model_path="org/m", simulate=True).to_wire()
        st.put_assignment(AssignmentRow("m-0", "m", "box-1", spec, "drain", 6.0, 7.0, url="http://127.0.0.1:9"))
        st.upsert_node("box-1", agent_labels={"gpu": "l4"}, facts={"cpus": 8}, seen_at=8.0)
        st.put_credential("box-1", "h" * 64, issued_at=9.0)
        st.confirm_credential("box-1", "h" * 64, at=10.0)
        st.put_hold("llmgw.io/rack=r7", reason="maintenance", drain=True, now=11.0)
        for kind in ("revisions", "suite", "result", "job"):
            st.put_doc(kind, f"{kind}-1", {"kind": kind, "n": [1, 2.5, None]}, now=12.0)
        for i in range(300):
            st.record("placed", replica=f"m-{i}", model="m", node="box-1", detail=f"#{i}", ts=100.0 + i // 3)
        want = everything(st)
        st.cluster_secret()
    out = migrate("--from", f"sqlite:{db}", "--to", pg_url)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split() for line in out.stdout.splitlines()[:7])
    assert lines == {"models": "1", "nodes": "1", "assignments": "1", "history": str(len(want["history"])),
                     "node_credentials": "1", "holds": "1", "lifecycle": "4"}, out.stdout
    assert pg_server.password not in out.stdout + out.stderr
    with PgStore.open(pg_url) as pg:
        assert everything(pg) == want
        pg.record("after the copy")  # history ids go on after the copied ones
        assert pg.history(limit=1)[0].id == max(h.id for h in want["history"]) + 1

    again = migrate("--from", f"sqlite:{db}", "--to", pg_url)
    assert again.returncode == 1
    last = again.stderr.strip().splitlines()[-1]  # (before it: Store.open's warning about the test's directory)
    assert last.startswith("llmgw store migrate: --to: postgresql://postgres@127.0.0.1:"), last
    assert last.endswith("pass --force to replace it"), last
    forced = migrate("--from", f"sqlite:{db}", "--to", pg_url, "--force")
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.startswith("replaced: models 1, nodes 1")
    with PgStore.open(pg_url) as pg:
        assert everything(pg) == want

    pg_dir = tmp_path / "pg-router"  # a router on the copy finds the fleet
    pg_dir.mkdir()
    d = Daemon(pg_config(pg_dir, pg_url))
    try:
        r = ctl(pg_dir, "-o", "json", "nodes")
        assert r.returncode == 0, r.stderr
        assert "r7" in r.stdout and "infer" in r.stdout
    finally:
        d.stop()


def test_store_migrate_refuses_bad_flags_in_one_line(tmp_path: Path) -> None:
    for args, expect in ((["--from", "router.db", "--to", "postgresql://x/y"], "--from: must be sqlite:PATH"),
                         (["--from", "sqlite:x.db", "--to", "mysql://x/y"], "--to: must be a postgresql:// url"),
                         (["--from", f"sqlite:{tmp_path / 'none.db'}", "--to", "postgresql://x/y"],
                          "is not a file")):
        done = migrate(*args)
        assert done.returncode == 1, done
        assert expect in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (tmp_path / "none.db").exists()
