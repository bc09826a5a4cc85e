"""One contract, two targets: the llama.cpp simulator and a real llama-server.

The real target needs LLMGW_LLAMA_SERVER=/path/to/bin/llama-server with tiny.gguf and tiny-lora.gguf
beside its bin/ directory (scripts/build-llama-server makes all three; scripts/test runs it); without it those
cases skip. Assertions are on structure, counts and cache fields, never on generated text: the real
tiny model emits random-weight gibberish.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

N_CTX_SLOT = 2048  # -c 4096 -np 2
METRICS = ["prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
           "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max", "prompt_tokens_seconds",
           "predicted_tokens_seconds", "requests_processing", "requests_deferred", "n_busy_slots_per_decode",
           "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
           "spec_decode_num_drafts_total"]
TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
           "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def text_of(n_words: int, salt: int = 0) -> str:
    return " ".join(f"{WORDS[(i * 7 + salt) % len(WORDS)]}{(i + salt) % 10}" for i in range(n_words))


@dataclass
class Server:
    kind: str  # "sim" | "real"
    url: str
    model: str  # the -m argument, as given
    proc: subprocess.Popen[bytes]
    early: list[tuple[int, Any]] = field(default_factory=list)  # answers seen before /health was 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


def _wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> list[tuple[int, Any]]:
    """Poll /health until 200; record every other answer (the loading state)."""
    early: list[tuple[int, Any]] = []
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                r = c.get(url + "/health")
            except httpx.TransportError:
                time.sleep(0.01)  # not listening yet: nothing to wait on but the clock
                continue
            if r.status_code == 200:
                return early
            early.append((r.status_code, r.json()))
    raise RuntimeError("server did not become healthy")


def start_sim(extra: list[str], tmp: Path) -> Server:
    model = "tiny.gguf"
    cmd = [sys.executable, "-m", "llmgw", "sim", "--engine", "llamacpp", "-m", model, "--port", "0",
           "-np", "2", "-c", "4096", *extra]
    with open(tmp / "sim.err", "wb") as err:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else b""
    if not line:
        _stop(proc)
        raise RuntimeError(f"simulator did not start: {(tmp / 'sim.err').read_text()}")
    info = json.loads(line)
    srv = Server("sim", info["url"], model, proc)
    srv.early = _wait_health(srv.url, proc)
    return srv


def real_paths() -> tuple[Path, Path, Path]:
    binary = os.environ.get("LLMGW_LLAMA_SERVER")
    if not binary:
        pytest.skip("LLMGW_LLAMA_SERVER is not set (path to a llama-server binary)")
    b = Path(binary)
    root = b.parent.parent
    model, lora = root / "tiny.gguf", root / "tiny-lora.gguf"
    for p in (b, model, lora):
        if not p.exists():
            pytest.skip(f"{p} is missing (scripts/build-llama-server makes it)")
    return b, model, lora


def start_real(extra: list[str], tmp: Path) -> Server:
    binary, model, _ = real_paths()
    port = _free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "4096", "-np", "2",
           "-t", "1", *extra]
    with open(tmp / "llama-server.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    srv = Server("real", f"http://127.0.0.1:{port}", str(model), proc)
    try:
        srv.early = _wait_health(srv.url, proc)
    except BaseException:
        _stop(proc)
        raise
    return srv


# The real tiny model's KV per token: 2 layers x (K + V) x 2 KV heads x 16 dims x 2 bytes.
SIM_LIKE_TINY = ["--sim-decode-ms-per-token", "1.5", "--sim-kv-bytes-per-token", "256"]


def start(kind: str, extra: list[str], tmp: Path) -> Server:
    if kind == "real":
        _, _, lora = real_paths()
        return start_real([a.replace("LORA", str(lora)) for a in extra], tmp)
    return start_sim([*(a.replace("LORA", "tiny-lora.gguf") for a in extra), *SIM_LIKE_TINY], tmp)


TARGETS = ["sim", pytest.param("real", marks=pytest.mark.realengine)]


@pytest.fixture(scope="module", params=TARGETS)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start(request.param, ["--metrics", "--cache-ram", "0", "--lora-scaled", "LORA:0"],
                tmp_path_factory.mktemp(request.param))
    try:
        yield srv
    finally:
        _stop(srv.proc)


@pytest.fixture
def c(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


def ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def assert_error(r: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == type_ and isinstance(err["message"], str) and err["message"]
    return err


def sse(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events[:3]
    return [e[len("data: "):] for e in events]


def wait_for(pred: Any, timeout: float = 20.0, show: Any = None, every: float = 0.02) -> Any:
    """Bounded polling of an HTTP answer (pred returns a truthy value when done)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in time; state: {show() if show else v}")
        time.sleep(every)


def n_tokens(c: httpx.Client, text: str) -> int:
    return len(ok(c.post("/tokenize", json={"content": text, "add_special": True}))["tokens"])


def metrics(c: httpx.Client) -> dict[str, float]:
    r = c.get("/metrics")
    assert r.status_code == 200, r.text
    out = {}
    for line in r.text.splitlines():
        if line.startswith("llamacpp:"):
            name, value = line.split(" ", 1)
            out[name[len("llamacpp:"):]] = float(value)
    return out


# -- health, models, tokens ----------------------------------------------------------------------
def test_health(server: Server, c: httpx.Client) -> None:
    assert ok(c.get("/health")) == {"status": "ok"}
    assert ok(c.get("/v1/health")) == {"status": "ok"}
    loading = {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}
    assert all(a == (503, loading) for a in server.early), server.early


def test_models(server: Server, c: httpx.Client) -> None:
    body = ok(c.get("/v1/models"))
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == server.model and card["object"] == "model" and card["owned_by"] == "llamacpp"
    assert isinstance(card["created"], int) and card["meta"]["n_ctx"] == N_CTX_SLOT
    (m,) = body["models"]
    assert m["name"] == m["model"] == server.model and m["details"]["format"] == "gguf"


def test_props(server: Server, c: httpx.Client) -> None:
    p = ok(c.get("/props"))
    assert p["total_slots"] == 2 and p["default_generation_settings"]["n_ctx"] == N_CTX_SLOT
    assert p["model_path"] == p["model_alias"] == server.model and p["endpoint_metrics"] is True
    assert p["default_generation_settings"]["params"]["n_predict"] == -1
    assert "<|im_start|>" in p["chat_template"] and p["bos_token"] and p["eos_token"]


def test_tokenize_detokenize(c: httpx.Client) -> None:
    plain = ok(c.post("/tokenize", json={"content": "Hello world"}))["tokens"]
    special = ok(c.post("/tokenize", json={"content": "Hello world", "add_special": True}))["tokens"]
    assert plain and all(isinstance(t, int) for t in plain)
    assert special[1:] == plain and special[0] not in plain  # add_special prepends the BOS
    pieces = ok(c.post("/tokenize", json={"content": "Hello world", "with_pieces": True}))["tokens"]
    assert [p["id"] for p in pieces] == plain
    assert all(isinstance(p["piece"], (str, list)) for p in pieces)
    assert "Hello world" in ok(c.post("/detokenize", json={"tokens": plain}))["content"]
    assert ok(c.post("/tokenize", json={})) == {"tokens": []}


def test_apply_template(c: httpx.Client) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = ok(c.post("/apply-template", json={"messages": msgs}))["prompt"]
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    # a final assistant message is continued (prefill), without its end marker
    msgs.append({"role": "assistant", "content": "The answer is"})
    prompt = ok(c.post("/apply-template", json={"messages": msgs}))["prompt"]
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\nThe answer is")
    err = assert_error(c.post("/apply-template", json={"messages": [*msgs, msgs[-1]]}), 400, "invalid_request_error")
    assert err["message"] == "Cannot have 2 or more assistant messages at the end of the list."
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    prompt = ok(c.post("/apply-template", json={"messages": [{"role": "user", "content": parts}]}))["prompt"]
    assert prompt == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"


# -- /completion -----------------------------------------------------------------------------------
def test_completion_shape(c: httpx.Client) -> None:
    prompt = text_of(40, salt=1)
    body = ok(c.post("/completion", json={"prompt": prompt, "n_predict": 4}))
    assert isinstance(body["content"], str) and body["stop"] is True
    assert body["id_slot"] in (0, 1) and body["stop_type"] in ("limit", "eos")
    assert body["tokens_predicted"] == 4 or body["stop_type"] == "eos"
    assert body["tokens_evaluated"] == n_tokens(c, prompt)
    t = body["timings"]
    assert TIMINGS <= set(t)
    assert t["prompt_n"] + t["cache_n"] == body["tokens_evaluated"] and t["predicted_n"] == body["tokens_predicted"]
    # the slot keeps the prompt and all generated tokens but the last, which never entered the KV
    assert body["tokens_cached"] == body["tokens_evaluated"] + body["tokens_predicted"] - 1
    assert body["generation_settings"]["n_predict"] == 4


def test_completion_prompt_reuse(c: httpx.Client) -> None:
    prefix = text_of(300, salt=2)
    m0 = metrics(c)
    a = ok(c.post("/completion", json={"prompt": prefix + " first question", "n_predict": 2}))
    b = ok(c.post("/completion", json={"prompt": prefix + " second question", "n_predict": 2}))
    n_prefix = n_tokens(c, prefix)
    assert a["timings"]["cache_n"] < 10 and a["timings"]["prompt_n"] >= n_prefix
    assert b["id_slot"] == a["id_slot"]
    assert b["tokens_cached"] > 0 and b["timings"]["cache_n"] >= n_prefix - 4
    assert b["timings"]["prompt_n"] <= 10
    m1 = metrics(c)
    assert m1["prompt_tokens_cached_total"] - m0["prompt_tokens_cached_total"] >= b["timings"]["cache_n"]
    assert m1["prompt_tokens_total"] - m0["prompt_tokens_total"] >= a["timings"]["prompt_n"] + b["timings"]["prompt_n"]
    # the very same prompt again: all but the last token come from the cache
    c2 = ok(c.post("/completion", json={"prompt": prefix + " second question", "n_predict": 2}))
    assert c2["timings"]["prompt_n"] == 1 and c2["timings"]["cache_n"] == c2["tokens_evaluated"] - 1
    # cache_prompt false recomputes everything
    d = ok(c.post("/completion", json={"prompt": prefix + " second question", "n_predict": 2, "cache_prompt": False}))
    assert d["timings"]["cache_n"] == 0 and d["timings"]["prompt_n"] == d["tokens_evaluated"]
    # a dissimilar prompt (LCP/len below --slot-prompt-similarity) goes to the least recently used slot
    e = ok(c.post("/completion", json={"prompt": text_of(300, salt=13), "n_predict": 1}))
    assert e["id_slot"] != d["id_slot"] and e["timings"]["cache_n"] <= 1


def test_completion_stream(c: httpx.Client) -> None:
    r = c.post("/completion", json={"prompt": text_of(20, salt=3), "n_predict": 5, "stream": True})
    data = sse(r)
    assert "[DONE]" not in data
    chunks = [json.loads(d) for d in data]
    *partials, last = chunks
    assert partials and all(p["stop"] is False and p["id_slot"] == -1 for p in partials)
    assert all(isinstance(p["content"], str) and p["tokens_evaluated"] > 0 for p in partials)
    assert [p["tokens_predicted"] for p in partials] == sorted(p["tokens_predicted"] for p in partials)
    assert last["stop"] is True and last["id_slot"] in (0, 1) and TIMINGS <= set(last["timings"])
    assert last["stop_type"] in ("limit", "eos") and last["tokens_predicted"] == last["timings"]["predicted_n"]
    assert len(partials) <= last["tokens_predicted"]


def test_completion_id_slot_pins(c: httpx.Client) -> None:
    for slot in (0, 1):
        body = ok(c.post("/completion", json={"prompt": text_of(10, salt=4), "n_predict": 1, "id_slot": slot}))
        assert body["id_slot"] == slot


# -- OpenAI routes ---------------------------------------------------------------------------------
def test_v1_completions(c: httpx.Client) -> None:
    body = ok(c.post("/v1/completions", json={"model": "anything", "prompt": text_of(30, 5), "max_tokens": 3}))
    assert body["object"] == "text_completion"
    assert body["id"].startswith("chatcmpl-")  # llama.cpp names text completions chatcmpl- too
    (ch,) = body["choices"]
    assert isinstance(ch["text"], str) and ch["finish_reason"] in ("length", "stop") and ch["index"] == 0
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert isinstance(u["prompt_tokens_details"]["cached_tokens"], int)
    assert TIMINGS <= set(body["timings"])
    data = sse(c.post("/v1/completions", json={"prompt": text_of(30, 5), "max_tokens": 3, "stream": True}))
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(ch["object"] == "text_completion" for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    # the second identical request found the prefix cached
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == chunks[-1]["usage"]["prompt_tokens"] - 1


def test_chat_completions(c: httpx.Client) -> None:
    msgs = [{"role": "user", "content": text_of(60, salt=6)}]
    body = ok(c.post("/v1/chat/completions", json={"model": "ignored", "messages": msgs, "max_tokens": 3}))
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (ch,) = body["choices"]
    assert ch["message"]["role"] == "assistant" and isinstance(ch["message"]["content"], str)
    assert ch["finish_reason"] in ("length", "stop")
    assert body["usage"]["completion_tokens"] <= 3 and TIMINGS <= set(body["timings"])
    n_prompt = body["usage"]["prompt_tokens"]
    data = sse(c.post("/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}))
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    finish = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] in ("length", "stop")
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens"] == n_prompt
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
    assert TIMINGS <= set(usage_chunk["timings"])


# -- /slots, /metrics, /lora-adapters --------------------------------------------------------------
def test_slots(c: httpx.Client) -> None:
    body = ok(c.post("/completion", json={"prompt": text_of(25, salt=7), "n_predict": 3, "id_slot": 0}))
    slots = ok(c.get("/slots"))
    assert [s["id"] for s in slots] == [0, 1]
    assert all(s["n_ctx"] == N_CTX_SLOT and s["is_processing"] is False for s in slots)
    s0 = slots[0]
    assert isinstance(s0["id_task"], int)
    assert s0["n_prompt_tokens"] == body["tokens_cached"]  # the KV it keeps
    # release() resets the per-task stats; the last task's params stay
    assert s0["n_prompt_tokens_processed"] == 0 and s0["n_prompt_tokens_cache"] == 0
    assert s0["params"]["lora"] == [] and s0["params"]["n_predict"] == 3
    assert "grammar" not in s0["params"] and "grammar" in body["generation_settings"]
    assert s0["next_token"] == [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}]


def test_metrics(c: httpx.Client) -> None:
    ok(c.post("/completion", json={"prompt": text_of(10, salt=8), "n_predict": 2}))
    m = metrics(c)
    assert set(METRICS) <= set(m)
    assert m["prompt_tokens_total"] > 0 and m["tokens_predicted_total"] > 0 and m["n_decode_total"] > 0
    assert m["requests_processing"] == 0 and m["requests_deferred"] == 0
    r = c.get("/metrics")
    assert "# TYPE llamacpp:prompt_tokens_total counter" in r.text
    assert "# TYPE llamacpp:requests_processing gauge" in r.text


def test_lora_adapters(server: Server, c: httpx.Client) -> None:
    (a,) = ok(c.get("/lora-adapters"))
    assert a["id"] == 0 and a["path"].endswith("tiny-lora.gguf") and a["scale"] == 0.0
    assert {"task_name", "prompt_prefix"} <= set(a)
    try:
        assert ok(c.post("/lora-adapters", json=[{"id": 0, "scale": 0.5}])) == {"success": True}
        assert ok(c.get("/lora-adapters"))[0]["scale"] == 0.5
    finally:
        ok(c.post("/lora-adapters", json=[{"id": 0, "scale": 0.0}]))
    err = assert_error(c.post("/lora-adapters", json={"id": 0}), 400, "invalid_request_error")
    assert err["message"] == "Request body must be an array"
    err = assert_error(c.post("/completion", json={"prompt": "x", "lora": {"id": 0}}), 400, "invalid_request_error")
    assert err["message"] == "Field 'lora': Error: 'lora' must be an array of objects with 'id' and 'scale' fields"
    # an unknown adapter id is silently ignored
    ok(c.post("/completion", json={"prompt": "x", "n_predict": 1, "lora": [{"id": 5, "scale": 1.0}]}))
    # the per-request list shows in the slot; a differing list clears the slot's KV
    p = text_of(80, salt=9)
    ok(c.post("/completion", json={"prompt": p, "n_predict": 1, "id_slot": 1, "lora": [{"id": 0, "scale": 0.0}]}))
    b = ok(c.post("/completion", json={"prompt": p, "n_predict": 1, "id_slot": 1, "lora": [{"id": 0, "scale": 1.0}]}))
    assert b["timings"]["cache_n"] == 0
    slot1 = ok(c.get("/slots"))[1]
    assert slot1["params"]["lora"] == [{"id": 0, "scale": 1.0}]
    # no list: the KV computed with the adapter on is reused under the global scale 0 (the quirk)
    d = ok(c.post("/completion", json={"prompt": p, "n_predict": 1, "id_slot": 1}))
    assert d["timings"]["cache_n"] == d["tokens_evaluated"] - 1


# -- errors ----------------------------------------------------------------------------------------
def test_errors(c: httpx.Client) -> None:
    for path in ("/completion", "/v1/completions", "/v1/chat/completions", "/tokenize"):
        err = assert_error(c.post(path, content=b"{not json", headers={"content-type": "application/json"}),
                           400, "invalid_request_error")
        assert err["message"].startswith("[json.exception.parse_error.101] parse error at line 1")
    err = assert_error(c.post("/completion", json={"prompt": "x", "n_predict": "many"}), 400, "invalid_request_error")
    assert err["message"] == "Field 'n_predict': [json.exception.type_error.302] type must be number, but is string"
    err = assert_error(c.post("/completion", json={"prompt": "x", "n_predict": -5}), 400, "invalid_request_error")
    assert err["message"] == "Field 'n_predict': Value must be between -1 <= value <= 2147483647, but got -5"
    err = assert_error(c.post("/completion", json={"prompt": "x", "stream": "yes"}), 400, "invalid_request_error")
    assert err["message"] == "Field 'stream': [json.exception.type_error.302] type must be boolean, but is string"
    err = assert_error(c.post("/completion", json={"n_predict": 1}), 400, "invalid_request_error")
    assert err["message"] == "[json.exception.out_of_range.403] key 'prompt' not found"
    err = assert_error(c.post("/v1/chat/completions", json={"max_tokens": 2}), 400, "invalid_request_error")
    assert err["message"] == "'messages' is required"
    err = assert_error(c.post("/v1/chat/completions", json={"messages": "hi"}), 400, "invalid_request_error")
    assert err["message"] == "Expected 'messages' to be an array"
    err = assert_error(c.post("/v1/chat/completions", json={"messages": [{"role": "user"}]}), 400,
                       "invalid_request_error")
    assert err["message"] == "All non-assistant messages must contain 'content'"
    assert c.get("/no/such/route").json() == {"error": {"message": "File Not Found", "type": "not_found_error",
                                                        "code": 404}}
    assert c.post("/health").status_code == 404  # routes are per method
    err = assert_error(c.post("/slots/0", params={"action": "save"}, json={"filename": "x"}), 501,
                       "not_supported_error")
    assert err["message"] == "This server does not support slots action. Start it with `--slot-save-path`"
    long = text_of(1200, salt=10)
    n = n_tokens(c, long)
    assert n > N_CTX_SLOT
    for stream in (False, True):
        err = assert_error(c.post("/completion", json={"prompt": long, "n_predict": 2, "stream": stream}),
                           400, "exceed_context_size_error")
        assert err["n_prompt_tokens"] == n and err["n_ctx"] == N_CTX_SLOT
        assert err["message"] == (f"request ({n} tokens) exceeds the available context size ({N_CTX_SLOT} "
                                  "tokens), try increasing it")
    err = assert_error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]}),
                       400, "exceed_context_size_error")
    assert err["n_ctx"] == N_CTX_SLOT


# -- disconnects and deferral ----------------------------------------------------------------------
def _busy(c: httpx.Client) -> list[int]:
    return [s["id"] for s in ok(c.get("/slots")) if s["is_processing"]]


def test_disconnect_frees_slot(server: Server, c: httpx.Client) -> None:
    prompt = text_of(20, salt=11)
    body = {"prompt": prompt, "n_predict": 1900, "ignore_eos": True, "stream": True, "id_slot": 0}
    with httpx.Client(base_url=server.url, timeout=60.0) as other:
        with other.stream("POST", "/completion", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert first["tokens_evaluated"] == n_tokens(c, prompt) and len(first["tokens"]) == 1
            s0 = ok(c.get("/slots"))[0]
            assert s0["is_processing"] is True and s0["params"]["n_predict"] == 1900
            assert s0["n_prompt_tokens_processed"] + s0["n_prompt_tokens_cache"] == first["tokens_evaluated"]
            nt = s0["next_token"][0]
            assert nt["has_next_token"] is True and nt["n_decoded"] >= 1 and nt["n_remain"] == 1900 - nt["n_decoded"]
    wait_for(lambda: not _busy(c))
    slot0 = ok(c.get("/slots"))[0]
    assert slot0["next_token"][0]["n_decoded"] < 1900  # stopped early, not run to its end


def test_requests_deferred_when_slots_busy(server: Server, c: httpx.Client) -> None:
    body = {"n_predict": 1900, "ignore_eos": True, "stream": True}
    clients = [httpx.Client(base_url=server.url, timeout=60.0) for _ in range(3)]
    streams = []
    try:
        for i, cl in enumerate(clients[:2]):
            s = cl.stream("POST", "/completion", json={**body, "prompt": text_of(20, salt=20 + i)})
            r = s.__enter__()
            streams.append(s)
            assert r.status_code == 200
        wait_for(lambda: len(_busy(c)) == 2, show=lambda: ok(c.get("/slots")))
        # the third one has no slot: its headers wait, so send it from a thread-free raw socket
        host, port = server.url.removeprefix("http://").split(":")
        payload = json.dumps({**body, "prompt": text_of(20, salt=30)}).encode()
        raw = socket.create_connection((host, int(port)))
        raw.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        try:
            m = wait_for(lambda: (mm := metrics(c))["requests_deferred"] == 1 and mm, show=lambda: metrics(c))
            assert m["requests_processing"] == 2
            assert_error(c.get("/slots", params={"fail_on_no_slot": "1"}), 503, "unavailable_error")
        finally:
            raw.close()
        wait_for(lambda: metrics(c)["requests_deferred"] == 0, show=lambda: metrics(c))
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        for cl in clients:
            cl.close()
    wait_for(lambda: not _busy(c))


def _raw_request(server: Server, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a request without waiting for its answer (its headers may wait for a slot)."""
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    raw = socket.create_connection((host, int(port)))
    raw.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return raw


def test_pinned_slot_defers_while_busy(server: Server, c: httpx.Client) -> None:
    body = {"n_predict": 1900, "ignore_eos": True, "stream": True, "id_slot": 0}
    with httpx.Client(base_url=server.url, timeout=60.0) as other:
        with other.stream("POST", "/completion", json={**body, "prompt": text_of(20, salt=40)}) as r:
            assert r.status_code == 200
            raw = _raw_request(server, "/completion", {**body, "prompt": text_of(20, salt=41)})
            try:
                # slot 1 is idle, but the request is pinned to slot 0: it waits
                m = wait_for(lambda: (mm := metrics(c))["requests_deferred"] == 1 and mm, show=lambda: metrics(c))
                assert m["requests_processing"] == 1 and _busy(c) == [0]
                assert ok(c.get("/slots", params={"fail_on_no_slot": "1"}))  # one slot is still idle
            finally:
                raw.close()
            wait_for(lambda: metrics(c)["requests_deferred"] == 0, show=lambda: metrics(c))
    wait_for(lambda: not _busy(c))


def _abandon_non_streaming(server: Server, c: httpx.Client, prompt: str, n_predict: int) -> None:
    raw = _raw_request(server, "/completion", {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True,
                                               "id_slot": 1})
    try:
        wait_for(lambda: _busy(c) == [1], show=lambda: ok(c.get("/slots")))
    finally:
        raw.close()


def test_non_streaming_disconnect_needs_a_quiet_second(server: Server, c: httpx.Client) -> None:
    """llama-server looks at a non-streaming client's socket only when its HTTP thread has waited
    HTTP_POLLING_SECONDS (1 s) without a result for any request; every /slots answer is such a result."""
    prompt = text_of(20, salt=42)
    n_prompt = n_tokens(c, prompt)
    # polled every 0.1 s, the server never has a quiet second: the abandoned request runs to its end
    _abandon_non_streaming(server, c, prompt, 400)
    wait_for(lambda: not _busy(c), every=0.1)
    assert ok(c.get("/slots"))[1]["n_prompt_tokens"] == n_prompt + 400 - 1
    # polled every 1.2 s, the next quiet second ends it early
    _abandon_non_streaming(server, c, text_of(20, salt=43), 1900)
    wait_for(lambda: not _busy(c), every=1.2)
    assert ok(c.get("/slots"))[1]["n_prompt_tokens"] < n_prompt + 1900 - 1


# -- start-up variants -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", TARGETS)
def test_api_key_alias_and_disabled_endpoints(kind: str, tmp_path: Path) -> None:
    srv = start(kind, ["--api-key", "k123", "--alias", "my-model", "--no-slots", "--cache-ram", "0"], tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=30.0) as c:
            assert ok(c.get("/health")) == {"status": "ok"}  # public
            assert_error(c.get("/v1/models"), 401, "authentication_error")
            assert_error(c.post("/completion", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}),
                         401, "authentication_error")
            auth = {"Authorization": "Bearer k123"}
            ok(c.get("/v1/models", headers={"Authorization": "k123"}))  # the Bearer prefix is optional
            ok(c.get("/v1/models", headers={"X-Api-Key": "k123"}))  # Anthropic's header works too
            body = ok(c.get("/v1/models", headers=auth))
            assert body["data"][0]["id"] == "my-model"
            assert_error(c.get("/slots", headers=auth), 501, "not_supported_error")
            assert_error(c.get("/metrics", headers=auth), 501, "not_supported_error")
    finally:
        _stop(srv.proc)


@pytest.mark.parametrize("kind", TARGETS)
def test_slot_save_restore_erase(kind: str, tmp_path: Path) -> None:
    (tmp_path / "slots").mkdir()
    srv = start(kind, ["--slot-save-path", str(tmp_path / "slots"), "--cache-ram", "0"], tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=60.0) as c:
            p = text_of(30, salt=60)
            body = ok(c.post("/completion", json={"prompt": p, "n_predict": 2, "id_slot": 0}))
            kept = body["tokens_cached"]
            saved = ok(c.post("/slots/0", params={"action": "save"}, json={"filename": "a.bin"}))
            assert saved["id_slot"] == 0 and saved["filename"] == "a.bin" and saved["n_saved"] == kept
            assert saved["n_written"] > 0 and "save_ms" in saved["timings"]
            assert ok(c.post("/slots/0", params={"action": "erase"})) == {"id_slot": 0, "n_erased": kept}
            assert ok(c.get("/slots"))[0]["n_prompt_tokens"] == 0
            restored = ok(c.post("/slots/1", params={"action": "restore"}, json={"filename": "a.bin"}))
            assert restored["id_slot"] == 1 and restored["n_restored"] == kept and "restore_ms" in restored["timings"]
            again = ok(c.post("/completion", json={"prompt": p, "n_predict": 2, "id_slot": 1}))
            assert again["timings"]["cache_n"] == again["tokens_evaluated"] - 1
            err = assert_error(c.post("/slots/1", params={"action": "restore"}, json={"filename": "nope.bin"}),
                               400, "invalid_request_error")
            assert err["message"].startswith("Unable to restore slot")
            err = assert_error(c.post("/slots/0", params={"action": "bogus"}), 400, "invalid_request_error")
            assert err["message"] == "Invalid action"
            err = assert_error(c.post("/slots/0", params={"action": "save"}, json={"filename": "../x"}),
                               400, "invalid_request_error")
            assert err["message"] == "Invalid filename"
    finally:
        _stop(srv.proc)


@pytest.mark.parametrize("kind", TARGETS)
def test_host_ram_prompt_cache(kind: str, tmp_path: Path) -> None:
    """With --cache-ram, a prompt pushed out of the only slot comes back from host RAM."""
    srv = start(kind, ["-np", "1", "--cache-ram", "100"], tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=60.0) as c:
            a, b = text_of(200, salt=50), text_of(200, salt=51)
            first = [ok(c.post("/completion", json={"prompt": p, "n_predict": 2})) for p in (a, b)]
            assert all(r["timings"]["cache_n"] <= 2 for r in first)  # B displaced A from the slot
            n_a = n_tokens(c, a)
            again = ok(c.post("/completion", json={"prompt": a + " more", "n_predict": 2}))
            assert again["timings"]["cache_n"] >= n_a - 2 and again["timings"]["prompt_n"] <= 5
            back = ok(c.post("/completion", json={"prompt": b + " more", "n_predict": 2}))
            assert back["timings"]["cache_n"] >= n_tokens(c, b) - 2
            assert ok(c.get("/slots"))[0]["n_ctx"] == 4096  # one slot has the whole context
    finally:
        _stop(srv.proc)


def test_sim_instant_abort(tmp_path: Path) -> None:
    """--sim-instant-abort: an abandoned non-streaming request frees its slot at once, however busy."""
    srv = start_sim(["--sim-instant-abort", "--sim-decode-ms-per-token", "5"], tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=30.0) as c:
            _abandon_non_streaming(srv, c, text_of(20, salt=44), 1900)
            wait_for(lambda: not _busy(c), timeout=5.0)
            assert ok(c.get("/slots"))[1]["n_prompt_tokens"] < 1000
    finally:
        _stop(srv.proc)


def test_sim_loading_state(tmp_path: Path) -> None:
    """The loading window of the real server is too short to catch; the simulator's is configurable."""
    srv = start_sim(["--sim-load-seconds", "0.5"], tmp_path)
    try:
        assert srv.early and srv.early[0] == (
            503, {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}})
    finally:
        _stop(srv.proc)
