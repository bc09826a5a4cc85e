"""Child processes the daemon and `llmgw sim fleet` start: each in its own session (so a whole
process group can be signalled: engines leave grandchildren), its ready line read from stdout,
and stopped with TERM, a grace period, then KILL."""

from __future__ import annotations

import os
import signal

import trio

__all__ = ["read_ready_line", "stop_groups"]


async def read_ready_line(proc: trio.Process) -> str | None:
    """The first stdout line (a simulator's JSON ready line); None if the process exits first."""
    assert proc.stdout is not None
    buf = b""
    while b"\n" not in buf:
        chunk = await proc.stdout.receive_some(4096)
        if not chunk:
            return None
        buf += chunk
    return buf.split(b"\n", 1)[0].decode()


def _signal_group(proc: trio.Process, sig: int) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


async def stop_groups(procs: list[trio.Process], grace: float = 5.0) -> None:
    """TERM every process group, wait up to `grace` seconds, KILL what is left, reap all."""
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    with trio.move_on_after(grace):
        for proc in procs:
            await proc.wait()
    for proc in procs:
        if proc.returncode is None:
            _signal_group(proc, signal.SIGKILL)
            await proc.wait()
