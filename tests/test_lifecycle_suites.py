"""Eval suites as files (llmgw.lifecycle.suites): the shipped examples parse; every problem of a
bad file is reported at once with file:line: key, like the config; bounds hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.config import ConfigError
from llmgw.lifecycle.json_schema import schema_problems, validate
from llmgw.lifecycle.suites import MAX_CASES, MAX_SUITE_BYTES, parse_suite

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples" / "suites").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_shipped_examples_parse(path: Path) -> None:
    s = parse_suite(path.read_text(), str(path))
    assert s.name == path.stem and s.cases


def problems(text: str, **kw: object) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_suite(text, "s.toml", **kw)  # type: ignore[arg-type]
    return [str(p) for p in e.value.problems]


def test_every_problem_is_named_with_its_line_and_key() -> None:
    text = """name = "bad"
pass_threshold = 1.5
colour = "red"

[[cases]]
name = "one"
prompt = "hi"
params = { max_tokens = -1, temprature = 0.5 }
checks = { regex = "(", contians = ["x"], json_schema = { type = "thing", pattern = "x" } }

[[cases]]
name = "two"
prompt = "a"
messages = [{ role = "robot", content = "x" }]

[[cases]]
name = "one"
prompt = "again"
"""
    got = problems(text)
    want = [
        "s.toml:3: colour: unknown key",
        "s.toml:2: pass_threshold: must be a number from 0 to 1",
        "s.toml:8: cases[0].params.max_tokens: must be a whole number from 0",
        "s.toml:8: cases[0].params.temprature: unknown sampling parameter",
        "s.toml:9: cases[0].checks.contians: unknown check",
        "s.toml:9: cases[0].checks.regex: not a valid regular expression",
        "s.toml:9: cases[0].checks.json_schema.type: must be one of",
        "s.toml:9: cases[0].checks.json_schema.pattern: unsupported keyword",
        "s.toml:14: cases[1].messages[0].role: must be one of system, user, assistant",
        "s.toml:11: cases[1]: needs exactly one of `prompt` and `messages`",
        "s.toml:17: cases[2].name: a second case named 'one'",
    ]
    for w in want:
        assert any(g.startswith(w) for g in got), (w, got)
    assert len(got) == len(want), got


def test_toml_syntax_errors_and_file_level_problems() -> None:
    assert problems("name = ")[0].startswith("s.toml:1: not valid TOML")
    assert problems('name = "x"') == ["s.toml: cases: missing: at least one [[cases]]"]
    assert "stored as 'y'" in problems('name = "x"\n[[cases]]\nprompt = "a"\n', name="y")[0]
    assert "not a valid suite name" in problems('name = "../etc"\n[[cases]]\nprompt = "a"\n')[0]
    assert "larger than" in problems("#" * (MAX_SUITE_BYTES + 1))[0]
    many = 'name = "x"\n' + '[[cases]]\nprompt = "a"\n' * (MAX_CASES + 1)
    assert f"at most {MAX_CASES}" in problems(many)[0]


def test_a_case_becomes_a_streamed_chat_request() -> None:
    s = parse_suite('name = "x"\n[[cases]]\nprompt = "hi"\nparams = { max_tokens = 3, stop = ["."] }\n')
    assert s.cases[0].request_body("m") == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "stream": True, "max_tokens": 3, "stop": ["."]}
    assert (s.pass_threshold, s.concurrency, s.timeout_s) == (1.0, 4, 60.0)


SCHEMA = {"type": "object", "required": ["a"], "additionalProperties": False,
          "properties": {"a": {"type": "integer", "minimum": 0}, "b": {"type": "array", "items": {"enum": [1, 2]},
                                                                       "maxItems": 2}}}


@pytest.mark.parametrize(("doc", "why"), [
    ({"a": 1}, None), ({"a": 1, "b": [1, 2]}, None), ({"a": -1}, "below the minimum"),
    ({}, "missing required property 'a'"), ({"a": 1, "c": 0}, "unexpected property 'c'"),
    ({"a": 1, "b": [3]}, "not one of the enum"), ({"a": 1, "b": [1, 1, 1]}, "items out of bounds"),
    ({"a": True}, "expected integer"), ([], "expected object"),
])
def test_the_json_schema_subset(doc: object, why: str | None) -> None:
    assert schema_problems(SCHEMA) == []
    got = validate(doc, SCHEMA)
    assert (got is None) if why is None else (got is not None and why in got), got


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                           lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids,
                                                                                     max_size=3), max_leaves=10)


@given(json_values, json_values)
def test_any_schema_is_checked_or_refused_without_raising(schema: object, doc: object) -> None:
    if not schema_problems(schema):
        validate(doc, schema)  # type: ignore[arg-type]
