"""Ready means ready: GET /ready and the daemon's "serving …" line wait until every model that
should have replicas has one that can serve (llmgw.route.readiness, llmgw.daemon.router.ready)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

from llmgw.config import DeployConfig, ModelConfig, default_config
from llmgw.config.schema import ReplicaConfig
from llmgw.daemon.router.ready import announce_when_ready
from llmgw.route.readiness import readiness
from llmgw.route.replicas import ReplicaTable

from .test_router_integration import Daemon


def _table(*models: ModelConfig) -> ReplicaTable:
    return ReplicaTable(replace(default_config(), models=models))


DEPLOYED = ModelConfig(name="m", engine="vllm", deploy=DeployConfig(count=2, simulate=True))


def test_a_model_waiting_for_its_replicas_is_not_ready() -> None:
    t = _table(DEPLOYED)
    r = readiness(t)
    assert not r.ready and r.missing == ["m"]
    assert r.to_dict() == {"status": "not_ready", "missing": ["m"],
                           "models": [{"model": "m", "ready": False, "serving": 0, "routed": 0, "wanted": 2}]}
    t.add_replica(DEPLOYED, "m-1", "http://127.0.0.1:1", "default", 1.0)
    r = readiness(t)
    assert r.ready and r.summary("http://h:8000") == "serving m at http://h:8000 (1/2 replicas)"


def test_draining_or_open_breaker_replicas_do_not_count() -> None:
    t = _table(DEPLOYED)
    a = t.add_replica(DEPLOYED, "m-1", "http://127.0.0.1:1", "default", 1.0)
    b = t.add_replica(DEPLOYED, "m-2", "http://127.0.0.1:2", "default", 1.0)
    a.draining = True
    b.breaker.trip(0.0)
    r = readiness(t)
    assert not r.ready and r.models[0].routed == 2 and r.models[0].serving == 0


def test_a_draining_router_is_not_ready_whatever_its_replicas() -> None:
    t = _table(DEPLOYED)
    t.add_replica(DEPLOYED, "m-1", "http://127.0.0.1:1", "default", 1.0)
    assert readiness(t).ready
    r = readiness(t, draining=True)
    assert not r.ready and r.to_dict()["status"] == "draining" and r.missing == []
    assert not readiness(_table(), draining=True).ready  # nothing to wait for, but stopping


def test_models_without_replicas_are_not_waited_for() -> None:
    assert readiness(_table()).ready  # nothing to wait for
    scaled_to_zero = ModelConfig(name="z", engine="vllm", deploy=DeployConfig(count=0))
    static = ModelConfig(name="s", engine="vllm", replicas=(ReplicaConfig(url="http://127.0.0.1:9"),))
    r = readiness(_table(scaled_to_zero, static))
    assert r.ready and [m.model for m in r.models] == ["s"]  # a static replica is routed from the start


def test_the_line_waits_and_warns_naming_the_missing_model(caplog: pytest.LogCaptureFixture) -> None:
    t = _table(DEPLOYED)

    async def scenario() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(announce_when_ready, lambda: readiness(t), "http://h:1")
            await trio.sleep(150)  # two warnings, still waiting
            assert not any(r.levelname == "INFO" for r in caplog.records)
            t.add_replica(DEPLOYED, "m-1", "http://127.0.0.1:1", "default", 1.0)
            t.add_replica(DEPLOYED, "m-2", "http://127.0.0.1:2", "default", 1.0)

    with caplog.at_level(logging.INFO, logger="llmgw.daemon"):
        trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and "m (0/2 replicas routed)" in warnings[0], warnings
    assert [r.getMessage() for r in caplog.records if r.levelname == "INFO"] == [
        "serving m at http://h:1 (2/2 replicas)"]


def test_ready_over_a_real_daemon(tmp_path: Path) -> None:
    cfg = tmp_path / "llmgw.toml"
    cfg.write_text(f"""
[server]
host = "127.0.0.1"
[router]
scrape_interval_s = 0.2
[admin]
socket = {json.dumps(str(tmp_path / "admin" / "admin.sock"))}
[control]
listen = "127.0.0.1:0"
store = {json.dumps(str(tmp_path / "router.db"))}
[agent]
state_dir = {json.dumps(str(tmp_path / "agent"))}
[sim]
replicas = 2
extra_args = ["--sim-load-seconds", "4"]
""")
    d = Daemon(cfg, role="router,agent", log_level="info")
    try:
        first = httpx.get(f"{d.url}/ready")  # the stdout line is printed at once: engines are loading
        assert first.status_code == 503, first.text
        assert first.json()["missing"] == ["sim-model"]
        assert not any("serving sim-model" in x for x in d.err)
        deadline = time.monotonic() + 60
        while (r := httpx.get(f"{d.url}/ready")).status_code != 200:
            assert time.monotonic() < deadline and d.proc.poll() is None, r.text
            time.sleep(0.05)
        body = r.json()
        assert body["status"] == "ready" and body["models"][0]["serving"] >= 1
        deadline = time.monotonic() + 10
        while not any("serving sim-model at " + d.url in x for x in d.err):
            assert time.monotonic() < deadline, d.err[-5:]
            time.sleep(0.01)
        line = json.loads(next(x for x in d.err if "serving sim-model" in x))
        assert line["level"] == "info" and line["msg"].endswith("replicas)")
        chat = httpx.post(f"{d.url}/v1/chat/completions", timeout=30,
                          json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 2})
        assert chat.status_code == 200, chat.text  # the README's curl after the line works
    finally:
        d.stop()

