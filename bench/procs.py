"""Processes the benchmarks start: llmgw daemons and simulators that print a JSON ready line,
each in its own session, stopped by process group (TERM, then KILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


def spawn(cmd: list[str], *, env: dict[str, str] | None = None,
          cpu: int | None = None) -> tuple[subprocess.Popen[bytes], dict]:
    """Start `cmd`, wait for its ready line; optionally pin all its threads to one CPU."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "PYTHONHASHSEED": "0", "LLMGW_LOG_LEVEL": "warning", **(env or {})})
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            os.sched_setaffinity(int(tid), {cpu})
    return proc, info


def stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_router(lines: list[str], tmp: Path, name: str, procs: list[subprocess.Popen[bytes]]) -> str:
    """An llmgw router on config ``lines`` (its store and admin socket in ``tmp``, the run's own
    directory, not the user's state directory), written to ``tmp/<name>.toml``; returns its URL.
    The process is appended to ``procs`` (the caller stops them)."""
    lines = [*lines, "[control]", f"store = {json.dumps(str(tmp / 'router.db'))}",
             "[admin]", f"socket = {json.dumps(str(tmp / 'admin' / 'admin.sock'))}"]
    cfg = tmp / f"{name}.toml"
    cfg.write_text("\n".join(lines) + "\n")
    proc, info = spawn([sys.executable, "-m", "llmgw", "daemon", "--config", str(cfg), "--port", "0",
                        "--log-level", "warning"])
    procs.append(proc)
    return info["url"]
