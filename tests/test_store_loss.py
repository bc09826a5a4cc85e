"""A router whose store is damaged, over real processes: it stops at start with one line saying
what to do, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for


def _spoil(db: Path) -> None:
    data = bytearray(db.read_bytes())
    for i in range(3 * 4096, len(data)):  # the header and the schema stay: the damage is in the tables
        data[i] = (i * 7 + 13) % 256
    db.write_bytes(bytes(data))


def test_a_corrupted_store_stops_the_router_at_start_with_what_to_do(
        fleet_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    f.stop_router()
    db = tmp_path / "router.db"
    assert db.stat().st_size > 4 * 4096
    _spoil(db)
    for text in ("damaged page", "not a database"):
        if text == "not a database":
            db.write_bytes(b"garbage, not SQLite " * 1000)
        for suffix in ("-wal", "-shm"):
            (tmp_path / f"router.db{suffix}").unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config",
                               str(f.router_config()), "--port", "0"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done.stderr[-2000:]
        assert "Traceback" not in done.stderr, text
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"llmgw daemon: control.store: store {db} is corrupted ("), last
        assert "move it aside" in last and "--adopt" in last and "backup" in last, last
