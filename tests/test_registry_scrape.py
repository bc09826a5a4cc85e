"""The registry's readings when nothing moves (issue 25): an unchanged /metrics body reuses the
last result, yet each reading is fresh — its time, the drain-rate observation, the capacity
callback only on a change — and the replica's pace slows while it is quiet, returns to the
interval when anything moves, and a replica that changed engine gets a fresh reader. A stub
engine over a real socket; the registry in process."""

from __future__ import annotations

import socket
from typing import Any

import trio
import trio.testing

from llmgw.config import parse_config
from llmgw.daemon.net.upstream import UpstreamPool
from llmgw.daemon.router.registry import Registry

from .stub_engine import StubEngine, answer, handler_of

CFG = ('[router]\nscrape_interval_s = 1.0\nstale_after_s = 60.0\nscrape_idle_factor = 4.0\n'
       '[[models]]\nname = "m"\nengine = "vllm"\n[[models.replicas]]\nurl = "{url}"\n')


def _body(running: int = 0, blocks: int = 1000, reads: int = 0) -> bytes:
    return (f'vllm:num_requests_running{{engine="0"}} {running}\nvllm:num_requests_waiting{{engine="0"}} 0\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} 0.0\n'
            f'vllm:request_success_total{{engine="0",finished_reason="stop"}} 5\n'
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n'
            f'http_requests_total{{handler="/metrics"}} {reads}\n').encode()


def test_an_unchanged_reading_is_reused_and_still_fresh() -> None:
    state: dict[str, Any] = {"running": 0, "blocks": 1000, "reads": 0}

    def metrics(conn: socket.socket, method: str, path: str, body: bytes) -> None:
        state["reads"] += 1  # like vLLM: the body is never the same twice
        conn.sendall(answer(200, _body(state["running"], state["blocks"], state["reads"]),
                            [("content-type", "text/plain")]))

    engine = StubEngine(handler_of({"/metrics": metrics}))
    try:
        reg = Registry(parse_config(CFG.format(url=engine.url)))
        rep = next(iter(reg.replicas.values()))
        capacity: list[int | None] = []
        reg.on_capacity = lambda r: capacity.append(r.last_scrape.kv_blocks)

        async def main() -> None:
            async with UpstreamPool() as pool:
                await reg.scrape_one(pool, rep)
                first, at1 = rep.last_scrape, rep.view.scraped_at
                assert first is not None and first.ok and capacity == [1000]
                assert reg.pace.gap(rep.id) == 1.0  # a first reading is never quiet
                clock.jump(1.0)
                await reg.scrape_one(pool, rep)
                assert rep.last_scrape is first  # nothing the contract reads moved: not parsed again
                assert rep.view.scraped_at is not None and at1 is not None and rep.view.scraped_at > at1
                assert len(rep.drain._points) == 2  # the drain rate saw both readings
                assert capacity == [1000]  # no capacity change, no callback
                assert reg.pace.gap(rep.id) == 2.0  # quiet: read less often
                await reg.scrape_one(pool, rep)
                assert reg.pace.gap(rep.id) == 4.0
                state["blocks"] = 2000  # the engine came back with another cache size
                await reg.scrape_one(pool, rep)
                assert rep.last_scrape is not first and capacity == [1000, 2000]
                assert reg.pace.gap(rep.id) == 1.0  # a change: back to every interval
                state["running"] = 3
                await reg.scrape_one(pool, rep)
                await reg.scrape_one(pool, rep)  # the same again, but the engine is busy: not quiet
                assert rep.view.running == 3.0 and reg.pace.gap(rep.id) == 1.0
                rep.view.inflight = 1  # a request of ours on it
                state["running"] = 0
                await reg.scrape_one(pool, rep)
                await reg.scrape_one(pool, rep)
                assert reg.pace.gap(rep.id) == 1.0
                rep.view.inflight = 0

        clock = trio.testing.MockClock()  # time moves only when the test says so
        trio.run(main, clock=clock)
    finally:
        engine.stop()


def test_a_failed_reading_returns_the_replica_to_the_interval() -> None:
    up = [True]

    def metrics(conn: socket.socket, method: str, path: str, body: bytes) -> None:
        conn.sendall(answer(200, _body(), [("content-type", "text/plain")]) if up[0] else answer(500, b"down"))

    engine = StubEngine(handler_of({"/metrics": metrics}))
    try:
        reg = Registry(parse_config(CFG.format(url=engine.url)))
        rep = next(iter(reg.replicas.values()))

        async def main() -> None:
            async with UpstreamPool() as pool:
                for _ in range(3):
                    await reg.scrape_one(pool, rep)
                assert reg.pace.gap(rep.id) == 4.0
                up[0] = False
                await reg.scrape_one(pool, rep)
                assert rep.scrape_error and reg.pace.gap(rep.id) == 1.0
                up[0] = True
                await reg.scrape_one(pool, rep)
                assert rep.scrape_error is None and rep.view.running == 0.0

        trio.run(main)
    finally:
        engine.stop()


def test_a_replica_that_changed_engine_gets_a_fresh_reader() -> None:
    reg = Registry(parse_config(CFG.format(url="http://127.0.0.1:1")))
    rep = next(iter(reg.replicas.values()))
    r1 = reg.reader(rep)
    assert reg.reader(rep) is r1
    rep.view.engine = "llamacpp"
    r2 = reg.reader(rep)
    assert r2 is not r1 and r2.kind == "llamacpp" and reg.reader(rep) is r2
