"""State privacy: the router's store (with its WAL, shared-memory and lock files) and the agent's
engine records (they hold `env`) and engine logs are 0600 in 0700 directories — created so, and
tightened with a warning when found looser."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.daemon.control.store.sqlite import Store, private_store_files
from llmgw.daemon.private_files import open_private, private_dir, write_private

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    old = os.umask(0o022)  # what most systems run with: new files 0644 unless llmgw says otherwise
    yield
    os.umask(old)


def test_a_new_store_and_its_wal_are_private(tmp_path: Path) -> None:
    path = tmp_path / "state" / "llmgw" / "router.db"
    with Store.open(str(path)) as s:
        s.put_model("m", {"a": 1})  # a write: the WAL and the shared memory exist now
        assert (tmp_path / "state" / "llmgw" / "router.db-wal").exists()
        for suffix in ("", "-wal", "-shm"):
            assert mode(f"{path}{suffix}") == 0o600, suffix
    assert mode(path.parent) == 0o700


def test_loose_store_files_and_their_own_directory_are_tightened(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "llmgw"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    path = d / "router.db"
    with Store.open(str(path)) as s:
        s.put_model("m", {"a": 1})
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.chmod(f"{path}{suffix}", 0o644)
    (d / "router.db.lock").write_text("")
    os.chmod(d / "router.db.lock", 0o666)
    with caplog.at_level(logging.WARNING):
        with Store.open(str(path)) as s:
            assert s.model("m") == {"a": 1}
    assert mode(d) == 0o700
    assert mode(path) == 0o600 and mode(d / "router.db.lock") == 0o600
    assert f"{path} was mode 0644: tightened to 0600" in caplog.text
    assert f"directory {d} was mode 0755: tightened to 0700" in caplog.text


def test_a_shared_directory_is_warned_about_not_chmodded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "var-lib"
    shared.mkdir()
    os.chmod(shared, 0o755)
    with caplog.at_level(logging.WARNING):
        private_store_files(str(shared / "router.db"))
    assert mode(shared) == 0o755  # not llmgw's own: others may need it
    assert mode(shared / "router.db") == 0o600
    assert "other users can list it" in caplog.text


def test_private_helpers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    private_dir(tmp_path / "a" / "b", "x")
    assert mode(tmp_path / "a" / "b") == 0o700
    f = tmp_path / "a" / "b" / "f.json"
    write_private(f, b"{}", "x")
    assert mode(f) == 0o600 and f.read_bytes() == b"{}"
    os.chmod(f, 0o644)
    write_private(f, b"[]", "x")  # replaced by a new 0600 file
    assert mode(f) == 0o600 and f.read_bytes() == b"[]"
    os.chmod(f, 0o640)
    with caplog.at_level(logging.WARNING):
        os.close(open_private(f, os.O_RDONLY, "x"))
    assert mode(f) == 0o600 and "was mode 0640" in caplog.text
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        private_dir(tmp_path / "file", "x")


def test_agent_records_and_engine_logs_are_private(fleet_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    state = tmp_path / "agent-a"
    (state / "logs").mkdir(parents=True)
    os.chmod(state, 0o755)
    os.chmod(state / "logs", 0o755)
    old_log = state / "logs" / "old-replica.log"
    old_log.write_text("from an older llmgw\n")
    os.chmod(old_log, 0o644)
    f = fleet_factory([sim_model(count=1, env=["API_SECRET=s3cr3t"])])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    records = list((state / "engines").glob("*.json"))
    logs = list((state / "logs").glob("*.log"))
    assert len(records) == 1 and "s3cr3t" in records[0].read_text()
    assert len(logs) == 2
    for d in (state, state / "engines", state / "logs"):
        assert mode(d) == 0o700, d
    for p in [*records, *logs]:
        assert mode(p) == 0o600, p
    assert "tightened" in f.log(f.agents["a"])


def test_the_router_store_of_a_running_daemon_is_private(fleet_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    for name in ("router.db", "router.db-wal", "router.db-shm", "router.db.lock"):
        assert mode(tmp_path / name) == 0o600, name

