"""The admin API's tenants, API keys and usage, served in-process over its listeners (admin_support:
every JSON answer is checked against the generated OpenAPI document): 201/400 naming the field/
404/409 answers, a key's secret answered once and never again, never its hash, the book pushed to
the router on each change, and the usage report from the store plus this router's unflushed use."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmgw.tenants.book import AuthRefused
from llmgw.tenants.usage import UsageRecord

from .admin_support import admin_stack

pytestmark = pytest.mark.anyio

T = "/api/v1/tenants"


async def test_tenants_create_show_update_delete(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        r = await c.post(T, json={"name": "team-a", "band": "high", "quota": {"rpm": 60, "tokens_per_day": 1000}})
        assert r.status_code == 201, r.text
        assert r.headers["location"] == f"{T}/team-a"
        t = r.json()
        assert (t["name"], t["band"], t["weight"], t["quota"], t["models"], t["static"], t["keys"]) == (
            "team-a", "high", 1.0, {"rpm": 60, "tokens_per_day": 1000}, None, False, 0)
        assert t["usage_today"]["requests"] == 0 and t["queue"] == {"waiting": 0, "share": 1.0}
        assert (await c.post(T, json={"name": "team-a"})).status_code == 409
        r = await c.patch(f"{T}/team-a", json={"weight": 3, "quota": {"rpm": None, "tpm": 5000}, "models": ["m"]})
        assert r.status_code == 200, r.text
        assert (r.json()["weight"], r.json()["quota"], r.json()["models"]) == (3.0, {"tpm": 5000,
                                                                                    "tokens_per_day": 1000}, ["m"])
        assert (await c.get(f"{T}/team-a")).json()["weight"] == 3.0
        assert [x["name"] for x in (await c.get(T)).json()] == ["team-a"]
        assert s.control.store.docs("tenant")["team-a"]["weight"] == 3.0  # written before it is answered
        assert (await c.delete(f"{T}/team-a")).status_code == 204
        assert (await c.get(f"{T}/team-a")).status_code == 404
        assert (await c.delete(f"{T}/team-a")).status_code == 404
        assert (await c.patch(f"{T}/nope", json={"weight": 2})).status_code == 404


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "Bad Name"}, "name"), ({}, "name"), ({"name": "a", "band": "urgent"}, "band"),
    ({"name": "a", "weight": 0}, "weight"), ({"name": "a", "quota": {"tpm": -1}}, "quota.tpm"),
    ({"name": "a", "quota": {"rpn": 1}}, "quota.rpn"), ({"name": "a", "models": "m"}, "models"),
    ({"name": "a", "created_at": 5}, "created_at"), ({"name": "a", "colour": "red"}, "colour"),
])
async def test_a_bad_tenant_is_a_400_naming_the_field(tmp_path: Path, body: dict, field: str) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        r = await c.post(T, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.json()
        assert (await c.get(T)).json() == []


async def test_the_static_tenant_cannot_be_made_or_changed(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        for r in (await c.post(T, json={"name": "static"}), await c.patch(f"{T}/static", json={"weight": 2}),
                  await c.delete(f"{T}/static")):
            assert r.status_code == 409 and "static" in r.json()["error"]["message"], r.text


async def test_a_keys_secret_is_answered_once_and_its_hash_never(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        assert (await c.post(f"{T}/team-a/keys", json={})).status_code == 404  # no such tenant yet
        await c.post(T, json={"name": "team-a"})
        r = await c.post(f"{T}/team-a/keys", json={"name": "ci", "models": ["m"], "quota": {"rpm": 5}})
        assert r.status_code == 201, r.text
        created = r.json()
        secret, kid = created["key"], created["id"]
        assert secret.startswith(f"sk-llmgw-{kid}-") and r.headers["cache-control"] == "no-store"
        assert (created["tenant"], created["name"], created["state"], created["models"], created["quota"]) == (
            "team-a", "ci", "active", ["m"], {"rpm": 5})
        stored = s.control.store.docs("api_key")[kid]
        assert secret not in str(stored) and stored["hash"] not in r.text  # only the hash is kept; never shown
        seen = [await c.get(f"/api/v1/keys/{kid}"), await c.get("/api/v1/keys"), await c.get(T),
                await c.get("/api/v1/keys", params={"tenant": "team-a"}), await c.get(f"{T}/team-a")]
        for answer in seen:
            assert answer.status_code == 200
            assert secret not in answer.text and stored["hash"] not in answer.text and '"hash"' not in answer.text
        assert seen[1].json()[0]["prefix"] == f"sk-llmgw-{kid}-…" and "key" not in seen[1].json()[0]
        assert seen[4].json()["keys"] == 1
        assert (await c.get("/api/v1/keys", params={"tenant": "other"})).json() == []
        # the router's book has it: the secret authenticates as the tenant's
        book = s.control.tenants.book
        assert book is not None and book.authenticate(f"Bearer {secret}", time.time()).tenant.name == "team-a"
        assert (await c.post(f"{T}/team-a/keys")).status_code == 201  # no body: every default


async def test_keys_change_revoke_and_rotate(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        await c.post(T, json={"name": "team-a"})
        first = (await c.post(f"{T}/team-a/keys", json={"quota": {"tpm": 100}})).json()
        r = await c.patch(f"/api/v1/keys/{first['id']}", json={"name": "renamed", "band": "low"})
        assert (r.status_code, r.json()["name"], r.json()["band"]) == (200, "renamed", "low")
        bad = await c.patch(f"/api/v1/keys/{first['id']}", json={"expires_at": "tomorrow"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "expires_at"
        assert (await c.get("/api/v1/keys/nokey00000")).status_code == 404

        r = await c.post(f"/api/v1/keys/{first['id']}/rotate", params={"grace_s": 3600})
        assert r.status_code == 201, r.text
        second = r.json()
        assert second["key"] != first["key"] and second["rotated_from"] == first["id"]
        assert (second["name"], second["band"], second["quota"]) == ("renamed", "low", {"tpm": 100})
        old = (await c.get(f"/api/v1/keys/{first['id']}")).json()
        assert old["state"] == "active" and old["expires_at"] == pytest.approx(time.time() + 3600, abs=60)
        book = s.control.tenants.book
        assert book is not None
        for secret in (first["key"], second["key"]):  # both work during the grace
            book.authenticate(f"Bearer {secret}", time.time())

        r = await c.post(f"/api/v1/keys/{second['id']}/rotate")  # no grace: the old one is revoked at once
        third = r.json()
        assert (await c.get(f"/api/v1/keys/{second['id']}")).json()["state"] == "revoked"
        with pytest.raises(AuthRefused) as e:
            s.control.tenants.book.authenticate(f"Bearer {second['key']}", time.time())
        assert e.value.status == 401 and "revoked" in e.value.message
        assert (await c.post(f"/api/v1/keys/{second['id']}/rotate")).status_code == 409

        r = await c.post(f"/api/v1/keys/{third['id']}/revoke")
        assert (r.status_code, r.json()["state"]) == (200, "revoked")
        revoked_at = r.json()["revoked_at"]
        assert (await c.post(f"/api/v1/keys/{third['id']}/revoke")).json()["revoked_at"] == revoked_at
        assert (await c.post("/api/v1/keys/nokey00000/revoke")).status_code == 404
        assert (await c.post(f"/api/v1/keys/{first['id']}/rotate", params={"grace_s": -1})).status_code == 400

        assert (await c.delete(f"{T}/team-a")).status_code == 204  # its keys go with it
        assert (await c.get("/api/v1/keys")).json() == []
        assert s.control.store.docs("api_key") == {}


async def test_usage_report_from_the_store_and_this_routers_unflushed_use(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        now = int(time.time()) // 60 * 60
        s.control.store.add_usage("r1", [UsageRecord(now - 60, "a", "k1", "m", 2, 100, 10, 50, 1),
                                         UsageRecord(now - 120, "b", "k2", "n", 1, 10, 0, 5, 0)])
        s.control.store.add_usage("r2", [UsageRecord(now - 3 * 86400, "a", "k1", "m", 1, 1, 0, 1, 0)])
        s.app.router.usage_peek = lambda: [UsageRecord(now, "a", "k3", "m", 1, 7, 0, 3, 0)]
        r = await c.get("/api/v1/usage", params={"since": "1d"})
        assert r.status_code == 200, r.text
        rep = r.json()
        assert rep["by"] == "tenant" and [g["tenant"] for g in rep["rows"]] == ["a", "b"]
        a = rep["rows"][0]
        assert (a["requests"], a["prompt_tokens"], a["cached_tokens"], a["completion_tokens"], a["errors"],
                a["total_tokens"]) == (3, 107, 10, 53, 1, 160)
        assert rep["total"]["requests"] == 4 and rep["total"]["total_tokens"] == 175
        by_key = (await c.get("/api/v1/usage", params={"since": "7d", "by": "key", "tenant": "a"})).json()
        assert [(g["key"], g["requests"]) for g in by_key["rows"]] == [("k1", 3), ("k3", 1)]
        assert by_key["filters"] == {"tenant": "a"}
        by_model = (await c.get("/api/v1/usage", params={"since": str(now - 600), "by": "model",
                                                         "model": "n"})).json()
        assert [(g["model"], g["requests"]) for g in by_model["rows"]] == [("n", 1)]
        by_day = (await c.get("/api/v1/usage", params={"by": "day"})).json()  # default: the last 7 days
        assert sum(g["requests"] for g in by_day["rows"]) == 5 and len(by_day["rows"]) == 2
        tenants = {t["name"]: t for t in (await c.get(T)).json()}
        assert tenants == {}  # usage of tenants no longer (or never) made is reported, they are not listed
        for params, field in (({"since": "yesterday"}, "since"), ({"until": "-5"}, "until"), ({"by": "week"}, "by"),
                              ({"since": "1h", "until": "2h"}, "until"), ({"tenants": "a"}, "tenants")):
            r = await c.get("/api/v1/usage", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (params, r.text)


async def test_a_tenants_view_counts_its_use_today(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        await c.post(T, json={"name": "a"})
        now = int(time.time()) // 60 * 60
        s.control.store.add_usage("r1", [UsageRecord(now, "a", "k1", "m", 2, 100, 10, 50, 0)])
        s.app.router.quota_use = lambda: {("tenant", "a"): {"rpm": {"limit": 60, "remaining": 58}}}
        s.app.router.queue_by_tenant = lambda: {"a": {"waiting": 3, "cost": 10, "share": 0.5}}
        t = (await c.get(f"{T}/a")).json()
        assert t["usage_today"] == {"requests": 2, "prompt_tokens": 100, "cached_tokens": 10,
                                    "completion_tokens": 50, "errors": 0}
        assert t["quota_use"] == {"rpm": {"limit": 60, "remaining": 58}}
        assert t["queue"] == {"waiting": 3, "share": 0.5}


async def test_tenant_routes_need_the_token_on_tcp(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        async with s.tcp_client(token=None) as c:
            for method, path in (("GET", T), ("POST", T), ("GET", "/api/v1/keys"), ("GET", "/api/v1/usage")):
                assert (await c.request(method, path)).status_code == 401
        async with s.tcp_client() as c:
            assert (await c.post(T, json={"name": "x"})).status_code == 201
