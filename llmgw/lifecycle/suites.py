"""Eval suites: a named TOML file of cases, each a prompt (or chat messages), sampling params and
checks on the answer, plus a pass threshold. Parsing reports every problem with file:line:key,
like the config (llmgw.config.locate finds the lines). Pure.

    name = "smoke"                 # optional: the name it is stored under otherwise
    description = "greets and answers JSON"
    pass_threshold = 0.9           # the share of cases that must pass (default 1.0)
    concurrency = 4                # cases in flight at once (default 4, at most 64)
    timeout_s = 30                 # per case (default 60): a timeout fails the case, the run goes on

    [[cases]]
    name = "hello"
    prompt = "Say hello"           # or messages = [{ role = "user", content = "…" }]
    params = { max_tokens = 32, temperature = 0 }
    checks = { contains = ["hello"], max_ttft_ms = 500 }
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from llmgw.config import ConfigError, ConfigProblem, render_key, toml_document
from llmgw.config.locate import KeyPath, TomlLocator
from llmgw.lifecycle.json_schema import schema_problems

__all__ = ["CHECK_KEYS", "MAX_CASES", "MAX_SUITE_BYTES", "Case", "Checks", "Suite", "parse_suite",
           "suite_name_problem"]

MAX_SUITE_BYTES = 1 << 20
MAX_CASES = 1000
MAX_TEXT = 64 * 1024  # a prompt, a message, an expected string
MAX_MESSAGES = 64
MAX_PATTERN = 1000
MAX_CONCURRENCY = 64
MAX_TIMEOUT_S = 600.0
PARAM_KEYS = {"max_tokens": int, "temperature": float, "top_p": float, "seed": int, "stop": list,
              "presence_penalty": float, "frequency_penalty": float}
CHECK_KEYS = ("contains", "not_contains", "regex", "equals", "json", "json_schema", "max_tokens",
              "max_ttft_ms", "max_latency_ms")
ROLES = ("system", "user", "assistant")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def suite_name_problem(name: str) -> str | None:
    if _NAME.fullmatch(name) is None:
        return f"not a valid suite name (letters, digits, '.', '_', '-'; at most 64): {name[:80]!r}"
    return None


@dataclass(frozen=True)
class Checks:
    contains: tuple[str, ...] = ()
    not_contains: tuple[str, ...] = ()
    regex: str | None = None
    equals: str | None = None
    json: bool = False
    json_schema: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_ttft_ms: float | None = None
    max_latency_ms: float | None = None


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str | None
    messages: tuple[tuple[str, str], ...]  # (role, content); empty when `prompt` is used
    params: dict[str, Any]
    checks: Checks

    def request_body(self, model: str) -> dict[str, Any]:
        """The OpenAI chat body for this case (a prompt becomes one user message), streamed so
        that the time to the first token is measured."""
        msgs = self.messages or (("user", self.prompt or ""),)
        return {"model": model, "messages": [{"role": r, "content": c} for r, c in msgs], "stream": True,
                **self.params}


@dataclass(frozen=True)
class Suite:
    name: str
    description: str = ""
    pass_threshold: float = 1.0
    concurrency: int = 4
    timeout_s: float = 60.0
    cases: tuple[Case, ...] = field(default_factory=tuple)
    source: str = ""  # the TOML text it was parsed from (what is stored and served)


class _Problems:
    def __init__(self, file: str, text: str) -> None:
        self.file, self.text, self._loc = file, text, None
        self.items: list[ConfigProblem] = []

    def add(self, path: KeyPath, message: str) -> None:
        if self._loc is None:
            self._loc = TomlLocator(self.text)
        self.items.append(ConfigProblem(self.file, render_key(path), self._loc.line_of(path), message))


def parse_suite(text: str, file: str = "suite", *, name: str | None = None) -> Suite:
    """A suite from TOML text; raises ConfigError listing every problem (file:line: key: what).
    `name`: the name it is stored under (the file's own `name`, if any, must agree)."""
    if len(text.encode()) > MAX_SUITE_BYTES:
        raise ConfigError([ConfigProblem(file, "", None, f"larger than {MAX_SUITE_BYTES} bytes")])
    doc = toml_document(text, file, invalid="not valid TOML")
    p = _Problems(file, text)
    known = {"name", "description", "pass_threshold", "concurrency", "timeout_s", "cases"}
    for k in doc:
        if k not in known:
            p.add((k,), f"unknown key (known: {', '.join(sorted(known))})")
    own = doc.get("name")
    if own is not None and (not isinstance(own, str) or suite_name_problem(own)):
        p.add(("name",), suite_name_problem(own) if isinstance(own, str) else "must be a string")
        own = None
    if name is not None and own is not None and own != name:
        p.add(("name",), f"the file names suite {own!r} but is stored as {name!r}")
    final = name or own or ""
    if not final:
        p.add(("name",), "missing: a suite needs a name")
    elif suite_name_problem(final):
        p.add(("name",), suite_name_problem(final))  # type: ignore[arg-type]
    desc = _str(p, doc, ("description",), "", MAX_TEXT)
    threshold = _num(p, doc, ("pass_threshold",), 1.0, 0.0, 1.0)
    conc = _int(p, doc, ("concurrency",), 4, 1, MAX_CONCURRENCY)
    timeout = _num(p, doc, ("timeout_s",), 60.0, 0.1, MAX_TIMEOUT_S)
    raw_cases = doc.get("cases")
    cases: list[Case] = []
    if not isinstance(raw_cases, list) or not raw_cases:
        p.add(("cases",), "missing: at least one [[cases]]")
    elif len(raw_cases) > MAX_CASES:
        p.add(("cases",), f"{len(raw_cases)} cases: at most {MAX_CASES}")
    else:
        seen: set[str] = set()
        for i, c in enumerate(raw_cases):
            case = _case(p, c, ("cases", i), i)
            cname = c.get("name") if isinstance(c, dict) else None
            if isinstance(cname, str):
                if cname in seen:
                    p.add(("cases", i, "name"), f"a second case named {cname!r}")
                seen.add(cname)
            if case is not None:
                cases.append(case)
    if p.items:
        raise ConfigError(p.items)
    return Suite(final, desc, threshold, conc, timeout, tuple(cases), text)


def _case(p: _Problems, c: Any, at: KeyPath, i: int) -> Case | None:
    if not isinstance(c, dict):
        p.add(at, "must be a table")
        return None
    before = len(p.items)
    known = {"name", "prompt", "messages", "params", "checks"}
    for k in c:
        if k not in known:
            p.add(at + (k,), f"unknown key (known: {', '.join(sorted(known))})")
    name = _str(p, c, at + ("name",), f"case-{i + 1}", 128)
    prompt = _str(p, c, at + ("prompt",), None, MAX_TEXT)
    messages: list[tuple[str, str]] = []
    raw = c.get("messages")
    if raw is not None:
        if not isinstance(raw, list) or not raw or len(raw) > MAX_MESSAGES:
            p.add(at + ("messages",), f"must be a list of 1 to {MAX_MESSAGES} {{ role, content }} tables")
        else:
            for j, m in enumerate(raw):
                mat = at + ("messages", j)
                if not isinstance(m, dict) or set(m) != {"role", "content"}:
                    p.add(mat, "must be a table with exactly `role` and `content`")
                    continue
                if m["role"] not in ROLES:
                    p.add(mat + ("role",), f"must be one of {', '.join(ROLES)}")
                content = _str(p, m, mat + ("content",), None, MAX_TEXT)
                messages.append((str(m["role"]), content or ""))
    if (prompt is None) == (raw is None):
        p.add(at, "needs exactly one of `prompt` and `messages`")
    params = _params(p, c.get("params", {}), at + ("params",))
    checks = _checks(p, c.get("checks", {}), at + ("checks",))
    if len(p.items) > before:
        return None
    return Case(name or "", prompt, tuple(messages), params, checks)


def _params(p: _Problems, raw: Any, at: KeyPath) -> dict[str, Any]:
    if not isinstance(raw, dict):
        p.add(at, "must be a table")
        return {}
    out: dict[str, Any] = {}
    for k, v in raw.items():
        kind = PARAM_KEYS.get(k)
        if kind is None:
            p.add(at + (k,), f"unknown sampling parameter (known: {', '.join(sorted(PARAM_KEYS))})")
        elif kind is int and (type(v) is not int or not 0 <= v <= 1 << 31):
            p.add(at + (k,), "must be a whole number from 0")
        elif kind is float and (type(v) not in (int, float) or not -1e6 <= v <= 1e6):
            p.add(at + (k,), "must be a number")
        elif kind is list and (not isinstance(v, list) or len(v) > 4 or not all(isinstance(s, str) and
                                                                              0 < len(s) <= 256 for s in v)):
            p.add(at + (k,), "must be a list of at most 4 strings")
        else:
            out[k] = v
    return out


def _checks(p: _Problems, raw: Any, at: KeyPath) -> Checks:
    if not isinstance(raw, dict):
        p.add(at, "must be a table")
        return Checks()
    for k in raw:
        if k not in CHECK_KEYS:
            p.add(at + (k,), f"unknown check (known: {', '.join(CHECK_KEYS)})")
    lists = {}
    for k in ("contains", "not_contains"):
        v = raw.get(k, [])
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or len(v) > 100 or not all(isinstance(s, str) and 0 < len(s) <= MAX_TEXT
                                                              for s in v):
            p.add(at + (k,), "must be a string or a list of at most 100 non-empty strings")
            v = []
        lists[k] = tuple(v)
    regex = _str(p, raw, at + ("regex",), None, MAX_PATTERN)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            p.add(at + ("regex",), f"not a valid regular expression: {e}")
    equals = _str(p, raw, at + ("equals",), None, MAX_TEXT)
    js = raw.get("json", False)
    if not isinstance(js, bool):
        p.add(at + ("json",), "must be true or false")
        js = False
    schema = raw.get("json_schema")
    if schema is not None:
        for key, msg in schema_problems(schema):
            p.add(at + ("json_schema", *key), msg)
    return Checks(lists["contains"], lists["not_contains"], regex, equals, js, schema,
                  _int(p, raw, at + ("max_tokens",), None, 1, 1 << 31),
                  _num(p, raw, at + ("max_ttft_ms",), None, 0.0, 3.6e6),
                  _num(p, raw, at + ("max_latency_ms",), None, 0.0, 3.6e6))


def _str(p: _Problems, d: dict[str, Any], at: KeyPath, default: Any, limit: int) -> Any:
    v = d.get(at[-1], default)  # type: ignore[arg-type]
    if v is default:
        return v
    if not isinstance(v, str):
        p.add(at, "must be a string")
        return default
    if len(v) > limit:
        p.add(at, f"longer than {limit} characters")
        return default
    return v


def _num(p: _Problems, d: dict[str, Any], at: KeyPath, default: Any, lo: float, hi: float) -> Any:
    v = d.get(at[-1], default)  # type: ignore[arg-type]
    if v is default:
        return v
    if type(v) not in (int, float) or not lo <= v <= hi:
        p.add(at, f"must be a number from {lo:g} to {hi:g}")
        return default
    return float(v)


def _int(p: _Problems, d: dict[str, Any], at: KeyPath, default: Any, lo: int, hi: int) -> Any:
    v = d.get(at[-1], default)  # type: ignore[arg-type]
    if v is default:
        return v
    if type(v) is not int or not lo <= v <= hi:
        p.add(at, f"must be a whole number from {lo} to {hi}")
        return default
    return v

