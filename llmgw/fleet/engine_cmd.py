"""The command line and environment an agent starts an engine with: `vllm serve`, `llama-server`, or
the simulator (`llmgw sim`), which takes the same flags as the engine it imitates."""

from __future__ import annotations

from llmgw.fleet.types import EngineSpec

__all__ = ["build_command", "build_env", "health_path"]

_DEFAULT_BINARY = {"vllm": "vllm", "llamacpp": "llama-server"}


def build_command(spec: EngineSpec, host: str, port: int, python: str) -> list[str]:
    """argv for `spec` listening on host:port; `python` runs the simulator."""
    if spec.engine not in _DEFAULT_BINARY:
        raise ValueError(f"unknown engine {spec.engine!r} (want vllm or llamacpp)")
    listen = ["--host", host, "--port", str(port)]
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
    env.update(dict(spec.env))
    if spec.gpu_indices:
        # The placement decision wins over a CUDA_VISIBLE_DEVICES in spec.env.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
    return env


def health_path(spec: EngineSpec) -> str:
    """Both engines (and the simulator) answer 200 here once they serve; llama.cpp 503 while loading."""
    return "/health"
