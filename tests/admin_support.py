"""A whole admin stack in one trio run for the admin API tests: a fake vLLM engine, the router
(serving it as model "m"), a control plane on an in-memory store, and the admin app on a Unix
socket in a temporary directory and on TCP 127.0.0.1:0 with a token."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs  # schemathesis brings it
import trio

from llmgw.admin.openapi import document
from llmgw.admin.routes import Resolver
from llmgw.config import Config, parse_config
from llmgw.daemon.control.admin.server import AdminApp, serve_admin
from llmgw.daemon.control.plane.plane import ControlPlane
from llmgw.daemon.net.httpserver import (
    Request,
    Response,
    json_response,
    serve_tcp,
    text_response,
)
from llmgw.daemon.router.control_port import RouterAdapter
from llmgw.daemon.router.proxy import Router
from llmgw.daemon.control.store.sqlite import Store
from llmgw.daemon.net.upstream import UpstreamPool

TOKEN = "s3cret-admin-token"

CONFIG = """
[admin]
socket = "{socket}"
tcp = "127.0.0.1:0"
token = "{token}"

[control]
store = ":memory:"
settle_s = 0.0

[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:{engine_port}"
"""


class FakeEngine:
    """Enough of vLLM for the router: chat completions, /v1/models, and /metrics whose prefix-cache
    counters grow by 100 queried / 60 hit tokens per scrape."""

    def __init__(self) -> None:
        self.scrapes = 0

    async def handle(self, req: Request) -> Response:
        if req.path == "/metrics":
            self.scrapes += 1
            q, h = 100 * self.scrapes, 60 * self.scrapes
            lines = ["vllm:num_requests_running{model_name=\"m\"} 0", "vllm:num_requests_waiting{model_name=\"m\"} 0",
                     "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.1",
                     f"vllm:prefix_cache_queries_total{{model_name=\"m\"}} {q}",
                     f"vllm:prefix_cache_hits_total{{model_name=\"m\"}} {h}"]
            return text_response(200, "\n".join(lines) + "\n")
        if req.path == "/v1/models":
            return json_response(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
        if req.path == "/v1/chat/completions":
            return json_response(200, {"id": "c1", "object": "chat.completion", "model": "m", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
        return json_response(404, {"error": {"message": "nope"}})


@dataclass
class Stack:
    cfg: Config
    router: Router
    control: ControlPlane
    app: AdminApp
    pool: UpstreamPool
    engine: FakeEngine
    socket: str
    tcp_url: str
    router_url: str

    def unix_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.socket), base_url="http://admin",
                                 event_hooks={"response": [_check_response]})

    def tcp_client(self, token: str | None = TOKEN) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {token}"} if token is not None else {}
        return httpx.AsyncClient(base_url=self.tcp_url, headers=headers, event_hooks={"response": [_check_response]})

    async def chat(self, content: str, request_id: str) -> httpx.Response:
        async with httpx.AsyncClient() as c:
            return await c.post(f"{self.router_url}/v1/chat/completions", headers={"x-request-id": request_id},
                                json={"model": "m", "messages": [{"role": "user", "content": content}]})

    async def scrape(self) -> None:
        for rep in list(self.router.registry.replicas.values()):
            await self.router.registry.scrape_one(self.pool, rep)


@asynccontextmanager
async def admin_stack(tmp: Path, **app_options: Any) -> AsyncIterator[Stack]:
    engine = FakeEngine()
    async with trio.open_nursery() as nursery:
        engine_port = await nursery.start(serve_tcp, engine.handle, "127.0.0.1", 0)
        socket = tmp / "admin" / "admin.sock"
        cfg = parse_config(CONFIG.format(socket=socket, token=TOKEN, engine_port=engine_port))
        with Store.memory() as store:
            async with UpstreamPool() as pool:
                router = Router(cfg, pool, seed=1)
                port = RouterAdapter(router)
                control = ControlPlane(cfg, store, port, token=None)
                app = AdminApp(control, port, token=cfg.admin.token, **app_options)
                addrs = await nursery.start(serve_admin, cfg.admin, app)
                router_port = await nursery.start(serve_tcp, router.handle, "127.0.0.1", 0)
                yield Stack(cfg, router, control, app, pool, engine, addrs["socket"], f"http://{addrs['tcp']}",
                            f"http://127.0.0.1:{router_port}")
                nursery.cancel_scope.cancel()


def ndjson(line: str) -> dict[str, Any]:
    obj = json.loads(line)
    assert isinstance(obj, dict)
    return obj


# -- every JSON answer the tests get is checked against the generated document --------------------------
_DOC = document()
_RESOLVER = Resolver()


def response_schema(method: str, raw_path: str, status: int) -> dict[str, Any]:
    """The documented schema of an answer; fails if the status is not documented for the route."""
    res = _RESOLVER.resolve(method, raw_path)
    if res.route is None or status == 401:  # answered before routing: the error envelope
        schema: dict[str, Any] = {"$ref": "#/components/schemas/ErrorBody"}
    else:
        responses = _DOC["paths"][res.route.path][method.lower()]["responses"]
        assert str(status) in responses, f"{method} {raw_path} answered undocumented {status}"
        schema = responses[str(status)]["content"]["application/json"]["schema"]
    return {**schema, "components": _DOC["components"]}


def assert_conforms(method: str, raw_path: str, status: int, body: Any) -> None:
    v = jsonschema_rs.validator_for(response_schema(method, raw_path, status))
    errors = [f"{e.instance_path}: {e.message}" for e in v.iter_errors(body)]
    assert not errors, f"{method} {raw_path} -> {status} does not match the document: {errors[:5]}"


async def _check_response(resp: httpx.Response) -> None:
    if resp.request.method == "HEAD" or not resp.headers.get("content-type", "").startswith("application/json"):
        return  # the event stream (checked line by line), 204s, HEAD
    await resp.aread()
    path = resp.request.url.raw_path.decode().partition("?")[0]
    assert_conforms(resp.request.method, path, resp.status_code, resp.json())
