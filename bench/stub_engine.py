"""A stub OpenAI engine that costs almost nothing, for measuring the router at saturation.

    python bench/stub_engine.py [--port 0] [--ports 1] [--step-ms 2] [--model m]

`llmgw sim` models an engine faithfully and costs ~1 ms of CPU per streamed request: on a
2-core machine, the engines then saturate their core long before the router does. This stub
streams like an engine's decode loop (every --step-ms, one token event to each running stream,
each its own send; after the last token, `data: [DONE]`) and does nothing else: no tokenizer,
no KV cache, no prefix hashing. It serves POST /v1/completions and /v1/chat/completions
(streamed or not; `max_tokens` tokens, default 16), GET /health, /v1/models and a /metrics with
vLLM's three mandatory gauges. Plain epoll, no trio. Prints one JSON ready line
({"url", "port"}) like `llmgw sim`; with --ports N it listens on N ports (one process standing
for N replicas: a router knows a replica by its URL) and the line also has "urls". Benchmark
use only."""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time

_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
         b"transfer-encoding: chunked\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _response(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


class _Stream:
    __slots__ = ("chat", "conn", "left", "n", "rid")

    def __init__(self, conn: _Conn, n: int, chat: bool, rid: int) -> None:
        self.conn, self.left, self.n, self.chat, self.rid = conn, n, n, chat, rid

    def event(self, model: str) -> bytes:
        self.left -= 1
        fin = "length" if self.left == 0 else None
        if self.chat:
            obj = {"id": f"chatcmpl-{self.rid}", "object": "chat.completion.chunk", "created": 0, "model": model,
                   "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": fin}]}
        else:
            obj = {"id": f"cmpl-{self.rid}", "object": "text_completion", "created": 0, "model": model,
                   "choices": [{"index": 0, "text": " tok", "finish_reason": fin}]}
        return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


class _Conn:
    __slots__ = ("buf", "out", "sock", "streaming")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf, self.out, self.streaming = sock, b"", b"", False

    def send(self, data: bytes) -> bool:
        data = self.out + data
        try:
            n = self.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            return False
        self.out = data[n:]
        return True


class Stub:
    def __init__(self, port: int, step_s: float, model: str, ports: int = 1) -> None:
        self.model, self.step_s = model, step_s
        self.ep = select.epoll()
        self.lsocks: dict[int, socket.socket] = {}
        for k in range(ports):
            ls = socket.socket()
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(("127.0.0.1", port if k == 0 else 0))
            ls.listen(1024)
            ls.setblocking(False)
            self.ep.register(ls.fileno(), select.EPOLLIN)
            self.lsocks[ls.fileno()] = ls
        self.lsock = next(iter(self.lsocks.values()))
        self.conns: dict[int, _Conn] = {}
        self.streams: list[_Stream] = []
        self.rid = 0

    def metrics(self) -> bytes:
        labels = f'engine="0",model_name="{self.model}"'
        return (f"vllm:num_requests_running{{{labels}}} {float(len(self.streams))}\n"
                f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
                f"vllm:kv_cache_usage_perc{{{labels}}} 0.0\n").encode()

    def handle(self, c: _Conn) -> bool:
        """Answer the complete requests in c.buf; False: close."""
        while not c.streaming:
            end = c.buf.find(b"\r\n\r\n")
            if end < 0:
                return True
            head = c.buf[:end].decode("latin-1")
            parts = head.split(" ", 2)
            if len(parts) < 3 or not parts[2].startswith("HTTP/1."):
                return False  # not HTTP/1.x (a peer router's HTTP/2 or gRPC probe): close
            method, target = parts[:2]
            length = 0
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            if len(c.buf) < end + 4 + length:
                return True
            body, c.buf = c.buf[end + 4:end + 4 + length], c.buf[end + 4 + length:]
            if method == "POST" and target in ("/v1/completions", "/v1/chat/completions"):
                req = json.loads(body or b"{}")
                n = max(1, int(req.get("max_tokens") or 16))
                self.rid += 1
                if req.get("stream"):
                    c.streaming = True
                    self.streams.append(_Stream(c, n, target.endswith("chat/completions"), self.rid))
                    if not c.send(_HEAD):
                        return False
                    continue
                text = " tok" * n
                obj = {"id": f"cmpl-{self.rid}", "object": "text_completion", "model": self.model,
                       "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
                out = _response("200 OK", json.dumps(obj).encode())
            elif target == "/health":
                out = _response("200 OK", b"")
            elif target == "/metrics":
                out = _response("200 OK", self.metrics(), "text/plain; version=0.0.4")
            elif target == "/v1/models":
                out = _response("200 OK", json.dumps({"object": "list", "data": [
                    {"id": self.model, "object": "model", "owned_by": "stub", "root": self.model}]}).encode())
            else:
                out = _response("404 Not Found", b'{"error": "not found"}')
            if not c.send(out):
                return False
        return True

    def close(self, c: _Conn) -> None:
        self.conns.pop(c.sock.fileno(), None)
        self.streams = [s for s in self.streams if s.conn is not c]
        c.sock.close()

    def step(self) -> None:
        current, self.streams = self.streams, []  # handle() may start new ones: next step
        still = []
        for s in current:
            c = s.conn
            if c.sock.fileno() < 0:
                continue
            data = s.event(self.model)
            if s.left == 0:
                data += _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
            if not c.send(data):
                self.close(c)
                continue
            if s.left:
                still.append(s)
            else:
                c.streaming = False
                if c.buf and not self.handle(c):  # a pipelined request waited
                    self.close(c)
        self.streams = still + self.streams

    def serve(self) -> None:
        next_step = time.monotonic() + self.step_s
        while True:
            timeout = max(0.0, next_step - time.monotonic()) if self.streams else -1
            for fd, _ in self.ep.poll(timeout):
                ls = self.lsocks.get(fd)
                if ls is not None:
                    while True:
                        try:
                            sock, _ = ls.accept()
                        except BlockingIOError:
                            break
                        sock.setblocking(False)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        self.conns[sock.fileno()] = _Conn(sock)
                        self.ep.register(sock.fileno(), select.EPOLLIN)
                    continue
                c = self.conns.get(fd)
                if c is None:
                    continue
                try:
                    data = c.sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.close(c)
                    continue
                c.buf += data
                if not self.handle(c):
                    self.close(c)
            now = time.monotonic()
            if self.streams and now >= next_step:
                self.step()
                next_step = max(next_step + self.step_s, now)
            elif not self.streams:
                next_step = now + self.step_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--model", default="m")
    ap.add_argument("--ports", type=int, default=1, help="listen on this many ports (each a replica's URL)")
    a = ap.parse_args()
    stub = Stub(a.port, a.step_ms / 1e3, a.model, a.ports)
    ports = [ls.getsockname()[1] for ls in stub.lsocks.values()]
    print(json.dumps({"url": f"http://127.0.0.1:{ports[0]}", "port": ports[0],
                      "urls": [f"http://127.0.0.1:{p}" for p in ports]}), flush=True)
    try:
        stub.serve()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
