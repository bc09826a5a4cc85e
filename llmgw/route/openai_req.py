"""What the router reads of an OpenAI request body, and the errors it answers in OpenAI's envelope.

The body is forwarded to the engine unchanged (unknown fields included: clients send new ones
before engines know them); the router only needs the model, whether it streams, a session key
and a size estimate of the prompt.

A body is untrusted: anything that is not a JSON object of the expected shape is a 400 naming
the problem, never an exception out of here. Nesting is bounded (:data:`MAX_DEPTH` levels),
so that nothing the router does with the body later (the request head, canonical JSON) can
run out of stack.

Parsing is msgspec's JSON decoder (several times faster than :mod:`json` on long prompts; vLLM
uses it too), with :func:`json.loads` behind it for whatever msgspec refuses: a body msgspec
decodes, ``json.loads`` decodes to the same object (tests/test_openai_req_parse.py checks it
with hypothesis), and one it refuses — malformed JSON, but also what ``json`` accepts and msgspec
does not (NaN, 1e400, lone surrogates, UTF-16 or a UTF-8 BOM, nesting past the interpreter's
recursion limit) — gets exactly the answer ``json`` gives, error message included."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["MAX_DEPTH", "RoutedBody", "ApiError", "decode_json", "parse_body", "error_body"]

MAX_DEPTH = 128  # nesting levels of a request body (tool schemas rarely pass 30)


class ApiError(Exception):
    """An error the router answers itself: OpenAI's envelope, a status, optional headers."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or []
        self.counted = False  # the router's core counted this request already (it ended there)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(slots=True)
class RoutedBody:
    model: str
    stream: bool
    session_key: str | None
    prompt_chars: int
    obj: dict[str, Any]


_decode = msgspec.json.Decoder().decode
_COUNT_BELOW = 8192  # bodies shorter than this: two bracket counts are cheaper than the walk


def decode_json(raw: bytes) -> Any:
    """The JSON value of ``raw`` as :func:`json.loads` gives it, raising what it raises
    (msgspec first: what it decodes, ``json`` decodes alike; what it refuses goes to ``json``)."""
    try:
        return _decode(raw)
    except (msgspec.DecodeError, RecursionError, TypeError):
        return json.loads(raw)


def parse_body(raw: bytes, *, kind: str) -> RoutedBody:
    """kind: 'chat' | 'completions' | 'embeddings'."""
    try:
        obj = decode_json(raw)
    except RecursionError:
        raise ApiError(400, f"Request body is nested too deeply (more than {MAX_DEPTH} levels).") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise ApiError(400, f"Request body is not valid JSON: {e}") from None
    # More brackets than MAX_DEPTH is the only way to be nested deeper: on a short body two
    # C-speed counts spare the walk; on a long one (a long prompt: few containers, many bytes)
    # the walk over the containers is the cheaper of the two.
    if (len(raw) >= _COUNT_BELOW or raw.count(b"[") + raw.count(b"{") > MAX_DEPTH) \
            and _deeper_than(obj, MAX_DEPTH):
        raise ApiError(400, f"Request body is nested too deeply (more than {MAX_DEPTH} levels).")
    if not isinstance(obj, dict):
        raise ApiError(400, "Request body must be a JSON object.")
    model = obj.get("model")
    if model is None:
        raise ApiError(400, "you must provide a model parameter", param="model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string", param="model")
    stream = obj.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    if kind == "chat":
        msgs = obj.get("messages")
        if not isinstance(msgs, list):
            raise ApiError(400, "'messages' must be a list of messages", param="messages")
        chars = sum(len(m.get("content") or "") if isinstance(m, dict) and isinstance(m.get("content"), str)
                    else 0 for m in msgs)
    elif kind == "completions":
        prompt = obj.get("prompt")
        if prompt is None:
            raise ApiError(400, "'prompt' is required", param="prompt")
        chars = len(prompt) if isinstance(prompt, str) else 4 * len(prompt) if isinstance(prompt, list) else 0
    else:
        inp = obj.get("input")
        if inp is None:
            raise ApiError(400, "'input' is required", param="input")
        chars = len(inp) if isinstance(inp, str) else 0
    user = obj.get("user")
    session = user if isinstance(user, str) and user else None
    return RoutedBody(model, stream, session, chars, obj)


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether containers nest more than ``limit`` levels in ``obj`` (a decoded JSON value: its
    containers are exact dicts and lists), level by level: no recursion, each container once."""
    if type(obj) is not dict and type(obj) is not list:
        return False
    level = [obj]
    for _ in range(limit):
        level = [c for o in level for c in (o.values() if type(o) is dict else o)
                 if type(c) is dict or type(c) is list]
        if not level:
            return False
    return True
