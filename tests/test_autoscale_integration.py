"""Autoscaling over real processes (docs/autoscaling.md): a router daemon, agents, simulated vLLM
engines. A ramp scales a model up and its end scales it down; a model idle past idle_to_zero_s
keeps no replica and its next request waits for a cold start and is served; a hold or a power
budget blocks a scale-up and the decision says so; `ctl scale` pins a count until released; a
cold start that takes longer than cold_start_wait_s answers 503 with Retry-After and the reason."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx
import pytest

from .test_facility_integration import H100, ctl, make_fleet  # noqa: F401 — make_fleet is a fixture
from .test_fleet_integration import Fleet, sim_model
from .test_sim_vllm import wait_for

SLOW = ["--sim-decode-ms-per-token", "100", "--max-num-seqs", "2"]  # a request holds its replica ~0.3 s


def scaled_model(count: int = 1, args: list[str] | None = None, **autoscale: Any) -> dict[str, Any]:
    m = sim_model(count=count, args=args or SLOW)
    m["autoscale"] = {"min": 1, "max": 3, "metric": "concurrency", "target": 1.0, "window_s": 4.0,
                      "panic_window_s": 2.0, "down_delay_s": 3.0, "cold_start_s": 2.0, **autoscale}
    return m


def view(f: Fleet, model: str = "m") -> dict[str, Any]:
    return f.get(f"/api/v1/models/{model}/autoscale")


def counter(f: Fleet, name: str, model: str = "m") -> float:
    assert f.router is not None
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    m = re.search(rf'^{re.escape(name)}{{model="{re.escape(model)}"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else -1.0


class Clients:
    """`n` clients sending chat requests back to back in threads, bounded in count and time."""

    def __init__(self, f: Fleet, n: int, model: str = "m", most: int = 2000, limit_s: float = 60.0) -> None:
        self.f, self.model, self.most, self.limit_s = f, model, most, limit_s
        self.ok = 0
        self.failed: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def run(self) -> None:
        end = time.monotonic() + self.limit_s
        while not self.stop.is_set() and self.ok + len(self.failed) < self.most and time.monotonic() < end:
            try:
                r = self.f.chat(self.model)
                with self.lock:
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failed.append(f"{r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as e:
                with self.lock:
                    self.failed.append(repr(e))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def test_a_ramp_scales_up_and_its_end_scales_down_with_no_failed_request(make_fleet: Any) -> None:  # noqa: F811
    f = make_fleet([scaled_model()])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    load = Clients(f, 4)
    try:
        wait_for(lambda: len(f.ready("m")) == 3, 40)  # C ≈ 4 at target 1 → max 3
        v = view(f)
        assert v["count"] == 3 and v["decision"]["desired"] == 3 and v["history"][0]["reason"]
        seen = load.ok
        wait_for(lambda: load.ok >= seen + 10, 30)
    finally:
        load.finish()
    assert not load.failed, load.failed[:5]
    light = Clients(f, 1)  # the ramp ends: one client goes on while replicas drain away under it
    try:
        wait_for(lambda: view(f)["count"] == 1 and len(f.replicas("m")) == 1, 40)  # down after down_delay_s
        seen = light.ok
        wait_for(lambda: light.ok >= seen + 3, 30)
    finally:
        light.finish()
    assert not light.failed, light.failed[:5]
    v = view(f)
    assert [h["desired"] for h in v["history"]][:1] == [1] and v["history"][0]["current"] > 1
    assert counter(f, "llmgw_autoscale_desired_replicas") == 1.0
    assert f.router is not None
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    assert 'llmgw_autoscale_decisions_total{direction="down",model="m"}' in text
    jobs = f.get("/api/v1/jobs")
    assert any(j["kind"] == "scale" and j["model"] == "m" for j in jobs), jobs


def test_to_zero_when_idle_and_back_with_the_first_request_served(make_fleet: Any) -> None:  # noqa: F811
    f = make_fleet([scaled_model(min=0, idle_to_zero_s=2.0, cold_start_wait_s=60.0,
                                 args=["--sim-load-seconds", "1"])])
    f.start_agent("a")
    wait_for(lambda: view(f)["count"] == 0 and not f.replicas("m"), 40)  # nobody calls it: zero replicas
    assert f.get("/api/v1/autoscale")[0]["decision"]["mode"] == "idle"
    assert f.router is not None
    listed = httpx.get(f"{f.router.url}/v1/models", timeout=5).json()
    assert "m" in [m["id"] for m in listed["data"]]  # still listed at zero
    assert httpx.get(f"{f.router.url}/ready", timeout=5).status_code == 200  # nothing to wait for
    r = f.chat("m")  # waits while a replica is placed and starts
    assert r.status_code == 200, r.text
    assert counter(f, "llmgw_cold_starts_total") == 1.0
    assert counter(f, "llmgw_cold_start_waits_total") == 1.0
    rid = r.headers.get("x-request-id")
    trace = f.get(f"/api/v1/traces/{rid}")
    queued = [p for p in trace["phases"] if p["name"] == "queued"]
    assert queued and "cold start" in queued[0].get("note", ""), trace["phases"]
    assert view(f)["cold_start_s"] > 0.5  # measured: the engine's load time and more


def test_a_cold_start_past_the_bound_answers_503_with_retry_after(make_fleet: Any) -> None:  # noqa: F811
    f = make_fleet([scaled_model(count=0, min=0, idle_to_zero_s=60.0, cold_start_wait_s=1.0,
                                 args=["--sim-load-seconds", "30"])])
    f.start_agent("a")
    wait_for(lambda: f.nodes().get("a", {}).get("state") == "ready", 30)
    r = f.chat("m")
    assert r.status_code == 503, r.text
    body = r.json()["error"]
    assert body["code"] == "cold_start" and "is starting (a cold start)" in body["message"]
    assert int(r.headers["retry-after"]) >= 1
    wait_for(lambda: view(f)["count"] == 1, 10)  # the wait woke the model all the same


def test_a_hold_blocks_the_scale_up_and_the_decision_says_so(make_fleet: Any) -> None:  # noqa: F811
    f = make_fleet([scaled_model()])
    f.start_agent("a", labels={"llmgw.io/rack": "r1"})
    f.start_agent("b", labels={"llmgw.io/rack": "r2"})
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    for rack in ("r1", "r2"):  # without drain: the running replica stays, nothing new is placed
        out = ctl(f, "facility", "hold", f"rack={rack}", "--reason", "maintenance")
        assert out.returncode == 0, out.stderr
    load = Clients(f, 4)
    try:
        wait_for(lambda: any("placement" in x for x in (view(f)["decision"] or {}).get("limited_by", [])), 40)
    finally:
        load.finish()
    d = view(f)["decision"]
    assert any("held" in x or "hold" in x for x in d["limited_by"]), d
    out = ctl(f, "explain-scale", "m")
    assert out.returncode == 0 and "placement" in out.stdout, out.stdout + out.stderr


def test_a_power_budget_blocks_the_scale_up_and_the_decision_says_so(make_fleet: Any) -> None:  # noqa: F811
    # two nodes of two H100s on one PDU: 4 × 70 W idle; a 1-GPU replica adds 630 W: room for one
    m = scaled_model()
    m["deploy"]["gpus"] = 1
    f = make_fleet([m], facility={"budgets": {"pdu=p1": 1000}})
    for node in ("a", "b"):
        f.start_agent(node, labels={"llmgw.io/rack": f"r-{node}", "llmgw.io/pdu": "p1"}, gpus=[H100, H100])
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    load = Clients(f, 4)
    try:
        wait_for(lambda: any("power budget" in x for x in (view(f)["decision"] or {}).get("limited_by", [])), 40)
    finally:
        load.finish()
    v = view(f)
    assert v["count"] == 2 and v["ready"] == 1, v  # asked one more, and stopped there: nothing can be placed
    assert len(f.replicas("m")) == 1


def test_ctl_scale_pins_the_count_until_released(make_fleet: Any) -> None:  # noqa: F811
    f = make_fleet([scaled_model()])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    out = ctl(f, "scale", "m", "2")
    assert out.returncode == 0, out.stderr
    assert "pinned" in out.stdout
    wait_for(lambda: len(f.ready("m")) == 2, 30)  # idle, yet 2: the pin wins
    wait_for(lambda: view(f)["decision"]["mode"] == "pinned", 10)  # the next round decides with the pin
    assert view(f)["pinned"] == 2
    out = ctl(f, "scale", "m", "--release")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: view(f)["pinned"] is None and len(f.replicas("m")) == 1, 40)  # idle: back to min


def test_the_count_and_a_pin_outlive_a_router_restart(make_fleet: Any) -> None:  # noqa: F811
    f = make_fleet([scaled_model()])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    assert ctl(f, "scale", "m", "2").returncode == 0
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    before = {r["replica"] for r in f.replicas("m")}
    f.stop_router()
    f.start_router()
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    v = view(f)
    assert v["pinned"] == 2 and v["count"] == 2
    assert {r["replica"] for r in f.replicas("m")} == before  # nothing restarted, nothing placed anew


def test_a_candidate_of_an_autoscaled_model_gets_the_live_count_and_promotes(make_fleet: Any) -> None:  # noqa: F811
    f = make_fleet([])
    f.start_agent("a")
    r = f.admin.put("/api/v1/models/m", json=scaled_model())  # made through the API: updates are the API's
    assert r.status_code in (200, 201), r.text
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    assert ctl(f, "scale", "m", "2").returncode == 0  # the live model at 2 (pinned)
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    r = f.admin.post("/api/v1/models/m/update", json={"deploy": {"args": [*SLOW, "--sim-seed", "7"]}})
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    wait_for(lambda: f.get(f"/api/v1/jobs/{job}")["state"] == "succeeded", 40)
    cand = [x for x in f.replicas() if x["model"] != "m" and x["model"].startswith("m")]
    assert len(cand) == 2, cand  # as many as the live model has in force
    r = f.admin.post("/api/v1/models/m/promote")
    assert r.status_code in (200, 202), r.text
    wait_for(lambda: len(f.ready("m")) == 2 and all(x["model"] == "m" for x in f.replicas()), 40)
    assert view(f)["count"] == 2


@pytest.mark.parametrize("metric", ["queue", "ttft_p90"])
def test_slo_metrics_scale_up_under_load(make_fleet: Any, metric: str) -> None:  # noqa: F811
    target = {"queue": 0.5, "ttft_p90": 0.2}[metric]
    f = make_fleet([scaled_model(metric=metric, target=target)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    load = Clients(f, 6)
    try:
        wait_for(lambda: view(f)["count"] >= 2, 40)
    finally:
        load.finish()
    assert not load.failed, load.failed[:5]


def test_an_adapters_request_wakes_its_model_from_zero_and_is_served(make_fleet: Any) -> None:  # noqa: F811
    m = scaled_model(count=0, min=0, idle_to_zero_s=60.0, cold_start_wait_s=60.0,
                     args=["--sim-zero-cost", "--sim-load-seconds", "0.5"])
    m["max_loaded_adapters"] = 2
    m["adapters"] = [{"name": "m-sql", "source": "/l/sql"}]  # loaded on demand
    f = make_fleet([m])
    f.start_agent("a")
    wait_for(lambda: f.nodes().get("a", {}).get("state") == "ready", 30)
    assert not f.replicas("m")
    assert f.router is not None
    r = httpx.post(f"{f.router.url}/v1/completions", timeout=60,
                   json={"model": "m-sql", "prompt": "hi", "max_tokens": 2})  # waits, then loads there
    assert r.status_code == 200, r.text
    assert counter(f, "llmgw_cold_starts_total") == 1.0 and counter(f, "llmgw_cold_start_waits_total") == 1.0
    listed = [{x["id"] for x in httpx.get(f"{r['url']}/v1/models", timeout=5).json()["data"]} for r in f.ready("m")]
    assert any("m-sql" in names for names in listed), listed  # loaded on the replica that came (another may follow)
