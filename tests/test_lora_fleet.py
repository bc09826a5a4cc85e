"""Declared LoRA adapters end to end on a simulated fleet (router + agent + `llmgw sim` engines):
from the config file and through the admin API, for vLLM and llama.cpp; what `ctl models` shows;
the store keeping them; an adapter whose file is missing failing its engine with the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from .test_fleet_integration import fleet_factory  # noqa: F401  (fixture)
from .test_sim_vllm import wait_for

SIM = {"count": 1, "simulate": True, "health_timeout_s": 20.0}


def _post(router: str, model: str) -> httpx.Response:
    return httpx.post(f"{router}/v1/completions", timeout=10, json={"model": model, "prompt": "hi", "max_tokens": 2})


def test_adapters_from_config_and_admin_api_reach_both_engines(fleet_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    vllm = {"name": "v", "engine": "vllm", "max_loaded_adapters": 2,
            "adapters": [{"name": "v-sql", "source": "/l/sql", "static": True}, {"name": "v-chat", "source": "org/chat"}],
            "deploy": {**SIM, "args": ["--sim-zero-cost"]}}
    f = fleet_factory([vllm])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("v")) == 1, 30)
    router = f.router.url
    engine = f.ready("v")[0]["url"]
    served = {m["id"]: m["parent"] for m in httpx.get(f"{engine}/v1/models").json()["data"]}
    assert served == {"v": None, "v-sql": "v"}  # the static one, loaded at start
    r = httpx.post(f"{engine}/v1/load_lora_adapter", json={"lora_name": "probe", "lora_path": "/l/p"})
    assert r.status_code == 200  # runtime loading is on
    wait_for(lambda: _post(router, "v-sql").status_code == 200, 20)
    listed = {m["id"]: m["parent"] for m in httpx.get(f"{router}/v1/models").json()["data"]}
    assert listed["v-sql"] == listed["v-chat"] == "v"

    lora = tmp_path / "l-a.gguf"
    lora.write_bytes(b"GGUF")
    bad = f.admin.post("/api/v1/models", json={"name": "l", "engine": "llamacpp",
                                               "adapters": [{"name": "l-a", "source": "org/repo"}], "deploy": SIM})
    assert bad.status_code == 400 and "adapters[0].source" in bad.text
    llama = {"name": "l", "engine": "llamacpp", "adapters": [{"name": "l-a", "source": str(lora), "scale": 0.25}],
             "deploy": {**SIM, "args": ["--sim-zero-cost", "--sim-lora-require-path", "-np", "1"]}}
    assert f.admin.post("/api/v1/models", json=llama).status_code == 201
    wait_for(lambda: len(f.ready("l")) == 1, 30)
    wait_for(lambda: _post(router, "l-a").status_code == 200, 20)
    (slot,) = httpx.get(f"{f.ready('l')[0]['url']}/slots").json()
    assert slot["params"]["lora"] == [{"id": 0, "scale": 0.25}]

    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", str(tmp_path / "admin" / "admin.sock"),
                          "models"], capture_output=True, text=True, timeout=30).stdout.splitlines()
    assert out[0].split()[:5] == ["MODEL", "ENGINE", "SOURCE", "READY", "ADAPTERS"]
    assert {ln.split()[0]: ln.split()[4] for ln in out[1:]} == {"l": "1", "v": "2"}

    f.stop_router()  # the store keeps the API-made model's adapters
    f.start_router()
    defn = f.get("/api/v1/models/l")
    assert defn["adapters"] == [{"name": "l-a", "source": str(lora), "static": False, "scale": 0.25}]


def test_a_missing_adapter_file_fails_the_engine_and_says_why(fleet_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    missing = str(tmp_path / "nowhere" / "gone.gguf")
    f = fleet_factory([{"name": "l", "engine": "llamacpp", "adapters": [{"name": "gone", "source": missing}],
                        "deploy": {**SIM, "args": ["--sim-zero-cost", "--sim-lora-require-path"]}}])
    f.start_agent("a")

    def failed() -> list[dict[str, Any]]:
        return [r for r in f.replicas("l") if r["state"] in ("crashed", "crashloop", "failed")]

    wait_for(lambda: bool(failed()), 30)
    rep = failed()[0]
    assert any(missing in line for line in rep["log_tail"]), rep
    assert _post(f.router.url, "gone").status_code == 503  # declared, served by nothing
