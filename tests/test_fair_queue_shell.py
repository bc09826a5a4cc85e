"""The fair queue through the router's trio shell (``Router.handle`` with a stand-in upstream,
as tests/test_openai_fuzz.py drives it): under saturation a high-band request that came after
low-band ones is served first, and the low-band waiter it displaced from the full queue is woken
and answered 429 at once — not left to its deadline.

The requests carry real API keys of two tenants (bands low and high) from a TenantBook pushed
into the router as the control plane pushes the store's: authentication makes their tags."""

from __future__ import annotations

import json
from typing import Any

import trio

from llmgw.config import parse_config
from llmgw.daemon.net.httpserver import Request
from llmgw.daemon.router.proxy import Router
from llmgw.tenants import ApiKey, Tenant, TenantBook, new_key
from llmgw.tenants.keys import visible_prefix

CFG = """
[router]
queue_size = 2
queue_timeout_s = 60.0
[[pools]]
name = "default"
max_inflight_per_replica = 1
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
"""
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()


class _Resp:
    def __init__(self) -> None:
        self.status, self.url = 200, "http://127.0.0.1:1"
        self.first_byte_at: float | None = None
        self.connected_at: float | None = None
        self.head_at: float | None = None
        self.last_byte_at: float | None = None
        self.body_bytes = 0

    def header(self, name: str) -> str | None:
        return "application/json" if name == "content-type" else None

    async def relay(self, sink: Any) -> None:
        self.first_byte_at = trio.current_time()
        sink.send_nowait(ANSWER, end=True)
        self.body_bytes += len(ANSWER)

    def close(self) -> None:
        pass


class _Pool:
    """Each request reaches the engine in turn (``order``), and is answered when the test opens
    its gate."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.gates: dict[str, trio.Event] = {}

    def stream(self, url: str, method: str, target: str, headers: list[tuple[str, str]], body: bytes,
               **kw: Any) -> Any:
        rid = dict(headers)["x-request-id"]
        pool = self

        class _Exchange:
            async def __aenter__(self) -> _Resp:
                pool.order.append(rid)
                gate = pool.gates[rid] = trio.Event()
                await gate.wait()
                return _Resp()

        return _Exchange()


class _Sink:
    def send_nowait(self, data: bytes, end: bool = False) -> bool:
        return True

    def flush_nowait(self) -> None:
        pass

    async def drain(self) -> None:
        pass


def _book() -> tuple[TenantBook, dict[str, str]]:
    """Tenants `bulk` (band low) and `chat` (band high), a key each: the requests' Authorization."""
    tenants = [Tenant("bulk", band="low"), Tenant("chat", band="high")]
    keys, secrets_ = [], {}
    for i, t in enumerate(tenants):
        secret, kid, h = new_key(lambda n, i=i: bytes([i + 1]) * n)
        keys.append(ApiKey(id=kid, tenant=t.name, hash=h, prefix=visible_prefix(kid)))
        secrets_[t.name] = secret
    return TenantBook(tenants, keys), secrets_


SENDER = {"a": "bulk", "low1": "bulk", "low2": "bulk", "high": "chat"}


def test_a_high_band_waiter_goes_first_and_the_low_one_it_displaced_gets_a_429_at_once() -> None:
    router = Router(parse_config(CFG), _Pool(), seed=0)  # type: ignore[arg-type]
    pool: _Pool = router.pool  # type: ignore[assignment]
    core = router.core
    book, secret = _book()
    router.tenancy.set_book(book)  # as the control plane pushes the store's tenants and keys
    results: dict[str, tuple[int, bytes, float]] = {}

    async def send(rid: str) -> None:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": rid}]}).encode()
        req = Request("POST", "/v1/chat/completions", "/v1/chat/completions", "",
                      [("x-request-id", rid), ("authorization", f"Bearer {secret[SENDER[rid]]}")], body, ("127.0.0.1", 1))
        resp = await router.handle(req)
        if not isinstance(resp.body, bytes):
            await resp.body.relay(_Sink())  # type: ignore[union-attr]
        results[rid] = (resp.status, resp.body if isinstance(resp.body, bytes) else b"", trio.current_time())

    async def until(cond: Any) -> None:
        while not cond():
            await trio.sleep(0)  # a turn of the scheduler, not a wait for time to pass

    async def main() -> None:
        start = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(send, "a")
            await until(lambda: "a" in pool.gates)  # the one slot is taken
            n.start_soon(send, "low1")
            await until(lambda: core.queue_lengths().get("m") == 1)
            n.start_soon(send, "low2")
            await until(lambda: core.queue_lengths().get("m") == 2)  # the queue is full
            n.start_soon(send, "high")
            await until(lambda: "low2" in results)  # displaced: answered now, not at its deadline
            status, body, at = results["low2"]
            err = json.loads(body)["error"]
            assert status == 429 and "displaced by a higher band" in err["message"] and at - start < 1.0
            assert core.queue_by_band() == {("m", "high"): 1, ("m", "low"): 1}
            pool.gates["a"].set()  # a ends: the high-band waiter goes, though low1 waited longer
            await until(lambda: "high" in pool.gates)
            assert pool.order == ["a", "high"]
            pool.gates["high"].set()
            await until(lambda: "low1" in pool.gates)
            pool.gates["low1"].set()
        assert pool.order == ["a", "high", "low1"]
        assert {k: v[0] for k, v in results.items()} == {"a": 200, "low1": 200, "low2": 429, "high": 200}
        text = router.metrics.render().decode()  # the exporter reads the clock: inside the run
        assert 'llmgw_queue_displaced_total{band="low"} 1.0' in text
        assert "# TYPE llmgw_queue_waiting gauge" in text

    trio.run(main)
    assert list(core.counters.rejections) == [("m", "queue_displaced")]
    assert core.counters.rejections[("m", "queue_displaced")][0] == 1
    d = [x for x in core.decisions if x.request_id == "high"][-1]
    assert (d.tenant, d.band, d.share) == ("chat", "high", 1.0)
