"""A misbehaving engine for tests: a raw HTTP/1.1 server in a thread, whose answers the test
writes byte for byte (truncated bodies, huge answers, odd headers), one connection at a time
per thread. Every answer closes its connection (``connection: close``), so the router's pool
never reuses one: what a test sends is exactly what one request gets."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from typing import Any

# (connection, method, path, body) -> None: write the answer (the connection is closed after)
Handler = Callable[[socket.socket, str, str, bytes], None]

METRICS = (b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
           b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n")
COMPLETION = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                         "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


def answer(status: int = 200, body: bytes = b"", headers: list[tuple[str, str]] | None = None) -> bytes:
    """A whole response with its content-length (and ``connection: close``)."""
    head = [f"HTTP/1.1 {status} X", f"content-length: {len(body)}", "connection: close"]
    head += [f"{k}: {v}" for k, v in headers or [("content-type", "application/json")]]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def send_huge(conn: socket.socket, size: int, content_type: str = "application/json") -> None:
    """A body of ``size`` bytes, sent until the peer gives up (it closes at its cap)."""
    conn.sendall(f"HTTP/1.1 200 OK\r\ncontent-length: {size}\r\ncontent-type: {content_type}\r\n"
                 f"connection: close\r\n\r\n".encode())
    block = b'{"data":[' + b" " * (65536 - 9)
    sent = 0
    try:
        while sent < size:
            piece = block[:size - sent]
            conn.sendall(piece)
            sent += len(piece)
            block = b" " * 65536
    except OSError:
        pass  # the router closed the connection: what we want


def normal(conn: socket.socket, method: str, path: str, body: bytes) -> None:
    """A well-behaved engine: health, metrics, models, completions."""
    if path == "/metrics":
        conn.sendall(answer(200, METRICS, [("content-type", "text/plain")]))
    elif path == "/v1/models":
        conn.sendall(answer(200, b'{"object":"list","data":[{"id":"m","object":"model"}]}'))
    elif path == "/health":
        conn.sendall(answer(200, b""))
    else:
        conn.sendall(answer(200, COMPLETION))


class StubEngine:
    """``StubEngine(handler)``: listens on 127.0.0.1, each connection served by ``handler`` in its
    own thread; ``stop()`` closes the listener and every open connection."""

    def __init__(self, handler: Handler = normal) -> None:
        self.handler = handler
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, headers) of each request
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                if self.stopped:
                    conn.close()
                    return
                self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            req = _read_request(conn)
            if req is not None:
                method, path, headers, body = req
                with self.lock:
                    self.requests.append((method, path, headers))
                self.handler(conn, method, path, body)
        except OSError:
            pass
        finally:
            with self.lock:
                self.conns.discard(conn)
            conn.close()

    def count(self, path: str) -> int:
        with self.lock:
            return sum(1 for _, p, _ in self.requests if p == path)

    def last_headers(self, path: str) -> dict[str, str]:
        with self.lock:
            return next(h for _, p, h in reversed(self.requests) if p == path)

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            conns, self.conns = list(self.conns), set()
        self.sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _read_request(conn: socket.socket) -> tuple[str, str, dict[str, str], bytes] | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        data = conn.recv(65536)
        if not data:
            return None
        rest += data
    return method, target.partition("?")[0], headers, rest[:length]


def handler_of(routes: dict[str, Any]) -> Handler:
    """A handler answering the paths in ``routes`` (bytes: sent as is; a callable: called like a
    handler), the rest as :func:`normal` does."""
    def handle(conn: socket.socket, method: str, path: str, body: bytes) -> None:
        r = routes.get(path)
        if r is None:
            normal(conn, method, path, body)
        elif isinstance(r, bytes):
            conn.sendall(r)
        else:
            r(conn, method, path, body)
    return handle
