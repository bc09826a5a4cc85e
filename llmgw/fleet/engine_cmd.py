"""The command line and environment an agent starts an engine with: `vllm serve`, `llama-server`, or
the simulator (`llmgw sim`), which takes the same flags as the engine it imitates."""

from __future__ import annotations

import json

from llmgw.fleet.types import EngineSpec

__all__ = ["KV_HASH_ALGO", "KV_HASH_SEED", "KV_TOPIC", "build_command", "build_env", "health_path",
           "kv_events_args"]

#: What a kv_events engine hashes with: the router computes the same chain (vllm-wire.md §2).
KV_HASH_ALGO = "sha256_cbor"
#: PYTHONHASHSEED given to a kv_events engine unless the deploy profile's env sets one: vLLM derives
#: its NONE_HASH from it, and every replica (and the router) must agree.
KV_HASH_SEED = "0"
KV_TOPIC = "kv"

_DEFAULT_BINARY = {"vllm": "vllm", "llamacpp": "llama-server"}


def kv_events_args(endpoint: str, replay: str) -> list[str]:
    """vLLM's flags for KV events (vllm-wire.md §1.1, §5), in the form every version since 0.10 takes:
    `publisher` spelled out (0.10/0.11 default to "null"). vLLM *binds* the PUB only when the endpoint
    has `*` or `::` or is ipc:// — a tcp://127.0.0.1:PORT would make it dial out — so the agent gives
    ipc:// paths in its private state directory: bound by the engine, reachable from this host only.
    The block size is left as the engine's (the router reads it from the engine)."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
           "replay_endpoint": replay, "topic": KV_TOPIC}
    return ["--kv-events-config", json.dumps(cfg, separators=(",", ":")),
            "--prefix-caching-hash-algo", KV_HASH_ALGO]


def build_command(spec: EngineSpec, host: str, port: int, python: str,
                  kv: tuple[str, str] | None = None) -> list[str]:
    """argv for `spec` listening on host:port; `python` runs the simulator; `kv`: the (endpoint,
    replay endpoint) a kv_events engine binds."""
    if spec.engine not in _DEFAULT_BINARY:
        raise ValueError(f"unknown engine {spec.engine!r} (want vllm or llamacpp)")
    if spec.kv_events and spec.engine != "vllm":
        raise ValueError(f"kv_events needs engine vllm ({spec.engine} publishes no KV events)")
    if spec.kv_events and kv is None:
        raise ValueError("kv_events engine without KV-event endpoints")
    listen = ["--host", host, "--port", str(port)]
    if spec.kv_events and kv is not None:
        listen += kv_events_args(*kv)
    if spec.simulate:
        if spec.engine == "vllm":
            model = [spec.model_path, "--served-model-name", spec.model]
        else:
            model = ["-m", spec.model_path, "--alias", spec.model, "--metrics"]
        return [python, "-m", "llmgw", "sim", "--engine", spec.engine, *listen, *model, *spec.args]
    binary = spec.binary or _DEFAULT_BINARY[spec.engine]
    if spec.engine == "vllm":
        return [binary, "serve", spec.model_path, *listen, "--served-model-name", spec.model, *spec.args]
    # --slots: the router reads per-slot state; --metrics: the llama.cpp metric contract.
    return [binary, "-m", spec.model_path, *listen, "--alias", spec.model, "--metrics", "--slots", *spec.args]


def build_env(spec: EngineSpec, base_env: dict[str, str]) -> dict[str, str]:
    """`base_env` + the spec's env + CUDA_VISIBLE_DEVICES for the assigned GPUs. Without assigned GPUs
    CUDA_VISIBLE_DEVICES is left as inherited: setting it empty would hide every GPU, which is not
    what "no placement" means (e.g. a CPU llama.cpp or a simulator)."""
    env = dict(base_env)
    if spec.kv_events:
        # A fixed seed, not the inherited one: the hash chain must match the router's and the other
        # replicas'. The deploy profile's env (applied next) may still set another on purpose.
        env["PYTHONHASHSEED"] = KV_HASH_SEED
    env.update(dict(spec.env))
    if spec.gpu_indices:
        # The placement decision wins over a CUDA_VISIBLE_DEVICES in spec.env.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
    return env


def health_path(spec: EngineSpec) -> str:
    """Both engines (and the simulator) answer 200 here once they serve; llama.cpp 503 while loading."""
    return "/health"
