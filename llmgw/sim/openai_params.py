"""Validation of OpenAI-style generation requests, shared by the simulator's vLLM and llama.cpp modes.

Each engine answers bad input with its own envelope; this module only decides *what* is wrong
(`ParamError` names the field) and turns a valid body into `GenParams`. Unknown fields are
accepted, as both engines accept them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ParamError", "GenParams", "parse_gen_params", "parse_stop"]


class ParamError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


@dataclass(frozen=True)
class GenParams:
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    include_stop_str_in_output: bool
    ignore_eos: bool
    min_tokens: int
    seed: int | None
    cache_salt: str | None
    echo: bool


def _int(body: Mapping, key: str, lo: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise ParamError(f"'{key}' must be an integer, got {type(v).__name__}", key)
    if lo is not None and v < lo:
        raise ParamError(f"'{key}' must be at least {lo}, got {v}", key)
    return v


def _bool(body: Mapping, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ParamError(f"'{key}' must be a boolean, got {type(v).__name__}", key)
    return v


def _number(body: Mapping, key: str, lo: float, hi: float) -> None:
    v = body.get(key)
    if v is None:
        return
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ParamError(f"'{key}' must be a number, got {type(v).__name__}", key)
    if not lo <= v <= hi:
        raise ParamError(f"'{key}' must be in [{lo}, {hi}], got {v}", key)


def parse_stop(v: object) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise ParamError("'stop' must be a string or a list of strings", "stop")


def _cache_salt(body: Mapping, strict: bool) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ParamError("Parameter 'cache_salt' must be a non-empty string.", "cache_salt")
    if strict and (len(salt) > 128 or any(c in salt for c in "@/\\\0")):
        # vLLM >= 0.30's validate_cache_salt, verbatim.
        raise ParamError(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL. (parameter=cache_salt)",
            "cache_salt",
        )
    return salt


def parse_gen_params(body: Mapping, *, chat: bool, strict_cache_salt: bool = True) -> GenParams:
    max_tokens = _int(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    n = _int(body, "n", 1) or 1
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise ParamError("'stream_options' must be an object", "stream_options")
    opts = opts or {}
    if opts and not stream:
        raise ParamError("Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = _bool(opts, "include_usage")
    continuous = _bool(opts, "continuous_usage_stats")
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0),
                        ("frequency_penalty", -2.0, 2.0), ("repetition_penalty", 0.0, 100.0)):
        _number(body, key, lo, hi)
    _int(body, "top_k", -1)
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ParamError("'stop_token_ids' must be a list of integers", "stop_token_ids")
    seed = _int(body, "seed")
    return GenParams(
        max_tokens=max_tokens,
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        stop=parse_stop(body.get("stop")),
        stop_token_ids=tuple(ids),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens", 0) or 0,
        seed=seed,
        cache_salt=_cache_salt(body, strict_cache_salt),
        echo=_bool(body, "echo"),
    )
