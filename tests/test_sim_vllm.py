"""The vLLM-mode simulator over real sockets: the OpenAI SDK as client, vLLM's HTTP shapes and
errors, metrics, runtime LoRA, KV events on ZMQ, queueing and cancellation."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import msgpack
import openai
import pytest
import zmq

from llmgw.kv.hashing import HashContext, LoRA, event_hash

from .conftest import SimProc


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metric(url: str, name: str, **labels: str) -> float:
    for key, v in metrics(url).items():
        if key.split("{")[0] == name and all(f'{k}="{val}"' in key for k, val in labels.items()):
            return v
    raise KeyError(name)


def wait_for(pred: Any, timeout: float = 10.0) -> None:
    """Poll an observable condition of another process, bounded (not sleep-as-sync)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


# -- the OpenAI SDK as a client -------------------------------------------------------------
def test_openai_sdk_chat_and_completions(vllm_sim: SimProc) -> None:
    client = openai.OpenAI(base_url=f"{vllm_sim.url}/v1", api_key="unused")
    chat = client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    comp = client.completions.create(model="sim-model", prompt="Once upon a time", max_tokens=3)
    assert comp.usage.completion_tokens == 3 and comp.choices[0].text

    stream = client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    text_stream = client.completions.create(model="sim-model", prompt="abc", max_tokens=3, stream=True)
    parts = list(text_stream)
    assert len(parts) == 3 and parts[-1].choices[0].finish_reason == "length"


def test_sse_framing_matches_vllm(vllm_sim: SimProc, golden: dict[str, Any]) -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    raw = httpx.post(f"{vllm_sim.url}/v1/chat/completions", json=body).text
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    first = json.loads(events[0][6:])
    example = golden["http_json_0.33.0"]["sse_chat_stream_example"]
    gold = [json.loads(e[6:]) for e in example.split("\n\n") if e.startswith("data: {")]
    for ours, theirs in zip([first, *[json.loads(e[6:]) for e in events[1:-2]]], gold, strict=False):
        assert list(ours) == list(theirs)  # same keys in the same order
        assert list(ours["choices"][0]) == list(theirs["choices"][0]) if ours["choices"] else True
    usage = json.loads(events[-3][6:])
    assert list(usage["usage"])[:3] == ["prompt_tokens", "total_tokens", "completion_tokens"]


def test_models_lists_adapters_with_parent_and_root(vllm_sim: SimProc) -> None:
    data = httpx.get(f"{vllm_sim.url}/v1/models").json()["data"]
    base, lora = data[0], data[1]
    assert base["id"] == "sim-model" and base["parent"] is None and base["max_model_len"] == 4096
    assert lora["id"] == "sql-lora" and lora["root"] == "/adapters/sql-lora" and lora["parent"] == "sim-model"
    assert lora["max_model_len"] is None


def test_tokenize_and_detokenize(vllm_sim: SimProc) -> None:
    r = httpx.post(f"{vllm_sim.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert list(r) == ["count", "max_model_len", "tokens", "token_strs"]
    assert r["count"] == len(r["tokens"]) and "".join(r["token_strs"]) == "Hello world"
    assert httpx.post(f"{vllm_sim.url}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    chat = httpx.post(f"{vllm_sim.url}/tokenize", json=msgs).json()
    assert chat["token_strs"] is None
    rendered = httpx.post(f"{vllm_sim.url}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # The chat request's usage counts exactly the tokens /tokenize gives for the same messages.
    done = httpx.post(f"{vllm_sim.url}/v1/chat/completions", json={**msgs, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"]


def test_health_version_and_unknown_routes(vllm_sim: SimProc) -> None:
    assert httpx.get(f"{vllm_sim.url}/health").status_code == 200
    assert httpx.get(f"{vllm_sim.url}/version").json() == {"version": "0.33.0"}
    assert httpx.get(f"{vllm_sim.url}/nope").status_code == 404
    assert httpx.get(f"{vllm_sim.url}/v1/chat/completions").status_code == 405


# -- bad input gets vLLM's errors -------------------------------------------------------------
@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": "nope", "messages": []}).encode(), 404, "model"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "x " * 5000}]}).encode(), 400, "input_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "cache_salt": "a/b"}).encode(), 400, "cache_salt"),
])
def test_bad_requests_get_vllm_errors(vllm_sim: SimProc, body: bytes, status: int, param: str | None) -> None:
    r = httpx.post(f"{vllm_sim.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param
    if status == 404:
        assert err == {"message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model",
                       "code": 404}
    assert httpx.get(f"{vllm_sim.url}/health").status_code == 200  # still alive


def test_runtime_lora_load_unload_with_vllms_messages(vllm_sim: SimProc, golden: dict[str, Any]) -> None:
    url = vllm_sim.url
    http = golden["http_json_0.33.0"]
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "tenant-x", "lora_path": "/adapters/x"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tenant-x' added successfully."
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "sql-lora", "lora_path": "/p"})
    assert again.status_code == 400 and again.json() == http["error_already_loaded_json"]
    missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "only-name"})
    assert missing.status_code == 400 and "must be provided" in missing.json()["error"]["message"]
    assert any(m["id"] == "tenant-x" for m in httpx.get(f"{url}/v1/models").json()["data"])
    out = httpx.post(f"{url}/v1/chat/completions",
                     json={"model": "tenant-x", "messages": [{"role": "user", "content": "q"}], "max_tokens": 1})
    assert out.status_code == 200 and out.json()["model"] == "tenant-x"
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "tenant-x"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tenant-x' removed successfully."
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "tenant-x"})
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'tenant-x' cannot be found."


def test_lora_routes_absent_without_env(sim_factory: Any) -> None:
    s = sim_factory(["sim-model", "--host", "127.0.0.1", "--port", "0", "--enable-lora", "--sim-zero-cost"])
    assert httpx.post(f"{s.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "b"}).status_code == 404


def test_lora_path_and_rank_errors(sim_factory: Any, tmp_path: Any, golden: dict[str, Any]) -> None:
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps({"r": 64}))
    s = sim_factory(["sim-model", "--host", "127.0.0.1", "--port", "0", "--enable-lora", "--sim-zero-cost",
                     "--sim-lora-require-path"], env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    nf = httpx.post(f"{s.url}/v1/load_lora_adapter", json={"lora_name": "sql-lora", "lora_path": "/nope"})
    assert nf.status_code == 404 and nf.json() == golden["http_json_0.33.0"]["error_load_adapter_path_not_found_json"]
    rank = httpx.post(f"{s.url}/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
    assert rank.status_code == 500 and "greater than max_lora_rank 16" in rank.json()["error"]["message"]


# -- metrics, queueing, cancellation ----------------------------------------------------------
def test_metrics_move_like_vllms(sim_factory: Any) -> None:
    s = sim_factory(["sim-model", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost"])
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    for _ in range(2):
        httpx.post(f"{s.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    m = metrics(s.url)
    lab = '{engine="0",model_name="sim-model"}'
    assert m[f"vllm:generation_tokens_total{lab}"] == 4
    assert m[f"vllm:prefix_cache_hits_total{lab}"] > 0  # the second request hit the first's blocks
    assert m[f"vllm:prefix_cache_queries_total{lab}"] == 2 * m[f"vllm:prompt_tokens_total{lab}"] / 2
    assert metric(s.url, "vllm:request_success_total", finished_reason="length") == 2
    assert m[f"vllm:time_to_first_token_seconds_count{lab}"] == 2
    assert "vllm:gpu_cache_usage_perc" not in " ".join(m)  # removed in 0.12


def test_old_version_exports_old_metric_names(sim_factory: Any) -> None:
    s = sim_factory(["sim-model", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost",
                     "--sim-vllm-version", "0.10.2"])
    names = {k.split("{")[0] for k in metrics(s.url)}
    assert {"vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_prefix_cache_hits_total"} <= names


def test_queueing_beyond_max_num_seqs_and_disconnect_frees(sim_factory: Any) -> None:
    s = sim_factory(["sim-model", "--host", "127.0.0.1", "--port", "0", "--max-num-seqs", "2",
                     "--sim-decode-ms-per-token", "50", "--sim-prefill-ms-per-token", "0"])
    host, port = "127.0.0.1", s.info["port"]
    body = json.dumps({"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}).encode()
    req = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    socks = []
    for _ in range(4):
        sock = socket.create_connection((host, port))
        sock.sendall(req)
        socks.append(sock)
    lab = {"model_name": "sim-model"}
    wait_for(lambda: metric(s.url, "vllm:num_requests_running", **lab) == 2
             and metric(s.url, "vllm:num_requests_waiting", **lab) == 2)
    for sock in socks:
        sock.recv(1)  # at least one is streaming; then every client leaves
        break
    for sock in socks:
        sock.close()
    wait_for(lambda: metric(s.url, "vllm:num_requests_running", **lab) == 0
             and metric(s.url, "vllm:num_requests_waiting", **lab) == 0)
    assert metric(s.url, "vllm:request_success_total", finished_reason="abort") == 4
    assert metric(s.url, "vllm:kv_cache_usage_perc", **lab) == 0


# -- KV events over ZMQ -------------------------------------------------------------------------
def _kv_sim(sim_factory: Any, version: str, extra_env: dict[str, str] | None = None) -> SimProc:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
           "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"}
    return sim_factory(["sim-model", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost",
                        "--prefix-caching-hash-algo", "sha256_cbor", "--sim-vllm-version", version,
                        "--kv-events-config", json.dumps(cfg), "--sim-kv-blocks", "300",
                        "--enable-lora", "--lora-modules", "sql-lora=/adapters/sql-lora"],
                       env={"PYTHONHASHSEED": "0", **(extra_env or {})})


def _replay(endpoint: str, start: int = 0) -> list[list[bytes]]:
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            if not dealer.poll(5000):
                raise AssertionError("replay did not answer")
            frames = dealer.recv_multipart()
            if frames[-2] == b"\xff" * 8:
                return out
            out.append(frames)
    finally:
        dealer.close()


@pytest.mark.parametrize("version", ["0.33.0", "0.23.0"])
def test_kv_events_published_with_vllms_hashes(sim_factory: Any, version: str) -> None:
    s = _kv_sim(sim_factory, version)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(s.info["kv_events"])
    ids = list(range(1, 49))  # the golden chain
    httpx.post(f"{s.url}/v1/completions", json={"prompt": ids, "max_tokens": 1})
    replayed = _replay(s.info["kv_replay"])
    payloads = [f[-1] for f in replayed]
    assert replayed and all(len(f) == (4 if version >= "0.26" else 3) for f in replayed)
    assert [int.from_bytes(f[-2], "big") for f in replayed] == list(range(len(replayed)))
    batch = msgpack.unpackb(payloads[0], raw=False, strict_map_key=False)
    assert len(batch) == 3 and batch[2] == 0
    ev = batch[1][0]
    if version >= "0.24":
        assert ev["type"] == "BlockStored"
        hashes, parent, tokens = ev["block_hashes"], ev["parent_block_hash"], ev["token_ids"]
        assert ev["extra_keys"] == [None, None, None]
    else:
        assert ev[0] == "BlockStored" and len(ev) == 12
        hashes, parent, tokens = ev[1], ev[2], ev[3]
    assert hashes == [3236607068019569386, 2758186210834249151, 5191110061519319221] and parent is None
    assert tokens == ids
    # The live PUB stream carries the same batches (subscribed before the request was sent).
    if sub.poll(2000):
        frames = sub.recv_multipart()
        assert frames[0] == b"kv" and len(frames) == 3
    sub.close()


def test_kv_events_lora_salt_and_bytes_hashes(sim_factory: Any) -> None:
    s = _kv_sim(sim_factory, "0.33.0", {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"})
    httpx.post(f"{s.url}/v1/completions",
               json={"model": "sql-lora", "prompt": list(range(1, 18)), "max_tokens": 1, "cache_salt": "tenant-a"})
    batch = msgpack.unpackb(_replay(s.info["kv_replay"])[0][-1], raw=False)
    ev = batch[1][0]
    ctx = HashContext.create("0.33.0", "sha256_cbor", 16, "0")
    expect = ctx.hash_tokens(list(range(1, 17)), LoRA("sql-lora", 1, "/adapters/sql-lora"), "tenant-a")
    assert ev["block_hashes"] == [expect[0]]
    assert ev["block_hashes"][0].hex().startswith("04ec30af")  # golden LoRA+salt block 0 (0.31+)
    assert ev["lora_name"] == "sql-lora" and ev["extra_keys"] == [["sql-lora", "tenant-a"]]
    assert event_hash(expect[0]) != 0


def test_kv_events_eviction_and_reset(sim_factory: Any) -> None:
    s = _kv_sim(sim_factory, "0.33.0")
    env_s = s
    for i in range(12):  # 12 × 40 blocks of distinct prompts overflow 299 usable blocks
        httpx.post(f"{env_s.url}/v1/completions", json={"prompt": [1000 + i] * 640, "max_tokens": 1})
    kinds = []
    for frames in _replay(s.info["kv_replay"]):
        for ev in msgpack.unpackb(frames[-1], raw=False)[1]:
            kinds.append(ev["type"])
    assert "BlockRemoved" in kinds and kinds.count("BlockStored") == 12


def test_sim_fleet_starts_and_stops_every_replica() -> None:
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "sim", "fleet", "2", "--", "--sim-zero-cost"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert proc.stdout is not None
        fleet = json.loads(proc.stdout.readline())["fleet"]
        assert len(fleet) == 2
        for r in fleet:
            assert httpx.get(f"{r['url']}/health").status_code == 200
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        for r in fleet:  # every replica's process is gone
            wait_for(lambda r=r: not os.path.exists(f"/proc/{r['pid']}") or
                     open(f"/proc/{r['pid']}/stat").read().split()[2] == "Z")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_embeddings_only_on_a_pooling_model(vllm_sim: SimProc) -> None:
    r = httpx.post(f"{vllm_sim.url}/v1/embeddings", json={"model": "sim-model", "input": "x"})
    assert r.status_code == 400 and "does not support Embeddings API" in r.json()["error"]["message"]


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_start_up_then_load_delay_the_engine(sim_factory: Any, engine: str) -> None:
    """A cold start is the process starting (nothing bound) and then the model loading: the ready
    line (vLLM: bound and serving; llama.cpp: listening, 503 while loading) comes after the first."""
    args = (["sim-model", "--port", "0"] if engine == "vllm" else ["--engine", "llamacpp", "-m", "tiny.gguf", "--port", "0"])
    t0 = time.monotonic()
    s = sim_factory([*args, "--host", "127.0.0.1", "--sim-zero-cost", "--sim-start-seconds", "0.4",
                     "--sim-load-seconds", "0.3"])
    waited = time.monotonic() - t0
    assert waited >= (0.7 if engine == "vllm" else 0.4)
    wait_for(lambda: httpx.get(f"{s.url}/health").status_code == 200)


def test_start_seconds_must_be_seconds() -> None:
    out = subprocess.run([sys.executable, "-m", "llmgw", "sim", "sim-model", "--sim-start-seconds", "-1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--sim-start-seconds" in out.stderr and "≥ 0" in out.stderr
