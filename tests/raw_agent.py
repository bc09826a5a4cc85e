"""A hand-driven agent for tests: speaks the agent stream's frames (msgpack maps, built by hand so
it can say what a real agent never would) over a socket, reads what the router sends on a thread,
and keeps the session alive with heartbeats once welcomed."""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any

import msgpack


class RawAgent:
    def __init__(self, port: int, *, node: str, token: str, engines: list[dict[str, Any]] | None = None,
                 credential: str | None = None, features: list[str] | None = None, agent_id: str = "raw-agent",
                 heartbeat_s: float = 0.2) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.settimeout(None)
        self._seq = 0
        self._lock = threading.Lock()
        self.inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.closed = threading.Event()
        self._stop = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        hello: dict[str, Any] = {"token": token, "node": node, "agent_id": agent_id, "versions": [1], "labels": {},
                                 "facts": {"cpus": 1, "memory_mb": 1000}, "engines": engines or []}
        if credential is not None:
            hello["credential"] = credential
        if features is not None:
            hello["features"] = features
        self.send("hello", **hello)
        self.answer = self.next(10)  # welcome or refused
        if self.answer.get("t") == "welcome":
            threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True).start()

    def send(self, t: str, **fields: Any) -> None:
        with self._lock:
            self._seq += 1
            body = msgpack.packb({"v": 1, "t": t, "seq": self._seq, **fields}, use_bin_type=True)
            self.sock.sendall(len(body).to_bytes(4, "big") + body)

    def report(self, **report: Any) -> None:
        self.send("engine_update", report=report)

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.send("heartbeat")
            except OSError:
                return

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                buf += data
                while len(buf) >= 4 and len(buf) - 4 >= (n := int.from_bytes(buf[:4], "big")):
                    self.inbox.put(msgpack.unpackb(buf[4:4 + n], raw=False))
                    buf = buf[4 + n:]
        except OSError:
            pass
        self.closed.set()
        self.inbox.put(None)

    def next(self, timeout: float = 10.0) -> dict[str, Any]:
        msg = self.inbox.get(timeout=timeout)
        if msg is None:
            raise EOFError("the router closed the connection")
        return msg

    def wait_for(self, t: str, timeout: float = 10.0) -> dict[str, Any]:
        """The next message of type `t` (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.next(max(0.01, deadline - time.monotonic()))
            if msg.get("t") == t:
                return msg

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
