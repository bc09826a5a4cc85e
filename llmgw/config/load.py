"""Typed llmgw configuration: one frozen-dataclass tree, read from TOML, written with tomli-w.

The schema is declarative.  Each section is a frozen dataclass: its annotations give the TOML
type (str, int, float, bool, ``X | None``, ``tuple[X, ...]`` for arrays, a nested dataclass for
a table, ``tuple[Section, ...]`` for an array of tables) and ``opt(...)`` in the field gives
the default, value checks, per-item checks and uniqueness.  One generic walker does type
checking, defaults and unknown-key detection and collects every problem; checks spanning
sections are small functions registered with ``@_cross_check``.  A new section is a new
dataclass plus a field on its parent: no new validation code.

Where things live: :mod:`llmgw.config.fields` (``opt`` and the value checks),
:mod:`llmgw.config.schema` (the section dataclasses), :mod:`llmgw.config.cross_checks` (the
checks across sections), here the errors, the walker and the API (``parse_config``, ``load_config``, ``dump_config``,
``model_from_dict`` ...). Import them all from ``llmgw.config``, the package's face.

Pure module: no I/O besides ``load_config`` reading the file, no sockets, no trio.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import MISSING, dataclass, fields, is_dataclass
from datetime import date, datetime, time
from functools import cache
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin, get_type_hints

import tomli_w

from llmgw.config.fields import _KNOWN_STRATEGIES, _suggest
from llmgw.config.locate import KeyPath, TomlLocator
from llmgw.config.names import PRESET_NAMES
from llmgw.config.cross_checks import (
    _CROSS_CHECKS, _adapter_sources, _metric_pairs, _pool_references, autoscale_settings, multi_node_engine,
)
from llmgw.config.schema import Config, ModelConfig, PoolConfig
from llmgw.config.starter import STARTER_TEXT
from llmgw.inputs.nesting import TooDeep, toml_loads

if TYPE_CHECKING:
    from os import PathLike

__all__ = [
    "ConfigError", "ConfigProblem", "default_config", "dump_config", "init_config_text", "load_config",
    "model_from_dict", "model_to_dict", "parse_config", "render_key", "to_plain", "toml_document", "too_deep_problem",
]


# ---------------------------------------------------------------------------------- errors
@dataclass(frozen=True)
class ConfigProblem:
    file: str
    key: str  # dotted path, e.g. "models[1].replicas[0].url"; "" for file-level problems
    line: int | None
    message: str
    column: int | None = None

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}" + (f":{self.column}" if self.column is not None else "")
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class ConfigError(Exception):
    def __init__(self, problems: list[ConfigProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


def render_key(path: KeyPath) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if re.fullmatch(r"[A-Za-z0-9_-]+", part) else tomli_w.dumps({"k": part})[4:-1]
            out += f".{text}" if out else text
    return out


# ---------------------------------------------------------------------------------- walker
_BAD = object()  # marks a value that failed validation (its problems are already recorded)
_TOML_TYPES = [(bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
               (list, "an array"), (dict, "a table"), (datetime, "a datetime"), (date, "a date"),
               (time, "a time")]


def _type_name(value: Any) -> str:
    return next((n for t, n in _TOML_TYPES if isinstance(value, t)), type(value).__name__)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _unoptional(tp: Any) -> Any:
    if get_origin(tp) in (Union, UnionType):
        return next(a for a in get_args(tp) if a is not type(None))
    return tp


def _table(cls: type, data: dict, path: KeyPath, problems: list) -> tuple[dict[str, Any], set[str]]:
    """Convert `data` against dataclass `cls`: (valid values by field name, names that failed)."""
    values: dict[str, Any] = {}
    failed: set[str] = set()
    specs = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in specs:
            known = list(specs)
            hint = _suggest(key, known) or f"; known keys: {', '.join(known)}"
            problems.append((path + (key,), f"unknown key{hint}"))
    for name, f in specs.items():
        if name in data:
            value = _convert(_hints(cls)[name], data[name], path + (name,), problems, f.metadata)
            if value is _BAD:
                failed.add(name)
            else:
                values[name] = value
        elif f.default is MISSING and f.default_factory is MISSING:
            problems.append((path + (name,), "missing required key"))
            failed.add(name)
    return values, failed


def _convert(tp: Any, value: Any, path: KeyPath, problems: list, meta: Any) -> Any:
    tp = _unoptional(tp)
    if is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append((path, f"expected a table, got {_type_name(value)}"))
            return _BAD
        values, failed = _table(tp, value, path, problems)
        out = _BAD if failed else tp(**values)
    elif get_origin(tp) is dict:
        elem = get_args(tp)[1]
        if not isinstance(value, dict):
            problems.append((path, f"expected a table, got {_type_name(value)}"))
            return _BAD
        item_meta = {"checks": meta.get("items", ())}
        conv = {k: _convert(elem, v, path + (k,), problems, item_meta) for k, v in value.items()}
        out = _BAD if any(x is _BAD for x in conv.values()) else conv
    elif get_origin(tp) is tuple:
        elem = get_args(tp)[0]
        if not isinstance(value, list):
            want = "an array of tables" if is_dataclass(elem) else "an array"
            problems.append((path, f"expected {want}, got {_type_name(value)}"))
            return _BAD
        item_meta = {"checks": meta.get("items", ())}
        items = [_convert(elem, v, path + (i,), problems, item_meta) for i, v in enumerate(value)]
        out = _BAD if any(x is _BAD for x in items) else tuple(items)
        if unique := meta.get("unique"):
            seen: dict[Any, int] = {}
            for i, raw in enumerate(value):  # raw values: also catches duplicates among bad items
                key = raw.get(unique) if isinstance(raw, dict) else None
                if not isinstance(key, str | int | float):
                    continue
                if key in seen:
                    first = render_key(path + (seen[key],))
                    problems.append((path + (i, unique), f"duplicate {unique} {key!r} (first in {first})"))
                    out = _BAD
                seen.setdefault(key, i)
    else:
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > 2**1023:  # tomllib accepts integers of any size
                problems.append((path, f"number too large: {value}"))
                return _BAD
            value = float(value)
        if not isinstance(value, tp) or (isinstance(value, bool) and tp is not bool):
            want = next(n for t, n in _TOML_TYPES if t is tp)
            problems.append((path, f"expected {want}, got {_type_name(value)}"))
            return _BAD
        out = value
    if out is not _BAD:
        for check in meta.get("checks", ()):
            if (msg := check(out)) is not None:
                problems.append((path, msg))
                return _BAD
    return out


# ---------------------------------------------------------------------------------- API
_SYNTAX_AT = re.compile(r"^(.*) \(at line (\d+), column (\d+)\)$", re.S)


def too_deep_problem(file: str, text: str, e: TooDeep) -> ConfigProblem:
    """A TOML text nested too deeply, as the problem of the key it is under (with its line)."""
    line = e.line if e.line is not None or e.path is None else TomlLocator(text).line_of(e.path)
    return ConfigProblem(file, e.where, line, e.message)


def toml_document(text: str, filename: str, *, invalid: str = "invalid TOML") -> dict[str, Any]:
    """TOML text as a table, nesting bounded; a syntax error or too deep a nesting is a
    ConfigError with the line and column (`invalid`: how the message begins)."""
    try:
        return toml_loads(text)
    except TooDeep as e:
        raise ConfigError([too_deep_problem(filename, text, e)]) from None
    except tomllib.TOMLDecodeError as e:
        msg, line, col = str(e), text.count("\n") + 1, None
        if m := _SYNTAX_AT.match(msg):
            msg, line, col = m.group(1), int(m.group(2)), int(m.group(3))
        msg = msg.removesuffix(" (at end of document)")
        raise ConfigError([ConfigProblem(filename, "", line, f"{invalid}: {msg}", col)]) from None


def parse_config(text: str, filename: str = "<string>") -> Config:
    """Parse and validate TOML text; raise ConfigError listing every problem found."""
    data = toml_document(text, filename)
    problems: list[tuple[KeyPath, str]] = []
    raw = data.get("strategies")
    names = {st.get("name") for st in raw if isinstance(st, dict)} if isinstance(raw, list) else set()
    token = _KNOWN_STRATEGIES.set(frozenset(PRESET_NAMES) | {n for n in names if isinstance(n, str)})
    try:
        values, failed = _table(Config, data, (), problems)
    finally:
        _KNOWN_STRATEGIES.reset(token)
    cfg = Config(**values)  # failed sections fall back to defaults, for the cross checks below
    for needs, check in _CROSS_CHECKS:
        if not needs & failed:
            problems.extend(check(cfg))
    if problems:
        loc = TomlLocator(text)
        out = [ConfigProblem(filename, render_key(p), loc.line_of(p), m) for p, m in problems]
        out.sort(key=lambda p: p.line if p.line is not None else float("inf"))
        raise ConfigError(out)
    return cfg


def load_config(path: str | PathLike[str]) -> Config:
    """Read and validate a TOML config file; unreadable files also raise ConfigError."""
    name = path if isinstance(path, str) else path.__fspath__()
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError([ConfigProblem(name, "", None, f"cannot read: {e.strerror or e}")]) from None
    except UnicodeDecodeError as e:
        msg = f"not valid UTF-8 (byte offset {e.start})"
        raise ConfigError([ConfigProblem(name, "", None, msg)]) from None
    return parse_config(text, name)


def default_config() -> Config:
    return Config()


def to_plain(obj: Any) -> Any:
    if is_dataclass(obj):
        out = {}
        for f in fields(obj):
            value = to_plain(getattr(obj, f.name))
            # tomli-w cannot write None; empty tables/arrays that equal the default add nothing
            if value is None or value == {} or (value == [] and f.default == ()):
                continue
            out[f.name] = value
        return out
    if isinstance(obj, tuple):
        return [to_plain(x) for x in obj]
    return obj


def dump_config(cfg: Config) -> str:
    """TOML text for `cfg`; parse_config(dump_config(cfg)) == cfg for any valid cfg."""
    return tomli_w.dumps(to_plain(cfg))


def init_config_text() -> str:
    """The commented starter file `llmgw config init` writes (equals default_config())."""
    return STARTER_TEXT


def model_to_dict(m: ModelConfig) -> dict[str, Any]:
    """A model's definition as plain data (what the store keeps and the admin API answers)."""
    return to_plain(m)


def model_from_dict(data: Any, source: str = "<model>", *, pools: tuple[PoolConfig, ...] = ()) -> ModelConfig:
    """Validate a model definition given as plain data (`pools`: those it may name);
    ConfigError names every bad field."""
    problems: list[tuple[KeyPath, str]] = []
    out = _convert(ModelConfig, data, (), problems, {})
    if not problems:
        one = Config(models=(out,), pools=pools)
        problems += [(p[2:], m) for p, m in (*_pool_references(one), *_adapter_sources(one),
                                              *multi_node_engine(one), *_metric_pairs(one),
                                              *autoscale_settings(one))]
    if problems:
        raise ConfigError([ConfigProblem(source, render_key(p) or "", None, m) for p, m in problems])
    return out
