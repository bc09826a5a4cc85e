"""Engine command lines and environment, and the restart policy (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.fleet.engine_cmd import build_command, build_env, health_path
from llmgw.fleet.lifecycle import RestartPolicy
from llmgw.fleet.types import EngineSpec
from llmgw.sim.args import build_llamacpp_parser, build_vllm_parser


def spec(**kw: Any) -> EngineSpec:
    base: dict[str, Any] = {"replica": "llama-8b/1", "model": "llama-8b", "engine": "vllm",
                            "model_path": "meta/llama-8b"}
    return EngineSpec(**{**base, **kw})


def test_vllm_command():
    s = spec(args=("--max-model-len", "8192"))
    assert build_command(s, "10.0.0.7", 8001, "/py") == [
        "vllm", "serve", "meta/llama-8b", "--host", "10.0.0.7", "--port", "8001",
        "--served-model-name", "llama-8b", "--max-model-len", "8192"]
    assert build_command(spec(binary="/opt/vllm/bin/vllm"), "h", 1, "/py")[0] == "/opt/vllm/bin/vllm"


def test_llamacpp_command():
    s = spec(engine="llamacpp", model_path="/m/tiny.gguf", binary="/opt/llama-server", args=("-np", "2"))
    assert build_command(s, "127.0.0.1", 9000, "/py") == [
        "/opt/llama-server", "-m", "/m/tiny.gguf", "--host", "127.0.0.1", "--port", "9000",
        "--alias", "llama-8b", "--metrics", "--slots", "-np", "2"]
    assert build_command(spec(engine="llamacpp"), "h", 1, "/py")[0] == "llama-server"


def test_simulated_commands_parse_as_the_simulator_expects():
    v = build_command(spec(simulate=True, args=("--sim-zero-cost",)), "127.0.0.1", 8001, "/py")
    assert v == ["/py", "-m", "llmgw", "sim", "--engine", "vllm", "--host", "127.0.0.1", "--port", "8001",
                 "meta/llama-8b", "--served-model-name", "llama-8b", "--sim-zero-cost"]
    ns = build_vllm_parser().parse_args(v[6:])
    assert (ns.model_tag, ns.served_model_name, ns.port) == ("meta/llama-8b", ["llama-8b"], 8001)

    l = build_command(spec(engine="llamacpp", model_path="x.gguf", simulate=True), "127.0.0.1", 9, "/py")
    assert l == ["/py", "-m", "llmgw", "sim", "--engine", "llamacpp", "--host", "127.0.0.1", "--port", "9",
                 "-m", "x.gguf", "--alias", "llama-8b", "--metrics"]
    ns = build_llamacpp_parser().parse_args(l[6:])
    assert (ns.model, ns.alias, ns.metrics, ns.port) == ("x.gguf", "llama-8b", True, 9)


def test_unknown_engine():
    with pytest.raises(ValueError):
        build_command(spec(engine="tgi"), "h", 1, "/py")


def test_env():
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    s = spec(env=(("HF_HOME", "/cache"), ("CUDA_VISIBLE_DEVICES", "9")), gpu_indices=(2, 3))
    env = build_env(s, base)
    assert env == {"PATH": "/bin", "HF_HOME": "/cache", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert base["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # not mutated
    assert build_env(spec(), base) == base
    assert "CUDA_VISIBLE_DEVICES" not in build_env(spec(simulate=True), {"PATH": "/bin"})
    assert health_path(spec()) == "/health"


def test_backoff_grows_and_caps():
    p = RestartPolicy(base_s=1.0, max_s=5.0, crashloop_after=100, window_s=1e9, jitter=0.0)
    assert [p.record_crash(float(t), 0.5) for t in range(6)] == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert p.crashes == 6


@pytest.mark.parametrize("rand", [0.0, 0.25, 0.5, 0.999])
def test_jitter_bounds(rand):
    p = RestartPolicy(base_s=2.0, jitter=0.2)
    d = p.record_crash(0.0, rand)
    assert d is not None and 1.6 <= d <= 2.4
    assert d == pytest.approx(2.0 * (1 + 0.2 * (2 * rand - 1)))


def test_crashloop_after_n_within_window():
    p = RestartPolicy(crashloop_after=3, window_s=10.0, jitter=0.0)
    assert p.record_crash(0.0, 0.5) == 1.0
    assert p.record_crash(1.0, 0.5) == 2.0
    assert p.record_crash(2.0, 0.5) is None
    assert p.first_crash_at == 0.0


def test_old_crashes_fall_out_of_the_window():
    p = RestartPolicy(crashloop_after=3, window_s=10.0, jitter=0.0)
    p.record_crash(0.0, 0.5)
    p.record_crash(1.0, 0.5)
    assert p.record_crash(10.5, 0.5) == 2.0  # the crash at 0 is forgotten
    assert p.crashes == 2


def test_healthy_for_a_window_resets():
    p = RestartPolicy(crashloop_after=3, window_s=10.0, jitter=0.0)
    p.record_crash(0.0, 0.5)
    p.record_crash(1.0, 0.5)
    p.record_healthy(2.0)
    p.record_healthy(11.0)  # healthy for 9 s: not yet
    assert p.crashes == 2
    p.record_healthy(12.0)
    assert p.crashes == 0
    assert p.record_crash(12.5, 0.5) == 1.0


def test_a_crash_ends_the_healthy_streak():
    p = RestartPolicy(crashloop_after=10, window_s=10.0, jitter=0.0)
    p.record_healthy(0.0)
    p.record_crash(5.0, 0.5)
    p.record_healthy(6.0)
    p.record_healthy(12.0)  # streak began at 6
    assert p.crashes == 1


def test_reset():
    p = RestartPolicy(crashloop_after=2, jitter=0.0)
    p.record_crash(0.0, 0.5)
    assert p.record_crash(1.0, 0.5) is None
    p.reset()
    assert p.crashes == 0
    assert p.record_crash(2.0, 0.5) == 1.0
