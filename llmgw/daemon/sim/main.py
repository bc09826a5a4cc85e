"""Process entry for `llmgw sim`: one replica in this process, or a fleet of child processes.

When a replica is ready it prints one JSON line on stdout (`{"ready": true, "url": ...}`), so a
launcher (the fleet, the agent, tests) learns its real port without polling."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
from typing import Any

import trio

from llmgw.daemon.sim.children import read_ready_line, stop_groups
from llmgw.sim.args import ArgError

log = logging.getLogger("llmgw.sim")


def _split_engine(argv: list[str]) -> tuple[str, list[str], str]:
    """(engine, the engine's flags, the --rpc workers of a multi-node head, or "")."""
    engine, rest, rpc = "vllm", [], ""
    it = iter(argv)
    for a in it:
        if a == "--engine":
            engine = next(it, "")
        elif a.startswith("--engine="):
            engine = a.split("=", 1)[1]
        elif a == "--rpc":  # the head of a multi-node replica is told its workers (as llama-server)
            rpc = next(it, "")
        else:
            rest.append(a)
    return engine, rest, rpc


def main(argv: list[str]) -> int:
    from llmgw.daemon.logs import LogSetupError, env_format, env_level, setup_logging

    try:  # no flags of its own (they are the engine's): the environment only
        setup_logging(env_level(os.environ, "warning"), env_format(os.environ), sys.stderr)
    except LogSetupError as e:
        print(f"llmgw sim: {e}", file=sys.stderr)
        return 2
    if argv and argv[0] == "fleet":
        return fleet_main(argv[1:])
    if argv and argv[0] == "worker":
        from llmgw.daemon.sim.worker import worker_main

        return worker_main(argv[1:])
    engine, rest, rpc = _split_engine(argv)
    if rpc:
        log.info("head of a multi-node replica; workers %s", rpc)
    try:
        if engine == "vllm":
            from llmgw.daemon.sim.vllm_server import build

            sim: Any = build(rest)
            kind = "vllm"
        elif engine == "llamacpp":
            from llmgw.daemon.sim.llamacpp_server import build as build_llama

            sim = build_llama(rest)
            kind = "llamacpp"
        else:
            print(f"llmgw sim: --engine must be vllm or llamacpp, got {engine!r}", file=sys.stderr)
            return 2
    except ArgError as e:
        print(f"llmgw sim: error: {e}", file=sys.stderr)
        return 2
    try:
        trio.run(_serve_one, sim, kind)
    except KeyboardInterrupt:
        pass
    except OSError as e:
        print(f"llmgw sim: error: {e}", file=sys.stderr)
        return 1
    return 0


async def _serve_one(sim: Any, kind: str) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(sim.serve)
        host = sim.host if sim.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        ready: dict[str, Any] = {"ready": True, "engine": kind, "url": f"http://{host}:{port}", "port": port,
                                 "pid": os.getpid()}
        pub = getattr(sim, "publisher", None)
        if pub is not None:
            # A wildcard bind resolves to 0.0.0.0; report an address a subscriber can dial, as
            # vLLM 0.31+ reports VLLM_HOST_IP.
            reach = os.environ.get("VLLM_HOST_IP") or host
            ready["kv_events"] = pub.endpoint.replace("0.0.0.0", reach)
            ready["kv_replay"] = pub.replay_endpoint and pub.replay_endpoint.replace("0.0.0.0", reach)
        print(json.dumps(ready), flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                if pub is not None:
                    await pub.stop()  # vLLM drains queued event batches for up to 1 s
                nursery.cancel_scope.cancel()
                return


def fleet_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="llmgw sim fleet",
                                description="Start N simulated replicas, one process each; Ctrl-C stops them all.")
    p.add_argument("n", type=int, help="number of replicas")
    p.add_argument("--engine", choices=["vllm", "llamacpp"], default="vllm",
                   help="the engine to simulate (default: vllm)")
    p.add_argument("--host", default="127.0.0.1", help="the address the replicas listen on (default: 127.0.0.1)")
    p.add_argument("--base-port", type=int, default=0, help="replica i listens on base+i (default: ephemeral)")
    p.add_argument("--model", default="sim-model", help="the model name the replicas serve (default: sim-model)")
    own, _, engine_args = _partition(argv)
    ns = p.parse_args(own)
    if ns.n < 1:
        p.error("n must be at least 1")
    return trio.run(_run_fleet, ns, engine_args)


def _partition(argv: list[str]) -> tuple[list[str], str, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], "--", argv[i + 1:]
    return argv, "", []


async def _run_fleet(ns: argparse.Namespace, engine_args: list[str]) -> int:
    procs: list[trio.Process] = []
    ready: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        for i in range(ns.n):
            port = ns.base_port + i if ns.base_port else 0
            cmd = [sys.executable, "-m", "llmgw", "sim", "--engine", ns.engine, "--host", ns.host,
                   "--port", str(port), *_model_args(ns, i), *engine_args]
            proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, start_new_session=True)
            procs.append(proc)
            line = await read_ready_line(proc)
            if line is None:
                print(f"llmgw sim fleet: replica {i} failed to start (exit {await proc.wait()})", file=sys.stderr)
                await stop_groups(procs)
                return 1
            info = json.loads(line)
            ready.append(info)
            nursery.start_soon(_drain, proc)
        print(json.dumps({"fleet": ready}), flush=True)
        for info in ready:
            print(f"replica ready: {info['url']} (pid {info['pid']})", file=sys.stderr)
        try:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async with trio.open_nursery() as waiters:
                    for proc in procs:
                        waiters.start_soon(_wait_then_cancel, proc, waiters.cancel_scope)
                    async for _ in signals:
                        waiters.cancel_scope.cancel()
                        break
        finally:
            with trio.CancelScope(shield=True):
                await stop_groups(procs)
            nursery.cancel_scope.cancel()
    return 0


def _model_args(ns: argparse.Namespace, i: int) -> list[str]:
    if ns.engine == "vllm":
        return [ns.model]
    return ["-m", f"{ns.model}.gguf", "--alias", ns.model]


async def _drain(proc: trio.Process) -> None:
    assert proc.stdout is not None
    while await proc.stdout.receive_some(65536):
        pass


async def _wait_then_cancel(proc: trio.Process, scope: trio.CancelScope) -> None:
    await proc.wait()
    scope.cancel()  # one replica died: stop the fleet rather than serve a partial one silently
