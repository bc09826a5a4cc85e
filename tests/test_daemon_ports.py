"""Two one-process daemons on one host, over real processes: each one's agent gets a control port of
its own (no [control] listen configured) and dials its own router; a port that is taken stops a
daemon with one line naming the address and the config key (exit 2), never a traceback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from .test_router_integration import Daemon
from .test_sim_vllm import wait_for


def one_process_config(tmp: Path, name: str, extra: str = "", admin: str = "") -> Path:
    d = tmp / name
    d.mkdir()
    path = d / "llmgw.toml"
    path.write_text(f"""
[server]
host = "127.0.0.1"
[router]
scrape_interval_s = 0.2
[admin]
socket = {json.dumps(str(d / "admin" / "admin.sock"))}
{admin}
[control]
store = {json.dumps(str(d / "router.db"))}
{extra}
[agent]
node = "{name}"
state_dir = {json.dumps(str(d / "agent"))}
[sim]
replicas = 1
model = "{name}-model"
""")
    return path


def chat(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_two_one_process_daemons_on_one_host_both_serve(tmp_path: Path) -> None:
    first = Daemon(one_process_config(tmp_path, "one"), role="router,agent", log_level="info")
    try:
        second = Daemon(one_process_config(tmp_path, "two"), role="router,agent", log_level="info")
        try:
            assert first.info["control"] != second.info["control"], (first.info, second.info)
            for d, model in ((first, "one-model"), (second, "two-model")):
                wait_for(lambda d=d: httpx.get(f"{d.url}/ready").status_code == 200, 60)
                r = chat(d.url, model)
                assert r.status_code == 200, r.text
            # each agent joined its own router: node `one` is on the first, `two` on the second
            for d, node in ((first, "one"), (second, "two")):
                out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", d.info["admin_socket"],
                                      "nodes", "-o", "json"], capture_output=True, text=True, timeout=30)
                assert [n["name"] for n in json.loads(out.stdout)] == [node], out.stdout + out.stderr
        finally:
            second.stop()
    finally:
        first.stop()


def run_daemon(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--config", str(config), "--log-level", "warning",
                           *args], capture_output=True, text=True, timeout=60)


def test_a_taken_port_is_one_clear_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = one_process_config(tmp_path, "clash", extra=f'listen = "127.0.0.1:{port}"')
        r = run_daemon(cfg, "--port", "0")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert f"control.listen: cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
        assert "already in use" in r.stderr.lower(), r.stderr
        cfg = one_process_config(tmp_path, "clash2")
        r = run_daemon(cfg, "--port", str(port))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert f"server.port (--port): cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
        cfg = one_process_config(tmp_path, "clash3", admin=f'tcp = "127.0.0.1:{port}"\ntoken = "admin-secret-1"')
        r = run_daemon(cfg, "--port", "0")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert f"admin.tcp: cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
        assert len([x for x in r.stderr.splitlines() if x.startswith("llmgw daemon:")]) == 1, r.stderr
