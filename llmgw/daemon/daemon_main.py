"""`llmgw daemon`: the router process. With no models configured it starts the embedded default:
a simulated fleet (`[sim]` in the config) as child processes, with the router in front of it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import replace
from typing import Any

import trio

from llmgw.daemon.children import read_ready_line, stop_groups
from llmgw.config import Config, ConfigError, ModelConfig, ReplicaConfig, default_config, load_config

log = logging.getLogger("llmgw.daemon")


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: structured logs that carry the request id where there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        for key in ("request_id", "model", "endpoint", "status", "outcome", "ttft_ms", "latency_ms"):
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="llmgw daemon", description="Run the llmgw router.")
    p.add_argument("--role", default="router", help="router (agent and router,agent come with the agents)")
    p.add_argument("--config", help="TOML config file (default: built-in defaults, a simulated fleet)")
    p.add_argument("--host", help="override server.host")
    p.add_argument("--port", type=int, help="override server.port (0 = ephemeral)")
    p.add_argument("--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "info"))
    ns = p.parse_args(argv)
    roles = set(ns.role.split(","))
    if roles != {"router"}:
        print(f"llmgw daemon: --role {ns.role!r} is not available yet (only 'router')", file=sys.stderr)
        return 2
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    logging.basicConfig(level=ns.log_level.upper(), handlers=[handler])
    try:
        cfg = load_config(ns.config) if ns.config else default_config()
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    server = cfg.server
    if ns.host is not None or ns.port is not None:
        server = replace(server, host=ns.host or server.host, port=server.port if ns.port is None else ns.port)
        cfg = replace(cfg, server=server)
    try:
        trio.run(_run, cfg)
    except KeyboardInterrupt:
        pass
    return 0


async def _run(cfg: Config) -> None:
    from llmgw.daemon.httpserver import serve_tcp
    from llmgw.daemon.router import Router
    from llmgw.daemon.upstream import UpstreamPool

    async with trio.open_nursery() as nursery:
        fleet: list[trio.Process] = []
        try:
            if not cfg.models and cfg.sim.replicas > 0:
                cfg = await _start_sim_fleet(cfg, fleet)
            async with UpstreamPool() as pool:
                router = Router(cfg, pool)
                async with trio.open_nursery() as inner:
                    inner.start_soon(router.registry.scrape_loop, pool)
                    port = await inner.start(lambda task_status: serve_tcp(
                        router.handle, cfg.server.host, cfg.server.port, task_status=task_status,
                        max_body_bytes=cfg.server.max_body_bytes))
                    url = f"http://{cfg.server.host}:{port}"
                    print(json.dumps({"ready": True, "role": "router", "url": url, "port": port,
                                      "models": [m.name for m in cfg.models], "pid": os.getpid()}), flush=True)
                    log.info("router listening on %s", url)
                    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for _ in signals:
                            inner.cancel_scope.cancel()
                            break
        finally:
            with trio.CancelScope(shield=True):
                await stop_groups(fleet)
            nursery.cancel_scope.cancel()


async def _start_sim_fleet(cfg: Config, procs: list[trio.Process]) -> Config:
    s = cfg.sim
    urls = []
    for i in range(s.replicas):
        port = s.base_port + i if s.base_port else 0
        cmd = [sys.executable, "-m", "llmgw", "sim", "--engine", s.engine, "--host", "127.0.0.1",
               "--port", str(port)]
        cmd += [s.model] if s.engine == "vllm" else ["-m", f"{s.model}.gguf", "--alias", s.model, "--metrics"]
        cmd += list(s.extra_args)
        proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, start_new_session=True)
        procs.append(proc)
        line = await read_ready_line(proc)
        if not line:
            raise RuntimeError(f"simulated replica {i} failed to start: {' '.join(cmd)}")
        urls.append(json.loads(line)["url"])
        log.info("simulated %s replica %d at %s", s.engine, i, urls[-1])
    model = ModelConfig(name=s.model, engine=s.engine,
                        replicas=tuple(ReplicaConfig(url=u) for u in urls))
    return replace(cfg, models=(model,))
