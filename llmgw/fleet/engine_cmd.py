"""The command line and environment an agent starts an engine with: `vllm serve`, `llama-server`, or
the simulator (`llmgw sim`), which takes the same flags as the engine it imitates.

Multi-node replicas (``spec.group``): a worker runs llama.cpp's RPC server, ``ggml-rpc-server
-H HOST -p PORT`` (``rpc-server`` in older releases; flags as in its tools/rpc/rpc-server.cpp) (the simulator:
``llmgw sim worker``, which only answers /health); the head is the serving engine, told its workers
with ``--rpc HOST:PORT,...`` (llama.cpp's flag; the simulator takes it too).

vLLM (not simulated) runs a Ray cluster per replica, as vLLM's multi-node docs do (docs/placement.md,
"vLLM multi-node replicas"): the head runs ``llmgw.daemon.agent.ray_launch head``, which starts
``ray start --head --port RAY_PORT --node-ip-address HOST --block`` and, once that port accepts, ``vllm
serve ... --pipeline-parallel-size N --distributed-executor-backend ray``; a worker runs
``ray_launch worker``, which waits for the head's Ray port and then runs ``ray start --address
HEAD:RAY_PORT --node-ip-address HOST --node-manager-port PORT --block`` (PORT: the agent's, which it
probes). The head starts first; its workers are told its Ray address (``group.peers``)."""

from __future__ import annotations

import json

from llmgw.fleet.types import EngineSpec, LoraLaunch

__all__ = ["KV_HASH_ALGO", "KV_HASH_SEED", "KV_TOPIC", "RUNTIME_LORA_ENV", "build_command", "build_env",
           "RPC_SERVER_NAMES", "health_path", "kv_events_args", "lora_args", "probes_tcp",
           "rpc_server_binary", "rpc_server_candidates", "ray_binary", "ray_candidates", "ray_group",
           "RAY_LAUNCH_MODULE"]

#: What a kv_events engine hashes with: the router computes the same chain (vllm-wire.md §2).
KV_HASH_ALGO = "sha256_cbor"
#: PYTHONHASHSEED given to a kv_events engine unless the deploy profile's env sets one: vLLM derives
#: its NONE_HASH from it, and every replica (and the router) must agree.
KV_HASH_SEED = "0"
KV_TOPIC = "kv"

_DEFAULT_BINARY = {"vllm": "vllm", "llamacpp": "llama-server"}
#: vLLM serves /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set (vllm-wire.md §4).
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def lora_args(engine: str, lora: LoraLaunch) -> list[str]:
    """The LoRA flags (vllm-wire.md §4, llamacpp.md). vLLM: LoRA on, its batch and rank limits, and
    the static adapters as ``--lora-modules`` — ``NAME=PATH`` where vLLM's parser reads that form
    back unchanged (one ``=``, no comma), else its JSON form, which every version since 0.10 takes.
    llama.cpp: every adapter loaded off, ``--lora-scaled FILE:0`` each (``--lora-init-without-apply``
    does not work in the verified build): a request applies one by its explicit ``lora`` list, and
    an adapter's id is its position here."""
    if engine == "llamacpp":
        return [arg for _, source in lora.adapters for arg in ("--lora-scaled", f"{source}:0")]
    out = ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_rank)]
    if lora.adapters:
        out.append("--lora-modules")
        for name, source in lora.adapters:
            item = f"{name}={source}"
            if item.count("=") != 1 or "," in item:
                item = json.dumps({"name": name, "path": source}, separators=(",", ":"))
            out.append(item)
    return out


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


#: The agent's launcher of a vLLM multi-node part (llmgw/daemon/agent/ray_launch.py).
RAY_LAUNCH_MODULE = "llmgw.daemon.agent.ray_launch"


def ray_group(spec: EngineSpec) -> bool:
    """A part of a real vLLM multi-node replica: a Ray cluster, whose head starts first."""
    return spec.group is not None and spec.engine == "vllm" and not spec.simulate


def _has_flag(args: tuple[str, ...] | list[str], flag: str) -> bool:
    alt = "--" + flag[2:].replace("-", "_")  # vLLM's parser takes --pipeline_parallel_size too
    return any(a in (flag, alt) or a.startswith((flag + "=", alt + "=")) for a in args)


def _ray_parallel_args(spec: EngineSpec) -> list[str]:
    """vLLM's documented multi-node setting: pipeline parallel across the nodes, tensor parallel over
    each node's GPUs, the Ray executor. A flag the profile's args already give is left to them."""
    assert spec.group is not None
    out: list[str] = []
    if not _has_flag(spec.args, "--tensor-parallel-size") and spec.gpu_indices:
        out += ["--tensor-parallel-size", str(len(spec.gpu_indices))]
    if not _has_flag(spec.args, "--pipeline-parallel-size"):
        out += ["--pipeline-parallel-size", str(spec.group.size)]
    if not _has_flag(spec.args, "--distributed-executor-backend"):
        out += ["--distributed-executor-backend", "ray"]
    return out


def _ray_worker_command(spec: EngineSpec, host: str, port: int, python: str, ray: str | None) -> list[str]:
    g = spec.group
    assert g is not None
    if len(g.peers) != 1:
        raise ValueError(f"worker of a {g.size}-node vLLM replica without its head's Ray address")
    return [python, "-m", RAY_LAUNCH_MODULE, "worker", "--ray", ray or ray_binary(spec), "--host", host,
            "--port", str(port), "--head", g.peers[0]]


def build_command(spec: EngineSpec, host: str, port: int, python: str,
                  kv: tuple[str, str] | None = None, rpc_server: str | None = None,
                  ray: str | None = None, ray_port: int | None = None) -> list[str]:
    """argv for `spec` listening on host:port; `python` runs the simulator; `kv`: the (endpoint,
    replay endpoint) a kv_events engine binds; `rpc_server`: llama.cpp's RPC worker binary as the
    agent found it (default: the first of ``rpc_server_candidates``); `ray`, `ray_port`: a vLLM
    multi-node part's ``ray`` binary as the agent found it, and (head) its Ray head's port."""
    if spec.engine not in _DEFAULT_BINARY:
        raise ValueError(f"unknown engine {spec.engine!r} (want vllm or llamacpp)")
    if spec.kv_events and spec.engine != "vllm":
        raise ValueError(f"kv_events needs engine vllm ({spec.engine} publishes no KV events)")
    if spec.kv_events and kv is None:
        raise ValueError("kv_events engine without KV-event endpoints")
    g = spec.group
    if g is not None and ray_group(spec):
        if g.role == "worker":
            return _ray_worker_command(spec, host, port, python, ray)
        if ray_port is None:
            raise ValueError("head of a vLLM multi-node replica without its Ray port")
    elif g is not None:
        if g.role == "worker":
            if spec.simulate:
                return [python, "-m", "llmgw", "sim", "worker", "--host", host, "--port", str(port)]
            return [rpc_server or rpc_server_binary(spec), "-H", host, "-p", str(port)]
        if len(g.peers) != g.size - 1:
            raise ValueError(f"head of a {g.size}-node replica without its workers' addresses")
    listen = ["--host", host, "--port", str(port)]
    if g is not None and not ray_group(spec):
        listen += ["--rpc", ",".join(g.peers)]
    if spec.kv_events and kv is not None:
        listen += kv_events_args(*kv)
    # After the model: --lora-modules takes every word up to the next flag (a positional MODEL too).
    args = [*lora_args(spec.engine, spec.lora), *spec.args] if spec.lora is not None else spec.args
    if spec.simulate:
        if spec.engine == "vllm":
            model = [spec.model_path, "--served-model-name", spec.model]
        else:
            model = ["-m", spec.model_path, "--alias", spec.model, "--metrics"]
        return [python, "-m", "llmgw", "sim", "--engine", spec.engine, *listen, *model, *args]
    binary = spec.binary or _DEFAULT_BINARY[spec.engine]
    if spec.engine == "vllm":
        serve = [binary, "serve", spec.model_path, *listen, "--served-model-name", spec.model, *args]
        if g is None:
            return serve
        return [python, "-m", RAY_LAUNCH_MODULE, "head", "--ray", ray or ray_binary(spec), "--host", host,
                "--ray-port", str(ray_port), "--", *serve, *_ray_parallel_args(spec)]
    # --slots: the router reads per-slot state; --metrics: the llama.cpp metric contract.
    return [binary, "-m", spec.model_path, *listen, "--alias", spec.model, "--metrics", "--slots", *args]


def build_env(spec: EngineSpec, base_env: dict[str, str]) -> dict[str, str]:
    """`base_env` + the spec's env + CUDA_VISIBLE_DEVICES for the assigned GPUs. Without assigned GPUs
    CUDA_VISIBLE_DEVICES is left as inherited: setting it empty would hide every GPU, which is not
    what "no placement" means (e.g. a CPU llama.cpp or a simulator)."""
    env = dict(base_env)
    if spec.kv_events:
        # A fixed seed, not the inherited one: the hash chain must match the router's and the other
        # replicas'. The deploy profile's env (applied next) may still set another on purpose.
        env["PYTHONHASHSEED"] = KV_HASH_SEED
    if spec.lora is not None and spec.engine == "vllm":
        env[RUNTIME_LORA_ENV] = "True"  # the router loads the other adapters on demand
    env.update(dict(spec.env))
    if spec.gpu_indices:
        # The placement decision wins over a CUDA_VISIBLE_DEVICES in spec.env.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
    return env


#: llama.cpp's RPC worker's names: `ggml-rpc-server` in the verified build (tools/rpc's target),
#: `rpc-server` in older releases. The agent takes the first it finds (``rpc_server_candidates``).
RPC_SERVER_NAMES = ("ggml-rpc-server", "rpc-server")


def rpc_server_candidates(spec: EngineSpec) -> list[str]:
    """Where llama.cpp's RPC worker may be, best first: next to the profile's llama-server binary
    (when it names a directory), then on PATH."""
    near = [spec.binary.rsplit("/", 1)[0] + "/" + n for n in RPC_SERVER_NAMES] \
        if spec.binary and "/" in spec.binary else []
    return [*near, *RPC_SERVER_NAMES]


def rpc_server_binary(spec: EngineSpec) -> str:
    """The RPC worker's binary when nothing was looked up: the first candidate."""
    return rpc_server_candidates(spec)[0]


def ray_candidates(spec: EngineSpec) -> list[str]:
    """Where Ray's ``ray`` command may be, best first: next to the profile's vllm binary (the same
    environment's bin directory) when it names a directory, then on PATH."""
    near = [spec.binary.rsplit("/", 1)[0] + "/ray"] if spec.binary and "/" in spec.binary else []
    return [*near, "ray"]


def ray_binary(spec: EngineSpec) -> str:
    """Ray's command when nothing was looked up: the first candidate."""
    return ray_candidates(spec)[0]


def probes_tcp(spec: EngineSpec) -> bool:
    """A worker that speaks no HTTP (llama.cpp's rpc-server, a Ray worker's node manager): up means
    it accepts a connection."""
    return spec.is_worker and not spec.simulate


def health_path(spec: EngineSpec) -> str:
    """Both engines (and the simulator) answer 200 here once they serve; llama.cpp 503 while loading."""
    return "/health"
