"""vLLM multi-node replicas over real processes: a router daemon, four agents in two racks, and
stand-in ``ray`` and ``vllm`` executables (written here) that behave as the real ones do at the level
the agents see. The Ray head stand-in listens on its --port and counts the workers that join it;
a Ray worker stand-in fails unless the head's port accepts, joins it, listens on its
--node-manager-port and exits when the head goes; the vllm stand-in does not listen until every
worker (pipeline parallel size - 1) has joined the Ray head named by RAY_ADDRESS, then runs the
llmgw simulator. So the start order (head first, then the workers) is really exercised.

A nodes = 2 replica comes up with both parts in one rack, is routed via the head only, is
restarted as a whole Ray cluster when its worker's process dies, and when the worker's agent
stops it leaves routing and is re-placed whole in the other rack."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .test_fleet_integration import Fleet, group_alive
from .test_sim_vllm import wait_for

RAY_STUB = r'''
import json, os, socket, sys, threading, time
argv = sys.argv[1:]
def opt(name):
    return argv[argv.index(name) + 1] if name in argv else None
stub = os.environ["STUB_DIR"]
def note(**kw):
    with open(os.path.join(stub, "calls.jsonl"), "a") as f:
        f.write(json.dumps({"prog": "ray", "argv": argv, "t": time.time(), "pid": os.getpid(),
                            "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP"), **kw}) + "\n")
assert argv[0] == "start" and "--block" in argv, argv
host = opt("--node-ip-address")
if "--head" in argv:
    port = int(opt("--port"))
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(16)
    note(role="head")
    joined = []
    lock = threading.Lock()
    def publish():
        path = os.path.join(stub, f"ray-{port}.nodes")
        with open(path + ".tmp", "w") as f:
            f.write(str(len(joined)))
        os.replace(path + ".tmp", path)
    def serve(c):
        line = c.makefile().readline()
        if not line.startswith("join "):
            c.close(); return
        with lock:
            joined.append(c); publish()
        while c.recv(1024):
            pass
        with lock:
            joined.remove(c); publish()
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
else:
    addr = opt("--address")
    h, p = addr.rsplit(":", 1)
    try:
        head = socket.create_connection((h, int(p)), timeout=5)
    except OSError as e:
        print(f"ConnectionError: could not reach the Ray head at {addr}: {e}", flush=True)
        sys.exit(1)
    head.sendall(f"join {host}\n".encode())
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, int(opt("--node-manager-port")))); ls.listen(16)
    threading.Thread(target=lambda: [ls.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
    note(role="worker")
    while head.recv(1024):
        pass
    print("the Ray head went away", flush=True)
    sys.exit(1)
'''

VLLM_STUB = r'''
import json, os, sys, time
argv = sys.argv[1:]
def opt(name):
    return argv[argv.index(name) + 1] if name in argv else None
stub = os.environ["STUB_DIR"]
assert argv[0] == "serve", argv
want = int(opt("--pipeline-parallel-size")) - 1
ray_port = os.environ["RAY_ADDRESS"].rsplit(":", 1)[1]
with open(os.path.join(stub, "calls.jsonl"), "a") as f:
    f.write(json.dumps({"prog": "vllm", "argv": argv, "t": time.time(), "pid": os.getpid(),
                        "RAY_ADDRESS": os.environ["RAY_ADDRESS"],
                        "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP")}) + "\n")
deadline = time.monotonic() + 60
path = os.path.join(stub, f"ray-{ray_port}.nodes")
while True:  # as vLLM's Ray executor: wait for the cluster's GPUs (a placement group) before serving
    try:
        if int(open(path).read() or 0) >= want:
            break
    except (OSError, ValueError):
        pass
    if time.monotonic() > deadline:
        print("timed out waiting for the Ray workers", flush=True)
        sys.exit(1)
    time.sleep(0.05)
with open(os.path.join(stub, "calls.jsonl"), "a") as f:
    f.write(json.dumps({"prog": "vllm", "serving": True, "t": time.time()}) + "\n")
os.execv(sys.executable, [sys.executable, "-m", "llmgw", "sim", "--engine", "vllm", "--host", opt("--host"),
                          "--port", opt("--port"), argv[1], "--served-model-name", opt("--served-model-name")])
'''


def write_stubs(tmp: Path) -> tuple[Path, Path]:
    bin_dir, stub_dir = tmp / "venv" / "bin", tmp / "stub"
    bin_dir.mkdir(parents=True)
    stub_dir.mkdir()
    for name, text in (("ray", RAY_STUB), ("vllm", VLLM_STUB)):
        p = bin_dir / name
        p.write_text(f"#!{sys.executable}\n{text}")
        p.chmod(0o755)
    return bin_dir, stub_dir


def calls(stub: Path) -> list[dict[str, Any]]:
    path = stub / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    bin_dir, stub = write_stubs(tmp_path)
    model = {"name": "m", "engine": "vllm",
             "deploy": {"count": 1, "nodes": 2, "keep_within": "rack", "binary": str(bin_dir / "vllm"),
                        "model_path": "/models/m", "env": [f"STUB_DIR={stub}"], "health_timeout_s": 30.0}}
    f = Fleet(tmp_path, [model], lost_after=2.0)
    f.stub = stub  # type: ignore[attr-defined]
    try:
        yield f
    finally:
        f.close()


def group(f: Fleet) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(head, worker) when the one group's two parts are ready."""
    ps = {r["replica"]: r for r in f.replicas("m")}
    heads = [r for r in ps.values() if not r["replica"].endswith("-w1") and r["desired"] == "run"]
    if len(heads) != 1:
        return None
    w = ps.get(heads[0]["replica"] + "-w1")
    if w is None or heads[0]["state"] != "ready" or w["state"] != "ready":
        return None
    return heads[0], w


def test_a_two_node_vllm_replica_starts_its_ray_head_first_serves_and_is_replaced_whole(fleet: Fleet) -> None:
    f = fleet
    stub: Path = f.stub  # type: ignore[attr-defined]
    racks = {"a": "r1", "b": "r1", "c": "r2", "d": "r2"}
    for node, rack in racks.items():
        f.start_agent(node, labels={"llmgw.io/rack": rack})
    wait_for(lambda: group(f) is not None and f.get("/api/v1/models")[0]["ready"] == 1, 60)
    head, worker = group(f)  # type: ignore[misc]
    assert head["node"] != worker["node"] and racks[head["node"]] == racks[worker["node"]]
    wait_for(lambda: f.chat("m").status_code == 200, 10)
    assert {r["replica"] for r in f.replicas("m") if r["routable"]} == {head["replica"]}

    # The launch, as vLLM's multi-node docs have it, in the order they need.
    seen = calls(stub)
    ray_head = next(c for c in seen if c["prog"] == "ray" and c.get("role") == "head")
    ray_worker = next(c for c in seen if c["prog"] == "ray" and c.get("role") == "worker")
    serve = next(c for c in seen if c["prog"] == "vllm" and "argv" in c)
    serving = next(c for c in seen if c.get("serving"))
    ray_port = ray_head["argv"][ray_head["argv"].index("--port") + 1]
    assert ray_head["argv"][:2] == ["start", "--head"] and ray_head["VLLM_HOST_IP"] == "127.0.0.1"
    assert {"--dashboard-port", "--ray-client-server-port", "--block"} <= set(ray_head["argv"])
    assert ray_worker["argv"][ray_worker["argv"].index("--address") + 1] == f"127.0.0.1:{ray_port}"
    assert serve["RAY_ADDRESS"] == f"127.0.0.1:{ray_port}"
    a = serve["argv"]
    assert a[a.index("--pipeline-parallel-size") + 1] == "2" and a[a.index("--distributed-executor-backend") + 1] \
        == "ray" and a[a.index("--served-model-name") + 1] == "m"
    assert ray_head["t"] <= ray_worker["t"] <= serving["t"]  # head first; vLLM served once the worker joined

    # The worker's process dies; its agent restarts it: the Ray cluster is broken, so the head is
    # restarted too, and the new worker joins the new head.
    os.kill(worker["pid"], signal.SIGKILL)
    old = {head["pid"], worker["pid"]}

    def renewed() -> bool:
        g = group(f)
        return g is not None and not {g[0]["pid"], g[1]["pid"]} & old and g[0]["routable"]

    wait_for(renewed, 60)
    head, worker = group(f)  # type: ignore[misc]
    assert head["node"] in racks and group_alive(head["pid"])
    events = [(h["event"], h.get("replica")) for h in f.get("/api/v1/history?limit=500")]
    assert ("replica restart", head["replica"]) in events
    wait_for(lambda: f.chat("m").status_code == 200, 10)
    joins = [c for c in calls(stub) if c["prog"] == "ray" and c.get("role") == "worker"]
    heads = [c for c in calls(stub) if c["prog"] == "ray" and c.get("role") == "head"]
    assert len(heads) == 2 and joins[-1]["argv"][joins[-1]["argv"].index("--address") + 1] == \
        f"127.0.0.1:{heads[-1]['argv'][heads[-1]['argv'].index('--port') + 1]}"

    # The worker's agent stops: the head leaves routing, and the group is re-placed whole.
    victim = worker["node"]
    f.agents[victim].stop()
    wait_for(lambda: not any(r["routable"] for r in f.replicas("m")), 10)
    wait_for(lambda: f.nodes()[victim]["state"] == "lost", 15)
    old_rack = racks[victim]

    def moved() -> bool:
        g = group(f)
        return g is not None and g[0]["replica"] != head["replica"] and {racks[g[0]["node"]], racks[g[1]["node"]]} \
            == ({"r1", "r2"} - {old_rack})

    wait_for(moved, 60)
    wait_for(lambda: not group_alive(head["pid"]), 15)  # the old head (its Ray head and vLLM) was stopped too
    wait_for(lambda: f.chat("m").status_code == 200, 10)
    events = [(h["event"], h.get("replica")) for h in f.get("/api/v1/history?limit=500")]
    assert ("group ready", head["replica"]) in events


def launcher(*args: str, stub: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "llmgw.daemon.agent.ray_launch", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "STUB_DIR": str(stub)})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_head_launcher_stops_vllm_when_its_ray_head_exits_and_both_on_term(tmp_path: Path) -> None:
    bin_dir, stub = write_stubs(tmp_path)
    procs = []
    try:
        for how in ("ray exits", "TERM"):
            (stub / "calls.jsonl").unlink(missing_ok=True)
            p = launcher("head", "--ray", str(bin_dir / "ray"), "--host", "127.0.0.1", "--ray-port", str(free_port()),
                         "--", str(bin_dir / "vllm"), "serve", "/m", "--host", "127.0.0.1", "--port", str(free_port()),
                         "--served-model-name", "m", "--pipeline-parallel-size", "2", stub=stub)
            procs.append(p)
            wait_for(lambda: any(c["prog"] == "vllm" for c in calls(stub)), 20)  # vLLM waits for a worker
            ray = next(c for c in calls(stub) if c["prog"] == "ray")["pid"]
            vllm = next(c for c in calls(stub) if c["prog"] == "vllm")["pid"]
            if how == "ray exits":
                os.kill(ray, signal.SIGKILL)
            else:
                p.send_signal(signal.SIGTERM)  # the launcher alone: it stops its children
            code = p.wait(20)
            assert code != 0, how
            wait_for(lambda: gone(ray) and gone(vllm), 10)
            out = p.stdout.read() if p.stdout else ""
            if how == "ray exits":
                assert "the Ray head exited" in out and "stopping the rest" in out, out
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def test_launchers_give_up_on_a_ray_head_that_never_accepts(tmp_path: Path) -> None:
    bin_dir, stub = write_stubs(tmp_path)
    dead = free_port()  # nothing listens there
    w = launcher("worker", "--ray", str(bin_dir / "ray"), "--host", "127.0.0.1", "--port", str(free_port()),
                 "--head", f"127.0.0.1:{dead}", "--wait-s", "0.5", stub=stub)
    not_ray = tmp_path / "not-ray"  # exits at once: the head launcher does not wait out its deadline
    not_ray.write_text(f"#!{sys.executable}\nimport sys; sys.exit(3)\n")
    not_ray.chmod(0o755)
    h = launcher("head", "--ray", str(not_ray), "--host", "127.0.0.1", "--ray-port", str(dead), "--",
                 str(bin_dir / "vllm"), "serve", "/m", stub=stub)
    try:
        assert w.wait(20) == 1
        assert f"the Ray head 127.0.0.1:{dead} did not accept within 0.5 s" in (w.stdout.read() if w.stdout else "")
        assert h.wait(20) == 1
        assert "did not accept on 127.0.0.1" in (h.stdout.read() if h.stdout else "")
        assert calls(stub) == []  # neither ray start --address nor vllm serve ran
    finally:
        for p in (w, h):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def test_a_missing_ray_or_vllm_is_named_and_nothing_is_left_running(tmp_path: Path) -> None:
    bin_dir, stub = write_stubs(tmp_path)
    for ray, vllm, missing in ((tmp_path / "no-ray", bin_dir / "vllm", "no-ray"),
                               (bin_dir / "ray", tmp_path / "no-vllm", "no-vllm")):
        (stub / "calls.jsonl").unlink(missing_ok=True)
        h = launcher("head", "--ray", str(ray), "--host", "127.0.0.1", "--ray-port", str(free_port()), "--",
                     str(vllm), "serve", "/m", stub=stub)
        try:
            assert h.wait(20) == 1
            out = h.stdout.read() if h.stdout else ""
            assert f"ray_launch: cannot run {tmp_path / missing}" in out, out
            for c in calls(stub):  # a Ray head started before vLLM was found missing: stopped
                wait_for(lambda c=c: gone(c["pid"]), 10)
        finally:
            if h.poll() is None:
                os.killpg(h.pid, signal.SIGKILL)
                h.wait(5)
