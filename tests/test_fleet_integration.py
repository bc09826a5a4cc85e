"""The fleet over real processes: a router daemon, several agent daemons with different node names
on this machine, and the engines they launch (`llmgw sim`, scripts that misbehave, and a real
llama-server where one is built). Observed through the admin API on the router's Unix socket."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_router_integration import Daemon, free_port
from .test_sim_vllm import wait_for

TOKEN = "join-Secret-4c1d"


def toml_value(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def table(name: str, values: dict[str, Any]) -> list[str]:
    return [f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()]


class Fleet:
    """A router and its agents; everything started is stopped (agents first)."""

    def __init__(self, tmp: Path, models: list[dict[str, Any]], *, lost_after: float = 3.0,
                 control: dict[str, Any] | None = None) -> None:
        self.control_extra = control or {}
        self.tmp = tmp
        self.control_port = free_port()
        self.models = models
        self.lost_after = lost_after
        self.agents: dict[str, Daemon] = {}
        self.router: Daemon | None = None
        self.start_router()

    def router_config(self) -> Path:
        lines = table("server", {"host": "127.0.0.1"})
        lines += table("router", {"scrape_interval_s": 0.2})
        lines += table("control", {"listen": f"127.0.0.1:{self.control_port}", "join_token": TOKEN,
                                   "heartbeat_s": 0.2, "not_ready_after_s": 1.0, "lost_after_s": self.lost_after,
                                   "drain_timeout_s": 2.0, "settle_s": 2.5, "store": str(self.tmp / "router.db"),
                                   **self.control_extra})
        lines += table("admin", {"socket": str(self.tmp / "admin" / "admin.sock")})
        for m in self.models:
            lines += ["[[models]]"] + [f"{k} = {toml_value(v)}" for k, v in m.items() if not isinstance(v, dict)]
            for k, v in m.items():  # its sub-tables: deploy, autoscale
                if isinstance(v, dict):
                    lines += table(f"models.{k}", v)
        path = self.tmp / "router.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start_router(self) -> None:
        self.router = Daemon(self.router_config(), role="router", log_level="info")
        self.admin = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.tmp / "admin" / "admin.sock")),
                                  base_url="http://llmgw", timeout=5)

    def stop_router(self) -> None:
        assert self.router is not None
        self.router.stop()

    def agent_config(self, node: str, token: str = TOKEN, **agent: Any) -> Path:
        values = {"node": node, "router": f"127.0.0.1:{self.control_port}", "join_token": token,
                  "state_dir": str(self.tmp / f"agent-{node}"), "reconnect_min_s": 0.1, "reconnect_max_s": 0.5,
                  "stop_grace_s": 3.0, **agent}
        restart = values.pop("restart", {"base_s": 0.1, "max_s": 0.5, "crashloop_after": 3, "window_s": 60.0})
        lines = table("agent", values) + table("agent.restart", restart)
        path = self.tmp / f"agent-{node}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start_agent(self, node: str, **kw: Any) -> Daemon:
        d = Daemon(self.agent_config(node, **kw), role="agent", log_level="info")
        self.agents[node] = d
        return d

    def get(self, path: str) -> Any:
        r = self.admin.get(path)
        r.raise_for_status()
        return r.json()

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["name"]: n for n in self.get("/api/v1/nodes")}

    def replicas(self, model: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.get("/api/v1/replicas") if model is None or r["model"] == model]

    def ready(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.replicas(model) if r["state"] == "ready" and r["desired"] == "run"]

    def chat(self, model: str) -> httpx.Response:
        assert self.router is not None
        return httpx.post(f"{self.router.url}/v1/chat/completions", timeout=10,
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})

    def log(self, d: Daemon) -> str:
        return "".join(d.err)

    def close(self) -> None:
        for a in self.agents.values():
            a.stop()
        if self.router is not None:
            self.router.stop()
        self.admin.close()


def sim_model(name: str = "m", count: int = 2, **deploy: Any) -> dict[str, Any]:
    return {"name": name, "engine": "vllm", "deploy": {"count": count, "simulate": True, "health_timeout_s": 20.0,
                                                       **deploy}}


@pytest.fixture
def fleet_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Fleet] = []

    def make(models: list[dict[str, Any]], **kw: Any) -> Fleet:
        f = Fleet(tmp_path, models, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()
    # engines left by a SIGKILLed agent in a test are its to clean; nothing may survive the test
    for rec in tmp_path.glob("agent-*/engines/*.json"):
        pgid = json.loads(rec.read_text()).get("pgid")
        if pgid:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def script(tmp: Path, name: str, body: str) -> str:
    path = tmp / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


# -----------------------------------------------------------------------------------------------
def test_replicas_spread_across_agents_and_serve(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model(count=3)])
    for n in ("a", "b", "c"):
        f.start_agent(n, labels={"llmgw.io/rack": f"r-{n}", "llmgw.io/site": "lab"})
    wait_for(lambda: len(f.ready("m")) == 3, 30)
    assert sorted(r["node"] for r in f.ready("m")) == ["a", "b", "c"]  # spread: one per node
    nodes = f.nodes()
    assert {n["state"] for n in nodes.values()} == {"ready"}
    assert nodes["a"]["location"] == "lab/r-a"
    assert nodes["a"]["facts"]["cpus"] >= 1
    for _ in range(6):
        r = f.chat("m")
        assert r.status_code == 200, r.text
    # every replica answers through the router: the scheduler knows all three
    wait_for(lambda: len({r["url"] for r in f.ready("m")}) == 3)
    models = httpx.get(f"{f.router.url}/v1/models").json()["data"]
    assert models[0]["replicas"] == 3


def test_killed_agent_loses_its_replicas_after_the_timeout_and_they_move(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model(count=2)], lost_after=2.0)
    for n in ("a", "b", "c"):
        f.start_agent(n)
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    victim = f.ready("m")[0]
    node = victim["node"]
    os.killpg(f.agents[node].proc.pid, signal.SIGKILL)  # the agent's group only: its engines live on
    f.agents[node].proc.wait(5)
    wait_for(lambda: f.nodes()[node]["state"] == "not_ready", 5)
    assert victim["replica"] in {r["replica"] for r in f.replicas("m")}  # not moved yet
    wait_for(lambda: f.nodes()[node]["state"] == "lost", 10)
    wait_for(lambda: len(f.ready("m")) == 2 and node not in {r["node"] for r in f.ready("m")}, 30)
    assert victim["replica"] not in {r["replica"] for r in f.replicas("m")}
    assert f.chat("m").status_code == 200
    # The orphaned engine still runs; the agent's next run finds it, and since the router moved
    # its replica elsewhere, stops it.
    assert group_alive(victim["pid"])
    f.start_agent(node)
    wait_for(lambda: not group_alive(victim["pid"]), 15)
    wait_for(lambda: f.nodes()[node]["state"] == "ready", 10)


def test_a_short_blip_reschedules_nothing(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model(count=2)], lost_after=4.0)
    for n in ("a", "b"):
        f.start_agent(n)
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    before = {r["replica"]: r["pid"] for r in f.ready("m")}
    agent = f.agents["a"]
    os.kill(agent.proc.pid, signal.SIGSTOP)  # heartbeats stop; the connection stays open
    try:
        wait_for(lambda: f.nodes()["a"]["state"] == "not_ready", 5)
        assert f.chat("m").status_code == 200  # its engine still serves meanwhile
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
    wait_for(lambda: f.nodes()["a"]["state"] == "ready", 10)
    after = {r["replica"]: r["pid"] for r in f.ready("m")}
    assert after == before
    placed = [h for h in f.get("/api/v1/history?limit=500") if h["event"] == "replica placed"]
    assert len(placed) == 2  # the first placements, nothing since


def test_router_restart_restarts_no_engine_and_loses_nothing(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model(count=2)])
    for n in ("a", "b"):
        f.start_agent(n)
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    f.admin.put("/api/v1/nodes/a/labels", json={"labels": {"llmgw.io/rack": "r7"}})
    before = {r["replica"]: (r["node"], r["pid"]) for r in f.ready("m")}
    f.stop_router()
    f.start_router()
    # ready at once (their engines answered the restarted router's probe), confirmed by the agents
    wait_for(lambda: len(f.ready("m")) == 2 and all(r["pid"] for r in f.ready("m")), 20)
    after = {r["replica"]: (r["node"], r["pid"]) for r in f.ready("m")}
    assert after == before
    assert all(r["restarts"] == 0 for r in f.ready("m"))
    assert f.nodes()["a"]["labels"]["llmgw.io/rack"] == "r7"  # operator labels survive in the store
    wait_for(lambda: f.chat("m").status_code == 200, 10)


def test_a_crashing_engine_is_restarted_with_backoff_then_crash_loops(fleet_factory: Any, tmp_path: Path) -> None:
    bad = script(tmp_path, "bad-engine", 'echo "fatal: cannot map model file $2" >&2; exit 3')
    f = fleet_factory([sim_model(count=1), {"name": "broken", "engine": "llamacpp",
                                            "deploy": {"count": 1, "binary": bad, "model_path": "x.gguf"}}])
    f.start_agent("a")
    wait_for(lambda: any(r["state"] == "crashloop" for r in f.replicas("broken")), 20)
    [r] = f.replicas("broken")
    assert r["restarts"] == 2  # crashloop_after = 3: the first start and two restarts
    assert any("cannot map model file x.gguf" in line for line in r["log_tail"])
    assert "operator" in r["detail"]
    # A crash of a healthy engine is restarted: SIGKILL the simulator's process group.
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    [sim] = f.ready("m")
    os.killpg(sim["pid"], signal.SIGKILL)
    wait_for(lambda: any(x["restarts"] == 1 and x["state"] == "ready" for x in f.replicas("m")), 20)
    [again] = f.ready("m")
    assert again["replica"] == sim["replica"] and again["pid"] != sim["pid"]
    # The operator restarts the crash-looping one (it crashes again: still reported, with its log).
    rid = r["replica"]
    assert f.admin.post(f"/api/v1/replicas/{rid}/restart").status_code in (200, 202)
    wait_for(lambda: f.replicas("broken")[0]["generation"] == 1, 10)


def test_an_engine_that_never_becomes_healthy_is_reported_with_its_log(fleet_factory: Any, tmp_path: Path) -> None:
    slow = script(tmp_path, "slow-engine", 'echo "loading weights 1/99"; exec sleep 60')
    f = fleet_factory([{"name": "slow", "engine": "llamacpp",
                        "deploy": {"count": 1, "binary": slow, "health_timeout_s": 1.0}}])
    f.start_agent("a")
    wait_for(lambda: any(r["state"] in ("failed", "crashloop") or r["restarts"] > 0
                         for r in f.replicas("slow")), 20)
    wait_for(lambda: any("loading weights" in line for r in f.replicas("slow") for line in r["log_tail"]), 10)
    r = f.replicas("slow")[0]
    assert "healthy" in r["detail"] or r["restarts"] > 0


def test_a_wrong_join_token_is_refused_and_not_logged(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model(count=1)])
    wrong = "not-the-Token-9z"
    agent = f.start_agent("intruder", token=wrong)
    assert f.router is not None
    wait_for(lambda: "wrong join token" in f.log(f.router), 10)
    wait_for(lambda: "refused" in f.log(agent), 10)
    assert "intruder" not in f.nodes()
    assert wrong not in f.log(f.router) and TOKEN not in f.log(f.router)
    assert wrong not in f.log(agent)


def test_a_stopped_agent_leaves_no_engine_behind(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model(count=2)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    pgids = [r["pid"] for r in f.ready("m")]
    assert all(group_alive(p) for p in pgids)
    f.agents["a"].stop()  # SIGTERM
    assert not any(group_alive(p) for p in pgids)
    # it said goodbye: its replicas left routing at once, not after failed requests
    wait_for(lambda: f.nodes()["a"]["state"] == "not_ready", 5)
    assert not any(r["routable"] for r in f.replicas("m"))


def test_malformed_and_oversized_messages_close_only_that_connection(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model(count=1)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    for payload in (b"\x00\x00\x00\x05garbage", b"\x7f\xff\xff\xff", b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", f.control_port), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(5)
            assert s.recv(100) == b""  # closed by the router
    assert f.router is not None and f.router.proc.poll() is None
    assert f.nodes()["a"]["state"] == "ready"
    assert f.chat("m").status_code == 200


def test_replicas_that_cannot_be_placed_say_why(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model("big", count=1, gpus=4, gpu_memory_mb=40000)])
    f.start_agent("a", gpus=[{"name": "L4", "memory_mb": 24000}, {"name": "L4", "memory_mb": 24000}])
    wait_for(lambda: f.nodes().get("a", {}).get("state") == "ready", 10)
    wait_for(lambda: bool(f.get("/api/v1/models")[0]["unplaceable"]), 10)
    why = f.get("/api/v1/models")[0]["unplaceable"]
    assert "4 GPUs" in why and "too few free GPUs" in why, why


def test_gpus_are_fitted_and_passed_to_the_engine(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model("g", count=2, gpus=1, gpu_memory_mb=20000)])
    f.start_agent("a", gpus=[{"name": "L4", "memory_mb": 24000}, {"name": "T4", "memory_mb": 16000}])
    f.start_agent("b", gpus=[{"name": "L4", "memory_mb": 24000}])
    wait_for(lambda: len(f.ready("g")) == 2, 30)
    placed = sorted((r["node"], tuple(r["gpus"])) for r in f.ready("g"))
    assert placed == [("a", (0,)), ("b", (0,))]  # the T4 is too small; spread across nodes


def test_the_stream_over_tls(fleet_factory: Any, tmp_path: Path) -> None:
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "router.pem", tmp_path / "router.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=llmgw-router", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    f = fleet_factory([sim_model(count=1)], control={"tls_cert": str(cert), "tls_key": str(key)})
    f.start_agent("a", tls=True, tls_ca=str(cert))
    plain = f.start_agent("b")  # no TLS: the handshake fails, the node never joins
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    assert f.ready("m")[0]["node"] == "a"
    wait_for(lambda: "connection" in f.log(plain) or "router" in f.log(plain), 10)
    assert "b" not in f.nodes()


@pytest.mark.skipif(not os.environ.get("LLMGW_LLAMA_SERVER"), reason="LLMGW_LLAMA_SERVER is not set")
def test_real_llama_server_replicas_end_to_end(fleet_factory: Any) -> None:
    binary = Path(os.environ["LLMGW_LLAMA_SERVER"])
    gguf = binary.parent.parent / "tiny.gguf"
    if not gguf.exists():
        pytest.skip(f"{gguf} not found")
    f = fleet_factory([{"name": "tiny", "engine": "llamacpp",
                        "deploy": {"count": 2, "binary": str(binary), "model_path": str(gguf),
                                   "args": ["-c", "512", "-np", "1", "-t", "1"], "health_timeout_s": 60.0}}])
    f.start_agent("a")
    f.start_agent("b")
    wait_for(lambda: len(f.ready("tiny")) == 2, 90)
    assert sorted(r["node"] for r in f.ready("tiny")) == ["a", "b"]
    r = f.chat("tiny")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None



def test_models_created_scaled_and_deleted_through_the_api_drain_first(fleet_factory: Any) -> None:
    f = fleet_factory([])
    f.start_agent("a")
    f.start_agent("b")
    slow = {"name": "api-model", "engine": "vllm",
            "deploy": {"count": 2, "simulate": True, "health_timeout_s": 20.0,
                       "args": ["--sim-decode-ms-per-token", "40", "--sim-prefill-ms-per-token", "0"]}}
    r = f.admin.post("/api/v1/models", json=slow)
    assert r.status_code == 201, r.text
    wait_for(lambda: len(f.ready("api-model")) == 2, 30)
    assert sorted(x["node"] for x in f.ready("api-model")) == ["a", "b"]
    bad = f.admin.post("/api/v1/models", json={"name": "x", "engine": "vllm", "deploy": {"count": -1}})
    assert bad.status_code == 400 and "deploy.count" in bad.text
    # A streamed request in flight while the model is scaled to zero: it finishes, then the engines stop.
    assert f.router is not None
    with httpx.stream("POST", f"{f.router.url}/v1/completions", timeout=20,
                      json={"model": "api-model", "prompt": "x", "max_tokens": 25, "stream": True}) as resp:
        assert resp.status_code == 200
        it = resp.iter_lines()
        next(it)
        assert f.admin.post("/api/v1/models/api-model/scale", json={"replicas": 0}).status_code == 200
        wait_for(lambda: {x["desired"] for x in f.replicas("api-model")} <= {"drain", "stop"}, 5)
        lines = [line for line in it if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 25
    wait_for(lambda: f.replicas("api-model") == [], 15)
    assert f.admin.delete("/api/v1/models/api-model").status_code == 204
    assert f.admin.get("/api/v1/models/api-model").status_code == 404


def test_an_agent_that_crashes_and_returns_readopts_its_engines(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model(count=2)], lost_after=10.0)
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    before = {r["replica"]: r["pid"] for r in f.ready("m")}
    os.killpg(f.agents["a"].proc.pid, signal.SIGKILL)  # the agent only; its engines keep serving
    f.agents["a"].proc.wait(5)
    assert f.chat("m").status_code == 200
    f.start_agent("a")
    def adopted() -> bool:
        ready = f.ready("m")
        return len(ready) == 2 and all(r["adopted"] for r in ready)

    wait_for(adopted, 20)
    assert {r["replica"]: r["pid"] for r in f.ready("m")} == before  # same engines, not restarted
    f.agents["a"].stop()  # and a stopped agent stops adopted engines too
    assert not any(group_alive(p) for p in before.values())
