"""The tolerant Prometheus text parser."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.route.prom import NotPrometheusText, Sample, index, parse

BASIC = b"""\
# HELP http_requests_total The total number of HTTP requests.
# TYPE http_requests_total counter
http_requests_total{method="post",code="200"} 1027 1395066363000
http_requests_total{method="post",code="400"}    3 1395066363000

# Escaping in label values:
msdos_file_access_time_seconds{path="C:\\\\DIR\\\\FILE.TXT",error="Cannot find file:\\n\\"FILE.TXT\\""} 1.458255915e9

# Minimalistic line:
metric_without_timestamp_and_labels 12.47

# A weird metric from before the epoch:
something_weird{problem="division by zero"} +Inf -3982045

# TYPE rpc_duration_seconds summary
rpc_duration_seconds{quantile="0.5"} 4773
rpc_duration_seconds_sum 1.7560473e+07
rpc_duration_seconds_count 2693
x_created 1.7e9
nan_gauge NaN
neg_inf -Inf
"""


def test_the_exposition_format_example() -> None:
    r = parse(BASIC)
    assert r.malformed == 0
    by = index(r.samples)
    assert [s.labels["code"] for s in by["http_requests_total"]] == ["200", "400"]
    assert by["http_requests_total"][0] == Sample("http_requests_total", {"method": "post", "code": "200"},
                                                  1027.0, 1395066363000.0)
    assert by["msdos_file_access_time_seconds"][0].labels == {
        "path": "C:\\DIR\\FILE.TXT", "error": 'Cannot find file:\n"FILE.TXT"'}
    assert by["metric_without_timestamp_and_labels"][0].value == 12.47
    weird = by["something_weird"][0]
    assert weird.value == math.inf and weird.timestamp == -3982045
    assert math.isnan(by["nan_gauge"][0].value) and by["neg_inf"][0].value == -math.inf
    # suffixes are plain names
    assert {"rpc_duration_seconds_sum", "rpc_duration_seconds_count", "x_created"} <= set(by)
    assert r.types == {"http_requests_total": "counter", "rpc_duration_seconds": "summary"}


def test_tolerances() -> None:
    text = ('  spaced { a = "1" , b="x}y" , } 2\r\n'
            'no_space{a="1"}3\r\n'
            'float_ts 1 1.5e9\r\n'
            'empty{} 4\n'
            'unknown_escape{a="x\\ty"} 5\n'
            'utf8{a="héllo ✓"} 6\n')
    r = parse(text)
    assert r.malformed == 0
    by = index(r.samples)
    assert by["spaced"][0].labels == {"a": "1", "b": "x}y"} and by["spaced"][0].value == 2
    assert by["no_space"][0].value == 3
    assert by["float_ts"][0].timestamp == 1.5e9
    assert by["empty"][0].labels == {}
    assert by["unknown_escape"][0].labels == {"a": "x\\ty"}
    assert by["utf8"][0].labels == {"a": "héllo ✓"}


@pytest.mark.parametrize("line", [
    'no_value',
    'bad_value{a="1"} abc',
    'unterminated{a="1} 2',
    'unclosed{a="1" 2',
    'dup{a="1",a="2"} 3',
    'label_no_quotes{a=1} 3',
    'too many tokens 1 2 3',
    'bad_ts 1 abc',
    'inf_ts 1 +Inf',
    '{"quoted.name"} 1',
    '9starts_with_digit 1',
    'ex{a="1"} 1 # {trace_id="x"} 1',
])
def test_malformed_lines_are_skipped_and_counted(line: str) -> None:
    r = parse(f"good 1\n{line}\ngood 2\n")
    assert [s.value for s in r.samples] == [1.0, 2.0]
    assert r.malformed == 1 and r.malformed_examples == [line[:120]]


def test_malformed_examples_are_capped() -> None:
    r = parse("ok 1\n" + "bad line here x\n" * 10)
    assert r.malformed == 10 and len(r.malformed_examples) == 3


@pytest.mark.parametrize("body", [
    b"<html><body>502 Bad Gateway</body></html>",
    b'{"error": "not found"}',
    b"  [1, 2, 3]",
    b"\x00\x01\x02binary",
    b"Internal Server Error",
    b"404 page not found\nreally\n",
])
def test_not_prometheus_text(body: bytes) -> None:
    with pytest.raises(NotPrometheusText):
        parse(body)
    with pytest.raises(NotPrometheusText):
        parse(body, names={"vllm:num_requests_running"})


@pytest.mark.parametrize("body", [b"", b"\n\n  \n", b"# only a comment\n", b"# HELP x y\nGARBAGE LINE HERE\n"])
def test_empty_or_comment_only_is_valid(body: bytes) -> None:
    r = parse(body)
    assert r.samples == []
    assert parse(body, names={"x"}).samples == []


def test_name_filter_only_parses_wanted_lines() -> None:
    text = ("# HELP a doc mentions b 1\n"
            "a 1\nab 2\nb{x=\"1\"} 3\nb{broken 4\nc 5\n  b{x=\"2\"} 6\n")
    r = parse(text, names={"b"})
    assert [(s.name, s.value) for s in r.samples] == [("b", 3.0), ("b", 6.0)]
    assert r.malformed == 1  # only the wanted broken line counts
    full = parse(text)
    assert len(full.samples) == 5 and full.malformed == 1


def test_name_filter_needs_a_valid_line_somewhere() -> None:
    # none of the wanted names, no comment: still Prometheus text if some other line parses
    assert parse(b"other 1\n", names={"wanted"}).samples == []


def test_bytes_that_are_not_utf8_do_not_raise() -> None:
    r = parse(b'a{x="\xff\xfe"} 1\n')
    assert r.samples[0].labels["x"] == "\ufffd\ufffd"


def test_pathological_line_is_fast() -> None:
    evil = "a{" + 'b="' + "\\" * 20000 + "\n" + "x" * 50000 + " 1\n"
    t0 = time.perf_counter()
    parse(evil + "ok 1\n")
    parse("m{" + 'l="v",' * 5000 + " 1\nok 1\n")
    assert time.perf_counter() - t0 < 2.0


# -- fuzz --------------------------------------------------------------------------------------
_PIECES = st.sampled_from(['vllm:num_requests_running', '{', '}', '"', '\\', '=', ',', ' ', '\t', '\n', '\r',
                           '#', '# HELP ', '# TYPE ', 'NaN', '+Inf', '-Inf', '1', '0.5', 'e', '-', 'engine',
                           'le="0.1"', '_total', ':', 'a', '\x00', '<', '{"'])


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=400), st.text(max_size=400),
                 st.lists(_PIECES, max_size=80).map("".join)))
def test_fuzz_never_raises_anything_else(body: bytes | str) -> None:
    for names in (None, {"vllm:num_requests_running", "a"}):
        try:
            r = parse(body, names=names)
        except NotPrometheusText:
            continue
        assert r.malformed >= 0
        for s in r.samples:
            assert isinstance(s.value, float) and isinstance(s.labels, dict)
            assert names is None or s.name in names


@settings(max_examples=200)
@given(st.lists(st.tuples(st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True),
                          st.dictionaries(st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True),
                                          st.text(st.characters(blacklist_characters="\x00"), max_size=20),
                                          max_size=4),
                          st.floats(allow_nan=False)), min_size=1, max_size=20))
def test_roundtrip_of_well_formed_samples(rows: list[tuple[str, dict[str, str], float]]) -> None:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    lines = []
    for name, labels, value in rows:
        body = ",".join(f'{k}="{esc(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{body}}} {value!r}" if labels else f"{name} {value!r}")
    text = "\n".join(lines)
    for names in (None, {name for name, _, _ in rows}):
        r = parse(text, names=names)
        assert r.malformed == 0
        assert [(s.name, s.labels, s.value) for s in r.samples] == rows
