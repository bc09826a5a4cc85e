"""Tenants end to end over real processes: a router daemon in front of a simulated vLLM engine,
tenants and keys made through its admin API (the Unix socket, as `llmgw ctl` does), requests on
its OpenAI port: no key once keys exist (401), a key's tenant's quota (429 rpm with its headers),
a model the tenant may not use (403), revocation and expiry (401), the usage the admin API
reports (this router's unflushed use included), and the tenant metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import SimProc, start_sim
from .test_router_integration import Daemon, write_config
from .test_tenants_router import metric


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in reversed(started):
        p.stop()


def admin(tmp: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp / "admin" / "admin.sock")),
                        base_url="http://admin/api/v1")


def test_keys_quotas_models_and_revocation_through_the_admin_api(procs: list[Any], tmp_path: Path) -> None:
    sim = start_sim(["--engine", "vllm", "m", "--served-model-name", "m", "other", "--host", "127.0.0.1",
                     "--port", "0", "--sim-zero-cost"])
    procs.append(sim)
    d = Daemon(write_config(tmp_path, [{"name": n, "replicas": [{"url": sim.url}]} for n in ("m", "other")],
                            server='api_keys = ["ops-secret"]'))  # the operator's key (the static tenant)
    procs.append(d)
    ops = {"authorization": "Bearer ops-secret"}
    body = {"model": "m", "prompt": "hello there", "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(d.url + "/v1/completions", json=body, headers=ops).status_code == 200

    with admin(tmp_path) as a:
        r = a.post("/tenants", json={"name": "team-a", "band": "high", "models": ["m"], "quota": {"rpm": 3}})
        assert r.status_code == 201, r.text
        r = a.post("/tenants/team-a/keys", json={"name": "ci"})
        assert r.status_code == 201, r.text
        secret, kid = r.json()["key"], r.json()["id"]
        auth = {"authorization": f"Bearer {secret}"}

        r = httpx.post(d.url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

        r = httpx.post(d.url + "/v1/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "3" and r.headers["x-ratelimit-remaining-requests"] == "2"
        r = httpx.post(d.url + "/v1/completions", json={**body, "model": "other"}, headers=auth)
        assert r.status_code == 403 and r.json()["error"] == {
            "message": "Tenant `team-a` may not use the model `other`.", "type": "invalid_request_error",
            "param": "model", "code": "model_not_allowed"}
        assert httpx.post(d.url + "/v1/completions", json=body, headers=auth).status_code == 200
        assert httpx.post(d.url + "/v1/completions", json=body, headers=auth).status_code == 200
        r = httpx.post(d.url + "/v1/completions", json=body, headers=auth)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["type"] == "requests"
        assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-remaining-requests"] == "0"

        usage = a.get("/usage", params={"tenant": "team-a", "by": "key"}).json()
        (row,) = usage["rows"]
        assert row["requests"] == 3 and row["completion_tokens"] == 9 and row["errors"] == 0
        r = httpx.get(d.url + "/metrics", headers=auth)  # a tenant's key does not see every tenant's figures
        assert r.status_code == 403 and "api_keys" in r.json()["error"]["message"]
        assert httpx.get(d.url + "/ready", headers=auth).json() == {"status": "ready"}
        assert "models" in httpx.get(d.url + "/ready", headers=ops).json()
        m = httpx.get(d.url + "/metrics", headers=ops).text
        assert metric(m, "llmgw_tokens_total", {"tenant": "team-a", "model": "m", "kind": "completion"}) == 9.0
        assert metric(m, "llmgw_tenant_requests_total", {"tenant": "team-a", "model": "m", "outcome": "refused"}) == 1.0
        assert metric(m, "llmgw_tenant_requests_total",
                      {"tenant": "team-a", "model": "other", "outcome": "refused"}) == 1.0
        assert metric(m, "llmgw_ratelimited_total", {"tenant": "team-a", "reason": "rpm"}) == 1.0

        assert a.post(f"/keys/{kid}/revoke").status_code == 200
        r = httpx.post(d.url + "/v1/completions", json=body, headers=auth)
        assert r.status_code == 401 and r.json()["error"]["message"] == "This API key has been revoked."

        r = a.post("/tenants/team-a/keys", json={"expires_at": time.time() + 600})
        assert r.status_code == 201, r.text
        soon, kid2 = r.json()["key"], r.json()["id"]
        assert a.patch(f"/keys/{kid2}", json={"expires_at": 1_000_000_000}).status_code == 200
        r = httpx.post(d.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {soon}"})
        assert r.status_code == 401 and r.json()["error"]["message"].startswith("This API key expired at 2001-")
