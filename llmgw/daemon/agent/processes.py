"""The operating-system side of the agent's engines: process groups and the identity of a process
under Linux /proc (is this pid still the engine we started, or a reused one?), a free port to give
a new engine, how its host is written in a URL and dialled, and where llama.cpp's RPC worker binary is."""

from __future__ import annotations

import os
import shutil
import socket

from llmgw.fleet.engine_cmd import ray_candidates, rpc_server_candidates
from llmgw.fleet.types import EngineSpec

__all__ = ["dial_host", "find_rpc_server", "free_port", "group_exists", "host_port", "is_same_process", "pid_alive",
           "process_starttime", "read_cmdline", "signal_group"]


# ---- process groups and /proc --------------------------------------------------------------------

def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; comm may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def pid_alive(pid: int) -> bool:
    """Exists and is not a zombie (a dead child nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def process_starttime(pid: int) -> int | None:
    """Start time in clock ticks since boot (stat field 22): tells a reused pid apart."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def read_cmdline(pid: int) -> list[str] | None:
    """/proc/<pid>/cmdline as a list; None when it cannot be read. Empty for a moment after a
    spawn returns: the kernel closes the close-on-exec descriptors (which is what tells the
    spawner that exec succeeded) before it lays out the new program's arguments."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return None


def _cmdline_matches(argv: list[str], cmd: list[str]) -> bool:
    """`argv` is `cmd`, allowing for a #! script, which the kernel runs as
    [interpreter, (arg), /path/to/script, args...]."""
    if argv == cmd:
        return True
    n = len(cmd) - 1
    head, tail = (argv[:-n], argv[-n:]) if n else (argv, [])
    return tail == cmd[1:] and 1 <= len(head) <= 3 and os.path.basename(cmd[0]) in map(os.path.basename, head)


def is_same_process(pid: int, pgid: int, cmd: list[str], starttime: int | None) -> bool:
    """`pid` is alive, leads group `pgid`, started at `starttime` (if known) and runs `cmd`: the
    process an engine record describes, not a reused pid."""
    if not pid_alive(pid):
        return False
    try:
        if os.getpgid(pid) != pgid:
            return False
    except ProcessLookupError:
        return False
    if starttime is not None and process_starttime(pid) != starttime:
        return False
    argv = read_cmdline(pid)
    if argv is None:
        return False
    if not argv:
        # Still inside exec (see read_cmdline): pid, group and start time already say it is the
        # process we started; without a start time there is nothing else to go by.
        return starttime is not None
    return _cmdline_matches(argv, cmd)


# ---- ports and hosts -----------------------------------------------------------------------------

def free_port(host: str, prefer: int | None, avoid: int | None = None) -> int:
    """`prefer` if it can be bound now, else a free ephemeral port (the engine binds it next); never
    `avoid` (another port of the same engine, not bound yet)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ([prefer] if prefer and prefer != avoid else []) + [0] * 8:
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            # As engines bind (SO_REUSEADDR): a port in TIME_WAIT after a restart counts as free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            got = int(s.getsockname()[1])
            if got != avoid:
                return got
        except OSError:
            continue
        finally:
            s.close()
    raise OSError(f"no free port on {host}")


def dial_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def host_port(host: str, port: int | None) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def find_ray(spec: EngineSpec) -> str | None:
    """Ray's ``ray`` command for a vLLM multi-node part: next to the profile's vllm binary, else on
    PATH; None: not found (the launcher then fails to run it, naming it)."""
    for c in ray_candidates(spec):
        if "/" in c:
            if os.path.isfile(c) and os.access(c, os.X_OK):
                return c
        elif shutil.which(c):
            return c
    return None


def ray_port_of(cmd: list[str]) -> int | None:
    """The Ray head's port in a recorded command line (an adopted vLLM multi-node head's)."""
    for i, a in enumerate(cmd[:-1]):
        if a == "--ray-port" and cmd[i + 1].isdigit():
            return int(cmd[i + 1])
    return None


def find_rpc_server(spec: EngineSpec) -> str | None:
    """llama.cpp's RPC worker binary for a multi-node worker: the first candidate that exists
    (an executable file, or a name on PATH); None: none found (the command's default then fails
    to start, naming it)."""
    for c in rpc_server_candidates(spec):
        if "/" in c:
            if os.path.isfile(c) and os.access(c, os.X_OK):
                return c
        elif shutil.which(c):
            return c
    return None
