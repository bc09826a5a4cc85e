"""The OpenAI surface as the openai SDK sees it, through a real router daemon in front of a
simulated vLLM with a LoRA adapter: ``GET /v1/models/{id}`` (a model, an adapter, a 404), and
every error the router makes raising the SDK's own exception class with one envelope
(``message``, ``type``, ``param``, a string ``code`` or null)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .conftest import start_sim
from .test_router_integration import Daemon, write_config


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    started: list[Any] = []
    try:
        s = start_sim(["--engine", "vllm", "sim-model", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost",
                       "--enable-lora", "--lora-modules", "sql-lora=/adapters/sql"])
        started.append(s)
        d = Daemon(write_config(tmp_path, [{"name": "sim-model", "replicas": [{"url": s.url}]}],
                                server="max_body_bytes = 4096"))
        started.append(d)
        deadline = time.monotonic() + 20  # the adapter is learnt from the engine's /v1/models
        while "sql-lora" not in httpx.get(f"{d.url}/v1/models").text:
            assert time.monotonic() < deadline, "the router never learnt the adapter"
            time.sleep(0.05)
        yield d.url
    finally:
        for p in reversed(started):
            p.stop()


def envelope(e: openai.APIStatusError) -> dict[str, Any]:
    body = e.response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str), err
    return err  # type: ignore[no-any-return]


def test_models_retrieve(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    m = client.models.retrieve("sim-model")
    assert m.id == "sim-model" and m.object == "model" and m.owned_by == "llmgw"
    a = client.models.retrieve("sql-lora")
    assert a.id == "sql-lora" and a.model_extra is not None and a.model_extra["parent"] == "sim-model"
    assert {x.id for x in client.models.list()} == {"sim-model", "sql-lora"}
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    err = envelope(e.value)
    assert err["code"] == "model_not_found" and err["param"] == "model" and "no-such-model" in err["message"]
    r = httpx.delete(f"{url}/v1/models/sim-model")
    assert r.status_code == 405 and r.json()["error"]["code"] is None


def test_router_errors_raise_the_sdk_classes_with_one_envelope(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    ok = client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2)
    assert ok.choices
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert envelope(nf.value)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model="sim-model", messages="not a list")  # type: ignore[arg-type]
    assert envelope(br.value)["param"] == "messages"
    with pytest.raises(openai.APIStatusError) as big:  # answered by the HTTP server, before the router
        client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x" * 8000}])
    assert big.value.status_code == 413
    assert envelope(big.value)["code"] == "request_too_large"
    with pytest.raises(openai.NotFoundError) as route:
        client.post("/nothing", cast_to=object, body={})
    assert envelope(route.value)["code"] == "not_found"
