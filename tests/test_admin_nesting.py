"""Bounded nesting of untrusted structured input (llmgw/admin/nesting.py) and its users: config
files, eval suites, `--set` values. The over-real-processes half is in test_ctl_lifecycle.py."""

from __future__ import annotations

import json

import pytest

from llmgw.inputs.nesting import MAX_DEPTH, TooDeep, deepest, json_loads, render_path, toml_loads
from llmgw.config import ConfigError, parse_config
from llmgw.lifecycle.revisions import parse_sets
from llmgw.lifecycle.suites import parse_suite


def nested(n: int) -> str:
    """n arrays, one in another."""
    return "[" * n + "]" * n


def test_depth_counts_the_document_as_the_first_level() -> None:
    assert deepest({"a": [1]}, 2) is None
    assert deepest({"a": [[1]]}, 2) == ("a", 0)
    assert deepest(json.loads(nested(MAX_DEPTH))) is None
    assert deepest(json.loads(nested(MAX_DEPTH + 1))) == (0,) * MAX_DEPTH
    assert deepest("text") is None and deepest([]) is None


def test_deepest_does_not_recurse() -> None:
    obj: dict[str, object] = {}
    node = obj
    for _ in range(100_000):
        node["k"] = node = {}
    assert deepest(obj) == ("k",) * MAX_DEPTH


def test_render_path_names_the_field_not_the_indices_into_its_value() -> None:
    assert render_path(("cases", 0, "params", "stop", 0, 0)) == "cases[0].params.stop"
    assert render_path((0, 0)) == ""
    long = render_path(("q",) * 300)
    assert long.startswith("q.q.q") and long.endswith("…") and len(long) < 90


def test_json_within_the_limit_parses_and_beyond_names_the_field() -> None:
    assert json_loads(nested(MAX_DEPTH)) == json.loads(nested(MAX_DEPTH))
    body = '{"deploy": {"args": ["[[[[", "{"], "env": ' + nested(100_000) + "}}"
    with pytest.raises(TooDeep) as e:
        json_loads(body.encode())
    assert str(e.value) == f"deploy.env: nested deeper than {MAX_DEPTH} levels"
    with pytest.raises(TooDeep, match=r'^a\[2\]\.b"c: nested'):  # indices before the key; escapes decoded
        json_loads('{"a": [1, "x,", {"b\\"c": ' + nested(70) + "}]}")
    with pytest.raises(TooDeep, match="^nested deeper"):  # the body itself
        json_loads(nested(70))
    with pytest.raises(ValueError):  # malformed: json's own error, never a RecursionError
        json_loads(b"[" * 100_000)
    # brackets inside strings do not count
    assert json_loads(json.dumps({"s": "[" * 1000})) == {"s": "[" * 1000}


def test_toml_within_the_limit_parses_and_beyond_names_key_table_and_line() -> None:
    assert toml_loads(f"a = {nested(MAX_DEPTH - 1)}") == {"a": json.loads(nested(MAX_DEPTH - 1))}
    text = (
        '# a comment [[[[[[\n'
        's = """\n[[[[[[[[\n"""\n'
        "t = '{{{{{{{{{{'\n"
        "[[models]]\nname = \"a\"\n[[models]]\nname = \"b\"\n[models.deploy]\n"
        f"env = {nested(500)}\n"
    )
    with pytest.raises(TooDeep) as e:
        toml_loads(text)
    assert (e.value.where, e.value.line) == ("models[1].deploy.env", 11)
    with pytest.raises(TooDeep) as e:  # unbalanced: refused before tomllib could recurse
        toml_loads("a = " + "{ b = " * 5000)
    assert e.value.where == "a"
    # dotted keys nest without brackets: measured after parsing
    with pytest.raises(TooDeep) as e:
        toml_loads("x." * 300 + "y = 1\n")
    assert e.value.where.startswith("x.x.x") and e.value.path is not None


def test_config_file_too_deep_is_a_config_error_with_key_and_line() -> None:
    text = f'[server]\nhost = "127.0.0.1"\n[[models]]\nname = "m"\n[models.deploy]\nenv = {nested(500)}\n'
    with pytest.raises(ConfigError) as e:
        parse_config(text, "f.toml")
    assert str(e.value.problems[0]) == f"f.toml:6: models[0].deploy.env: nested deeper than {MAX_DEPTH} levels"
    with pytest.raises(ConfigError) as e:
        parse_config("[server]\n" + "a." * 200 + "b = 1\n", "f.toml")
    p = e.value.problems[0]
    assert p.line == 2 and p.key.startswith("server.a.a") and "nested deeper" in p.message


def test_suite_too_deep_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as e:
        parse_suite(f"a = {nested(500)}\n", "suite x")
    assert str(e.value.problems[0]) == f"suite x:1: a: nested deeper than {MAX_DEPTH} levels"


def test_set_values_too_deep_name_the_key() -> None:
    with pytest.raises(ValueError, match=f"^--set deploy.env: nested deeper than {MAX_DEPTH} levels$"):
        parse_sets([f"deploy.env={nested(500)}"])
    with pytest.raises(ValueError, match=f"^--set deploy.env: nested deeper than {MAX_DEPTH}"):
        parse_sets([f"deploy.env={'[' * 100_000}"])  # unbalanced too
    with pytest.raises(ValueError, match="nested deeper"):
        parse_sets(["a." * 100 + "b=1"])
    assert parse_sets([f"deploy.env={nested(10)}"]) == {"deploy": {"env": json.loads(nested(10))}}
