"""Finished traces to a JSON Lines file (``[router.traces] file``): a sampled share of them
(``sample``), one object a line as ``GET /api/v1/traces/{id}`` answers it, in a file rotated at
``max_file_mb`` (``file.1`` is the newest old one, up to ``files_kept``).

The request path only appends the trace to a bounded list (``on_end``, called by the core as each
trace ends); a task writes the list out every ``flush_s`` — the disk is never waited on while a
request is in flight. The file is created 0600 (traces name models, replicas and request ids).
A write that fails (a full disk, a removed directory) drops that batch, counted and logged at
most once a minute; the daemon goes on, and the next flush tries again. Sampling is exact and
deterministic: with ``sample = 0.25`` every 4th trace is written."""

from __future__ import annotations

import json
import logging
import os
from typing import BinaryIO

import trio

from llmgw.config.schema import TracesConfig
from llmgw.daemon.net.log_limit import LogLimiter, repeats
from llmgw.daemon.private_files import PRIVATE_FILE
from llmgw.route.trace import Trace

log = logging.getLogger("llmgw.traces")

__all__ = ["TraceLog"]

MAX_PENDING = 10_000  # traces waiting for the next flush; beyond: dropped (counted)


class TraceLog:
    def __init__(self, cfg: TracesConfig, *, flush_s: float = 1.0) -> None:
        assert cfg.file is not None
        self.path = cfg.file
        self.rate = cfg.sample
        self.max_bytes = max(1, int(cfg.max_file_mb * (1 << 20)))
        self.files_kept = cfg.files_kept
        self.flush_s = flush_s
        self._acc = 0.0  # sampling: a trace is written each time this passes 1
        self._pending: list[Trace] = []
        self._file: BinaryIO | None = None
        self._size = 0
        self._limit = LogLimiter(60.0)
        self.written = 0  # traces written
        self.dropped = 0  # sampled traces not written (the list was full, or the write failed)
        self.rotations = 0

    # -- the request path ------------------------------------------------------------------------
    def on_end(self, trace: Trace) -> None:
        acc = self._acc + self.rate
        if acc < 1.0:
            self._acc = acc
            return
        self._acc = acc - 1.0
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append(trace)

    def check(self) -> None:
        """Open (create) the file now: raises OSError when it cannot be (the daemon refuses to start)."""
        self._open()

    # -- the writer --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Flush every ``flush_s`` until cancelled; then once more, and close the file."""
        try:
            while True:
                await trio.sleep(self.flush_s)
                self.flush(trio.current_time())
        finally:
            self.flush(trio.current_time())
            self.close()

    def flush(self, now: float) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        done = 0
        try:
            f = self._open()
            for t in batch:
                line = (json.dumps(t.to_dict(), separators=(",", ":"), ensure_ascii=True) + "\n").encode()
                if self._size and self._size + len(line) > self.max_bytes:
                    f.flush()
                    f = self._rotate()
                f.write(line)
                self._size += len(line)
                done += 1
            f.flush()
        except OSError as e:
            self.dropped += len(batch) - done
            self.written += done
            self.close()  # opened again (or created anew) at the next flush
            n = self._limit.hit("write", now)
            if n is not None:
                log.warning("cannot write traces to %s: %s; %d dropped so far%s", self.path, e.strerror or e,
                            self.dropped, repeats(n))
            return
        self.written += done
        n = self._limit.clear("write", now)
        if n is not None:
            log.info("writing traces to %s again%s", self.path, repeats(n))

    def _open(self) -> BinaryIO:
        if self._file is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
            self._file = os.fdopen(fd, "ab")
            self._size = os.fstat(fd).st_size
        return self._file

    def _rotate(self) -> BinaryIO:
        """path → path.1 → path.2 ... (the oldest beyond files_kept is removed); a new path."""
        self.close()
        if self.files_kept == 0:
            os.unlink(self.path)
        else:
            for i in range(self.files_kept - 1, 0, -1):
                older = f"{self.path}.{i}"
                if os.path.exists(older):
                    os.replace(older, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self.rotations += 1
        return self._open()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
