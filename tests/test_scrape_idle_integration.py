"""Issue 25, over real processes: an idle replica is read less often (scrape_idle_factor), its
reading never goes stale meanwhile, and after the idle period a burst that ends between two
scrapes still lets a waiting request through at the next reading — scrape_soon brings every
replica back to the normal cadence at once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from .test_router_integration import Daemon, procs, sim, write_config  # noqa: F401 — procs is a fixture
from .test_sim_vllm import metric, wait_for

# An idle replica is read every 4 intervals (stale_after_s 12 leaves room for it). The interval is
# the default's: a burst's end must fall between two readings (the next request then waits).
INTERVAL, STALE = 1.0, 12.0


def _endpoint(d: Daemon) -> dict[str, Any]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=d.info["admin_socket"]), base_url="http://admin") as c:
        eps = c.get("/api/v1/endpoints").json()
    return next(e for e in eps if e["id"] == "m/0")


def test_an_idle_replica_is_read_less_often_and_waiters_still_pass_promptly(procs: list[Any],  # noqa: F811
                                                                            tmp_path: Path) -> None:
    s = sim(procs, "--sim-decode-ms-per-token", "20", "--sim-prefill-ms-per-token", "0")
    cfg = write_config(tmp_path, [{"name": "m", "replicas": [{"url": s.url}]}],
                       router=f"stale_after_s = {STALE}\nscrape_idle_factor = 4.0\nqueue_timeout_s = 30.0")
    cfg.write_text(cfg.read_text().replace("scrape_interval_s = 0.2", f"scrape_interval_s = {INTERVAL}"))
    d = Daemon(cfg)
    procs.append(d)

    # 1. idle: the reading gets older than a few intervals (it is read less often), never stale
    ages: list[float] = []

    def slowed() -> bool:
        e = _endpoint(d)  # (its "stale" is the flag the last decision set: the age tells now)
        assert e["scrape_error"] is None, e
        if e["scrape_age_s"] is not None:
            assert e["scrape_age_s"] < STALE, e
            ages.append(e["scrape_age_s"])
        return max(ages, default=0.0) > 2.5 * INTERVAL

    wait_for(slowed, timeout=30)

    # 2. a burst after the idle period, ending between two scrapes: the router's last reading says
    # saturated while the engine is idle; the next request waits and is let through by the next
    # reading (scrape_soon), not by the queue's 30 s deadline
    burst = {"model": "m", "prompt": "x", "max_tokens": 150, "ignore_eos": True, "stream": True, "n": 128}
    with httpx.Client(timeout=60) as c:
        for _ in range(5):
            with c.stream("POST", f"{d.url}/v1/completions", json=burst) as r:
                assert r.status_code == 200
                wait_for(lambda: metric(d.url, "llmgw_endpoint_running", endpoint="m/0") >= 64)
                r.read()
            if metric(d.url, "llmgw_endpoint_running", endpoint="m/0") >= 64 and \
                    metric(s.url, "vllm:num_requests_running") == 0:
                break
        else:
            raise AssertionError("every burst's end was scraped before the next request could be sent")
        t0 = time.monotonic()
        r = c.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        waited = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert waited < 20  # let through by a reading (a quarter interval on), not by the queue's 30 s deadline

    # 3. idle again: slows down again, still never stale
    ages.clear()
    wait_for(slowed, timeout=30)
