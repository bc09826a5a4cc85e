"""Walk one chat request through the router and count its crossings: each call from the trio
shell (llmgw/daemon/) into the pure core (llmgw/route/). The shell should ask the core once per
request and twice per attempt (plan; next, finish), not go back and forth.

    .venv/bin/python bench/walk_request.py [--attempts 1|2]

No sockets: the upstream pool is a stand-in that answers 200 with a short body (or, with
--attempts 2, fails the first try with a connect error, so the request is retried). Prints
the crossings in order with the core function each lands in. Also used by
tests/test_request_walk.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
CFG = """
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
[[models.replicas]]
url = "http://127.0.0.1:2"
"""
BODY = (b'{"model": "m", "stream": true, "messages": [{"role": "system", "content": "be brief"},'
        b' {"role": "user", "content": "hello"}]}')


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def send_nowait(self, data: bytes, end: bool = False) -> bool:
        self.data += data
        return True

    def flush_nowait(self) -> None:
        pass

    async def drain(self) -> None:
        pass


class _Resp:
    status = 200
    first_byte_at = 0.0
    connected_at = head_at = 0.0
    body_bytes = 0
    last_byte_at = None

    def header(self, name: str) -> str | None:
        return "text/event-stream" if name == "content-type" else None

    async def relay(self, sink: Any) -> None:
        sink.send_nowait(b"data: {}\n\ndata: [DONE]\n\n", end=True)

    def close(self) -> None:
        pass


class _Exchange:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    async def __aenter__(self) -> _Resp:
        if self.fail:
            from llmgw.daemon.net.upstream import UpstreamConnectError
            raise UpstreamConnectError("refused (stand-in)")
        return _Resp()


class _Pool:
    def __init__(self, failures: int) -> None:
        self.failures = failures

    def stream(self, *a: Any, **kw: Any) -> _Exchange:
        fail = self.failures > 0
        self.failures -= 1
        return _Exchange(fail)


def walk(attempts: int = 1) -> tuple[int, list[str], bytes]:
    """(crossings, the core functions they landed in, the body the client got)."""
    from llmgw.config import parse_config
    from llmgw.daemon.net.httpserver import Request
    from llmgw.daemon.router.proxy import Router

    shell = str(ROOT / "llmgw" / "daemon")
    core = str(ROOT / "llmgw" / "route")
    router = Router(parse_config(CFG), _Pool(attempts - 1), seed=0)  # type: ignore[arg-type]
    req = Request("POST", "/v1/chat/completions", "/v1/chat/completions", "",
                  [("content-type", "application/json")], BODY, ("127.0.0.1", 1))
    landed: list[str] = []

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        f = frame.f_code.co_filename
        back = frame.f_back
        if f.startswith(core) and back is not None and back.f_code.co_filename.startswith(shell):
            landed.append(f"{Path(f).stem}.{frame.f_code.co_qualname}")

    sink = _Sink()

    async def main() -> None:
        sys.setprofile(prof)
        try:
            resp = await router.handle(req)
            await resp.body.relay(sink)  # type: ignore[union-attr]
        finally:
            sys.setprofile(None)

    trio.run(main)
    return len(landed), landed, bytes(sink.data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attempts", type=int, default=1, choices=(1, 2))
    ns = p.parse_args()
    n, landed, _ = walk(ns.attempts)
    print(f"{n} crossings from llmgw/daemon/ into llmgw/route/ for one chat request "
          f"({ns.attempts} attempt(s)):")
    for name in landed:
        print(f"  {name}")


if __name__ == "__main__":
    main()
