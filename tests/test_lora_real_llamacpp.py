"""Declared LoRA adapters on a real llama-server, deployed by an agent and routed by the router:
the engine starts with both adapters off, a request for one runs with the explicit list (that
adapter at its scale, the other at 0), and the next base request runs with every adapter at 0 and
recomputes the prompt rather than reuse the adapter's KV — checked on the server's side (its
/slots and the answer's cached tokens).

Needs LLMGW_LLAMA_SERVER (scripts/build-llama-server writes tiny.gguf and tiny-lora.gguf beside
its bin/); skipped without it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_fleet_integration import fleet_factory  # noqa: F401  (fixture)
from .test_llamacpp_contract import real_paths
from .test_sim_vllm import wait_for

pytestmark = pytest.mark.realengine

PROMPT = " ".join(f"word{i}" for i in range(120))


def _complete(router: str, model: str) -> dict[str, Any]:
    r = httpx.post(f"{router}/v1/completions", timeout=30,
                   json={"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _slot_lora(engine: str) -> list[dict[str, Any]]:
    (slot,) = httpx.get(f"{engine}/slots", timeout=5).json()
    return slot["params"]["lora"]


def test_two_adapters_at_start_and_the_explicit_list_per_request(fleet_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    binary, model, lora = real_paths()
    x, y = tmp_path / "x.gguf", tmp_path / "y.gguf"  # two adapters (the same weights, two files)
    shutil.copy(lora, x)
    shutil.copy(lora, y)
    f = fleet_factory([{"name": "tiny", "engine": "llamacpp",
                        "adapters": [{"name": "tiny-x", "source": str(x)},
                                     {"name": "tiny-y", "source": str(y), "scale": 0.5}],
                        "deploy": {"count": 1, "binary": str(binary), "model_path": str(model),
                                   "args": ["-c", "4096", "-np", "1", "-t", "1", "--cache-ram", "0"],
                                   "health_timeout_s": 60.0}}])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("tiny")) == 1, 90)
    engine = f.ready("tiny")[0]["url"]
    listed = httpx.get(f"{engine}/lora-adapters", timeout=5).json()
    assert [(a["id"], a["path"], a["scale"]) for a in listed] == [(0, str(x), 0.0), (1, str(y), 0.0)]
    router = f.router.url
    wait_for(lambda: httpx.post(f"{router}/v1/completions", timeout=30,  # the router learned the ids
                                json={"model": "tiny-y", "prompt": "x", "max_tokens": 1}).status_code == 200, 30)

    _complete(router, "tiny-y")
    assert _slot_lora(engine) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]
    base = _complete(router, "tiny")
    assert _slot_lora(engine) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    assert _cached(base) == 0  # the adapter's KV was not reused
    again = _complete(router, "tiny")
    assert _cached(again) > 100  # the same settings: the prompt's KV is reused
    _complete(router, "tiny-x")
    assert _slot_lora(engine) == [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]
    models = {m["id"]: m for m in httpx.get(f"{router}/v1/models", timeout=5).json()["data"]}
    assert models["tiny-x"]["parent"] == models["tiny-y"]["parent"] == "tiny"


def test_a_missing_adapter_file_is_in_the_failed_engines_log_tail(fleet_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    binary, model, _ = real_paths()
    missing = str(tmp_path / "nowhere" / "gone.gguf")
    f = fleet_factory([{"name": "tiny", "engine": "llamacpp", "adapters": [{"name": "gone", "source": missing}],
                        "deploy": {"count": 1, "binary": str(binary), "model_path": str(model),
                                   "args": ["-c", "512", "-np", "1", "-t", "1"], "health_timeout_s": 60.0}}])
    f.start_agent("a")

    def failed() -> list[dict[str, Any]]:
        return [r for r in f.replicas("tiny") if r["state"] in ("crashed", "crashloop")]

    wait_for(lambda: bool(failed()), 60)
    assert any(missing in line for line in failed()[0]["log_tail"]), failed()[0]["log_tail"]
