"""The admin API served in-process over its two listeners: every route, auth, and the bad-input
answers. Every JSON answer is checked against the generated OpenAPI document (admin_support)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs  # schemathesis brings it
import pytest
import trio

from llmgw import __version__
from llmgw.admin.openapi import document
from llmgw.daemon.control.admin.server import AdminSetupError, _private_dir
from llmgw.daemon.net.httpserver import json_response, serve_unix
from llmgw.fleet.types import NodeFacts

from .admin_support import TOKEN, admin_stack, assert_conforms, ndjson

pytestmark = pytest.mark.anyio

SHARED = "You are a careful assistant. " * 12  # a head longer than the prefix index's 64-byte minimum


async def test_unix_socket_is_private_and_needs_no_token(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        assert stat.S_IMODE(os.stat(os.path.dirname(s.socket)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(s.socket).st_mode) == 0o600
        async with s.unix_client() as c:
            r = await c.get("/api/v1/status")
        assert r.status_code == 200
        body = r.json()
        assert body["version"] == __version__ and body["router_id"] == s.control.router_id


async def test_tcp_needs_the_token_and_gives_no_hint(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        answers = []
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {TOKEN}"},
                        {"authorization": f"Bearer {TOKEN}x"}):
            async with s.tcp_client(token=None) as c:
                for path in ("/api/v1/status", "/api/v1/no-such-route"):  # 401 before routing: no 404
                    r = await c.get(path, headers=headers)
                    assert r.status_code == 401, (headers, path)
                    assert r.headers["www-authenticate"] == "Bearer"
                    assert TOKEN not in r.text
                    answers.append(r.json())
        assert all(a == answers[0] for a in answers)  # missing and wrong look the same
        async with s.tcp_client() as c:
            assert (await c.get("/api/v1/status")).status_code == 200
            assert (await c.get("/api/v1/nodes", headers={"authorization": f"bearer {TOKEN}"})).status_code == 200


async def test_unknown_routes_wrong_methods_and_bad_input(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        r = await c.get("/api/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert (await c.get("/api/v2/nodes")).status_code == 404
        r = await c.patch("/api/v1/nodes")
        assert r.status_code == 405 and r.headers["allow"] == "GET"
        r = await c.request("HEAD", "/api/v1/status")
        assert r.status_code == 405
        r = await c.get("/api/v1/models/m/scale")  # the scale route's path, not a model named "m/scale"
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        r = await c.post("/api/v1/models")
        assert r.status_code == 405 or r.status_code == 400
        r = await c.put("/api/v1/models/m", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await c.put("/api/v1/nodes/n1/labels", json={"labels": {"rack": 12, "ok": "x"}, "extra": 1})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "extra"  # fields in the body's order
        assert {p["field"]: p["message"] for p in err["problems"]} == {
            "extra": "unknown field", "labels.rack": "expected a string, got an integer"}
        assert "labels.rack: expected a string" in err["message"]
        r = await c.put("/api/v1/nodes/n1/labels", json=["rack"])
        assert r.status_code == 400 and r.json()["error"]["message"] == "expected an object, got an array"
        r = await c.put("/api/v1/nodes/n1/labels", json={"labels": {"-bad-": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "labels.-bad-"
        r = await c.put("/api/v1/nodes/bad%20name/labels", json={"labels": {}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name"
        r = await c.post("/api/v1/models/m/scale", json={"replicas": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "replicas"
        r = await c.post("/api/v1/models/m/scale", json={"replicas": True})
        assert r.status_code == 400 and "expected an integer" in r.json()["error"]["message"]
        r = await c.post("/api/v1/models/m/scale", json={})
        assert r.status_code == 400 and [p["field"] for p in r.json()["error"]["problems"]] == ["replicas"]
        assert r.json()["error"]["problems"][0]["message"].startswith("required (or `release: true`")
        r = await c.get("/api/v1/decisions", params={"limit": "many"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
        r = await c.get("/api/v1/decisions", params={"limit": "0"})
        assert r.status_code == 400 and "must be >= 1" in r.json()["error"]["message"]
        r = await c.get("/api/v1/cache", params={"window_s": "nan"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "window_s"
        r = await c.post("/api/v1/models", json={"name": "x", "engine": "tgi", "replicas": [{"url": 3}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_body"
        assert {p["field"] for p in err["problems"]} == {"engine", "replicas[0].url"}


async def test_nodes_and_their_labels(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        assert (await c.get("/api/v1/nodes")).json() == []
        assert (await c.get("/api/v1/nodes/n1")).status_code == 404
        assert (await c.request("DELETE", "/api/v1/nodes/n1/labels", json={"keys": ["a"]})).status_code == 404
        # a node may be labelled before its agent first connects
        r = await c.put("/api/v1/nodes/n1/labels", json={"labels": {"llmgw.io/rack": "r12", "tier": "gold"}})
        assert r.status_code == 200
        node = r.json()
        assert node["name"] == "n1" and node["operator_labels"] == {"llmgw.io/rack": "r12", "tier": "gold"}
        assert node["location"] == "r12"
        r = await c.put("/api/v1/nodes/n1/labels", json={"labels": {"tier": "silver"}})  # merged
        assert r.json()["labels"] == {"llmgw.io/rack": "r12", "tier": "silver"}
        r = await c.request("DELETE", "/api/v1/nodes/n1/labels", json={"keys": ["tier", "absent"]})
        assert r.status_code == 200 and r.json()["operator_labels"] == {"llmgw.io/rack": "r12"}
        assert [n["name"] for n in (await c.get("/api/v1/nodes")).json()] == ["n1"]
        assert (await c.get("/api/v1/nodes/n1")).json()["labels"] == {"llmgw.io/rack": "r12"}


async def test_models_create_show_update_scale_delete(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        views = (await c.get("/api/v1/models")).json()
        assert [(v["name"], v["source"]) for v in views] == [("m", "config")]
        m = (await c.get("/api/v1/models/m")).json()
        assert m["name"] == "m" and m["engine"] == "vllm" and m["strategy"] == "chat"  # defaults in force
        assert m["replicas"][0]["url"].startswith("http://127.0.0.1:")
        assert (await c.get("/api/v1/models/nope")).status_code == 404

        new = {"name": "org/new", "engine": "llamacpp", "deploy": {"count": 1, "simulate": True}}
        r = await c.post("/api/v1/models", json=new)
        assert r.status_code == 201 and r.headers["location"] == "/api/v1/models/org%2Fnew"
        assert r.json()["deploy"]["count"] == 1
        assert (await c.post("/api/v1/models", json=new)).status_code == 409
        # a name with "/" is reached url-encoded or as plain path segments
        assert (await c.get("/api/v1/models/org%2Fnew")).json() == (await c.get("/api/v1/models/org/new")).json()

        r = await c.put("/api/v1/models/org/new", json={**new, "name": "other"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name"
        r = await c.put("/api/v1/models/org/new", json={"engine": "llamacpp"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name"  # the whole definition
        r = await c.put("/api/v1/models/org/new", json={"name": "org/new", "engine": "llamacpp", "strategy": "batch",
                                                        "deploy": {"count": 2, "simulate": True}})
        assert r.status_code == 200 and r.json()["strategy"] == "batch" and r.json()["name"] == "org/new"
        assert s.control.models["org/new"].strategy == "batch"
        r = await c.put("/api/v1/models/m", json={"name": "m", "engine": "vllm"})
        assert r.status_code == 409 and "config file" in r.json()["error"]["message"]

        r = await c.post("/api/v1/models/org/new/scale", json={"replicas": 3})
        assert r.status_code == 200 and r.json()["deploy"]["count"] == 3
        assert (await c.get("/api/v1/models/org%2Fnew")).json()["deploy"]["count"] == 3
        assert (await c.post("/api/v1/models/m/scale", json={"replicas": 2})).status_code == 409  # static
        assert (await c.post("/api/v1/models/nope/scale", json={"replicas": 2})).status_code == 404
        view = next(v for v in (await c.get("/api/v1/models")).json() if v["name"] == "org/new")
        assert view["source"] == "api" and view["desired_replicas"] == 3 and view["definition"]["name"] == "org/new"

        r = await c.delete("/api/v1/models/org/new")
        assert r.status_code == 204 and r.content == b""
        assert (await c.delete("/api/v1/models/org/new")).status_code == 404
        assert (await c.delete("/api/v1/models/m")).status_code == 409
        assert [v["name"] for v in (await c.get("/api/v1/models")).json()] == ["m"]
        events = (await c.get("/api/v1/history", params={"model": "org/new"})).json()
        assert [e["event"] for e in events][:2] == ["model deleted", "model saved"]  # newest first
        assert len((await c.get("/api/v1/history", params={"model": "org/new", "limit": 1})).json()) == 1
        assert (await c.get("/api/v1/history", params={"node": "nowhere"})).json() == []


async def test_replicas_list_filter_and_restart(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        assert (await c.get("/api/v1/replicas")).json() == []
        r = await c.post("/api/v1/models", json={"name": "sim", "engine": "vllm", "deploy": {"count": 2,
                                                                                              "simulate": True}})
        assert r.status_code == 201
        ctl = s.control
        ctl._transitions(ctl.nodes.connected("n1", "agent-1", labels={}, facts=NodeFacts(cpus=4, memory_mb=8192),
                                             now=trio.current_time()))
        ctl.reconcile_once()  # places both replicas on n1
        reps = (await c.get("/api/v1/replicas")).json()
        assert len(reps) == 2 and {r["node"] for r in reps} == {"n1"} and reps[0]["state"] == "pending"
        assert len((await c.get("/api/v1/replicas", params={"model": "sim", "node": "n1"})).json()) == 2
        assert (await c.get("/api/v1/replicas", params={"node": "n2"})).json() == []
        assert (await c.get("/api/v1/replicas", params={"model": "m"})).json() == []
        rid = reps[0]["replica"]
        assert rid.startswith("sim/")
        r = await c.post(f"/api/v1/replicas/{rid.replace('/', '%2F')}/restart")
        assert r.status_code == 202 and r.json()["replica"] == rid and r.json()["generation"] == 1
        r = await c.post(f"/api/v1/replicas/{rid}/restart")  # the id's "/" as a path separator
        assert r.status_code == 202 and r.json()["generation"] == 2
        assert (await c.post("/api/v1/replicas/m/0/restart")).status_code == 404  # static: not ours to restart
        assert (await c.get("/api/v1/replicas/m/0/restart")).status_code == 405
        node = (await c.get("/api/v1/nodes/n1")).json()
        assert node["state"] == "ready" and sorted(node["replicas"]) == sorted(r["replica"] for r in reps)


async def test_endpoints_decisions_and_cache_hits(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        eps = (await c.get("/api/v1/endpoints")).json()
        assert [e["id"] for e in eps] == ["m/0"] and eps[0]["scrape"] is None
        assert eps[0]["breaker"]["state"] == "closed"
        await s.scrape()
        for i in range(3):
            r = await s.chat(SHARED + f"question {i}", f"req-{i}")
            assert r.status_code == 200, r.text
        await s.scrape()
        ep = (await c.get("/api/v1/endpoints", params={"model": "m"})).json()[0]
        assert ep["scrape"]["prefix_queries_total"] == 200 and ep["scrape"]["prefix_hits_total"] == 120
        assert ep["stale"] is False and ep["kv_usage"] == 0.1
        assert (await c.get("/api/v1/endpoints", params={"model": "x"})).json() == []

        ds = (await c.get("/api/v1/decisions")).json()
        assert [d["request_id"] for d in ds] == ["req-2", "req-1", "req-0"]  # newest first
        assert ds[0]["chosen"] == "m/0" and ds[0]["candidates"][0]["endpoint"] == "m/0"
        assert "prefix hit" in ds[0]["note"] and "prefix miss" in ds[2]["note"]
        assert [d["request_id"] for d in (await c.get("/api/v1/decisions", params={"limit": 1})).json()] == ["req-2"]
        assert len((await c.get("/api/v1/decisions", params={"model": "m", "replica": "m/0"})).json()) == 3
        assert (await c.get("/api/v1/decisions", params={"replica": "m/9"})).json() == []
        one = (await c.get("/api/v1/decisions/req-1")).json()
        assert one["request_id"] == "req-1" and [a["request_id"] for a in one["decisions"]] == ["req-1"]
        assert (await c.get("/api/v1/decisions/nope")).status_code == 404

        cache = (await c.get("/api/v1/cache")).json()
        assert cache["window_s"] == 300 and cache["bucket_s"] == 10
        total = cache["total"]
        assert (total["prefix_hits"], total["prefix_misses"]) == (2, 1)
        assert total["engine_query_tokens"] == 100 and total["engine_hit_rate"] == pytest.approx(0.6)
        assert [m["model"] for m in cache["models"]] == ["m"]
        assert [(r["replica"], r["model"]) for r in cache["replicas"]] == [("m/0", "m")]
        assert len(cache["models"][0]["prefix_hit_rate_series"]) == 30
        short = (await c.get("/api/v1/cache", params={"window_s": "20"})).json()
        assert short["window_s"] == 20 and len(short["total"]["engine_hit_rate_series"]) == 2


async def test_event_stream_snapshot_then_deltas(tmp_path: Path) -> None:
    doc = document()
    async with admin_stack(tmp_path, events_tick_s=0.2, ping_s=0.5, decisions_poll_s=0.02) as s:
        await s.chat(SHARED + "before", "before")
        async with s.tcp_client() as c, c.stream("GET", "/api/v1/events") as r:
            assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
            lines = r.aiter_lines()
            snap = ndjson(await anext(lines))
            assert snap["type"] == "snapshot" and snap["rev"] == 1
            assert [d["request_id"] for d in snap["decisions"]] == ["before"]
            assert [m["name"] for m in snap["models"]] == ["m"] and [e["id"] for e in snap["endpoints"]] == ["m/0"]
            _conforms_event(doc, snap)
            await s.chat(SHARED + "after", "after")
            seen: dict[str, dict[str, Any]] = {}
            with trio.fail_after(5):
                while not {"decision", "update", "ping"} <= set(seen):
                    ev = ndjson(await anext(lines))
                    _conforms_event(doc, ev)
                    seen.setdefault(ev["type"], ev)
            assert seen["decision"]["decision"]["request_id"] == "after" and seen["decision"]["rev"] > 1
            assert "endpoints" in seen["update"]  # the endpoint's inflight/scrape age moved
            assert seen["ping"]["rev"] >= 1  # pings repeat the current revision


def _conforms_event(doc: dict[str, Any], ev: dict[str, Any]) -> None:
    schema = doc["paths"]["/api/v1/events"]["get"]["responses"]["200"]["content"]["application/x-ndjson"]["schema"]
    v = jsonschema_rs.validator_for({**schema, "components": doc["components"]})
    assert v.is_valid(ev), [e.message for e in v.iter_errors(ev)][:3]


async def test_openapi_document_is_served_behind_the_token(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        async with s.tcp_client(token=None) as c:
            assert (await c.get("/api/v1/openapi.json")).status_code == 401
        async with s.tcp_client() as c:
            r = await c.get("/api/v1/openapi.json")
        assert r.status_code == 200 and r.json() == json.loads(json.dumps(document()))


async def test_the_socket_refuses_other_users(tmp_path: Path) -> None:
    """SO_PEERCRED: a peer of another uid gets 403 (simulated: the server expects a uid we are not)."""
    async def ok(_req: Any) -> Any:
        return json_response(200, {"ok": True})

    path = str(tmp_path / "s.sock")
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve_unix(ok, path, peer_uid=os.getuid() + 1,
                                                           task_status=task_status))
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://x") as c:
            r = await c.get("/")
        assert r.status_code == 403 and "owner" in r.json()["error"]["message"]
        nursery.cancel_scope.cancel()


def test_the_socket_directory_must_be_private(tmp_path: Path) -> None:
    d = tmp_path / "new" / "dir"
    _private_dir(str(d))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    _private_dir(str(d))  # ours and private: fine again
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(AdminSetupError, match="chmod 700"):
        _private_dir(str(open_dir))
    (tmp_path / "file").write_text("")
    with pytest.raises(AdminSetupError, match="not a directory"):
        _private_dir(str(tmp_path / "file"))
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(AdminSetupError, match="not a directory"):
        _private_dir(str(tmp_path / "link"))
    if os.getuid() == 0:  # only root can hand a directory to someone else
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 12345, 12345)
        with pytest.raises(AdminSetupError, match="belongs to uid 12345"):
            _private_dir(str(theirs))


def test_error_answers_match_the_document() -> None:
    assert_conforms("GET", "/api/v1/nope", 404, {"error": {"message": "x", "type": "not_found_error",
                                                           "param": None, "code": "not_found"}})
