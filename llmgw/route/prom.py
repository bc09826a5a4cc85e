"""A fast, tolerant parser for the Prometheus text exposition format (version 0.0.4, and the
sample lines of OpenMetrics), for scraping engines' /metrics.

Pure: bytes in, samples out. Sample names are kept exactly as written: `_total`, `_created`,
`_bucket`, `_sum` and `_count` are not stripped or grouped into families (the metric contract asks
for `vllm:request_success_total` by that name). A line that cannot be parsed is skipped and counted;
the only exception raised is `NotPrometheusText`, for a body that is not Prometheus text at all
(an HTML error page, JSON, binary data, or text of which not one line parses).

Lines end at "\n" only (a "\r" before it is dropped). Accepted, beyond the strict grammar: blank
lines, CRLF line ends, leading whitespace, whitespace
around `{`, `}`, `=` and `,`, a trailing comma in the label set, `Inf`/`inf`/`NaN`/`+Inf`/`-Inf`
and any spelling Python's float() accepts, a timestamp as an integer (ms, 0.0.4) or a float (s,
OpenMetrics), stored as written. Label escapes `\\\\`, `\\"` and `\\n` are decoded; an unknown escape
keeps its backslash. Not supported (counted as malformed): the quoted UTF-8 metric names of
Prometheus 3 (`{"my.metric", a="b"} 1`) and OpenMetrics exemplars (`# {...}` after the value).
A sample line with a repeated label name is malformed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

__all__ = ["NotPrometheusText", "Sample", "ParseResult", "parse", "select", "parse_selected", "index"]


class NotPrometheusText(ValueError):
    """The body is not Prometheus text at all (see `parse`). The only exception `parse` raises."""


@dataclass(slots=True, frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float  # may be NaN or ±inf
    timestamp: float | None = None  # as written: ms (text 0.0.4) or s (OpenMetrics); None = none


@dataclass(slots=True)
class ParseResult:
    samples: list[Sample]
    malformed: int = 0  # lines skipped because they did not parse
    malformed_examples: list[str] = field(default_factory=list)  # the first few, truncated
    types: dict[str, str] = field(default_factory=dict)  # family -> type from # TYPE lines (unfiltered parse)

    def get(self, name: str) -> list[Sample]:
        """Samples named exactly `name` (a linear scan; use `index()` for many look-ups)."""
        return [s for s in self.samples if s.name == name]


def index(samples: Iterable[Sample]) -> dict[str, list[Sample]]:
    """Group samples by name, keeping their order."""
    out: dict[str, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.name, []).append(s)
    return out


_MAX_EXAMPLES = 3
_EXAMPLE_LEN = 120

# name, then either `{labels}` (quoted strings may hold `}`) or whitespace, then value [timestamp].
_SAMPLE = re.compile(
    r'[ \t]*([a-zA-Z_:][a-zA-Z0-9_:]*)'
    r'(?:[ \t]*\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\}[ \t]*|[ \t]+)'
    r'(\S+)(?:[ \t]+(\S+))?[ \t]*\Z', re.S)
_PAIR = r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"'
_LABELS_OK = re.compile(r'[ \t]*(?:(?:%s)[ \t]*,[ \t]*)*(?:(?:%s)[ \t]*)?' % (_PAIR, _PAIR), re.S)
_LABEL_PAIRS = re.compile(_PAIR, re.S)
_ESCAPE = re.compile(r'\\(.)', re.S)
_UNESCAPE = {"n": "\n", "\\": "\\", '"': '"'}
_COMMENT = re.compile(r'#[ \t]*(HELP|TYPE)[ \t]+([a-zA-Z_:][a-zA-Z0-9_:]*)(?:[ \t]+(.*))?\Z', re.S)


def _unescape(m: re.Match[str]) -> str:
    c = m.group(1)
    return _UNESCAPE.get(c, "\\" + c)


_CACHE_MAX, _CACHE_BODY_MAX = 8192, 512
_label_cache: dict[str, dict[str, str] | None] = {}  # label-set text -> parsed; engines repeat them


def _labels(body: str) -> dict[str, str] | None:
    try:
        hit = _label_cache[body]
    except KeyError:
        hit = _parse_labels(body)
        if len(body) <= _CACHE_BODY_MAX:
            if len(_label_cache) >= _CACHE_MAX:
                _label_cache.clear()
            _label_cache[body] = hit
    return None if hit is None else dict(hit)


def _parse_labels(body: str) -> dict[str, str] | None:
    if _LABELS_OK.fullmatch(body) is None:
        return None
    pairs = _LABEL_PAIRS.findall(body)  # safe on a validated body: no match can start inside a value
    labels = dict(pairs)
    if len(labels) != len(pairs):
        return None  # a repeated label name
    if "\\" in body:
        for k, v in pairs:
            if "\\" in v:
                labels[k] = _ESCAPE.sub(_unescape, v)
    return labels


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _sample(line: str) -> Sample | None:
    m = _SAMPLE.match(line)
    if m is None:
        return None
    name, body, vtext, ttext = m.groups()
    value = _float(vtext)
    if value is None:
        return None
    ts: float | None = None
    if ttext is not None:
        ts = _float(ttext)
        if ts is None or not math.isfinite(ts):
            return None
    labels = {} if body is None else _labels(body)
    if labels is None:
        return None
    return Sample(name, labels, value, ts)


_ANY_COMMENT = re.compile(r'^[ \t]*#', re.M)
_ANY_COMMENT_BYTES = re.compile(rb'\n[ \t]*#')
_FILTERS: dict[frozenset[str], tuple[re.Pattern[str], re.Pattern[bytes]]] = {}


def _filter_re(names: frozenset[str]) -> tuple[re.Pattern[str], re.Pattern[bytes]]:
    pats = _FILTERS.get(names)
    if pats is None:
        # a leading literal "\n" lets re skip ahead fast (much faster than ^ with re.M)
        alts = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
        pat = r'\n[ \t]*((?:%s)(?=[ \t{])[^\n]*)' % alts
        pats = re.compile(pat), re.compile(pat.encode())
        if len(_FILTERS) >= 64:
            _FILTERS.clear()
        _FILTERS[names] = pats
    return pats


def _decode(data: bytes | bytearray | memoryview | str) -> str:
    if isinstance(data, str):
        text = data
    else:
        raw = bytes(data)
        if b"\x00" in raw:
            raise NotPrometheusText("body contains NUL bytes")
        text = raw.decode("utf-8", errors="replace")
    if "\x00" in text:
        raise NotPrometheusText("body contains NUL bytes")
    head = text.lstrip()[:1]
    if head in ("<", "{", "["):
        kind = "HTML/XML" if head == "<" else "JSON"
        raise NotPrometheusText(f"body looks like {kind}, not Prometheus text: {text.lstrip()[:60]!r}")
    return text


def parse(data: bytes | str, *, names: Collection[str] | None = None) -> ParseResult:
    """Parse an exposition body.

    `names`: when given, only samples with these exact names are returned. The lines holding them
    are found first (`select`) and only those are parsed, so other lines (most of a vLLM body is
    histogram buckets the router never reads) are neither validated nor counted as malformed, and
    `types` stays empty.

    Raises NotPrometheusText when the body holds a NUL byte, starts (after whitespace) with `<`, `{`
    or `[`, or has non-blank lines of which none is a comment or a parseable sample. An empty body is
    valid Prometheus text with no samples.
    """
    if names is not None:
        wanted = names if isinstance(names, frozenset) else frozenset(names)
        if wanted:
            return parse_selected(select(data, wanted), wanted, data)
    full = _parse_lines(_decode(data))
    if not full.samples and full.malformed and not full.comments:
        _raise(full)
    return ParseResult(full.samples, full.malformed, full.examples, full.types)


def select(data: bytes | str, names: frozenset[str]) -> list[str]:
    """The lines of `data` that start (after blanks) with one of `names` followed by a space, a
    tab or `{`, in body order, "\r" ends dropped: what `parse(data, names=names)` parses. Raises
    NotPrometheusText for a body with a NUL byte or one that starts like HTML or JSON.

    One regex scan of the body (it costs about as much as counting the body's lines); a bytes
    body is scanned as bytes and only the selected lines are decoded (a vLLM body is ~50 KB, of
    which the router reads ~10 lines)."""
    text_re, bytes_re = _filter_re(names)
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        if b"\x00" in raw:
            raise NotPrometheusText("body contains NUL bytes")
        if not b"!" <= raw[:1] < b"\x7f" or raw[:1] in b"<{[":  # not the usual `#` or name first
            _decode(raw)  # raises for HTML or JSON, as the text checks decide
        out = []
        for ln in bytes_re.findall(b"\n" + raw):
            out.append((ln[:-1] if ln[-1:] == b"\r" else ln).decode("utf-8", errors="replace"))
        return out
    text = _decode(data)
    return [ln[:-1] if ln[-1:] == "\r" else ln for ln in text_re.findall("\n" + text)]


def parse_selected(lines: list[str], names: frozenset[str], data: bytes | str) -> ParseResult:
    """Parse the lines `select` chose from `data` (the body they came from: when none of them
    holds a wanted sample and the body has no comment, it is checked to be Prometheus text)."""
    samples: list[Sample] = []
    examples: list[str] = []
    malformed = 0
    for line in lines:
        s = _sample(line)
        if s is not None and s.name in names:
            samples.append(s)
        elif s is None:
            malformed += 1
            if len(examples) < _MAX_EXAMPLES:
                examples.append(line[:_EXAMPLE_LEN])
    if samples or _has_comment(data):
        return ParseResult(samples, malformed, examples)
    text = _decode(data)
    if not text.strip():
        return ParseResult(samples, malformed, examples)
    # nothing wanted and no comment: is it Prometheus text at all? (rare: decide the slow way)
    full = _parse_lines(text)
    if not full.samples and full.malformed and not full.comments:
        _raise(full)
    return ParseResult(samples, malformed, examples)


def _has_comment(data: bytes | str) -> bool:
    if isinstance(data, str):
        return _ANY_COMMENT.search(data) is not None
    raw = bytes(data)
    return raw.lstrip(b" \t")[:1] == b"#" or _ANY_COMMENT_BYTES.search(raw) is not None


@dataclass(slots=True)
class _Lines:
    samples: list[Sample]
    malformed: int
    examples: list[str]
    types: dict[str, str]
    comments: int


def _raise(full: _Lines) -> None:
    raise NotPrometheusText(f"no line parses as Prometheus text ({full.malformed} lines), "
                            f"e.g. {full.examples[0]!r}")


def _parse_lines(text: str) -> _Lines:
    samples: list[Sample] = []
    types: dict[str, str] = {}
    examples: list[str] = []
    malformed = comments = 0
    for line in text.split("\n"):  # not splitlines(): U+2028, \x1c... are legal in label values
        if line[-1:] == "\r":
            line = line[:-1]
        if not line or line.isspace():
            continue
        stripped = line.lstrip(" \t")
        if stripped[:1] == "#":
            comments += 1
            c = _COMMENT.match(stripped) if "TYPE" in stripped else None
            if c is not None and c.group(1) == "TYPE" and c.group(3):
                types[c.group(2)] = c.group(3).strip()
            continue
        s = _sample(line)
        if s is None:
            malformed += 1
            if len(examples) < _MAX_EXAMPLES:
                examples.append(line[:_EXAMPLE_LEN])
        else:
            samples.append(s)
    return _Lines(samples, malformed, examples, types, comments)
