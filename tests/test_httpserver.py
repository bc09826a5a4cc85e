"""Tests for llmgw.daemon.net.httpserver over real loopback sockets (no sleeps as sync)."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from functools import partial

import httpx
import pytest
import trio
import trio.testing

from llmgw.daemon.net.httpserver import (
    Request, Response, ServerStats, json_response, serve_tcp, serve_unix, text_response,
)


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


pytestmark = pytest.mark.anyio


@asynccontextmanager
async def running(handler, **opts) -> AsyncIterator[tuple[str, int, ServerStats]]:
    stats = ServerStats()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_tcp, handler, "127.0.0.1", 0, stats=stats, **opts))
        yield f"http://127.0.0.1:{port}", port, stats
        nursery.cancel_scope.cancel()


def client(base: str, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, timeout=10.0, **kw)


async def raw_exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        out = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(65536):
                out += chunk
    return out


async def echo(req: Request) -> Response:
    return json_response(200, {
        "method": req.method, "path": req.path, "query": req.query_params(),
        "body": req.body.decode(), "ua": req.header("User-Agent"), "client": list(req.client or ()),
    })


async def test_get_and_post_json() -> None:
    async with running(echo) as (base, _, stats), client(base) as c:
        r = await c.get("/v1/models?a=1&b=x%20y", headers={"user-agent": "t/1"})
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/json"
        assert r.headers["content-length"] == str(len(r.content))
        assert b", " not in r.content  # compact JSON
        got = r.json()
        assert got["method"] == "GET" and got["path"] == "/v1/models"
        assert got["query"] == {"a": "1", "b": "x y"} and got["ua"] == "t/1"
        assert got["client"][0] == "127.0.0.1"

        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert r.status_code == 200
        assert json.loads(r.json()["body"]) == {"model": "m", "messages": []}
        await trio.testing.wait_all_tasks_blocked()  # server finished its bookkeeping
        assert stats.requests_served == 2


async def test_keepalive_reuses_one_connection() -> None:
    ports: set[int] = set()

    async def handler(req: Request) -> Response:
        assert req.client is not None
        ports.add(req.client[1])
        return text_response(200, "ok")

    async with running(handler) as (base, _, stats):
        async with client(base) as c:
            for _ in range(5):
                r = await c.get("/")
                assert r.text == "ok"
        assert len(ports) == 1
        await trio.testing.wait_all_tasks_blocked()
        assert stats.connections_total == 1 and stats.requests_served == 5


async def test_http10_closes_connection() -> None:
    async with running(echo) as (_, port, stats):
        out = await raw_exchange(port, b"GET /x HTTP/1.0\r\n\r\n")  # returns only on close
        assert out.startswith(b"HTTP/1.1 200")
        assert json.loads(out.split(b"\r\n\r\n", 1)[1])["path"] == "/x"
        assert stats.requests_served == 1


async def test_pipelined_requests_answered_in_order() -> None:
    async with running(echo) as (_, port, _s):
        out = await raw_exchange(
            port, b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert out.count(b"HTTP/1.1 200") == 2
        assert out.index(b'"path":"/a"') < out.index(b'"path":"/b"')


async def test_bytes_during_slow_handler_are_kept_not_cancelled() -> None:
    release = trio.Event()
    cancelled = False

    async def handler(req: Request) -> Response:
        nonlocal cancelled
        if req.path == "/slow":
            try:
                await release.wait()
            except trio.Cancelled:
                cancelled = True
                raise
        return text_response(200, req.path)

    async with running(handler) as (_, port, _s):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            await trio.testing.wait_all_tasks_blocked()  # handler parked, watcher reading
            await stream.send_all(b"GET /next HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            await trio.testing.wait_all_tasks_blocked()  # watcher consumed the pipelined bytes
            release.set()
            out = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some(65536):
                    out += chunk
        assert not cancelled
        assert out.count(b"HTTP/1.1 200") == 2 and out.index(b"/slow") < out.index(b"/next")


async def test_watching_resumes_after_pipelined_request() -> None:
    release, second_started, second_cancelled = trio.Event(), trio.Event(), trio.Event()

    async def handler(req: Request) -> Response:
        if req.path == "/first":
            await release.wait()
        else:
            second_started.set()
            try:
                await trio.sleep_forever()
            finally:
                second_cancelled.set()
        return text_response(200, req.path)

    async with running(handler) as (_, port, stats):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /first HTTP/1.1\r\nhost: x\r\n\r\n")
        await trio.testing.wait_all_tasks_blocked()
        await stream.send_all(b"GET /second HTTP/1.1\r\nhost: x\r\n\r\n")  # pipelined
        await trio.testing.wait_all_tasks_blocked()
        release.set()
        with trio.fail_after(5):
            assert (await stream.receive_some(1000)).startswith(b"HTTP/1.1 200")
            await second_started.wait()
        await stream.aclose()  # leaving during the pipelined request is still noticed
        with trio.fail_after(5):
            await second_cancelled.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert stats.requests_served == 1 and stats.client_disconnects == 1


async def test_stream_chunks_arrive_incrementally() -> None:
    second_allowed = trio.Event()

    async def handler(req: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            yield b"data: first\n\n"
            await second_allowed.wait()  # only the client can release this
            yield b"data: second\n\n"
        return Response(200, [("content-type", "text/event-stream")], gen())

    async with running(handler) as (base, _, stats), client(base) as c:
        async with c.stream("GET", "/stream") as r:
            assert r.headers["transfer-encoding"] == "chunked"
            chunks = r.aiter_raw()
            with trio.fail_after(5):
                assert await chunks.__anext__() == b"data: first\n\n"
            second_allowed.set()
            rest = b"".join([c async for c in chunks])
        assert rest == b"data: second\n\n"
        r2 = await c.get("/again")  # the connection is reusable after a stream
        assert r2.status_code == 200
        assert stats.connections_total == 1


async def test_stream_framing_for_http10_and_declared_length() -> None:
    async def handler(req: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            yield b"ab"
            yield b""  # skipped: an empty chunk would end a chunked body
            yield b"cd"
        headers = [("content-length", "4")] if req.path == "/sized" else []
        return Response(200, headers, gen())

    async with running(handler) as (base, port, _s):
        out = await raw_exchange(port, b"GET / HTTP/1.0\r\n\r\n")  # close-delimited
        head, body = out.split(b"\r\n\r\n", 1)
        assert b"transfer-encoding" not in head.lower() and body == b"abcd"
        async with client(base) as c:
            r = await c.get("/sized")
            assert r.headers["content-length"] == "4" and r.content == b"abcd"
            r = await c.get("/chunked")
            assert r.headers["transfer-encoding"] == "chunked" and r.content == b"abcd"


async def test_expect_100_continue() -> None:
    async with running(echo) as (_, port, _s):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
                                  b"expect: 100-continue\r\nconnection: close\r\n\r\n")
            with trio.fail_after(5):
                assert await stream.receive_some(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
            await stream.send_all(b"hello")
            out = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some(65536):
                    out += chunk
        assert out.startswith(b"HTTP/1.1 200") and b'"body":"hello"' in out


async def test_client_disconnect_mid_stream_closes_generator() -> None:
    finished = trio.Event()

    async def handler(req: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            try:
                yield b"data: first\n\n"
                await trio.sleep_forever()  # an engine waiting for its next token
                yield b"never"
            finally:
                finished.set()
        return Response(200, [("content-type", "text/event-stream")], gen())

    async with running(handler) as (base, _, stats), client(base) as c:
        async with c.stream("GET", "/stream") as r:
            async with aclosing(r.aiter_raw()) as chunks:
                with trio.fail_after(5):
                    assert await chunks.__anext__() == b"data: first\n\n"
        # leaving the block mid-body makes httpx drop the connection
        with trio.fail_after(5):
            await finished.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert stats.client_disconnects == 1 and stats.requests_active == 0


async def test_disconnect_while_body_blocked_on_send_acloses_generator() -> None:
    finished = trio.Event()
    ended_by: list[str] = []

    async def handler(req: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            try:
                while True:  # fill the socket: the server ends up parked in send_all
                    yield b"x" * 65536
            except GeneratorExit:
                ended_by.append("aclose")
                raise
            finally:
                finished.set()
        return Response(200, [], gen())

    async with running(handler) as (_, port, _s):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(5):
            assert await stream.receive_some(100)
        await trio.testing.wait_all_tasks_blocked()  # server blocked on a full socket
        await stream.aclose()
        with trio.fail_after(5):
            await finished.wait()
        assert ended_by == ["aclose"]


async def test_disconnect_during_slow_handler_cancels_it() -> None:
    started, cleaned_up = trio.Event(), trio.Event()

    async def handler(req: Request) -> Response:
        started.set()
        try:
            await trio.sleep_forever()  # a long non-streaming generation
        finally:
            cleaned_up.set()
        return text_response(200, "unreachable")

    async with running(handler) as (_, port, stats):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        with trio.fail_after(5):
            await started.wait()
        await stream.aclose()
        with trio.fail_after(5):
            await cleaned_up.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert stats.client_disconnects == 1 and stats.connections_open == 0


async def test_oversized_body_gets_413() -> None:
    async with running(echo, max_body_bytes=1024) as (base, _, stats), client(base) as c:
        r = await c.post("/", content=b"x" * 4096)  # Content-Length, rejected up front
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["code"] == 413 and err["type"] == "invalid_request_error" and err["param"] is None
        assert "1024" in err["message"]

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(8):
                yield b"y" * 512

        r = await c.post("/", content=chunked())  # counted while reading
        assert r.status_code == 413
        r = await c.post("/", content=b"z" * 1024)  # at the limit is fine
        assert r.status_code == 200 and len(r.json()["body"]) == 1024


async def test_garbage_gets_400_and_close() -> None:
    async with running(echo) as (_, port, stats):
        out = await raw_exchange(port, b"\x00\x01 not http at all\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400 ")
        head, body = out.split(b"\r\n\r\n", 1)
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == 400
        assert stats.requests_served == 0


async def test_custom_error_body_builder() -> None:
    def llama_cpp(status: int, message: str, kind: str) -> object:
        return {"error": {"code": status, "message": message, "type": kind}}

    async with running(echo, error_body=llama_cpp) as (_, port, _s):
        out = await raw_exchange(port, b"BAD\r\n\r\n")
        err = json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]
        assert set(err) == {"code", "message", "type"}
        assert err["code"] == 400 and err["type"] == "invalid_request_error"


async def test_handler_exception_is_500_and_server_survives(caplog: pytest.LogCaptureFixture) -> None:
    async def handler(req: Request) -> Response:
        if req.path == "/boom":
            raise RuntimeError("kaboom")
        return text_response(200, "fine")

    caplog.set_level(logging.ERROR, logger="llmgw.daemon.net.httpserver")
    async with running(handler) as (base, _, stats), client(base) as c:
        r = await c.get("/boom")
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "Internal server error", "type": "server_error",
                                     "param": None, "code": 500}
        r = await c.get("/ok")  # same keep-alive connection still works
        assert r.text == "fine"
        assert stats.handler_errors == 1 and stats.connections_total == 1
    excs = [rec.exc_info[1] for rec in caplog.records if rec.exc_info]
    assert len(excs) == 1 and "kaboom" in str(excs[0])  # logged with its traceback


async def test_slow_head_gets_408_and_idle_connection_is_closed() -> None:
    async with running(echo, request_timeout=0.2, keepalive_timeout=0.2) as (_, port, _s):
        out = await raw_exchange(port, b"GET / HTTP/1.1\r\nhost:")  # never finishes the head
        assert out.startswith(b"HTTP/1.1 408 ")
        assert await raw_exchange(port, b"") == b""  # idle: closed without a word


async def test_head_request_has_no_body() -> None:
    async with running(echo) as (_, port, _s):
        out = await raw_exchange(port, b"HEAD / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        head, body = out.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200") and b"content-length: " in head and body == b""


async def test_cancelling_server_closes_everything() -> None:
    finished = trio.Event()

    async def handler(req: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            try:
                yield b"one"
                await trio.sleep_forever()
                yield b"unreachable"
            finally:
                finished.set()
        return Response(200, [], gen())

    stats = ServerStats()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_tcp, handler, "127.0.0.1", 0, stats=stats))
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(5):
            assert await stream.receive_some(1000)
        nursery.cancel_scope.cancel()
    assert finished.is_set()  # the nursery exit waited for the stream's cleanup
    assert stats.connections_open == 0 and stats.requests_active == 0
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(5):
        while await stream.receive_some(1000):  # server side is closed: EOF
            pass
    await stream.aclose()


async def test_unix_socket(tmp_path) -> None:
    sockdir = tmp_path / "run"
    sockdir.mkdir(mode=0o700)
    path = str(sockdir / "llmgw.sock")
    async with trio.open_nursery() as nursery:
        assert await nursery.start(partial(serve_unix, echo, path)) == path
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmgw", timeout=10) as c:
            r = await c.post("/x?k=v", content=b"hi")
            assert r.json()["body"] == "hi" and r.json()["query"] == {"k": "v"}
            assert r.json()["client"] == []  # no peer address on Unix sockets
        with pytest.raises(OSError):  # a live server is not clobbered
            await serve_unix(echo, path)
        nursery.cancel_scope.cancel()
    assert not os.path.exists(path)
    # a stale socket file left by a crash is replaced
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_unix, echo, path))
        nursery.cancel_scope.cancel()


def test_request_helpers() -> None:
    req = Request("GET", "/p?a=1&a=2&b=&c=%2F", "/p", "a=1&a=2&b=&c=%2F",
                  [("x-one", "1"), ("x-one", "2")], b'{"k": 1}', None)
    assert req.header("X-One") == "1" and req.header("missing") is None
    assert req.query_params() == {"a": "2", "b": "", "c": "/"}
    assert req.json() == {"k": 1}
    r = json_response(201, {"a": [1, 2]}, headers=[("x-y", "z")])
    assert r.body == b'{"a":[1,2]}' and r.headers == [("content-type", "application/json"), ("x-y", "z")]


# ---------------------------------------------------------------- the codec's edges, over the wire

@pytest.mark.parametrize("raw, status", [
    (b"GET / HTTP/2.0\r\nhost: x\r\n\r\n", 505),
    (b"GET / HTTP/1.1\r\nhost: x\r\nx: " + b"a" * 2000 + b"\r\n\r\n", 431),
    (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n", 501),
    (b"GET / HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"GET / HTTP/1.1\r\nhost: x\r\nx: a\x01b\r\n\r\n", 400),
])
async def test_refused_requests_get_their_status_and_close(raw: bytes, status: int) -> None:
    async with running(echo, max_head_bytes=1024) as (_, port, stats):
        out = await raw_exchange(port, raw)
        head, body = out.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 %d " % status) and b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == status
        assert stats.requests_served == 0


async def test_chunked_request_body_and_100_continue() -> None:
    async with running(echo) as (_, port, _s):
        out = await raw_exchange(port, b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                                       b"connection: close\r\n\r\n5;x=y\r\nhello\r\n1\r\n!\r\n0\r\nt: 1\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200") and b'"body":"hello!"' in out
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                                  b"expect: 100-continue\r\nconnection: close\r\n\r\n")
            with trio.fail_after(5):
                assert await stream.receive_some(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
            await stream.send_all(b"2\r\nhi\r\n0\r\n\r\n")
            out = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some(65536):
                    out += chunk
        assert out.startswith(b"HTTP/1.1 200") and b'"body":"hi"' in out


async def test_invalid_response_from_handler_is_500(caplog: pytest.LogCaptureFixture) -> None:
    closed = trio.Event()

    async def handler(req: Request) -> Response:
        if req.path == "/bad-header":
            return Response(200, [("x-bad", "a\r\nInjected: yes")], b"ok")
        if req.path == "/bad-stream":
            async def gen() -> AsyncIterator[bytes]:
                try:
                    yield b"never sent"
                finally:
                    closed.set()
            g = gen()
            await g.__anext__()  # started, so that aclose() runs its finally
            return Response(200, [("bad name", "v")], g)
        if req.path == "/204-with-body":
            return Response(204, [], b"body")
        return text_response(200, "fine")

    caplog.set_level(logging.ERROR, logger="llmgw.daemon.net.httpserver")
    async with running(handler) as (base, _, stats), client(base) as c:
        for path in ("/bad-header", "/bad-stream", "/204-with-body"):
            r = await c.get(path)
            assert r.status_code == 500 and "Injected" not in r.headers
            assert r.json()["error"]["message"] == "Internal server error"
        assert closed.is_set()
        r = await c.get("/ok")  # the connection is still good
        assert r.text == "fine" and stats.connections_total == 1 and stats.handler_errors == 3


async def test_stream_not_matching_its_content_length_is_cut(caplog: pytest.LogCaptureFixture) -> None:
    async def handler(req: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            yield b"abcd"
        return Response(200, [("content-length", req.query)], gen())

    caplog.set_level(logging.ERROR, logger="llmgw.daemon.net.httpserver")
    async with running(handler) as (_, port, stats):
        for declared in (b"10", b"2"):
            out = await raw_exchange(port, b"GET /?%s HTTP/1.1\r\nhost: x\r\n\r\n" % declared)  # closes
            head, body = out.split(b"\r\n\r\n", 1)
            assert b"content-length: %s" % declared in head and len(body) <= 4
        assert stats.handler_errors == 2 and stats.requests_served == 0


async def test_a_body_that_aborts_ends_the_response_unfinished(caplog: pytest.LogCaptureFixture) -> None:
    from llmgw.http1.sinks import BodyAborted

    async def handler(req: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            yield b"half"
            raise BodyAborted("the source broke off")
        return Response(200, [], gen())

    caplog.set_level(logging.ERROR, logger="llmgw.daemon.net.httpserver")
    async with running(handler) as (_, port, stats):
        out = await raw_exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")  # the server closes
        assert out.endswith(b"\r\n\r\n4\r\nhalf\r\n")  # no last chunk
        with pytest.raises(trio.BrokenResourceError):  # HTTP/1.0: reset, not a clean end
            await raw_exchange(port, b"GET / HTTP/1.0\r\n\r\n")
        await trio.testing.wait_all_tasks_blocked()
        assert stats.responses_aborted == 2 and stats.handler_errors == 0 and stats.requests_served == 0
    assert not caplog.records


async def test_stream_that_produces_at_once_is_coalesced_and_complete() -> None:
    async def handler(req: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            for i in range(100):
                yield b"%d," % i
                if i % 30 == 29:
                    await trio.sleep(0)  # a pause: what is held goes out first
        return Response(200, [("content-type", "text/plain")], gen())

    async with running(handler) as (base, port, _s):
        async with client(base) as c:
            r = await c.get("/")
            assert r.content == b"".join(b"%d," % i for i in range(100))
            assert r.headers["transfer-encoding"] == "chunked"

    async def quick(req: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            yield b"first"
            yield b"second"
        return Response(200, [], gen())

    async with running(quick) as (_, port, _s):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(5):
                data = await stream.receive_some(65536)
        # head, both chunks and the end of the body in one send(), so one segment
        assert data.endswith(b"\r\n\r\n5\r\nfirst\r\n6\r\nsecond\r\n0\r\n\r\n"), data


async def test_send_now_hands_what_the_socket_refuses_to_a_flusher_task() -> None:
    from llmgw.daemon.net.http_conn import _Conn
    from llmgw.http1.server import RequestParser

    a, b = trio.socket.socketpair()
    out = socket.socket(fileno=a.fileno())
    try:
        out.setblocking(False)
        c = _Conn(out, RequestParser(), None)
        got = bytearray()
        async with trio.open_nursery() as nursery:
            c.nursery = nursery
            c.pending = b"x" * 2_000_000  # far more than the socket buffer
            c.send_now()
            assert c.flushing is not None and c.pending == b""
            c.pending = b"y" * 10
            c.send_now()  # queued behind the flusher's bytes
            nursery.start_soon(c.write, b"z")  # waits for the flusher
            with trio.fail_after(10):
                while len(got) < 2_000_011:
                    got += await b.recv(65536)
        assert got == b"x" * 2_000_000 + b"y" * 10 + b"z" and c.flushing is None and not c.eof

        c.pending = b"x" * 2_000_000
        async with trio.open_nursery() as nursery:
            c.nursery = nursery
            c.send_now()
            b.close()  # the peer leaves with the flusher's bytes unsent
        assert c.eof and c.scope.cancel_called and c.flushing is None
    finally:
        out.detach()
        a.close()
        b.close()


async def test_last_chunk_does_not_wait_for_a_slow_aclose() -> None:
    released = trio.Event()

    class Body:
        def __init__(self) -> None:
            self.done = False

        def __aiter__(self) -> Body:
            return self

        async def __anext__(self) -> bytes:
            if self.done:
                raise StopAsyncIteration
            self.done = True
            return b"last"

        async def aclose(self) -> None:
            await released.wait()  # cleanup that ends only once the client has "last"

    async def handler(req: Request) -> Response:
        return Response(200, [], Body())

    async with running(handler) as (_, port, _s):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            out = b""
            with trio.fail_after(5):
                while b"4\r\nlast\r\n" not in out:
                    out += await stream.receive_some(65536)
                assert not out.endswith(b"0\r\n\r\n")  # the end comes after the cleanup
                released.set()
                while not out.endswith(b"0\r\n\r\n"):
                    out += await stream.receive_some(65536)


# ------------------------------------------------------------------------------ RelayBody
class Relayed:
    """A RelayBody: writes ``pieces`` into the sink, optionally parks forever after them."""

    def __init__(self, pieces: list[bytes], park: bool = False, end: bool = False) -> None:
        self.pieces, self.park, self.end = pieces, park, end  # end: the last piece ends the body
        self.relayed = self.closed = self.cancelled = False
        self.finished = trio.Event()
        self.sink_full = 0

    async def relay(self, sink) -> None:
        self.relayed = True
        try:
            for i, p in enumerate(self.pieces):
                if not sink.send_nowait(p, self.end and i == len(self.pieces) - 1):
                    self.sink_full += 1
                    await sink.drain()
            if self.park:
                sink.flush_nowait()
                await trio.sleep_forever()  # an engine waiting for its next token
        except trio.Cancelled:
            self.cancelled = True
            raise
        finally:
            self.finished.set()

    async def aclose(self) -> None:
        self.closed = True


async def test_relay_body_is_framed_and_the_connection_kept() -> None:
    bodies: list[Relayed] = []

    async def handler(req: Request) -> Response:
        bodies.append(Relayed([b"data: one\n\n", b"data: two\n\n"], end=req.path == "/end"))
        return Response(200, [("content-type", "text/event-stream")], bodies[-1])

    async with running(handler) as (_, port, stats):
        raw = (b"GET / HTTP/1.1\r\nhost: x\r\n\r\nGET /end HTTP/1.1\r\nhost: x\r\n\r\n"
               b"HEAD / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        out = await raw_exchange(port, raw)
        first, second, third = out.split(b"0\r\n\r\n", 2)
        for resp in (first, second):  # the end written by the server, or with the last piece
            assert resp.endswith(b"\r\n\r\nb\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n")
            assert b"transfer-encoding: chunked" in resp.lower()
        assert third.startswith(b"HTTP/1.1 200") and third.endswith(b"\r\n\r\n")  # HEAD: no body
        assert bodies[0].relayed and not bodies[0].closed and bodies[1].relayed
        assert not bodies[2].relayed and bodies[2].closed  # HEAD: aclose() instead of relay()
        assert stats.requests_served == 3


async def test_relay_body_backpressure_loses_nothing() -> None:
    body = Relayed([b"%06d" % i * 10_000 for i in range(300)])  # 18 MB: more than the socket buffers hold

    async def handler(req: Request) -> Response:
        return Response(200, [], body)

    async with running(handler) as (_, port, _s):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            with trio.fail_after(10):
                while not body.sink_full:  # not reading: the relay must wait in drain()
                    await trio.sleep(0.01)
                out = bytearray()
                while data := await stream.receive_some(1 << 20):
                    out += data
        rest = bytes(out).partition(b"\r\n\r\n")[2]
        got, pos = b"", 0
        while True:  # de-chunk
            nl = rest.index(b"\r\n", pos)
            size = int(rest[pos:nl], 16)
            if not size:
                break
            got += rest[nl + 2:nl + 2 + size]
            pos = nl + 4 + size
        assert got == b"".join(body.pieces)


async def test_client_disconnect_cancels_a_relay_body() -> None:
    body = Relayed([b"data: first\n\n"], park=True)

    async def handler(req: Request) -> Response:
        return Response(200, [("content-type", "text/event-stream")], body)

    async with running(handler) as (base, _, stats), client(base) as c:
        async with c.stream("GET", "/stream") as r, aclosing(r.aiter_raw()) as chunks:
            with trio.fail_after(5):
                assert await chunks.__anext__() == b"data: first\n\n"
        with trio.fail_after(5):
            await body.finished.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert body.cancelled and not body.closed
        assert stats.client_disconnects == 1 and stats.requests_active == 0


async def test_half_close_right_after_the_request_counts_as_leaving() -> None:
    # The request and the FIN usually arrive together: the read that gets the request
    # must not miss the EOF queued behind it (an edge-triggered reader gets no second
    # edge), or the connection would hang.  Whether the handler starts before the EOF
    # is seen is a race; if it does, it is cancelled.
    started, cleaned_up = trio.Event(), trio.Event()

    async def handler(req: Request) -> Response:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cleaned_up.set()
        return text_response(200, "unreachable")

    async with running(handler) as (_, port, stats):
        for i in range(6):
            s = trio.socket.socket()
            await s.connect(("127.0.0.1", port))
            with s:
                if i % 2:
                    await trio.sleep(0.05)  # the server is watching before anything arrives
                await s.send(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
                s.shutdown(socket.SHUT_WR)
                with trio.fail_after(5):
                    assert await s.recv(65536) == b""  # the server closed: it took that as leaving
                    if started.is_set():
                        await cleaned_up.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert stats.requests_active == 0 and stats.connections_open == 0 and stats.requests_served == 0


# -- connection bounds (llmgw.daemon.net.http_limits) ---------------------------------------------
async def wait_until(pred, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.005)


async def read_to_eof(stream: trio.SocketStream) -> bytes:
    out = b""
    with trio.fail_after(5):
        try:
            while chunk := await stream.receive_some(65536):
                out += chunk
        except trio.BrokenResourceError:
            pass
    return out


async def test_at_the_cap_the_connection_waiting_longest_makes_room() -> None:
    async with running(echo, max_connections=3) as (_, port, stats):
        idle = []
        for _ in range(3):
            idle.append(await trio.open_tcp_stream("127.0.0.1", port))
            await wait_until(lambda: stats.connections_open == len(idle))
        await idle[2].send_all(b"GET /a HTTP/1.1\r\nhost: x\r\n")  # a request under way: waits too
        async with client(f"http://127.0.0.1:{port}") as c:
            r = await c.get("/served")  # the 4th connection: the oldest idle one is closed for it
            assert r.status_code == 200 and r.json()["path"] == "/served"
            assert await read_to_eof(idle[0]) == b""  # closed without a word: it had asked nothing
            r = await c.get("/again")  # the same keep-alive connection: no room needed
            assert r.status_code == 200
        assert stats.connections_evicted == 1 and stats.connections_refused == 0
        await idle[1].send_all(b"GET /b HTTP/1.1\r\nhost: x\r\n\r\n")  # not closed: still served
        assert (await idle[1].receive_some(65536)).startswith(b"HTTP/1.1 200")
        for s in idle:
            await s.aclose()


async def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503() -> None:
    release = trio.Event()

    async def slow(req: Request) -> Response:
        await release.wait()
        return text_response(200, "done")

    async with running(slow, max_connections=2) as (_, port, stats), trio.open_nursery() as nursery:
        busy = []

        async def hold() -> None:
            async with client(f"http://127.0.0.1:{port}") as c:
                busy.append((await c.get("/")).status_code)

        nursery.start_soon(hold)
        nursery.start_soon(hold)
        await wait_until(lambda: stats.requests_active == 2)
        out = await raw_exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head
        assert "connection limit" in json.loads(body)["error"]["message"]
        assert stats.connections_refused == 1 and stats.connections_evicted == 0
        release.set()
        await wait_until(lambda: busy == [200, 200])


async def test_a_new_connection_must_send_its_first_byte_in_time() -> None:
    async with running(echo, first_request_timeout=0.2) as (_, port, stats):
        assert await raw_exchange(port, b"") == b""  # closed by the server, without a word
        assert stats.connections_idle_closed == 1
        async with client(f"http://127.0.0.1:{port}") as c:  # one that asks in time is served
            assert (await c.get("/")).status_code == 200
