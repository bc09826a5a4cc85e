"""The usage tap (llmgw/daemon/router/usage_tap.py): usage read from non-streamed bodies and from
streams however the reads split them, the usage-only chunk taken out only when the router asked
for it, and the request body asking for a stream's usage."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from llmgw.daemon.router.usage_tap import UsageTap, client_asked_usage, usage_tap, with_include_usage


class Sink:
    def __init__(self) -> None:
        self.out = b""
        self.ended = False
        self.calls = 0

    def send_nowait(self, data: bytes, end: bool = False) -> bool:
        assert not self.ended
        assert data or end, "an empty send that is not the end would end a chunked body"
        self.calls += 1
        self.out += data
        self.ended = end
        return True

    def flush_nowait(self) -> None:
        pass

    async def drain(self) -> None:
        pass


def ev(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


CHUNKS = [ev({"id": "c", "choices": [{"index": 0, "delta": {"content": w}}]}) for w in ("Hi", " the", ' "usage"')]
USAGE = {"prompt_tokens": 10, "total_tokens": 13, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
STREAM = b"".join(CHUNKS) + ev({"id": "c", "choices": [], "usage": USAGE}) + b"data: [DONE]\n\n"


def relay(body: bytes, cuts: list[int], *, stream: bool, strip: bool) -> tuple[UsageTap, Sink]:
    sink = Sink()
    tap = usage_tap(sink, stream=stream, strip=strip)
    points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    for a, b in zip(points, points[1:]):
        tap.send_nowait(body[a:b], end=b == len(body))
    if not sink.ended:
        tap.send_nowait(b"", True)
    return tap, sink


@given(st.lists(st.integers(min_value=0), max_size=12))
def test_a_streams_usage_is_read_and_its_chunk_stripped_however_reads_split_it(cuts: list[int]) -> None:
    tap, sink = relay(STREAM, cuts, stream=True, strip=True)
    assert tap.usage == (10, 4, 3)
    assert sink.out == b"".join(CHUNKS) + b"data: [DONE]\n\n"  # a content chunk that says "usage" stays


@given(st.lists(st.integers(min_value=0), max_size=12))
def test_a_usage_chunk_the_client_asked_for_stays(cuts: list[int]) -> None:
    tap, sink = relay(STREAM, cuts, stream=True, strip=False)
    assert tap.usage == (10, 4, 3) and sink.out == STREAM


def test_usage_in_a_chunk_with_choices_is_read_and_never_stripped() -> None:
    # llama.cpp's /v1/completions: its last chunk carries a choice and usage
    last = ev({"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": USAGE})
    body = CHUNKS[0] + last + b"data: [DONE]\n\n"
    tap, sink = relay(body, [5], stream=True, strip=True)
    assert tap.usage == (10, 4, 3) and sink.out == body


@given(st.lists(st.integers(min_value=0), max_size=12))
def test_a_stream_without_usage_counts_its_events(cuts: list[int]) -> None:
    body = b"".join(CHUNKS) + b"data: [DONE]\n\n"
    tap, sink = relay(body, cuts, stream=True, strip=True)
    assert tap.usage is None and tap.events == 4 and sink.out == body


def test_a_stream_cut_off_mid_event_sends_nothing_half_until_the_end() -> None:
    sink = Sink()
    tap = UsageTap(sink, stream=True, strip=True)
    tap.send_nowait(CHUNKS[0] + CHUNKS[1][:10])
    assert sink.out == CHUNKS[0]  # the whole event now; the half one waits for its rest
    tap.send_nowait(b"", True)  # the end (e.g. an error event follows in the proxy): what was held goes
    assert sink.out == CHUNKS[0] + CHUNKS[1][:10]


@given(st.lists(st.integers(min_value=0), max_size=6))
def test_a_non_streamed_bodys_usage_is_read(cuts: list[int]) -> None:
    body = json.dumps({"id": "x", "choices": [{"message": {"content": 'say "usage": {"prompt_tokens": 99}'}}],
                       "usage": USAGE, "prompt_logprobs": None}).encode()
    tap, sink = relay(body, cuts, stream=False, strip=True)
    assert tap.usage == (10, 4, 3) and sink.out == body


def test_a_large_body_keeps_only_its_tail() -> None:
    body = json.dumps({"data": [{"embedding": [0.125] * 50000}], "usage": {"prompt_tokens": 7, "total_tokens": 7}})
    tap, sink = relay(body.encode(), list(range(0, len(body), 4096)), stream=False, strip=False)
    assert tap.usage == (7, 0, 0) and len(tap.tail) <= 16384


def test_malformed_usage_is_no_usage() -> None:
    for u in ({"prompt_tokens": "10"}, {"prompt_tokens": -1}, [], {"completion_tokens": 3}):
        tap, _ = relay(json.dumps({"usage": u}).encode(), [], stream=False, strip=False)
        assert tap.usage is None, u
    tap, _ = relay(b'{"usage": {"prompt_tokens": 1, ', [], stream=False, strip=False)
    assert tap.usage is None
    tap, _ = relay(b'{"choices": [{"text": "usage"}], "usage" :\n {"prompt_tokens": 2}}', [], stream=False, strip=False)
    assert tap.usage == (2, 0, 0)  # a value "usage" is no member; spaces around the colon are
    tap, sink = relay(ev({"choices": [{"text": "usage"}]}) + b"data: [DONE]\n\n", [], stream=True, strip=True)
    assert tap.usage is None and sink.out.count(b"data:") == 2


def test_the_body_asks_for_usage() -> None:
    body = {"model": "m", "stream": True}
    raw = json.dumps(body).encode() + b"\n"
    assert json.loads(with_include_usage(raw, body)) == {**body, "stream_options": {"include_usage": True}}
    kept = {**body, "stream_options": {"continuous_usage_stats": True, "include_usage": False}}
    assert json.loads(with_include_usage(json.dumps(kept).encode(), kept))["stream_options"] == \
        {"continuous_usage_stats": True, "include_usage": True}
    bad = {**body, "stream_options": "yes"}
    assert with_include_usage(json.dumps(bad).encode(), bad) is None  # the engine's 400 stays the client's
    assert client_asked_usage({"stream_options": {"include_usage": True}})
    assert not client_asked_usage({"stream_options": {"include_usage": 1}}) and not client_asked_usage({})
