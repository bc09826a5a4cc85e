"""How llama-server reads a request, as pure functions: prompts (strings, token ids, mixed lists),
chat messages with its ChatML checks, and the typed fields of server_schema, each failing with the
message the real server gives (nlohmann::json's wording included) — see tests/test_llamacpp_contract.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llmgw.sim.llamacpp_surface import LlamaError
from llmgw.sim.tokenizer import Tokenizer

__all__ = ["jtype", "type_error", "parse_json", "flag", "lenient_flag", "num_int", "check_numbers", "lora_map",
           "tokenize_mixed", "prompt_tokens", "render_chat", "INT32_MAX"]

INT32_MAX = 2**31 - 1
# server_schema fields read as numbers that the simulator otherwise ignores: only their type is checked
_NUMERIC = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
            "presence_penalty", "frequency_penalty", "mirostat", "mirostat_tau", "mirostat_eta", "n_keep",
            "n_probs", "min_keep", "dynatemp_range", "dynatemp_exponent", "xtc_probability", "xtc_threshold",
            "top_n_sigma", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n")


def jtype(v: object) -> str:
    """nlohmann::json's type_name()."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array"}.get(type(v), "object")


def type_error(want: str, v: object, key: str | None = None) -> LlamaError:
    msg = f"[json.exception.type_error.302] type must be {want}, but is {jtype(v)}"
    return LlamaError("invalid_request_error", f"Field '{key}': {msg}" if key else msg)


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        # nlohmann's prefix; the detail after it is Python's wording
        raise LlamaError("invalid_request_error", f"[json.exception.parse_error.101] parse error at line "
                         f"{e.lineno}, column {e.colno}: syntax error while parsing value - {e.msg}") from None
    except UnicodeDecodeError:
        raise LlamaError("invalid_request_error",
                         "[json.exception.parse_error.101] parse error: invalid UTF-8 byte") from None


def flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """A server_schema bool: null counts as absent, another type is an error."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise type_error("boolean", v, key)
    return v


def lenient_flag(body: object, key: str, default: bool) -> bool:
    """json_value(): a missing or mistyped value gives the default, silently."""
    v = body.get(key) if isinstance(body, Mapping) else None
    return v if isinstance(v, bool) else default


def _int32(v: int | float) -> int:
    """nlohmann's get<int32_t>: floats truncate (out of range: INT_MIN), integers wrap."""
    if isinstance(v, float):
        return int(v) if -2**31 <= v < 2**31 else -2**31
    return (v + 2**31) % 2**32 - 2**31


def num_int(body: Mapping[str, Any], keys: tuple[str, ...], default: int, lo: int | None = None,
            hi: int | None = None) -> int:
    """A server_schema number: the first alias given wins; hard limits are errors."""
    for key in keys:
        v = body.get(key)
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise type_error("number", v, key)
        n = _int32(v)
        if lo is not None and hi is not None and not lo <= n <= hi:
            raise LlamaError("invalid_request_error",
                             f"Field '{key}': Value must be between {lo} <= value <= {hi}, but got {n}")
        return n
    return default


def check_numbers(body: Mapping[str, Any]) -> None:
    for key in _NUMERIC:
        v = body.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise type_error("number", v, key)


def lora_map(items: list[Any]) -> dict[int, float]:
    """parse_lora_request: [{"id", "scale"}] -> {id: scale}; json_value() turns a missing or mistyped
    id into -1 and scale into 0, and unknown ids are ignored later: nothing here is an error."""
    out: dict[int, float] = {}
    for e in items:
        e = e if isinstance(e, dict) else {}
        i, s = e.get("id", -1), e.get("scale", 0.0)
        i = i if isinstance(i, int) and not isinstance(i, bool) else -1
        out[i] = float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else 0.0
    return out


def tokenize_mixed(tok: Tokenizer, content: object, add_special: bool) -> list[int]:
    """A string, or a list of strings and token ids; BOS only when the first element is a string."""
    if isinstance(content, str):
        return tok.encode(content, add_special_tokens=add_special)
    if not isinstance(content, list):
        raise type_error("string", content)
    out: list[int] = []
    for i, x in enumerate(content):
        if isinstance(x, str):
            out += tok.encode(x, add_special_tokens=add_special and i == 0)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            out.append(int(x))
        else:
            raise type_error("number", x)
    return out


_BAD_PROMPT = ("\"prompt\" elements must be a string, a list of tokens, a JSON object containing a prompt string, "
               "or a list of mixed strings & tokens.")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _subprompt(tok: Tokenizer, p: object) -> list[int]:
    if isinstance(p, str) or (isinstance(p, list) and any(_is_int(x) for x in p)
                              and any(isinstance(x, str) for x in p)):
        return tokenize_mixed(tok, p, True)
    if isinstance(p, list) and all(_is_int(x) for x in p):
        return list(p)  # token ids as given: no BOS
    if isinstance(p, dict) and "prompt_string" in p:
        return tokenize_mixed(tok, p["prompt_string"], True)
    raise LlamaError("invalid_request_error", _BAD_PROMPT)


def prompt_tokens(tok: Tokenizer, body: Mapping[str, Any]) -> list[int]:
    """tokenize_input_prompts, for the one prompt the simulator serves per request."""
    if "prompt" not in body:
        raise LlamaError("invalid_request_error", "[json.exception.out_of_range.403] key 'prompt' not found")
    p = body["prompt"]
    if isinstance(p, list) and not any(_is_int(x) for x in p):
        if not p:
            raise LlamaError("invalid_request_error", "\"prompt\" must not be empty")
        if len(p) > 1:
            raise LlamaError("invalid_request_error", "the simulator serves one prompt per request")
        p = p[0]
    ids = _subprompt(tok, p)
    if not all(tok.valid_id(i) for i in ids):
        raise LlamaError("invalid_request_error", "Prompt contains invalid tokens")
    return ids


def _content_text(content: object) -> str:
    """oaicompat_content_load_media and the template's join of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise LlamaError("invalid_request_error", "Expected 'content' to be a string or an array")
    texts = []
    for part in content:
        t = part.get("type", "") if isinstance(part, dict) else ""
        for kind, names in (("image", ("image_url",)), ("audio", ("input_audio",)),
                            ("video", ("input_video", "video_url"))):
            if t in names:
                raise LlamaError("server_error", f"{kind} input is not supported - hint: if this is unexpected, "
                                 "you may need to provide the mmproj")
        if t != "text":
            raise LlamaError("invalid_request_error", "unsupported content[].type")
        if not isinstance(part.get("text"), str):
            raise LlamaError("server_error", "Failed to parse messages: [json.exception.out_of_range.403] key "
                             "'text' not found" if "text" not in part else
                             f"Failed to parse messages: {type_error('string', part['text']).message}")
        texts.append(part["text"])
    return "\n".join(texts)


def render_chat(body: Mapping[str, Any]) -> str:
    """oaicompat_chat_params_parse + the tiny model's ChatML template. Any role string renders; a
    final assistant message is continued (prefill_assistant), without its end marker."""
    if "messages" not in body:
        raise LlamaError("invalid_request_error", "'messages' is required")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise LlamaError("invalid_request_error", "Expected 'messages' to be an array")
    contents = []
    for m in msgs:  # first pass: contents, as oaicompat_chat_params_parse checks them
        role = m.get("role") if isinstance(m, dict) else None
        has = isinstance(m, dict) and "content" in m
        if role != "assistant" and not has:
            raise LlamaError("invalid_request_error", "All non-assistant messages must contain 'content'")
        if role == "assistant" and not has and "tool_calls" not in m:
            raise LlamaError("invalid_request_error", "Assistant message must contain either 'content' or "
                             "'tool_calls'!")
        contents.append(_content_text(m.get("content")))
    texts: list[tuple[str, str]] = []
    for m, text in zip(msgs, contents):  # second pass: roles (common_chat_msgs_parse_oaicompat)
        role = m.get("role")
        if not isinstance(role, str):
            detail = (f"Missing 'role' in message: {json.dumps(m, separators=(',', ':'), ensure_ascii=False)}"
                      if role is None else type_error("string", role).message)
            raise LlamaError("server_error", f"Failed to parse messages: {detail}")
        texts.append((role, text))
    prefill = bool(texts) and texts[-1][0] == "assistant"
    if prefill and len(texts) >= 2 and texts[-2][0] == "assistant":
        raise LlamaError("invalid_request_error", "Cannot have 2 or more assistant messages at the end of the list.")
    parts = [f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in texts]
    if prefill:
        parts[-1] = f"<|im_start|>assistant\n{texts[-1][1]}"
    elif lenient_flag(body, "add_generation_prompt", True):
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
