"""Tenants on the OpenAI port, over real processes (a router daemon in front of simulated vLLM and
llama.cpp engines): 401 in OpenAI's envelope for a missing or unknown static key, the usage tap
(a stream's usage asked of the engine and its chunk taken out when the client did not ask, kept
when it did; a non-streamed answer's usage), counted per tenant in /metrics. Store keys and quotas:
tests/test_tenants_quotas.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import SimProc, start_sim
from .test_router_integration import Daemon, write_config

KEY = "sk-static-test-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in reversed(started):
        p.stop()


def engine(procs: list[Any], kind: str) -> SimProc:
    args = (["--engine", "vllm", "m"] if kind == "vllm" else ["--engine", "llamacpp", "-m", "m.gguf", "-np", "2",
                                                              "--metrics"])
    s = start_sim([*args, "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost"])
    procs.append(s)
    return s


def daemon(procs: list[Any], tmp: Path, sim: SimProc, kind: str = "vllm", server: str = "",
           tenants: str = "") -> Daemon:
    path = write_config(tmp, [{"name": "m", "engine": kind, "replicas": [{"url": sim.url}]}], server=server)
    if tenants:
        path.write_text(path.read_text() + "[tenants]\n" + tenants + "\n")
    d = Daemon(path)
    procs.append(d)
    return d


def metric(text: str, name: str, labels: dict[str, str]) -> float | None:
    """A sample of a /metrics page: `name` with exactly `labels`."""
    want = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{") and sorted(head[len(name) + 1:-1].split(",")) == want:
            return float(value)
    return None


def events(text: str) -> list[Any]:
    out = []
    for ev in text.split("\n\n"):
        if ev.startswith("data: "):
            out.append("[DONE]" if ev == "data: [DONE]" else json.loads(ev[6:]))
    return out


def tokens(d: Daemon, kind: str, tenant: str = "static") -> float:
    text = httpx.get(d.url + "/metrics", headers=AUTH).text
    return metric(text, "llmgw_tokens_total", {"tenant": tenant, "model": "m", "kind": kind}) or 0.0


def test_static_keys_401_in_openai_envelope(procs: list[Any], tmp_path: Path) -> None:
    sim = engine(procs, "vllm")
    d = daemon(procs, tmp_path, sim, server=f"api_keys = [{json.dumps(KEY)}]")
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": f"Basic {KEY}"},
                    {"authorization": "Bearer sk-llmgw-abcdefghij-" + "0" * 48}):
        r = httpx.post(d.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json() == {"error": {"message": "Invalid or missing API key.", "type": "invalid_request_error",
                                      "param": None, "code": "invalid_api_key"}}
        assert KEY not in r.text
    assert httpx.get(d.url + "/metrics").status_code == 401
    assert set(httpx.get(d.url + "/ready").json()) == {"status"}  # no key: only the status
    r = httpx.post(d.url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert "x-ratelimit-limit-requests" not in r.headers  # no quota: no header pairs
    m = httpx.get(d.url + "/metrics", headers=AUTH).text
    assert metric(m, "llmgw_ratelimited_total", {"tenant": "-", "reason": "auth"}) == 5.0  # 4 + /metrics
    assert metric(m, "llmgw_tenant_requests_total", {"tenant": "static", "model": "m", "outcome": "ok"}) == 1.0
    assert metric(m, "llmgw_tokens_total", {"tenant": "static", "model": "m", "kind": "completion"}) == 2.0


@pytest.mark.parametrize("kind", ["vllm", "llamacpp"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_usage_is_asked_for_and_its_chunk_stripped_unless_the_client_asked(
        procs: list[Any], tmp_path: Path, kind: str, path: str) -> None:
    sim = engine(procs, kind)
    d = daemon(procs, tmp_path, sim, kind, server=f"api_keys = [{json.dumps(KEY)}]")
    body: dict[str, Any] = {"model": "m", "max_tokens": 5, "ignore_eos": True}
    if path == "/v1/completions":
        body["prompt"] = "one two three four five six seven"
    else:
        body["messages"] = [{"role": "user", "content": "one two three four five six seven"}]
    whole = httpx.post(d.url + path, json=body, headers=AUTH)
    assert whole.status_code == 200, whole.text
    usage = whole.json()["usage"]
    assert usage["completion_tokens"] == 5
    assert tokens(d, "prompt") == usage["prompt_tokens"] and tokens(d, "completion") == 5

    r = httpx.post(d.url + path, json={**body, "stream": True}, headers=AUTH)
    assert r.status_code == 200 and "x-llmgw-endpoint" in r.headers
    got = events(r.text)
    assert got[-1] == "[DONE]"
    assert not [e for e in got[:-1] if e["choices"] == []], "the usage-only chunk is the router's, not the client's"
    # the engine's own count (the router asked for it): the prompt's tokens exactly, not an estimate
    assert tokens(d, "prompt") == 2 * usage["prompt_tokens"] and tokens(d, "completion") == 10

    asked = {**body, "stream": True, "stream_options": {"include_usage": True}}
    got = events(httpx.post(d.url + path, json=asked, headers=AUTH).text)
    last = [e for e in got[:-1] if "usage" in e]
    assert last and last[-1]["usage"]["completion_tokens"] == 5
    if path == "/v1/chat/completions" or kind == "vllm":
        assert got[-2]["choices"] == []  # the client asked: its usage chunk is there, last before [DONE]
    assert tokens(d, "prompt") == 3 * usage["prompt_tokens"] and tokens(d, "completion") == 15


def test_stream_usage_off_counts_chunks_and_leaves_the_body_alone(procs: list[Any], tmp_path: Path) -> None:
    sim = engine(procs, "vllm")
    d = daemon(procs, tmp_path, sim, tenants="stream_usage = false")  # and no key: the anonymous tenant
    body = {"model": "m", "prompt": "abcd" * 8, "max_tokens": 4, "ignore_eos": True, "stream": True}
    got = events(httpx.post(d.url + "/v1/completions", json=body).text)
    assert len(got) == 5 and not any(e != "[DONE]" and "usage" in e for e in got)
    assert tokens(d, "completion", "default") == 4  # one token an event
    assert tokens(d, "prompt", "default") == 8  # the planner's estimate: 32 characters / 4
