"""llama-server's HTTP shapes as pure functions: error envelopes, /completion and OpenAI results and
chunks, /slots objects, /v1/models and the Prometheus text of /metrics. Field names and order follow
tools/server/server-task.cpp and server-context.cpp of the build in ../shared/specs/llamacpp.md,
checked against that real server."""

from __future__ import annotations

import json
import secrets
import string
import time
from collections.abc import Callable
from typing import Any

from llmgw.sim.llamacpp_core import LlamaCore, LlamaRequest

__all__ = ["LlamaError", "dumps", "error_body", "BUILD_INFO", "completion_final", "completion_partial",
           "oai_completion", "oai_completion_chunk", "chat_final", "chat_chunks", "chat_final_chunks",
           "slot_json", "models_json", "metrics_text", "task_params", "middleware_error", "completion_id",
           "props_json"]

BUILD_INFO = "b0-unknown"  # what the real build reports as system_fingerprint


def dumps(obj: Any) -> bytes:
    # nlohmann::json dump(): compact, UTF-8 kept as is.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


_STATUS = {"invalid_request_error": 400, "exceed_context_size_error": 400, "authentication_error": 401,
           "permission_error": 403, "not_found_error": 404, "server_error": 500, "not_supported_error": 501,
           "unavailable_error": 503}


class LlamaError(Exception):
    """An error llama-server answers with format_error_response: {"error": {code, message, type}}."""

    def __init__(self, type_: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message
        self.status = _STATUS[type_]
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return error_body(self.type, self.message, **self.extra)


def error_body(type_: str, message: str, **extra: Any) -> dict[str, Any]:
    """format_error_response (handlers): code, message, type, then extras."""
    return {"error": {"code": _STATUS[type_], "message": message, "type": type_, **extra}}


def middleware_error(type_: str, message: str) -> dict[str, Any]:
    """The HTTP layer's own errors (404 route, 401 key, 503 loading) list their keys in this order."""
    return {"error": {"message": message, "type": type_, "code": _STATUS[type_]}}


def task_params(n_predict: int, stream: bool, lora: dict[int, float] | None, seed: int, ignore_eos: bool,
                stop: tuple[str, ...], full: bool) -> dict[str, Any]:
    """task_params::to_json with llama-server's default sampling settings: `full` is the response's
    generation_settings, else the shorter only_metrics form /slots shows."""
    out: dict[str, Any] = {
        "seed": seed, "temperature": 0.800000011920929, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
        "top_k": 40, "top_p": 0.949999988079071, "min_p": 0.05000000074505806, "top_n_sigma": -1.0,
        "xtc_probability": 0.0, "xtc_threshold": 0.10000000149011612, "typical_p": 1.0, "repeat_last_n": 64,
        "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
        "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64}
    if full:
        out["dry_sequence_breakers"] = ["\n", ":", "\"", "*"]
    out.update({"mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.10000000149011612, "adaptive_target": -1.0,
                "adaptive_decay": 0.8999999761581421})
    if full:
        out["stop"] = list(stop)
    out.update({"max_tokens": n_predict, "n_predict": n_predict, "n_keep": 0, "n_discard": 0,
                "ignore_eos": ignore_eos, "stream": stream})
    if full:
        out["logit_bias"] = []
    out.update({"n_probs": 0, "min_keep": 0})
    if full:
        out.update({"grammar": "", "grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": []})
    out.update({
        "chat_format": "Content-only", "reasoning_format": "deepseek", "reasoning_in_content": False,
        "generation_prompt": "",
        "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
        "speculative.types": "none", "timings_per_token": False, "post_sampling_probs": False,
        "backend_sampling": False,
        "lora": [{"id": i, "scale": s} for i, s in sorted((lora or {}).items())],
    })
    return out


# -- /completion -------------------------------------------------------------------------------
def completion_final(r: LlamaRequest, content: str, prompt_text: str, model: str, n_tokens_cached: int,
                     stream: bool, settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "index": 0, "content": "" if stream else content, "tokens": [], "id_slot": r.slot, "stop": True,
        "model": model, "tokens_predicted": r.n_gen, "tokens_evaluated": len(r.prompt),
        "generation_settings": settings, "prompt": prompt_text, "has_new_line": "\n" in content,
        "truncated": r.truncated, "stop_type": r.stop_type,
        "stopping_word": r.text.stopped_on or "", "tokens_cached": n_tokens_cached, "timings": r.timings(),
    }


def completion_partial(r: LlamaRequest, content: str, token: int) -> dict[str, Any]:
    out: dict[str, Any] = {"index": 0, "content": content, "tokens": [token], "stop": False, "id_slot": -1,
                           "tokens_predicted": r.n_gen, "tokens_evaluated": len(r.prompt)}
    if r.stop_type == "word":
        # llama.cpp sends a token's partial before it checks limit/EOS, but after a stop word
        out["timings"] = r.timings()
    return out


# -- OpenAI shapes -----------------------------------------------------------------------------
def _finish_reason(r: LlamaRequest) -> str:
    return "stop" if r.stop_type in ("eos", "word") else "length"


def usage(r: LlamaRequest) -> dict[str, Any]:
    return {"completion_tokens": r.n_gen, "prompt_tokens": len(r.prompt),
            "total_tokens": r.n_gen + len(r.prompt), "prompt_tokens_details": {"cached_tokens": r.n_cached}}


def completion_id(choice: Callable[[str], str] = secrets.choice) -> str:
    """gen_chatcmplid: every OpenAI route, /v1/completions too, gets a chatcmpl- id (``choice``: the
    OS's randomness unless a test passes its own)."""
    return "chatcmpl-" + "".join(choice(_ALNUM) for _ in range(32))


_ALNUM = string.digits + string.ascii_uppercase + string.ascii_lowercase
# The results' "created" is the wall clock: each function below takes it as ``clock`` (default time.time).
Clock = Callable[[], float]


def _head(cid: str, model: str, obj: str, clock: Clock) -> dict[str, Any]:
    return {"created": int(clock()), "model": model, "system_fingerprint": BUILD_INFO, "object": obj,
            "id": cid}


def oai_completion(r: LlamaRequest, content: str, cid: str, model: str, clock: Clock = time.time) -> dict[str, Any]:
    out = {"choices": [{"text": content, "index": 0, "logprobs": None, "finish_reason": _finish_reason(r)}],
           **_head(cid, model, "text_completion", clock), "usage": usage(r)}
    out["id"] = out.pop("id")  # llama.cpp puts id after usage
    out["timings"] = r.timings()
    return out


def oai_completion_chunk(r: LlamaRequest, content: str, cid: str, model: str,
                         clock: Clock = time.time) -> dict[str, Any]:
    out = {"choices": [{"text": content, "index": 0, "logprobs": None, "finish_reason": None}],
           **_head(cid, model, "text_completion", clock)}
    if r.stop_type == "word":
        out["timings"] = r.timings()
    return out


def chat_final(r: LlamaRequest, content: str, cid: str, model: str, clock: Clock = time.time) -> dict[str, Any]:
    out = {"choices": [{"finish_reason": _finish_reason(r), "index": 0,
                        "message": {"role": "assistant", "content": content}}],
           **_head(cid, model, "chat.completion", clock), "usage": usage(r)}
    out["id"] = out.pop("id")
    out["timings"] = r.timings()
    return out


def _chat_chunk(cid: str, model: str, delta: dict[str, Any], finish: str | None, clock: Clock) -> dict[str, Any]:
    return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "created": int(clock()),
            "id": cid, "model": model, "system_fingerprint": BUILD_INFO, "object": "chat.completion.chunk"}


def chat_chunks(r: LlamaRequest, content: str, cid: str, model: str,
                clock: Clock = time.time) -> list[dict[str, Any]]:
    """One token's chunks: the role delta with the first token, then the content delta if any."""
    out = []
    if r.n_gen == 1:
        out.append(_chat_chunk(cid, model, {"role": "assistant", "content": None}, None, clock))
    if content:
        out.append(_chat_chunk(cid, model, {"content": content}, None, clock))
    if out and r.stop_type == "word":
        out[-1]["timings"] = r.timings()
    return out


def chat_final_chunks(r: LlamaRequest, cid: str, model: str, include_usage: bool,
                      clock: Clock = time.time) -> list[dict[str, Any]]:
    out = [_chat_chunk(cid, model, {}, _finish_reason(r), clock)]
    if include_usage:
        u = _chat_chunk(cid, model, {}, None, clock)
        u["choices"] = []
        u["usage"] = usage(r)
        out.append(u)
    out[-1]["timings"] = r.timings()
    return out


# -- /slots, /v1/models, /metrics --------------------------------------------------------------
def slot_json(core: LlamaCore, i: int) -> dict[str, Any]:
    s = core.slots[i]
    out: dict[str, Any] = {"id": s.id, "n_ctx": s.n_ctx, "speculative": False, "is_processing": s.is_processing}
    r = s.shown
    if r is None:
        return out
    if s.req is not None:
        out.update({
            "id_task": r.id_task, "n_prompt_tokens": len(s.tokens), "n_prompt_tokens_processed": r.n_processed,
            "n_prompt_tokens_cache": r.n_cached, "params": r.params,
            "next_token": [{"has_next_token": True, "has_new_line": "\n" in r.text.text,
                            "n_remain": -1 if r.n_predict < 0 else r.n_predict - r.n_gen, "n_decoded": r.n_gen}],
        })
    else:
        # release() resets the slot's stats; the previous task's id and params stay
        out.update({
            "id_task": r.id_task, "n_prompt_tokens": len(s.tokens), "n_prompt_tokens_processed": 0,
            "n_prompt_tokens_cache": 0, "params": r.params,
            "next_token": [{"has_next_token": r.stop_type == "none", "has_new_line": False, "n_remain": -1,
                            "n_decoded": 0}],
        })
    return out


def models_json(name: str, n_ctx: int, n_ctx_train: int, n_vocab: int, clock: Clock = time.time) -> dict[str, Any]:
    return {
        "models": [{
            "name": name, "model": name, "modified_at": "", "size": "", "digest": "", "type": "model",
            "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
            "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                        "parameter_size": "", "quantization_level": ""},
        }],
        "object": "list",
        "data": [{
            "id": name, "aliases": [name], "tags": [], "object": "model",
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "created": int(clock()), "owned_by": "llamacpp",
            "meta": {"vocab_type": 1, "n_vocab": n_vocab, "n_ctx": n_ctx, "n_ctx_train": n_ctx_train,
                     "n_embd": 64, "n_params": 0, "size": 0, "ftype": "F16"},
        }],
    }


CHATML_JINJA = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")


def props_json(name: str, path: str, n_slots: int, n_ctx: int, slots_on: bool, metrics_on: bool,
               bos: str, eos: str) -> dict[str, Any]:
    """GET /props: the server's defaults (the tiny model's ChatML template and capabilities)."""
    params = task_params(-1, False, None, 4294967295, False, (), full=False)
    params["reasoning_format"] = "none"  # the server default; a request's parse turns it into deepseek
    return {
        "default_generation_settings": {"params": params, "n_ctx": n_ctx},
        "total_slots": n_slots, "model_alias": name, "model_ftype": "F16", "model_path": path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": "<__media_simulated__>", "endpoint_slots": slots_on, "endpoint_props": False,
        "endpoint_metrics": metrics_on, "ui": True, "ui_settings": {}, "chat_template": CHATML_JINJA,
        "chat_template_caps": {
            "supports_object_arguments": False, "supports_parallel_tool_calls": False,
            "supports_preserve_reasoning": False, "supports_reasoning_effort": False,
            "supports_string_content": True, "supports_system_role": True, "supports_tool_calls": False,
            "supports_tools": False, "supports_typed_content": False},
        "bos_token": bos, "eos_token": eos, "build_info": BUILD_INFO, "is_sleeping": False,
        "cors_proxy_enabled": False,
    }


def _num(v: float) -> str:
    # C++ ostream << double: 6 significant digits, integers without a point.
    return f"{v:g}"


def metrics_text(core: LlamaCore) -> str:
    m = core.metrics
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", m.prompt_tokens),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", m.prompt_cached),
        ("prompt_seconds_total", "Total time spent processing prompts", m.prompt_seconds),
        ("tokens_predicted_total", "Number of generation tokens processed", m.predicted_tokens),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", m.predicted_seconds),
        ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and multimodal "
                           "decoding", m.n_decode),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", m.n_tokens_max),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model", 0),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", 0),
    ]
    pps = m.bucket_prompt_tokens / m.bucket_prompt_seconds if m.bucket_prompt_seconds > 0 else 0.0
    gps = m.bucket_predicted_steps / m.bucket_predicted_seconds if m.bucket_predicted_seconds > 0 else 0.0
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", pps),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s", gps),
        ("requests_processing", "Number of requests processing", core.requests_processing),
        ("requests_deferred", "Number of requests deferred", core.requests_deferred),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         m.n_busy_slots / max(m.n_decode, 1)),
    ]
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, desc, value in items:
            lines += [f"# HELP llamacpp:{name} {desc}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {_num(float(value))}"]
    m.reset_bucket()  # the gauges average over the window between two scrapes
    return "\n".join(lines) + "\n"
