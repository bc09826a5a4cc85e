"""The launcher of a vLLM multi-node replica's parts, as the agent runs them (docs/placement.md,
"vLLM multi-node replicas"; the command lines are llmgw/fleet/engine_cmd.py's):

    python -m llmgw.daemon.agent.ray_launch head --ray RAY --host HOST --ray-port P -- vllm serve ...
    python -m llmgw.daemon.agent.ray_launch worker --ray RAY --host HOST --port Q --head HEAD:P

``head`` starts the Ray head (``ray start --head --port P --node-ip-address HOST --dashboard-port D
--ray-client-server-port C --block``, D and C free ports instead of Ray's fixed 8265 and 10001), waits
until P accepts a connection, then starts ``vllm serve`` with ``RAY_ADDRESS=HOST:P`` (so it joins
this Ray cluster, not another on the host); both run until one exits, then the other is stopped
and the launcher exits with the first one's status. ``worker`` waits until the head's Ray port
accepts, then becomes ``ray start --address HEAD:P --node-ip-address HOST --node-manager-port Q
--block`` (Q: the agent's port, which it probes). Both set ``VLLM_HOST_IP=HOST`` (vLLM's docs: each
node its own address, on the private network). The agent runs each in its own process group and
signals the whole group to stop it; the launcher forwards TERM/INT to its children as well.

Bounds: waiting for a Ray port gives up after ``--wait-s`` (default 300 s, as vLLM's
multi-node-serving.sh), exiting 1 with a message the agent shows in the engine's log tail.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["main", "split_host_port"]

WAIT_S = 300.0
_POLL_S = 0.2


def split_host_port(addr: str) -> tuple[str, int]:
    """HOST:PORT or [V6]:PORT → (host, port); ValueError when it is not one."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not HOST:PORT: {addr!r}")
    return host.strip("[]"), int(port)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def wait_port(host: str, port: int, deadline: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Poll until host:port accepts (True), the deadline passes or `alive` turns False (False)."""
    while time.monotonic() < deadline:
        if _accepts(host, port):
            return True
        if not alive():
            return False
        time.sleep(_POLL_S)  # polling another process's port: there is nothing to wait on
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _env(host: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_HOST_IP"] = host
    env.update(extra)
    return env


def _stop(procs: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_head(ray: str, host: str, ray_port: int, serve: list[str], wait_s: float) -> int:
    procs: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, _frame: object) -> None:
        _stop(procs)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Ray's head has two more fixed default ports (its dashboard's 8265 and its client server's
    # 10001): free ones instead, so that two replicas' Ray heads on one node do not collide.
    ray_cmd = [ray, "start", "--head", "--port", str(ray_port), "--node-ip-address", host,
               "--dashboard-port", str(_free_port()), "--ray-client-server-port", str(_free_port()), "--block"]
    print("ray_launch: starting the Ray head:", " ".join(ray_cmd), flush=True)
    head = subprocess.Popen(ray_cmd, env=_env(host))
    procs.append(head)
    if not wait_port(host, ray_port, time.monotonic() + wait_s, lambda: head.poll() is None):
        print(f"ray_launch: the Ray head did not accept on {host}:{ray_port} "
              f"({'exited ' + str(head.returncode) if head.poll() is not None else f'after {wait_s:g} s'})",
              flush=True)
        _stop(procs)
        return 1
    print("ray_launch: starting vLLM:", " ".join(serve), flush=True)
    try:
        procs.append(subprocess.Popen(serve, env=_env(host, RAY_ADDRESS=f"{host}:{ray_port}")))
    except OSError as e:
        print(f"ray_launch: cannot run {serve[0]}: {e}", flush=True)
        _stop(procs)
        return 1
    while True:
        for p in procs:
            code = p.poll()
            if code is not None:
                which = "the Ray head" if p is head else "vLLM"
                print(f"ray_launch: {which} exited with status {code}; stopping the rest", flush=True)
                _stop(procs)
                return code or 1
        time.sleep(_POLL_S)  # two children of one parent: poll both


def run_worker(ray: str, host: str, port: int, head: str, wait_s: float) -> int:
    head_host, head_port = split_host_port(head)
    if not wait_port(head_host, head_port, time.monotonic() + wait_s):
        print(f"ray_launch: the Ray head {head} did not accept within {wait_s:g} s", flush=True)
        return 1
    cmd = [ray, "start", "--address", head, "--node-ip-address", host, "--node-manager-port", str(port),
           "--block"]
    print("ray_launch: joining the Ray head:", " ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, _env(host))
    return 1  # not reached


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ray_launch", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    h = sub.add_parser("head")
    h.add_argument("--ray", required=True)
    h.add_argument("--host", required=True)
    h.add_argument("--ray-port", type=int, required=True)
    h.add_argument("--wait-s", type=float, default=WAIT_S)
    h.add_argument("serve", nargs=argparse.REMAINDER)
    w = sub.add_parser("worker")
    w.add_argument("--ray", required=True)
    w.add_argument("--host", required=True)
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--head", required=True)
    w.add_argument("--wait-s", type=float, default=WAIT_S)
    a = ap.parse_args(argv)
    try:
        if a.role == "head":
            serve = a.serve[1:] if a.serve[:1] == ["--"] else a.serve
            if not serve:
                ap.error("head: no vllm serve command after --")
            return run_head(a.ray, a.host, a.ray_port, serve, a.wait_s)
        return run_worker(a.ray, a.host, a.port, a.head, a.wait_s)
    except ValueError as e:
        ap.error(str(e))
    except OSError as e:
        print(f"ray_launch: cannot run {a.ray}: {e}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
