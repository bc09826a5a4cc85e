"""Fuzz the OpenAI request path: arbitrary JSON bodies (and arbitrary bytes), paths, methods and
headers through the router's HTTP handler and core (``Router.handle``), with a stand-in upstream
that answers any status and content type and may break off mid-body (as bench/walk_request.py
does, without sockets). Never a 500 and never an exception: an OpenAI-style error, or the
engine's answer relayed (or cut off as a truncated body must be); every answer's head can be
framed; the router's counts come back to zero after each request."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from llmgw.config import parse_config
from llmgw.daemon.net.httpserver import Request
from llmgw.daemon.net.upstream import UpstreamClosed, UpstreamConnectError
from llmgw.daemon.router.proxy import Router
from llmgw.http1.response_head import serialize_response_head
from llmgw.http1.sinks import BodyAborted

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CFG = """
[server]
api_keys = ["k"]
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
[[models.replicas]]
url = "http://127.0.0.1:2"
"""
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/metrics", "/health",
         "/v1/nope", "/"]
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- the stand-in upstream ----------------------------------------------------------------------
class _Resp:
    def __init__(self, status: int, content_type: str | None, body: bytes, breaks: bool) -> None:
        self.status, self.content_type, self.body, self.breaks = status, content_type, body, breaks
        self.first_byte_at: float | None = None
        self.url = "http://127.0.0.1:1"
        # what an UpstreamResponse records for the request's trace
        self.connected_at: float | None = None
        self.head_at: float | None = None
        self.last_byte_at: float | None = None
        self.body_bytes = 0

    def header(self, name: str) -> str | None:
        return self.content_type if name == "content-type" else None

    async def relay(self, sink: Any) -> None:
        sink.flush_nowait()
        if self.body:
            self.first_byte_at = trio.current_time()
            sink.send_nowait(self.body, end=not self.breaks)
            self.body_bytes += len(self.body)
        if self.breaks:
            raise UpstreamClosed("upstream closed the connection mid-response", received=True, url=self.url)

    def close(self) -> None:
        pass


class _Exchange:
    def __init__(self, answer: dict[str, Any] | None) -> None:
        self.answer = answer

    async def __aenter__(self) -> _Resp:
        a = self.answer
        if a is None:
            raise UpstreamConnectError("cannot connect to 127.0.0.1:1: refused (stand-in)", url="http://127.0.0.1:1")
        return _Resp(a["status"], a["content_type"], a["body"], a["breaks"])


class _Pool:
    def __init__(self) -> None:
        self.answers: list[dict[str, Any] | None] = []

    def stream(self, *a: Any, **kw: Any) -> _Exchange:
        return _Exchange(self.answers.pop(0) if self.answers else None)


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()
        self.ended = False

    def send_nowait(self, data: bytes, end: bool = False) -> bool:
        assert not self.ended, "bytes after the end of the body"
        self.data += data
        self.ended = end
        return True

    def flush_nowait(self) -> None:
        pass

    async def drain(self) -> None:
        pass


# -- what a client may send, what an engine may answer ------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]) | json_values},
                                          optional={"content": json_values, "name": json_values,
                                                    "tool_calls": json_values}) | json_values, max_size=4)
_fields = {"messages": messages | json_values, "prompt": st.text(max_size=20) | st.lists(st.integers(), max_size=8)
           | json_values, "input": st.text(max_size=20) | json_values, "stream": st.booleans() | json_values,
           "user": json_values, "cache_salt": json_values, "tools": json_values, "max_tokens": json_values}
bodies = st.one_of(
    st.fixed_dictionaries({"model": st.just("m"), "messages": messages, "prompt": st.text(max_size=20),
                           "input": st.text(max_size=20)},  # mostly routable
                          optional={k: v for k, v in _fields.items() if k not in ("messages", "prompt", "input")}),
    st.fixed_dictionaries({"model": st.just("m")}, optional=_fields),
    st.fixed_dictionaries({}, optional={"model": st.sampled_from(["m", "nope", ""]) | json_values, **_fields}),
    json_values)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, blacklist_characters="\x7f"),
                      max_size=40)  # what the request parser can hand over (latin-1, no controls)
_answer = st.fixed_dictionaries({
    "status": st.sampled_from([200] * 6 + [201, 400, 404, 422, 429, 500, 502, 503]),
    "content_type": st.none() | st.sampled_from(["application/json", "text/event-stream"]) | header_text,
    "body": st.binary(max_size=64), "breaks": st.booleans()})
answers = st.one_of(_answer, _answer, _answer, st.none())  # None: the connection is refused
requests = st.fixed_dictionaries({
    "path": st.sampled_from(PATHS[:3] * 4 + PATHS), "method": st.sampled_from(["POST"] * 6 + ["GET", "PUT"]),
    "auth": st.sampled_from(["Bearer k"] * 6 + ["Bearer x", None]),
    "headers": st.lists(st.tuples(st.just("x-request-id"), header_text)
                        | st.tuples(st.just("x-session-id"), header_text)
                        | st.tuples(st.just("x-llmgw-strategy"), st.sampled_from(["chat", "batch"]) | header_text),
                        max_size=3),
    "answers": st.lists(answers, min_size=1, max_size=3)})


@pytest.fixture(scope="module")
def router() -> tuple[Router, _Pool]:
    pool = _Pool()
    return Router(parse_config(CFG), pool, seed=0), pool  # type: ignore[arg-type]


def run(router: Router, pool: _Pool, r: dict[str, Any], body: bytes) -> None:
    pool.answers = list(r["answers"])
    headers = [(k, v) for k, v in r["headers"]]
    if r["auth"] is not None:
        headers.append(("authorization", r["auth"]))
    req = Request(r["method"], r["path"], r["path"], "", headers, body, ("127.0.0.1", 1))

    async def main() -> None:
        resp = await router.handle(req)
        event(f"status {resp.status}{'' if isinstance(resp.body, bytes) else ' relayed'}")
        # never a 500 of the router's own; an engine's 5xx is relayed as the engine sent it (the
        # second replica to fail the same request: poison, or the last attempt)
        assert resp.status != 500 or not isinstance(resp.body, bytes), resp.body
        # the head can be framed (else the server would answer 500)
        serialize_response_head(resp.status, resp.headers, method=req.method, body_length=None)
        if isinstance(resp.body, bytes):
            if resp.status >= 400:
                err = json.loads(resp.body)["error"]
                assert isinstance(err["message"], str) and isinstance(err["type"], str)
                assert "127.0.0.1" not in err["message"]  # no internal address to clients
            return
        sink = _Sink()
        try:
            await resp.body.relay(sink)  # type: ignore[union-attr]
        except BodyAborted:
            assert not sink.ended  # a truncated body never ends cleanly
        else:
            assert sink.ended or not sink.data

    trio.run(main)
    for rep in router.registry.all_replicas():  # every attempt was finished, once
        assert rep.view.inflight == 0, rep.id
    assert not any(router.core.queue_lengths().values())


@SETTINGS
@given(r=requests, body=bodies)
def test_any_json_body(router: tuple[Router, _Pool], r: dict[str, Any], body: Any) -> None:
    run(*router, r, json.dumps(body).encode())


@SETTINGS
@given(r=requests, body=st.binary(max_size=200) | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_bytes(router: tuple[Router, _Pool], r: dict[str, Any], body: bytes) -> None:
    run(*router, r, body)


@SETTINGS
@given(r=requests, depth=st.integers(1, 3000), opener=st.sampled_from([b"[", b'{"a":']))
def test_deep_json(router: tuple[Router, _Pool], r: dict[str, Any], depth: int, opener: bytes) -> None:
    closer = b"]" if opener == b"[" else b"}"
    inner = opener * depth + (b"1" if opener != b"[" else b"") + closer * depth
    run(*router, {**r, "path": "/v1/chat/completions", "method": "POST", "auth": "Bearer k"},
        b'{"model": "m", "messages": [], "x": ' + inner + b"}")
