"""Issue 21 item 4, over real processes: a burst that ends between two scrapes leaves the router's
last reading of the replica saturated; a request that then waits must be let through by the next
scrape that shows the room (it used to wait out queue_timeout_s and get 429 from an idle replica)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from .test_router_integration import Daemon, procs, sim  # noqa: F401 — procs is a fixture
from .test_sim_vllm import metric, wait_for


def _default_config(tmp: Path, url: str) -> Path:
    """One replica and the default [router] section (scrape every 1 s, saturation_load 64,
    queue_timeout_s 10)."""
    path = tmp / "llmgw.toml"
    path.write_text("\n".join([
        "[server]", 'host = "127.0.0.1"',
        "[control]", f"store = {json.dumps(str(tmp / 'router.db'))}",
        "[admin]", f"socket = {json.dumps(str(tmp / 'admin' / 'admin.sock'))}",
        "[[models]]", 'name = "m"', 'engine = "vllm"',
        "[[models.replicas]]", f"url = {json.dumps(url)}"]) + "\n")
    return path


def _running_seen(d: Daemon) -> float:
    return metric(d.url, "llmgw_endpoint_running", endpoint="m/0")


def test_an_idle_replica_serves_the_request_after_a_burst(procs: list[Any], tmp_path: Path) -> None:  # noqa: F811
    s = sim(procs, "--sim-decode-ms-per-token", "20", "--sim-prefill-ms-per-token", "0")
    d = Daemon(_default_config(tmp_path, s.url))
    procs.append(d)
    # 128 sequences for 3 s (150 tokens at 20 ms): scrapes every 1 s see it whole
    burst = {"model": "m", "prompt": "x", "max_tokens": 150, "ignore_eos": True, "stream": True, "n": 128}
    with httpx.Client(timeout=30) as c:
        for _ in range(5):  # until the burst ends between two scrapes (the router's reading still 128)
            with c.stream("POST", f"{d.url}/v1/completions", json=burst) as r:
                assert r.status_code == 200
                wait_for(lambda: _running_seen(d) >= 64)  # a scrape saw the burst: saturated
                r.read()
            if _running_seen(d) >= 64 and metric(s.url, "vllm:num_requests_running") == 0:
                break
        else:
            raise AssertionError("every burst's end was scraped before the next request could be sent")
        t0 = time.monotonic()
        r = c.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        waited = time.monotonic() - t0
    assert r.status_code == 200, r.text  # was: 429 "All replicas stayed saturated" after 10 s
    assert waited < 10  # let through by the next scrape (1 s), not by the queue's deadline
