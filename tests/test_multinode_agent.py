"""The agent's side of a multi-node replica's llama.cpp worker: its RPC server serves one client at
a time with a listen backlog of 1 (tools/rpc in llama.cpp), so once it is up and its head holds
the connection, probing it by connecting would fill the backlog and fail: its liveness is then its
process. A stand-in script behaves as the real one does."""

from __future__ import annotations

import socket
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from llmgw.fleet.types import EngineSpec, GroupLaunch

from .test_engines import Harness, groups, running  # noqa: F401  (groups: the fixture)

pytestmark = pytest.mark.anyio

RPC_SERVER = '''
import socket, sys
args = sys.argv[1:]
host, port = args[args.index("-H") + 1], int(args[args.index("-p") + 1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port))
s.listen(1)  # as ggml-rpc's server: one client at a time, a backlog of 1
print("Starting RPC server", flush=True)
while True:
    c, _ = s.accept()
    while c.recv(4096):
        pass
    c.close()
'''


async def test_a_busy_rpc_worker_stays_ready(tmp_path: Path, groups: set[int]) -> None:  # noqa: F811
    server = tmp_path / "ggml-rpc-server"
    server.write_text(f"#!{sys.executable}\n{RPC_SERVER}")
    server.chmod(0o755)
    spec = EngineSpec(replica="big/1-w1", model="big", engine="llamacpp", model_path="big.gguf",
                      binary=str(tmp_path / "llama-server"),
                      group=GroupLaunch(role="worker", group="big/1", rank=1, size=2))
    h = Harness(tmp_path / "state", groups)
    async with running(h):
        h.sup.apply([spec])
        ready = await h.wait_for("ready")
        assert ready.url is not None
        port = int(ready.url.rsplit(":", 1)[1])
        head = socket.create_connection(("127.0.0.1", port))  # the head's session: the server is busy now
        try:
            with trio.move_on_after(8.0):  # without the fix: unhealthy after ~3 probe timeouts
                await h.wait_for("unhealthy", timeout=8.0)
                raise AssertionError(f"a busy RPC worker went unhealthy: {h.seen[-1].detail}")
        finally:
            head.close()
        assert h.states() == ["starting", "ready"]
        h.sup.apply([replace(spec, generation=1)])  # a restart: a new process is probed again
        assert (await h.wait_for("ready")).pid != ready.pid
