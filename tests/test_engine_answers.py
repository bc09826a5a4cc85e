"""Engines' answers to the router are untrusted input: each is read under a small cap (the memory
of an answer over it is never held), parsed without raising, and nothing a replica's URL or
answer does leaves the scrape of that replica. Pure parsers, the scrape boundary in process,
and a router process in front of a stub engine answering hundreds of megabytes."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from llmgw.config import parse_config
from llmgw.daemon.net.upstream import UpstreamPool
from llmgw.daemon.router.registry import Registry
from llmgw.route.contract import ScrapeResult
from llmgw.route.engine_answers import MAX_ADAPTERS, BadAnswer, adapters_of, restarted, slot_count_of

from .stub_engine import METRICS, StubEngine, answer, handler_of, send_huge
from .test_router_integration import Daemon, write_config
from .test_sim_vllm import wait_for

CFG = '[[models]]\nname = "m"\nengine = "{engine}"\n[[models.replicas]]\nurl = "http://127.0.0.1:1"\n'


# -- the parsers --------------------------------------------------------------------------------
def test_adapters_of_reads_entries_with_a_parent() -> None:
    body = b'{"data": [{"id": "m"}, {"id": "sql", "parent": "m"}, 7, {"id": "x", "parent": null}]}'
    assert adapters_of(body) == {"sql"}


@pytest.mark.parametrize("body", [
    b"", b"not json", b"[1]", b'{"data": 5}', b'{"data": [{"id": ["x"], "parent": "m"}]}',
    b'{"data": [{"parent": "m"}]}', b'{"data": [{"id": "' + b"a" * 300 + b'", "parent": "m"}]}',
    b"[" * 100_000, b'{"data": [' + b"1" * 5000 + b"]}", b"\xff\xfe",
])
def test_adapters_of_refuses_what_it_cannot_use(body: bytes) -> None:
    with pytest.raises(BadAnswer):
        adapters_of(body)


def test_adapters_are_bounded() -> None:
    many = b",".join(b'{"id": "a%d", "parent": "m"}' % i for i in range(MAX_ADAPTERS + 1))
    with pytest.raises(BadAnswer, match="more than"):
        adapters_of(b'{"data": [' + many + b"]}")


def test_slot_count_of() -> None:
    assert slot_count_of(b'[{"id": 0}, {"id": 1}]') == 2
    for bad in (b"[]", b"{}", b"nope", b"[" * 100_000):
        with pytest.raises(BadAnswer):
            slot_count_of(bad)


# -- the scrape boundary ------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["http://[::1", "ftp://x", "http://h:99999", "https://127.0.0.1:1"])
def test_a_bad_replica_url_marks_the_replica_and_is_logged_once(url: str, caplog: pytest.LogCaptureFixture) -> None:
    reg = Registry(parse_config(CFG.format(engine="vllm")))
    rep = next(iter(reg.replicas.values()))
    rep.view.url = url  # as an agent's report could set it

    async def main() -> None:
        async with UpstreamPool() as pool:
            for _ in range(3):
                await reg.scrape_one(pool, rep, models_too=True)  # raises nothing

    with caplog.at_level(logging.INFO, logger="llmgw.router"):
        trio.run(main)
    assert rep.scrape_errors == 3 and "unusable upstream URL" in (rep.scrape_error or "")
    lines = [r for r in caplog.records if r.name == "llmgw.router"]
    assert len(lines) == 1 and url in lines[0].getMessage() and lines[0].exc_info is None


def test_any_exception_from_an_answer_stays_in_the_scrape(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    import llmgw.daemon.router.registry as registry

    def broken(*a: Any) -> Any:
        raise KeyError("a bug in a parser")

    monkeypatch.setattr(registry.MetricReader, "read", broken)
    engine = StubEngine()
    try:
        reg = Registry(parse_config(CFG.format(engine="vllm").replace("http://127.0.0.1:1", engine.url)))
        rep = next(iter(reg.replicas.values()))

        async def main() -> None:
            async with UpstreamPool() as pool:
                await reg.scrape_one(pool, rep, models_too=True)

        with caplog.at_level(logging.WARNING, logger="llmgw.router"):
            trio.run(main)
    finally:
        engine.stop()
    assert rep.scrape_errors == 1 and "a bug in a parser" in (rep.scrape_error or "")
    assert caplog.records[-1].exc_info is not None  # not an engine's fault: the traceback is kept


def test_slots_are_learnt_once_and_a_disabled_route_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    slots = StubEngine(handler_of({"/slots": answer(200, b'[{"id":0},{"id":1},{"id":2}]'),
                                   "/metrics": answer(200, b"llamacpp:requests_processing 0\n")}))
    off = StubEngine(handler_of({"/slots": answer(501, b'{"error":"slots off"}'),
                                 "/metrics": answer(200, b"llamacpp:requests_processing 0\n")}))
    try:
        regs = []
        for e in (slots, off):
            reg = Registry(parse_config(CFG.format(engine="llamacpp").replace("http://127.0.0.1:1", e.url)))
            regs.append((reg, next(iter(reg.replicas.values()))))

        async def main() -> None:
            async with UpstreamPool() as pool:
                for _ in range(3):
                    for reg, rep in regs:
                        await reg.scrape_one(pool, rep, models_too=True)

        with caplog.at_level(logging.WARNING, logger="llmgw.router"):
            trio.run(main)
    finally:
        slots.stop()
        off.stop()
    assert regs[0][1].slots == 3 and slots.count("/slots") == 1
    assert regs[1][1].slots is None and off.count("/slots") == 3
    assert not [r for r in caplog.records if "/slots" in r.getMessage()]


# -- a router in front of an engine answering hundreds of megabytes ----------------------------
@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in reversed(started):
        p.stop()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def chunked_forever(conn: socket.socket, method: str, path: str, body: bytes) -> None:
    """/metrics as a chunked body that never ends: only a cap stops the reader."""
    conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/plain\r\n\r\n")
    piece = b"%x\r\n%b\r\n" % (65536, (METRICS * 1000)[:65536])
    try:
        for _ in range(200 * 16):  # 200 MB at most
            conn.sendall(piece)
    except OSError:
        pass


def test_huge_engine_answers_keep_the_router_small_and_serving(procs: list[Any], tmp_path: Path) -> None:
    n = [0]

    def metrics(conn: socket.socket, *a: Any) -> None:
        n[0] += 1  # every other scrape is huge; the others let the router go on to /v1/models
        if n[0] % 2:
            conn.sendall(answer(200, METRICS, [("content-type", "text/plain")]))
        else:
            chunked_forever(conn, *a)

    engine = StubEngine(handler_of({"/v1/models": lambda c, *a: send_huge(c, 195 << 20), "/metrics": metrics}))
    procs.append(engine)
    cfg = write_config(tmp_path, [{"name": "m", "replicas": [{"url": engine.url}]}])
    cfg.write_text(cfg.read_text().replace("scrape_interval_s = 0.2", "scrape_interval_s = 0.05"))
    d = Daemon(cfg)
    procs.append(d)
    wait_for(lambda: engine.count("/metrics") >= 2)
    base = rss_mb(d.proc.pid)
    wait_for(lambda: engine.count("/v1/models") >= 12 and engine.count("/metrics") >= 100, timeout=60)
    grown = rss_mb(d.proc.pid) - base
    assert grown < 40, f"RSS grew by {grown:.0f} MB"
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    r = httpx.get(f"{d.url}/metrics")
    errors = [line for line in r.text.splitlines() if line.startswith("llmgw_scrape_errors_total{")]
    assert errors and float(errors[0].rpartition(" ")[2]) >= 100
    log = "".join(d.err)
    assert "exceeds 4194304 bytes" in log and "Traceback" not in log
    assert log.count("/metrics from") <= 2  # logged when it started, then at most once a minute


def test_a_restart_shows_as_cumulative_counters_going_backwards() -> None:
    before = ScrapeResult("vllm", finished_total=12.0, prefix_queries_total=800.0, prefix_hits_total=200.0)
    assert not restarted(None, before)
    assert not restarted(before, ScrapeResult("vllm", finished_total=13.0, prefix_queries_total=900.0,
                                              prefix_hits_total=200.0))
    assert restarted(before, ScrapeResult("vllm", finished_total=0.0, prefix_queries_total=0.0, prefix_hits_total=0.0))
    assert restarted(before, ScrapeResult("vllm", finished_total=12.0, prefix_queries_total=5.0))
    assert not restarted(before, ScrapeResult("vllm"))  # a counter missing says nothing


def test_a_scrape_that_shows_a_restart_reads_the_engines_models_at_once() -> None:
    """Issue 21 item 6: the router's /v1/models read (every tenth scrape) comes at once when the
    engine's counters went backwards (a stub engine over a real socket: its answers, its log)."""
    finished = [7]
    asked: list[str] = []

    def metrics(conn: socket.socket, method: str, path: str, body: bytes) -> None:
        asked.append(path)
        text = METRICS + b"# TYPE vllm:request_success_total counter\n" + \
            f'vllm:request_success_total{{finished_reason="stop"}} {finished[0]}\n'.encode()
        conn.sendall(answer(200, text, [("content-type", "text/plain")]))

    def models(conn: socket.socket, method: str, path: str, body: bytes) -> None:
        asked.append(path)
        conn.sendall(answer(200, b'{"object":"list","data":[{"id":"m","object":"model","parent":null}]}'))

    engine = StubEngine(handler_of({"/metrics": metrics, "/v1/models": models}))
    try:
        reg = Registry(parse_config(CFG.format(engine="vllm").replace("http://127.0.0.1:1", engine.url)))
        rep = next(iter(reg.replicas.values()))

        async def main() -> None:
            async with UpstreamPool() as pool:
                await reg.scrape_one(pool, rep)
                await reg.scrape_one(pool, rep)  # the same engine: /metrics only
                assert asked == ["/metrics", "/metrics"]
                finished[0] = 0  # a new process counts from zero
                await reg.scrape_one(pool, rep)
                assert asked[2:] == ["/metrics", "/v1/models"]

        trio.run(main)
    finally:
        engine.stop()
