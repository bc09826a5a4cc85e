"""The agent's record of an engine process it owns, kept as JSON in ``state_dir/engines/<id>.json``
while the process lives: what a later agent run needs to recognise the process and adopt it
(pid, process group, start time, command line) and to serve it again (spec, port, url).

Pure data and its JSON form; the supervisor (llmgw.daemon.agent.engines) writes and reads the
files. ``from_wire`` raises KeyError, TypeError or ValueError for a record it cannot use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmgw.fleet.types import EngineSpec

__all__ = ["EngineRecord"]


@dataclass(frozen=True)
class EngineRecord:
    spec: EngineSpec
    pid: int
    pgid: int
    port: int
    cmd: list[str]
    url: str = ""
    started_at: float | None = None  # Unix time
    starttime: int | None = None  # /proc/<pid>/stat's start time in clock ticks: tells a reused pid apart

    def to_wire(self) -> dict[str, Any]:
        return {"replica": self.spec.replica, "pid": self.pid, "pgid": self.pgid, "port": self.port,
                "url": self.url, "cmd": self.cmd, "spec": self.spec.to_wire(),
                "spec_hash": self.spec.spec_hash(), "started_at": self.started_at, "starttime": self.starttime}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> EngineRecord:
        spec = EngineSpec.from_wire(d["spec"])
        pid, pgid, port = int(d["pid"]), int(d["pgid"]), int(d["port"])
        cmd = [str(a) for a in d["cmd"]]
        return cls(spec=spec, pid=pid, pgid=pgid, port=port, cmd=cmd, url=d.get("url", ""),
                   started_at=d.get("started_at"), starttime=d.get("starttime"))
