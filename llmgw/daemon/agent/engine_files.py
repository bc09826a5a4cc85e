"""What the agent keeps on disk for each engine, under its private ``state_dir``: the engine
records (``engines/*.json``: spec, pid, process group, port, command — how a restarted agent finds
and adopts its engines), the engine logs (``logs/``), and a kv_events engine's ipc sockets
(``kv/``). Directories are 0700 and files 0600 from their first byte (a record holds the
engine's env; a log may hold prompts)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

from llmgw.daemon.agent.engine_logs import EngineLog
from llmgw.daemon.private_files import private_dir, tighten_file, write_private
from llmgw.fleet.engine_record import EngineRecord
from llmgw.fleet.types import EngineSpec

__all__ = ["MAX_IPC_PATH", "EngineFiles", "safe_id"]

MAX_IPC_PATH = 103  # sun_path is 108 bytes on Linux, 104 on macOS (with the NUL)


def safe_id(replica: str) -> str:
    """A file name for a replica id; the hash keeps "a/b" and "a_b" apart."""
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", replica)[:80]
    return f"{clean}-{hashlib.sha256(replica.encode()).hexdigest()[:8]}"


class EngineFiles:
    def __init__(self, state_dir: Path, log: logging.Logger) -> None:
        self.state_dir, self._log = state_dir, log

    def private_dirs(self) -> None:
        """state_dir, engines/ and logs/ 0700; files an older llmgw left open to others become 0600."""
        for d in (self.state_dir, self.state_dir / "engines", self.state_dir / "logs"):
            private_dir(d, "agent.state_dir", log=self._log)
        for path in sorted((self.state_dir / "logs").glob("*.log*")):
            tighten_file(path, "engine log", log=self._log)

    # -- records ------------------------------------------------------------------------------------
    def _record_path(self, replica: str) -> Path:
        return self.state_dir / "engines" / f"{safe_id(replica)}.json"

    def records(self) -> Iterator[tuple[Path, EngineRecord]]:
        """Every readable record (an unreadable one is logged and removed)."""
        for path in sorted((self.state_dir / "engines").glob("*.json")):
            tighten_file(path, "agent engine record", log=self._log)
            try:
                rec = EngineRecord.from_wire(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                self._log.warning("dropping unreadable engine record %s: %s", path, e)
                path.unlink(missing_ok=True)
                continue
            yield path, rec

    def write_record(self, rec: EngineRecord) -> None:
        path = self._record_path(rec.spec.replica)
        private_dir(path.parent, "agent.state_dir", log=self._log)
        # 0600 from the first byte (the record holds the engine's env); atomic: never half a record
        write_private(path, json.dumps(rec.to_wire()).encode(), "agent engine record", log=self._log)

    def remove_record(self, replica: str) -> None:
        self._record_path(replica).unlink(missing_ok=True)

    # -- logs ---------------------------------------------------------------------------------------
    def logfile(self, replica: str) -> EngineLog:
        return EngineLog(self.state_dir / "logs" / f"{safe_id(replica)}.log", replica, self._log)

    # -- kv_events sockets --------------------------------------------------------------------------
    def kv_paths(self, spec: EngineSpec) -> tuple[str, str] | None:
        """ipc:// endpoints a kv_events engine binds, derived from the replica id (so an adopted engine's
        are known too) in the agent's 0700 state_dir/kv: only this host's agent user can connect."""
        if not spec.kv_events:
            return None
        base = self.state_dir / "kv" / hashlib.sha256(spec.replica.encode()).hexdigest()[:16]
        return f"ipc://{base}.pub", f"ipc://{base}.replay"

    def kv_endpoints(self, spec: EngineSpec) -> tuple[str, str] | None:
        """`kv_paths`, with kv/ made private and the path checked against the Unix socket limit."""
        kv = self.kv_paths(spec)
        if kv is None:
            return None
        private_dir(self.state_dir / "kv", "agent.state_dir", log=self._log)
        if max(len(e.removeprefix("ipc://").encode()) for e in kv) > MAX_IPC_PATH:
            raise ValueError(f"agent.state_dir {str(self.state_dir)!r} is too long for the engine's "
                             f"KV-event sockets (a Unix socket path is at most {MAX_IPC_PATH} bytes)")
        return kv

    def kv_report(self, spec: EngineSpec, live: bool) -> dict[str, str | None]:
        kv = self.kv_paths(spec) if live else None
        return {"kv_endpoint": kv[0], "kv_replay": kv[1]} if kv else {}
