"""parse_body's decoder (msgspec first, json behind it) and what it costs nothing to keep: the
same objects and the same errors as json.loads alone, the depth bound, the request head's limit,
and the usage tap's body rewrite without a re-encode of the body."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.daemon.router.usage_tap import with_include_usage
from llmgw.route.openai_req import MAX_DEPTH, ApiError, _deeper_than, decode_json, parse_body
from llmgw.route.request_head import request_head

_scalars = (st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
            | st.floats(allow_nan=False) | st.text())
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                       max_leaves=20)
_ws = st.sampled_from(["", " ", "\n", "\t", "\r\n  "])


def _dump(v: Any, ws: st.DataObject) -> str:
    """JSON text of ``v`` with whitespace drawn between tokens, ASCII or not."""
    sp = ws.draw(_ws)
    if isinstance(v, dict):
        items = [f"{sp}{json.dumps(k, ensure_ascii=ws.draw(st.booleans()))}{sp}:{sp}{_dump(x, ws)}"
                 for k, x in v.items()]
        return "{" + ",".join(items) + sp + "}"
    if isinstance(v, list):
        return "[" + ",".join(sp + _dump(x, ws) for x in v) + sp + "]"
    return json.dumps(v, ensure_ascii=ws.draw(st.booleans()))


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and (a == b or repr(a) == repr(b)) and json.dumps(a) == json.dumps(b)


@settings(max_examples=300, deadline=None)
@given(_values, st.data())
def test_decoding_agrees_with_json_loads(v: Any, ws: st.DataObject) -> None:
    raw = _dump(v, ws).encode("utf-8", "surrogatepass")
    try:
        want: Any = ("ok", json.loads(raw))
    except (ValueError, RecursionError) as e:
        want = ("err", type(e), str(e))
    try:
        got: Any = ("ok", decode_json(raw))
    except (ValueError, RecursionError) as e:
        got = ("err", type(e), str(e))
    assert got[0] == want[0] and (got[1:] == want[1:] if got[0] == "err" else _same(got[1], want[1]))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40) | st.text(alphabet='{}[]":,0123456789.eE+-tfnrul aNI\\\\ud80\x00é', max_size=30)
       .map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_whatever_bytes_come_json_loads_answer_stands(raw: bytes) -> None:
    try:
        want: Any = ("ok", json.loads(raw))
    except (ValueError, RecursionError) as e:
        want = ("err", type(e), str(e))
    try:
        got: Any = ("ok", decode_json(raw))
    except (ValueError, RecursionError) as e:
        got = ("err", type(e), str(e))
    assert got[0] == want[0] and (got[1:] == want[1:] if got[0] == "err" else _same(got[1], want[1]))


@pytest.mark.parametrize("raw", [b"NaN", b'{"a": [NaN, Infinity]}', b"1e400", b'"\\ud800"', b"\xef\xbb\xbf{}",
                                 '{"a": "é"}'.encode("utf-16"), b"1" * 5000, b'{"a":"\xed\xa0\x80"}'])
def test_what_msgspec_refuses_json_reads_as_before(raw: bytes) -> None:
    try:
        want: Any = ("ok", json.loads(raw))
    except ValueError as e:
        want = ("err", str(e))
    try:
        got: Any = ("ok", decode_json(raw))
    except ValueError as e:
        got = ("err", str(e))
    assert repr(got) == repr(want)


def _old_deeper_than(obj: Any, limit: int) -> bool:
    if not isinstance(obj, (dict, list)):
        return False
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in (o.values() if isinstance(o, dict) else o) if isinstance(c, (dict, list)))
    return False


@settings(max_examples=200, deadline=None)
@given(_values, st.integers(1, 6))
def test_the_level_walk_measures_depth_as_the_stack_walk_did(v: Any, limit: int) -> None:
    assert _deeper_than(v, limit) == _old_deeper_than(v, limit)


@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 500, 5000, 100000])
@pytest.mark.parametrize("pad", [0, 20000])  # a short body (bracket counts first) and a long one (the walk)
def test_depth_is_bounded_with_the_same_message(depth: int, pad: int) -> None:
    inner = b"[" * (depth - 1) + b"]" * (depth - 1)
    raw = b'{"model": "m", "messages": [], "x": ' + (inner or b"0") + b', "p": "' + b"a" * pad + b'"}'
    if depth <= MAX_DEPTH:
        assert parse_body(raw, kind="chat").model == "m"
    else:
        with pytest.raises(ApiError) as e:
            parse_body(raw, kind="chat")
        assert e.value.status == 400 and e.value.message == \
            f"Request body is nested too deeply (more than {MAX_DEPTH} levels)."


def test_invalid_json_keeps_jsons_message() -> None:
    for raw in (b"{", b'{"model": "m",}', b"\xff", b"[1, 2"):
        with pytest.raises(ApiError) as e:
            parse_body(raw, kind="chat")
        try:
            json.loads(raw)
        except ValueError as err:
            assert e.value.message == f"Request body is not valid JSON: {err}"


# -- the request head's limit ----------------------------------------------------------------
_content = st.text(max_size=40) | st.none() | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}) | st.text(max_size=5), max_size=3)
_msg = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                              "content": _content},
                             optional={"name": st.text(max_size=5), "tool_call_id": st.text(max_size=5)})


@settings(max_examples=300, deadline=None)
@given(st.lists(_msg | st.integers(), max_size=6), st.none() | st.lists(st.dictionaries(st.text(max_size=3), st.integers()),
                                                                         max_size=2), st.integers(0, 300))
def test_a_limited_chat_head_is_the_whole_heads_start(msgs: list[Any], tools: Any, limit: int) -> None:
    body: dict[str, Any] = {"messages": msgs}
    if tools is not None:
        body["tools"] = tools
    assert request_head(body, "chat", limit) == request_head(body, "chat")[:limit]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60) | st.lists(st.integers(-5, 2**33), max_size=40) | st.lists(st.text(max_size=30), max_size=3),
       st.integers(0, 200), st.sampled_from([("completions", "prompt"), ("embeddings", "input")]))
def test_a_limited_prompt_head_is_the_whole_heads_start(p: Any, limit: int, kind: tuple[str, str]) -> None:
    body = {kind[1]: p}
    assert request_head(body, kind[0], limit) == request_head(body, kind[0])[:limit]


# -- the usage tap's rewrite: the bytes spliced, never the body encoded again ----------------
_opts = st.dictionaries(st.sampled_from(["include_usage", "continuous_usage_stats", "x"]), _scalars, max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8).filter(lambda k: k != "stream_options"), _values, max_size=4),
       st.none() | _opts, st.booleans(), st.data())
def test_include_usage_is_spliced_into_the_clients_bytes(body: dict[str, Any], opts: Any, twice: bool,
                                                         ws: st.DataObject) -> None:
    members = [(json.dumps(k, ensure_ascii=ws.draw(st.booleans())), _dump(v, ws)) for k, v in {"model": "m", **body}.items()]
    if opts is not None:  # the member anywhere among the others, maybe twice (the last one counts)
        at = ws.draw(st.integers(0, len(members)))
        members.insert(at, ('"stream_options"', _dump(opts, ws)))
        if twice:
            members.insert(ws.draw(st.integers(0, at)), ('"stream_options"', '{"first": [1]}'))
    text = "{" + ",".join(ws.draw(_ws) + k + ws.draw(_ws) + ":" + ws.draw(_ws) + v + ws.draw(_ws)
                          for k, v in members) + "}" + ws.draw(_ws)
    raw = text.encode("utf-8", "surrogatepass")
    parsed = json.loads(raw)
    out = with_include_usage(raw, parsed)
    assert out is not None
    want = {**parsed, "stream_options": {**(parsed.get("stream_options") or {}), "include_usage": True}}
    assert json.dumps(json.loads(out), sort_keys=True) == json.dumps(want, sort_keys=True)
    top = json.loads(out, object_pairs_hook=lambda pairs: pairs)  # every member, duplicates kept
    assert [k for k, _ in top].count("stream_options") == 1  # said once: no parser has to pick
    if opts is None:
        assert out.startswith(raw.rstrip()[:-1])  # the client's bytes as they came, one member added


def test_the_body_is_not_encoded_again() -> None:
    """The messages' bytes reach the engine as the client wrote them (spacing, escapes)."""
    raw = b'{ "model" : "m", "messages" : [ {"role": "user", "content": "caf\\u00e9 \\/ x"} ],\n "stream_options": {"x": 1} }'
    out = with_include_usage(raw, json.loads(raw))
    assert out is not None and b'[ {"role": "user", "content": "caf\\u00e9 \\/ x"} ]' in out
    assert json.loads(out)["stream_options"] == {"x": 1, "include_usage": True}
