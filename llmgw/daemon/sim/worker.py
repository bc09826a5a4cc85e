"""`llmgw sim worker`: the simulator's stand-in for a worker process of a multi-node replica (what
llama.cpp's rpc-server is to llama-server). It only stays up and answers ``GET /health`` with 200
(anything else 404); the head (`llmgw sim ... --rpc HOST:PORT,...`) is told its workers.

Bounded: a request head over 8 KiB, or one not complete in 10 s, is answered 400 and the
connection closed."""

from __future__ import annotations

import argparse
import json
import os
import signal

import trio

__all__ = ["worker_main"]

_MAX_HEAD = 8192
_READ_TIMEOUT_S = 10.0


async def _answer(stream: trio.SocketStream) -> None:
    buf = b""
    with trio.move_on_after(_READ_TIMEOUT_S):
        while b"\r\n\r\n" not in buf and len(buf) <= _MAX_HEAD:
            try:
                chunk = await stream.receive_some(4096)
            except (trio.BrokenResourceError, OSError):
                return
            if not chunk:
                break
            buf += chunk
    line = buf.split(b"\r\n", 1)[0].split(b" ")
    whole = b"\r\n\r\n" in buf[:_MAX_HEAD + 4]
    ok = whole and len(line) == 3 and line[0] == b"GET" and line[1] == b"/health"
    if not whole:  # too long, cut short, or too slow
        body, status = b'{"error":"bad request"}', b"400 Bad Request"
    elif ok:
        body, status = b'{"status":"ok","role":"worker"}', b"200 OK"
    else:
        body, status = b'{"error":"not found"}', b"404 Not Found"
    try:
        await stream.send_all(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                              + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    except (trio.BrokenResourceError, OSError):
        pass
    finally:
        await stream.aclose()


async def _serve(host: str, port: int) -> None:
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, _answer, listeners)
        shown = host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        print(json.dumps({"ready": True, "role": "worker", "url": f"http://{shown}:{bound}", "port": bound,
                          "pid": os.getpid()}), flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                return


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="llmgw sim worker",
                                description="A simulated worker process of a multi-node replica: answers /health.")
    p.add_argument("--host", default="127.0.0.1", help="the address it listens on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="the port it listens on (default: ephemeral)")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"--port must be 0..65535, got {args.port}")
    try:
        trio.run(_serve, args.host, args.port)
    except KeyboardInterrupt:
        pass
    except OSError as e:
        print(f"llmgw sim worker: error: {e}", flush=True)
        return 1
    return 0
