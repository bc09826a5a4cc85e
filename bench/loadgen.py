"""A lean HTTP/1.1 load generator on raw trio sockets, for benchmarks where the client must cost
less than the server it measures (httpx costs ~1 ms CPU per request; this costs a few µs).

Only what our benchmarks need: pre-built requests over keep-alive connections, responses read to
their end (Content-Length or chunked), optional per-response timing. Also process CPU readers."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import trio

__all__ = ["build_request", "Conn", "proc_cpu_seconds", "Latencies"]


def build_request(method: str, path: str, body: bytes = b"", host: str = "127.0.0.1",
                  headers: dict[str, str] | None = None) -> bytes:
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    if body:
        head.append("Content-Type: application/json")
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Conn:
    """One keep-alive connection; `request()` returns (status, body bytes, first-byte time)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    @classmethod
    async def open(cls, host: str, port: int) -> Conn:
        stream = await trio.open_tcp_stream(host, port)
        stream.setsockopt(6, 1, 1)  # TCP_NODELAY
        return cls(stream)

    async def _more(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        self.buf += data

    async def _until(self, marker: bytes) -> int:
        while (i := self.buf.find(marker)) < 0:
            await self._more()
        return i

    async def request(self, raw: bytes) -> tuple[int, bytes, float]:
        await self.stream.send_all(raw)
        end = await self._until(b"\r\n\r\n")
        first_byte = time.perf_counter()
        head = bytes(self.buf[:end]).decode("latin-1").lower()
        del self.buf[: end + 4]
        status = int(head[9:12])
        if "transfer-encoding: chunked" in head:
            body = bytearray()
            while True:
                i = await self._until(b"\r\n")
                size = int(bytes(self.buf[:i]).split(b";")[0], 16)
                while len(self.buf) < i + 2 + size + 2:
                    await self._more()
                body += self.buf[i + 2 : i + 2 + size]
                del self.buf[: i + 2 + size + 2]
                if size == 0:
                    return status, bytes(body), first_byte
        length = 0
        for line in head.split("\r\n"):
            if line.startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        while len(self.buf) < length:
            await self._more()
        body = bytes(self.buf[:length])
        del self.buf[:length]
        return status, body, first_byte

    async def _send_head(self, raw: bytes) -> tuple[int, str]:
        """Send a request, read its answer's head: (status, the head in lower case)."""
        await self.stream.send_all(raw)
        end = await self._until(b"\r\n\r\n")
        head = bytes(self.buf[:end]).decode("latin-1").lower()
        del self.buf[: end + 4]
        return int(head[9:12]), head

    async def stream_events(self, raw: bytes) -> tuple[int, str, float | None]:
        """Send a streaming request and read its SSE answer to `data: [DONE]` (the connection is
        then spent: chunk framing is not parsed). Returns (status, the head in lower case, the
        seconds from sending to the first `data:` event — None unless the status is 200)."""
        t0 = time.perf_counter()
        status, head = await self._send_head(raw)
        if status != 200:
            return status, head, None
        await self._until(b"data: ")
        first = time.perf_counter() - t0
        await self._until(b"data: [DONE]")
        return status, head, first

    async def stream_times(self, raw: bytes) -> tuple[int, str, list[float]]:
        """Like stream_events, with the arrival of every ``data:`` event but ``[DONE]``: (status,
        the head in lower case, seconds from sending to each event — empty unless 200). Events
        that arrive in one read share its time."""
        t0 = time.perf_counter()
        status, head = await self._send_head(raw)
        times: list[float] = []
        if status != 200:
            return status, head, times
        seen = 0  # where the next event is looked for in buf
        done = b"data: [DONE]"
        while True:
            now = time.perf_counter() - t0
            while (i := self.buf.find(b"data: ", seen)) >= 0:
                rest = bytes(self.buf[i:i + len(done)])
                if rest == done:
                    return status, head, times
                if done.startswith(rest):  # perhaps [DONE], cut by the read: wait for more
                    seen = i
                    break
                times.append(now)
                seen = i + 6
            else:
                seen = max(seen, len(self.buf) - 5)
            await self._more()

    async def aclose(self) -> None:
        await self.stream.aclose()


def proc_cpu_seconds(pid: int) -> float:
    """user+system CPU of a process (and its reaped children), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(parts[11]) + int(parts[12])) / ticks


@dataclass
class Latencies:
    values: list[float] = field(default_factory=list)

    def pct(self, p: float) -> float:
        if not self.values:
            return float("nan")
        s = sorted(self.values)
        return s[min(len(s) - 1, int(p / 100 * len(s)))]
