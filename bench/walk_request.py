"""Walk one chat request through the router and count its crossings: each call from the trio
shell (llmgw/daemon/) into the pure core (llmgw/route/, llmgw/kv/). The shell should ask the core
once per request and twice per attempt (plan; next, finish), not go back and forth.

    .venv/bin/python bench/walk_request.py [--attempts 1|2] [--tier2]

No sockets: the upstream pool is a stand-in that answers 200 with a short body (or, with
--attempts 2, fails the first try with a connect error, so the request is retried). With
--tier2 the model has kv_events on: tier 2's step asks the shell for the engine's release and
the prompt's tokens (each one more next, and one tokenized), and the same request again finds its
hashes cached (no step: plan, next, finish). Prints the crossings in order with the core
function each lands in. Also used by tests/test_request_walk.py."""

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
CFG_TIER2 = CFG.replace('engine = "vllm"\n', 'engine = "vllm"\n[models.deploy]\nkv_events = true\n', 1)
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


class _Reply:
    def __init__(self, body: bytes) -> None:
        self.status = 200
        self.body = body


class _Pool:
    def __init__(self, failures: int) -> None:
        self.failures = failures

    async def request(self, url: str, method: str, path: str, *a: Any, **kw: Any) -> _Reply:
        if path == "/version":
            return _Reply(b'{"version": "0.33.0"}')
        return _Reply(b'{"count": 40, "tokens": [%s]}' % ",".join(str(i) for i in range(100, 140)).encode())

    def stream(self, *a: Any, **kw: Any) -> _Exchange:
        fail = self.failures > 0
        self.failures -= 1
        return _Exchange(fail)


def walk(attempts: int = 1, *, tier2: bool = False, repeat: bool = False) -> tuple[int, list[str], bytes]:
    """(crossings, the core functions they landed in, the body the client got). `tier2`: a
    kv_events model; `repeat`: count the same request's second walk (its hashes cached)."""
    from llmgw.config import parse_config
    from llmgw.daemon.net.httpserver import Request
    from llmgw.daemon.router.proxy import Router

    shell = str(ROOT / "llmgw" / "daemon")
    core = (str(ROOT / "llmgw" / "route"), str(ROOT / "llmgw" / "kv"))
    router = Router(parse_config(CFG_TIER2 if tier2 else CFG), _Pool(attempts - 1), seed=0)  # type: ignore[arg-type]
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
        if repeat:
            resp = await router.handle(req)
            await resp.body.relay(_Sink())  # type: ignore[union-attr]
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
    p.add_argument("--tier2", action="store_true", help="a kv_events model: tier 2's step, then a repeat")
    ns = p.parse_args()
    for repeat in (False, True) if ns.tier2 else (False,):
        n, landed, _ = walk(ns.attempts, tier2=ns.tier2, repeat=repeat)
        what = "the same request again" if repeat else "one chat request"
        print(f"{n} crossings from llmgw/daemon/ into llmgw/route/ and llmgw/kv/ for {what} "
              f"({ns.attempts} attempt(s){', tier 2' if ns.tier2 else ''}):")
        for name in landed:
            print(f"  {name}")


if __name__ == "__main__":
    main()
