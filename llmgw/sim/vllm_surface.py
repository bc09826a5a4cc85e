"""vLLM's HTTP shapes, as pure functions: error bodies, model cards, OpenAI responses and chunks,
and the runtime LoRA registry with vLLM's own messages. Shapes follow vLLM 0.33's pydantic
models as recorded in ../shared/specs (vllm-wire.md §4 and the golden JSON)."""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["VllmError", "error_body", "dumps", "LoraRegistry", "LoraEntry", "model_list"]


def dumps(obj: Any) -> bytes:
    # pydantic's model_dump_json: compact, UTF-8 kept as is.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class VllmError(Exception):
    """An error vLLM answers with its envelope: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or _DEFAULT_TYPES.get(status, "BadRequestError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, self.param)


_DEFAULT_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                  501: "NotImplementedError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_ or _DEFAULT_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


def model_not_found(name: object) -> VllmError:
    return VllmError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")


@dataclass(frozen=True)
class LoraEntry:
    name: str
    int_id: int
    path: str
    base_model_name: str | None
    rank: int


class LoraRegistry:
    """The frontend's adapter registry plus the worker's LRU CPU cache (max_cpu_loras).

    vLLM has no "max_loras exceeded" error: loading always succeeds and the oldest adapter falls
    out of the worker cache (to be reloaded when next used); --max-loras only limits how many
    distinct adapters one running batch holds."""

    def __init__(self, served: list[str], max_lora_rank: int, max_cpu_loras: int, version: tuple[int, ...]) -> None:
        self.served = served
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.version = version
        self.adapters: dict[str, LoraEntry] = {}
        self.resident: OrderedDict[str, None] = OrderedDict()  # worker-side LRU
        self._next_id = 1
        self.loads = 0  # adapter loads into the worker cache (cold starts)

    def load(self, name: object, path: object, *, load_inplace: bool = False,
             exists: bool = True, rank: int = 8, base_model_name: str | None = None) -> str:
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise VllmError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.adapters and not load_inplace:
            msg = f"The lora adapter '{name}' has already been loaded."
            if self.version >= (0, 15):
                msg += " If you want to load the adapter in place, set 'load_inplace' to True."
            raise VllmError(400, msg, "InvalidUserInput")
        if name in self.served:
            raise VllmError(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")
        if not exists:
            raise VllmError(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        if rank > self.max_lora_rank:
            raise VllmError(500, f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.",
                            "InternalServerError")
        old = self.adapters.get(name)
        int_id = old.int_id if old else self._next_id
        if not old:
            self._next_id += 1
        self.adapters[name] = LoraEntry(name, int_id, path, base_model_name, rank)
        self.touch(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: object) -> str:
        if not isinstance(name, str) or name not in self.adapters:
            raise VllmError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        self.resident.pop(name, None)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def touch(self, name: str) -> bool:
        """Mark an adapter used; True when it had to be loaded into the worker cache."""
        if name in self.resident:
            self.resident.move_to_end(name)
            return False
        self.resident[name] = None
        self.loads += 1
        while len(self.resident) > self.max_cpu_loras:
            self.resident.popitem(last=False)
        return True


def _permission(created: int, token_hex: Callable[[int], str]) -> list[dict[str, Any]]:
    return [{"id": f"modelperm-{token_hex(8)}", "object": "model_permission", "created": created,
             "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
             "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
             "organization": "*", "group": None, "is_blocking": False}]


def model_list(served: list[str], model_path: str, max_model_len: int, loras: list[LoraEntry],
               created: int, *, token_hex: Callable[[int], str] = secrets.token_hex) -> dict[str, Any]:
    """/v1/models; ``token_hex`` draws the permission ids' random part."""
    cards = [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": model_path,
              "parent": None, "max_model_len": max_model_len, "permission": _permission(created, token_hex)}
             for name in served]
    for lora in loras:
        cards.append({"id": lora.name, "object": "model", "created": created, "owned_by": "vllm",
                      "root": lora.path, "parent": lora.base_model_name or served[0],
                      "max_model_len": None, "permission": _permission(created, token_hex)})
    return {"object": "list", "data": cards}


def usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def chat_first_chunk(rid: str, created: int, model: str, index: int) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None}


def chat_chunk(rid: str, created: int, model: str, index: int, text: str, finish: str | None,
               stop_reason: str | int | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = None
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice], "kv_transfer_params": None}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish: str | None,
                     stop_reason: str | int | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish,
                         "stop_reason": stop_reason, "token_ids": None, "prompt_token_ids": None}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, u: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": u}


def chat_response(rid: str, created: int, model: str, choices: list[tuple[str, str | None, str | int | None]],
                  u: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text, "refusal": None,
                                                 "annotations": None, "audio": None, "function_call": None,
                                                 "tool_calls": [], "reasoning_content": None},
                         "logprobs": None, "finish_reason": finish, "stop_reason": stop, "token_ids": None}
                        for i, (text, finish, stop) in enumerate(choices)],
            "service_tier": None, "system_fingerprint": None, "usage": u, "prompt_logprobs": None,
            "prompt_token_ids": None, "kv_transfer_params": None}


def completion_response(rid: str, created: int, model: str, choices: list[tuple[str, str | None, str | int | None]],
                        u: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop,
                         "prompt_logprobs": None, "prompt_token_ids": None, "token_ids": None}
                        for i, (text, finish, stop) in enumerate(choices)],
            "service_tier": None, "system_fingerprint": None, "usage": u, "kv_transfer_params": None}
