"""The cheap /metrics readings (issue 25): `prom.select` on bytes picks the same lines as the
decoded-text scan, and `MetricReader` gives the result `contract.scrape` gives for every body —
reusing the last result, the same object, when the body or the contract's lines are unchanged."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from llmgw.config import MetricNames
from llmgw.route.contract import ScrapeResult, contract_for, evaluate, scrape
from llmgw.route.metric_reader import KEEP_BODY_BYTES, MetricReader
from llmgw.route.prom import NotPrometheusText, parse, select

from .test_contract import llama_body, vllm_body

# Lines whose names share a prefix with the contract's (they must not be picked), and the rest of
# what a real vLLM /metrics serves beside its engine families.
NOISE = (b'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 3.0\n'
         b'vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.76e9\n'
         b'vllm:kv_cache_usage_percent 0.9\n'
         b'# HELP http_requests_total Total number of requests by method, status and handler.\n'
         b'# TYPE http_requests_total counter\n'
         b'http_requests_total{handler="/metrics",method="GET",status="2xx"} 41.0\n'
         b'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0\n'
         b'process_cpu_seconds_total 12.5\n')


def _vllm_bodies() -> list[tuple[str, bytes]]:
    info = {"num_gpu_blocks": "2048", "block_size": "16", "enable_prefix_caching": "True"}
    out = [("vllm 0.12", vllm_body()),
           ("vllm 0.10.1 old names", vllm_body((0, 10, 1), kv=0.5)),
           ("vllm 0.11 hidden old", vllm_body((0, 11, 0), show_hidden_old=True)),
           ("vllm lora", vllm_body(lora_enabled=True, max_loras=2, loras=({"a", "b"}, {"c"}))),
           ("vllm cache info", vllm_body(success={"stop": 3, "abort": 1}, cache_info=info)),
           ("vllm dp", vllm_body(engine="0") + vllm_body(engine="1", running=5)),
           ("vllm with noise", vllm_body(cache_info=info) + NOISE),
           ("vllm noise first", NOISE + vllm_body()),
           ("vllm crlf", vllm_body().replace(b"\n", b"\r\n")),
           ("vllm indented", b"\n".join(b"  \t" + ln for ln in vllm_body().split(b"\n"))),
           ("vllm first line wanted", b"vllm:num_requests_running 7\n" + vllm_body())]
    return out


BODIES: list[tuple[str, str, bytes]] = [
    *(("vllm", name, body) for name, body in _vllm_bodies()),
    ("llamacpp", "llama.cpp", llama_body().encode()),
    ("llamacpp", "llama.cpp old build", llama_body().encode() + b"llamacpp:kv_cache_usage_ratio 0.3\n"),
    ("vllm", "empty", b""),
    ("vllm", "blank", b"\n\n  \n"),
    ("vllm", "html", b"<html><body>502 Bad Gateway</body></html>"),
    ("vllm", "html after blanks", b"  \n\t<html>"),
    ("vllm", "html after a control character", b"\x1c<html>"),
    ("vllm", "json", b'{"error": "nope"}'),
    ("vllm", "nul", b"vllm:num_requests_running 1\x00\n"),
    ("vllm", "garbage", b"this is not\nprometheus text\n"),
    ("vllm", "comments only", b"# nothing here\n"),
    ("vllm", "no wanted line", b"other_metric 1\n"),
    ("vllm", "bad values", b"vllm:num_requests_running abc\nvllm:num_requests_waiting 1\n"),
    ("vllm", "latin-1 label", b'vllm:num_requests_running{model_name="caf\xe9"} 2\nvllm:num_requests_waiting 0\n'),
]


@pytest.mark.parametrize("kind,name,body", BODIES, ids=[b[1] for b in BODIES])
def test_bytes_and_text_select_the_same_lines(kind: str, name: str, body: bytes) -> None:
    names = contract_for(kind).names()
    try:
        text_lines = select(body.decode("utf-8", errors="replace"), names)
    except NotPrometheusText as e:
        with pytest.raises(NotPrometheusText) as got:
            select(body, names)
        assert str(got.value) == str(e)
        return
    assert select(body, names) == text_lines


@pytest.mark.parametrize("kind,name,body", BODIES, ids=[b[1] for b in BODIES])
def test_a_reader_gives_what_scrape_gives(kind: str, name: str, body: bytes) -> None:
    expected = scrape(kind, None, body.decode("utf-8", errors="replace"))  # the text path, as before
    reader = MetricReader(kind, None)
    assert reader.read(body) == expected
    assert reader.read(body) == expected  # again: the same answer
    assert scrape(kind, None, body) == expected
    try:
        full = parse(body)
    except NotPrometheusText:
        assert expected.errors and expected.errors[0].startswith("not Prometheus text")
        return
    if "noise" not in name and "bad values" not in name and "garbage" not in name:
        # the whole body parsed gives the same reading as the lines the contract reads
        assert evaluate(kind, None, full) == expected


def test_an_identical_body_is_not_read_again() -> None:
    body = llama_body().encode()
    assert len(body) <= KEEP_BODY_BYTES
    reader = MetricReader("llamacpp", None)
    first = reader.read(body)
    assert reader.changed
    again = reader.read(bytes(body))  # equal bytes, another object
    assert again is first and not reader.changed
    moved = reader.read(llama_body(processing=3).encode())
    assert moved is not first and reader.changed and moved.running == 3.0


def test_a_body_whose_contract_lines_stand_still_is_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import llmgw.route.metric_reader as mr
    reader = MetricReader("vllm", None)
    first = reader.read(vllm_body() + NOISE)
    assert len(vllm_body() + NOISE) > 0 and reader.changed

    def no_parse(*a: Any) -> Any:
        raise AssertionError("parsed again")

    monkeypatch.setattr(mr, "parse_selected", no_parse)
    # another line moved (vLLM counts every read of /metrics): the contract's lines did not
    again = reader.read(vllm_body() + NOISE.replace(b"} 41.0", b"} 42.0"))
    assert again is first and not reader.changed
    monkeypatch.undo()
    moved = reader.read(vllm_body(waiting=9) + NOISE)
    assert moved is not first and moved.waiting == 9.0 and reader.changed


def test_a_big_body_is_not_kept_but_its_lines_still_spare_the_parse() -> None:
    pad = b"".join(b'vllm:iteration_tokens_total_bucket{le="%d"} 0.0\n' % i for i in range(2000))
    body = vllm_body() + pad
    assert len(body) > KEEP_BODY_BYTES
    reader = MetricReader("vllm", None)
    first = reader.read(body)
    assert reader._body is None  # not kept: 512 replicas' bodies would be 25 MB
    assert reader.read(body) is first and not reader.changed


def test_errors_are_read_fresh_and_recovery_is_seen() -> None:
    reader = MetricReader("vllm", None)
    bad = reader.read(b"<html>oops</html>")
    assert bad.errors and bad.errors[0].startswith("not Prometheus text")
    assert reader.read(b"<html>oops</html>").errors == bad.errors
    good = reader.read(vllm_body())
    assert good.ok and good is not bad and reader.changed
    # a body missing a mandatory metric: an error on the result, the same each time
    missing = b"vllm:num_requests_running 1\n"
    r1 = reader.read(missing)
    assert r1.errors == scrape("vllm", None, missing).errors
    assert reader.read(missing + b"other 2\n") is r1  # same contract lines: the same result


def test_a_reader_follows_its_engine_and_overrides() -> None:
    reader = MetricReader("vllm", None)
    assert reader.for_engine("vllm", None) is reader
    other = reader.for_engine("llamacpp", None)
    assert other is not reader and other.kind == "llamacpp"
    names = MetricNames(running="my_running")
    mine = reader.for_engine("vllm", names)
    assert mine is not reader and mine.for_engine("vllm", names) is mine
    body = b"my_running 4\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\n"
    assert mine.read(body) == scrape("vllm", names, body) and mine.read(body).running == 4.0


def test_a_reused_result_is_equal_to_a_fresh_one() -> None:
    reader = MetricReader("vllm", None)
    r = reader.read(vllm_body())
    fresh = scrape("vllm", None, vllm_body())
    assert r == fresh and replace(r) == fresh and isinstance(r, ScrapeResult)
