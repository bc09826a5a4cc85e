"""Tenants end to end over a real one-process daemon (router + agent + simulated engines): a tenant
and a key made with `llmgw ctl`, the key admitted on the OpenAI port and the request's usage in
`llmgw ctl usage` once the router has flushed it; the key revoked, and refused (401) at once. And
with two routers on one store: a key revoked at the leader is refused on the follower's OpenAI port
within `[store] poll_s`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .test_router_integration import Daemon
from .test_sim_vllm import wait_for


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tenants-e2e")
    sock = tmp / "admin" / "admin.sock"
    cfg = tmp / "llmgw.toml"
    cfg.write_text(f"""
[server]
host = "127.0.0.1"
[admin]
socket = {json.dumps(str(sock))}
[control]
listen = "127.0.0.1:0"
store = {json.dumps(str(tmp / "llmgw" / "router.db"))}
[agent]
node = "box-1"
state_dir = {json.dumps(str(tmp / "agent"))}
[sim]
replicas = 1
[tenants]
usage_flush_s = 0.2
share_sync_s = 0.2
""")
    d = Daemon(cfg, role="router,agent")
    try:
        admin = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x")
        wait_for(lambda: sum(r["state"] == "ready" for r in admin.get("/api/v1/replicas").json()) == 1, 30)
        yield {"socket": str(sock), "url": d.url}
    finally:
        d.stop()


def ctl(d: dict[str, Any], *args: str) -> Any:
    r = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", d["socket"], "-o", "json", *args],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, (args, r.stderr)
    return json.loads(r.stdout)


def chat(d: dict[str, Any], key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{d['url']}/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def test_a_key_is_admitted_counted_and_refused_once_revoked(daemon: dict[str, Any]) -> None:
    assert chat(daemon, None).status_code == 200  # no key anywhere yet: open, as before tenants
    ctl(daemon, "tenants", "create", "team-a", "--rpm", "100")
    key = ctl(daemon, "keys", "create", "team-a", "--name", "ci")
    assert chat(daemon, None).status_code == 401  # a key exists: every request needs one
    r = chat(daemon, key["key"])
    assert r.status_code == 200, r.text
    assert r.headers.get("x-ratelimit-limit-requests") == "100"
    wait_for(lambda: any(g["tenant"] == "team-a" and g["requests"] == 1
                         for g in ctl(daemon, "usage", "--since", "1h")["rows"]), 10)
    by_key = ctl(daemon, "usage", "--since", "1h", "--by", "key", "--tenant", "team-a")["rows"]
    assert [(g["key"], g["requests"]) for g in by_key] == [(key["id"], 1)] and by_key[0]["completion_tokens"] > 0
    t = ctl(daemon, "tenants", "show", "team-a")
    assert t["usage_today"]["requests"] == 1 and t["quota_use"]["rpm"]["limit"] == 100
    ctl(daemon, "keys", "revoke", key["id"])
    r = chat(daemon, key["key"])
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]


def test_a_followers_openai_port_refuses_a_key_revoked_at_the_leader(tmp_path: Any) -> None:
    from .ha_cluster import Cluster

    c = Cluster(tmp_path, [], routers=2)
    try:
        lead = c.wait_leader()
        follower = 1 - lead
        wait_for(lambda: c.status(follower).get("role") == "follower")
        assert c.clients[lead].post("/api/v1/tenants", json={"name": "team-a"}).status_code == 201
        made = c.clients[lead].post("/api/v1/tenants/team-a/keys", json={}).json()

        def status_at(i: int) -> int:
            return httpx.post(f"{c.router(i).url}/v1/chat/completions", timeout=10,
                              headers={"authorization": f"Bearer {made['key']}"},
                              json={"model": "nothing-here", "messages": [{"role": "user", "content": "hi"}]}).status_code

        wait_for(lambda: status_at(follower) != 401, timeout=10)  # known there (no such model: 404, not 401)
        assert c.clients[lead].post(f"/api/v1/keys/{made['id']}/revoke").status_code == 200
        wait_for(lambda: status_at(follower) == 401, timeout=5)  # poll_s is 0.1 here
    finally:
        c.close()
