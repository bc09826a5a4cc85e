"""Store keys and quotas on the OpenAI port: the router in this process (its book pushed through
RouterPort.set_tenants, as the control plane does), real simulated vLLM engines in their own
processes, real HTTP between them. 401 for revoked, expired and orphaned keys; 403 for a model
the key or tenant may not use; 429 for rpm, tpm, concurrency and budgets with OpenAI's bodies,
Retry-After and the x-ratelimit-* headers; the headers on every answer; a budget exhausted
mid-stream finishes that stream and refuses the next; settlement at every end."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio

from llmgw.config import parse_config
from llmgw.daemon.net.httpserver import serve_tcp
from llmgw.daemon.net.upstream import UpstreamPool
from llmgw.daemon.router.control_port import RouterAdapter
from llmgw.daemon.router.proxy import Router
from llmgw.tenants import ApiKey, Quota, Tenant, TenantBook, new_key
from llmgw.tenants.keys import visible_prefix

from .conftest import SimProc, start_sim

SLOW = ["--sim-decode-ms-per-token", "25", "--sim-prefill-ms-per-token", "0"]
BODY = {"model": "m", "prompt": "abcd" * 4, "max_tokens": 4, "ignore_eos": True}  # cost 4 + 4


@pytest.fixture
def sims() -> Iterator[dict[str, SimProc]]:
    started: dict[str, SimProc] = {}
    yield started
    for s in started.values():
        s.stop()


def engine(sims: dict[str, SimProc], *extra: str) -> SimProc:
    s = start_sim(["--engine", "vllm", "m", "--served-model-name", "m", "other", "--host", "127.0.0.1", "--port", "0",
                   *extra])
    sims[str(len(sims))] = s
    return s


@dataclass
class Stack:
    router: Router
    port: RouterAdapter
    url: str
    client: httpx.AsyncClient

    def book(self, tenants: list[Tenant], keys: list[ApiKey]) -> None:
        self.port.set_tenants(TenantBook(tenants, keys, static_tenant="static"))

    async def post(self, key: str | None, body: dict[str, Any] | None = None,
                   path: str = "/v1/completions") -> httpx.Response:
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        return await self.client.post(self.url + path, json=BODY if body is None else body, headers=headers)


@asynccontextmanager
async def stack(url: str, extra: str = "") -> AsyncIterator[Stack]:
    cfg = parse_config(f'[server]\nhost = "127.0.0.1"\n[router]\nscrape_interval_s = 0.2\n{extra}\n'
                       f'[[models]]\nname = "m"\nengine = "vllm"\n[[models.replicas]]\nurl = "{url}"\n'
                       f'[[models]]\nname = "other"\nengine = "vllm"\n[[models.replicas]]\nurl = "{url}"\n')
    async with trio.open_nursery() as nursery, UpstreamPool() as pool:
        router = Router(cfg, pool, seed=1)
        port = await nursery.start(serve_tcp, router.handle, "127.0.0.1", 0)
        async with httpx.AsyncClient(timeout=30) as client:
            yield Stack(router, RouterAdapter(router), f"http://127.0.0.1:{port}", client)
        nursery.cancel_scope.cancel()


def make_key(tenant: str, **kw: Any) -> tuple[str, ApiKey]:
    secret, kid, digest = new_key(secrets.token_bytes)
    return secret, ApiKey(id=kid, tenant=tenant, hash=digest, prefix=visible_prefix(kid), **kw)


def error(r: httpx.Response) -> dict[str, Any]:
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "param", "code"}, e
    return e  # type: ignore[no-any-return]


def test_revoked_expired_and_orphaned_keys_are_401_and_an_active_one_is_its_tenants(
        sims: dict[str, SimProc]) -> None:
    url = engine(sims, "--sim-zero-cost").url

    async def main() -> None:
        async with stack(url) as s:
            good, k1 = make_key("a", name="ok")
            revoked, k2 = make_key("a", revoked_at=1.0)
            expired, k3 = make_key("a", expires_at=1_000_000_000.0)
            orphan, k4 = make_key("gone")
            s.book([Tenant("a")], [k1, k2, k3, k4])
            for key, msg in ((revoked, "This API key has been revoked."),
                             (expired, "This API key expired at 2001-09-09T01:46:40Z."),
                             (orphan, "This API key's tenant no longer exists."),
                             (None, "Invalid or missing API key."),
                             (good[:-1] + ("1" if good.endswith("0") else "0"), "Invalid or missing API key.")):
                r = await s.post(key)
                assert r.status_code == 401, r.text
                assert error(r) == {"message": msg, "type": "invalid_request_error", "param": None,
                                    "code": "invalid_api_key"}
                assert (key or "§")[-20:] not in r.text
            s.book([Tenant("a", band="high", weight=2.0)], [k1, k2, k3, k4])
            r = await s.post(good)
            assert r.status_code == 200, r.text
            trace = s.port.traces().get(r.headers["x-request-id"])
            assert trace is not None and (trace.tenant, trace.key, trace.band) == ("a", k1.id, "high")
            recs = s.port.usage_drain()
            assert [(u.tenant, u.key, u.model, u.requests, u.completion_tokens) for u in recs] == \
                [("a", k1.id, "m", 1, 4)]
            # revocation takes effect on the next request once the book is pushed
            s.book([Tenant("a")], [k2])
            assert (await s.post(good)).status_code == 401

    trio.run(main)


def test_a_model_the_key_or_tenant_may_not_use_is_403(sims: dict[str, SimProc]) -> None:
    url = engine(sims, "--sim-zero-cost").url

    async def main() -> None:
        async with stack(url) as s:
            k_tenant, k1 = make_key("a")
            k_key, k2 = make_key("b", models=("other",))
            s.book([Tenant("a", models=("m",)), Tenant("b")], [k1, k2])
            assert (await s.post(k_tenant)).status_code == 200
            r = await s.post(k_tenant, {**BODY, "model": "other"})
            assert r.status_code == 403 and error(r) == {
                "message": "Tenant `a` may not use the model `other`.", "type": "invalid_request_error",
                "param": "model", "code": "model_not_allowed"}
            r = await s.post(k_key)
            assert r.status_code == 403 and error(r)["message"] == "This API key may not use the model `m`."
            assert (await s.post(k_key, {**BODY, "model": "other"})).status_code == 200
            models = (await s.client.get(s.url + "/v1/models", headers={"authorization": f"Bearer {k_key}"})).json()
            assert [m["id"] for m in models["data"]] == ["other"]  # only what it may use
            m = s.router.metrics.render().decode()
            assert 'llmgw_ratelimited_total{reason="model",tenant="a"} 1.0' in m
            assert 'llmgw_tenant_requests_total{model="other",outcome="refused",tenant="a"} 1.0' in m
            counts = s.router.core.counters.requests
            assert counts[("other", "rejected", 403)][0] == 1 and counts[("m", "rejected", 403)][0] == 1

    trio.run(main)


def ratelimit_headers(r: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.startswith("x-ratelimit-")}


def test_rpm_429_with_retry_after_and_headers(sims: dict[str, SimProc]) -> None:
    url = engine(sims, "--sim-zero-cost").url

    async def main() -> None:
        async with stack(url) as s:
            key, k = make_key("a")
            s.book([Tenant("a", quota=Quota(rpm=2))], [k])
            first = await s.post(key)
            assert first.status_code == 200
            h = ratelimit_headers(first)
            assert h["x-ratelimit-limit-requests"] == "2" and h["x-ratelimit-remaining-requests"] == "1"
            assert "x-ratelimit-reset-requests" in h and "x-ratelimit-limit-tokens" not in h
            assert (await s.post(key)).status_code == 200
            r = await s.post(key)
            assert r.status_code == 429, r.text
            e = error(r)
            assert e["type"] == "requests" and e["code"] == "rate_limit_exceeded"
            assert "requests per minute" in e["message"] and "`a`" in e["message"]
            assert int(r.headers["retry-after"]) >= 1
            assert ratelimit_headers(r)["x-ratelimit-remaining-requests"] == "0"
            m = s.router.metrics.render().decode()
            assert 'llmgw_ratelimited_total{reason="rpm",tenant="a"} 1.0' in m
            assert s.router.core.counters.requests[("m", "rejected", 429)][0] == 1

    trio.run(main)


def test_tpm_429_and_a_request_bigger_than_the_tpm_is_never_admitted(sims: dict[str, SimProc]) -> None:
    url = engine(sims, "--sim-zero-cost").url

    async def main() -> None:
        async with stack(url) as s:
            key, k = make_key("a")
            s.book([Tenant("a", quota=Quota(tpm=100))], [k])
            big = {**BODY, "max_tokens": 80}  # charged 4 + 80 up front, settled to 4 + 80 (ignore_eos)
            r = await s.post(key, big)
            assert r.status_code == 200 and ratelimit_headers(r)["x-ratelimit-limit-tokens"] == "100"
            r = await s.post(key, big)
            assert r.status_code == 429 and error(r)["type"] == "tokens" and error(r)["code"] == "rate_limit_exceeded"
            assert "tokens per minute" in error(r)["message"]
            r = await s.post(key, {**BODY, "max_tokens": 500})
            assert r.status_code == 429 and "max_tokens" in error(r)["message"] and r.headers["retry-after"] == "60"

    trio.run(main)


def test_concurrency_429_while_one_streams_then_admitted_again(sims: dict[str, SimProc]) -> None:
    url = engine(sims, *SLOW).url

    async def main() -> None:
        async with stack(url) as s:
            key, k = make_key("a")
            s.book([Tenant("a", quota=Quota(concurrency=1))], [k])
            slow = {**BODY, "max_tokens": 40, "stream": True}
            async with s.client.stream("POST", s.url + "/v1/completions", json=slow,
                                       headers={"authorization": f"Bearer {key}"}) as first:
                assert first.status_code == 200
                r = await s.post(key)
                assert r.status_code == 429 and error(r)["type"] == "requests" and "concurren" in error(r)["message"]
                assert s.port.quota_use()[("tenant", "a")]["concurrency"]["inflight"] == 1
                async for _ in first.aiter_bytes():
                    pass
            assert (await s.post(key)).status_code == 200  # released at the stream's end
            # a client that leaves mid-stream releases its slot too
            async with s.client.stream("POST", s.url + "/v1/completions", json=slow,
                                       headers={"authorization": f"Bearer {key}"}) as gone:
                async for _ in gone.aiter_bytes():
                    break
            with trio.fail_after(10):
                while s.port.quota_use()[("tenant", "a")]["concurrency"]["inflight"]:
                    await trio.sleep(0.01)
            assert (await s.post(key)).status_code == 200

    trio.run(main)


def test_a_budget_exhausted_mid_stream_finishes_that_stream_and_refuses_the_next(sims: dict[str, SimProc]) -> None:
    url = engine(sims, "--sim-zero-cost").url

    async def main() -> None:
        async with stack(url) as s:
            key, k = make_key("a")
            s.book([Tenant("a", quota=Quota(tokens_per_day=105))], [k])
            # 80 characters: estimated 20 tokens, 40 to the engine: each request uses more than it is charged
            body = {"model": "m", "prompt": "a " * 40, "max_tokens": 20, "stream": True, "ignore_eos": True}
            r = await s.post(key, {**body, "max_tokens": 200})
            assert r.status_code == 429 and error(r)["code"] == "insufficient_quota"  # 220 > 105 up front
            r = await s.post(key, body)  # charged 40, uses 60
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            r = await s.post(key, body)  # 60 used + 40 charged ≤ 105: admitted; it takes the budget to 120
            assert r.status_code == 200, r.text
            assert r.text.endswith("data: [DONE]\n\n") and r.text.count('"text"') == 20  # finished whole
            r = await s.post(key, {**body, "max_tokens": 1})
            assert r.status_code == 429, r.text
            e = error(r)
            assert e["type"] == "insufficient_quota" and e["code"] == "insufficient_quota"
            assert "per day" in e["message"] and int(r.headers["retry-after"]) >= 1
            assert s.port.quota_use()[("tenant", "a")]["day"]["used"] > 105  # the engine's count, over the budget

    trio.run(main)


def test_every_answer_after_admission_carries_the_headers_and_settles(sims: dict[str, SimProc]) -> None:
    sim = engine(sims, "--sim-zero-cost")

    async def main() -> None:
        async with stack(sim.url, "connect_timeout_s = 0.5\nmax_attempts = 1") as s:
            key, k = make_key("a")
            s.book([Tenant("a", quota=Quota(rpm=100, tpm=10_000, concurrency=5))], [k])
            ok = await s.post(key)
            stream = await s.post(key, {**BODY, "stream": True})
            bad = await s.post(key, {**BODY, "temperature": "hot"})  # the engine's 400, relayed
            for r in (ok, stream, bad):
                assert ratelimit_headers(r)["x-ratelimit-limit-requests"] == "100", r
                assert ratelimit_headers(r)["x-ratelimit-limit-tokens"] == "10000"
            assert bad.status_code == 400
            sims["0"].stop()  # the engine is gone: the router's 502/503 carries them too
            down = await s.post(key)
            assert down.status_code >= 500 and ratelimit_headers(down)["x-ratelimit-limit-requests"] == "100"
            use = s.port.quota_use()[("tenant", "a")]
            assert use["concurrency"]["inflight"] == 0  # every end released
            rows = {(u.model, u.requests, u.errors, u.completion_tokens) for u in s.port.usage_drain()}
            assert sum(r[1] for r in rows) == 4 and sum(r[2] for r in rows) == 2

    trio.run(main)


def test_the_eval_runner_passes_a_closed_book_and_is_no_tenants_use(sims: dict[str, SimProc]) -> None:
    """Lifecycle × tenants: llmgw's eval runner reaches the OpenAI port with the router's internal
    token and no tenant key (daemon/control/lifecycle/eval_runner.py): with keys in the store it is
    not refused, charged or counted as any tenant's use; a forged internal token is just a missing key."""
    from llmgw.daemon.router.proxy import INTERNAL_HEADER

    s = engine(sims, "--sim-zero-cost")

    async def main() -> None:
        async with stack(s.url) as st:
            secret, key = make_key("t", quota=Quota(rpm=1))
            st.book([Tenant("t", quota=Quota(rpm=1))], [key])
            assert (await st.post(None)).status_code == 401
            for _ in range(3):  # past the tenant's rpm: the runner is nobody's
                r = await st.client.post(st.url + "/v1/completions", json=BODY,
                                         headers={INTERNAL_HEADER: st.router.internal_token})
                assert r.status_code == 200, r.text
                assert not any(h.startswith("x-ratelimit-") for h in r.headers)
            r = await st.client.post(st.url + "/v1/completions", json=BODY, headers={INTERNAL_HEADER: "forged"})
            assert r.status_code == 401
            assert st.port.usage_peek() == []
            assert (await st.post(secret)).status_code == 200  # the tenant's own minute is untouched

    trio.run(main)
