"""An engine's log file, ``state_dir/logs/<id>.log``: the engine's stdout and stderr are appended to
it (a file, not a pipe, so the engine survives an agent crash without a SIGPIPE), it is rotated
once when it grows past LOG_ROTATE_BYTES, and the agent tails it from its end: each complete line
goes to the agent's logger (DEBUG, with the replica) and to a ring of the last LOG_TAIL_LINES,
which a crash report carries. Logs are 0600 in a 0700 directory: an engine may log prompts."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import BinaryIO

import trio

from llmgw.daemon.private_files import open_private, private_dir

__all__ = ["LOG_ROTATE_BYTES", "LOG_TAIL_LINES", "EngineLog"]

LOG_ROTATE_BYTES = 10 * 1024 * 1024
LOG_TAIL_LINES = 50
_READ_CHUNK = 65536


class EngineLog:
    """One engine's log file and the agent's tail of it."""

    def __init__(self, path: Path, replica: str, log: logging.Logger) -> None:
        self.path = path
        self.replica = replica
        self.ring: deque[str] = deque(maxlen=LOG_TAIL_LINES)  # the last lines read
        self._log = log
        self._reader: BinaryIO | None = None
        self._partial = b""

    def open_for_engine(self, cmd: list[str]) -> BinaryIO:
        """The file for appending (rotated first when too big), with a start line naming `cmd`;
        the tail follows it from its end."""
        path = self.path
        private_dir(path.parent, "agent.state_dir", log=self._log)
        if path.exists() and path.stat().st_size > LOG_ROTATE_BYTES:
            os.replace(path, path.with_suffix(".log.1"))  # keeps its 0600
        # the caller closes it once the child holds its own fd
        out = os.fdopen(open_private(path, os.O_WRONLY | os.O_APPEND, "engine log", log=self._log), "ab")
        out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} start: {' '.join(cmd)}\n".encode())
        out.flush()
        self.follow()
        return out

    def follow(self) -> None:
        """Tail the log from its current end."""
        self.close()
        self._partial = b""
        try:
            self._reader = open(self.path, "rb")  # noqa: SIM115
            self._reader.seek(0, os.SEEK_END)
        except OSError:
            self._reader = None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    async def tail(self, interval: float) -> None:
        while True:
            self.drain()
            await trio.sleep(interval)

    def drain(self, final: bool = False) -> None:
        """Forward new complete lines to the logger and the ring. Bounded per call (16 chunks) so a
        chatty engine cannot stall the loop; the next tick reads on."""
        if self._reader is None:
            return
        for _ in range(16):
            chunk = self._reader.read(_READ_CHUNK)
            if not chunk:
                break
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            for raw in lines:
                self._line(raw)
        if final and self._partial:
            self._line(self._partial)
            self._partial = b""

    def _line(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\r")
        self.ring.append(line)
        self._log.debug("%s", line, extra={"replica": self.replica})
