"""What the router reads of an OpenAI request body, and the errors it answers in OpenAI's envelope.

The body is forwarded to the engine unchanged (unknown fields included: clients send new ones
before engines know them); the router only needs the model, whether it streams, a session key
and a size estimate of the prompt."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["RoutedBody", "ApiError", "parse_body", "error_body"]


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


def parse_body(raw: bytes, *, kind: str) -> RoutedBody:
    """kind: 'chat' | 'completions' | 'embeddings'."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"Request body is not valid JSON: {e}") from None
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
