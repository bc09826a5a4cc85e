"""`llmgw sim --engine llamacpp`: one simulated llama-server — its HTTP surface (/completion, OpenAI
routes, /slots, /lora-adapters, /metrics, /props, /tokenize ...) around the pure slot core.

Facts followed: ../shared/specs/llamacpp.md, checked against a real llama-server (tests/
test_llamacpp_contract.py runs the same assertions on both). A client that leaves is noticed as
llama-server notices it: a stream at once, a non-streaming request (or a stream still waiting for a
slot) only after a second without results for any request (`_reap`; --sim-instant-abort frees at once).

Not modelled (the simulator answers 400 or 404 where the real server would serve): several prompts in
one request and n > 1, infill, embeddings, rerank, /v1/responses, /v1/messages, POST /props, grammars,
tools, logprobs, speculative decoding, context shift, n_cache_reuse, multimodal input; nor
cpp-httplib's limit of 100 requests per keep-alive connection."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import trio

from llmgw.daemon.net.httpserver import Request, Response, serve_tcp
from llmgw.daemon.sim.runner import EngineRunner
from llmgw.sim import llamacpp_params as lp
from llmgw.sim import llamacpp_surface as ls
from llmgw.sim.args import ArgError, build_llamacpp_parser, parse_lora_args, sim_options
from llmgw.sim.llamacpp_core import LlamaConfig, LlamaCore, LlamaRequest, LoraAdapter, Output
from llmgw.sim.llamacpp_surface import LlamaError
from llmgw.sim.textstream import TextStream
from llmgw.sim.tokenizer import VOCAB_SIZE, Tokenizer

log = logging.getLogger("llmgw.sim.llamacpp")

# cpp-httplib's defaults as llama-server sets them (an empty CORS origin unless --cors-origins).
_BASE = [("server", "llama.cpp"), ("access-control-allow-origin", "")]
_JSON = [*_BASE, ("content-type", "application/json; charset=utf-8")]
_SSE = [*_BASE, ("x-accel-buffering", "no"), ("content-type", "text/event-stream"),
        ("keep-alive", "timeout=5, max=100")]
_KEEPALIVE_S = 5.0  # cpp-httplib closes a keep-alive connection idle this long
_PUBLIC = ("/health", "/v1/health")
_SEED_DEFAULT = 4294967295  # LLAMA_DEFAULT_SEED, as /slots shows it
HTTP_POLLING_S = 1.0  # HTTP_POLLING_SECONDS: how long an HTTP thread waits for results between checks


def _json(status: int, obj: Any) -> Response:
    # cpp-httplib closes the connection after any error status
    extra = [("connection", "close")] if status >= 400 else [("keep-alive", "timeout=5, max=100")]
    return Response(status, [*_JSON, *extra], ls.dumps(obj))


def _server_error_body(status: int, message: str, err_type: str) -> Any:
    """httpserver's own errors (bad framing, huge bodies) in llama.cpp's envelope."""
    return {"error": {"code": status, "message": message,
                      "type": "server_error" if status >= 500 else "invalid_request_error"}}


class LlamaSim:
    def __init__(self, ns: argparse.Namespace, env: Mapping[str, str]) -> None:
        self.opts = opts = sim_options(ns)
        self.model_path: str = ns.model
        self.model_name: str = ns.alias or ns.model
        self.host: str = ns.host
        self.port: int = ns.port
        self.api_key: str | None = ns.api_key or env.get("LLAMA_API_KEY") or None
        self.metrics_on: bool = ns.metrics
        self.slots_on: bool = ns.slots
        self.slot_save_path: str | None = ns.slot_save_path
        if self.slot_save_path is not None and not Path(self.slot_save_path).is_dir():
            raise ArgError(f"not a directory: {self.slot_save_path}")
        if ns.ctx_size < ns.parallel:
            raise ArgError(f"-c {ns.ctx_size} is smaller than -np {ns.parallel}")
        self.n_ctx_slot = ns.ctx_size // ns.parallel
        self.n_ctx_train = max(ns.ctx_size, 4096)  # the simulated GGUF's llama.context_length
        adapters = [LoraAdapter(i, path, scale) for i, (path, scale) in enumerate(parse_lora_args(ns.lora_args))]
        if opts.lora_require_path:
            for a in adapters:
                if not Path(a.path).exists():
                    raise ArgError(f"failed to load LoRA adapter {a.path!r}: file not found")
        cfg = LlamaConfig(
            n_slots=ns.parallel, n_ctx=self.n_ctx_slot, n_batch=ns.batch_size,
            slot_prompt_similarity=ns.slot_prompt_similarity,
            prefill_s_per_token=opts.prefill_ms_per_token / 1e3, decode_s_per_step=opts.decode_ms_per_token / 1e3,
            decode_s_per_seq=opts.decode_ms_per_seq / 1e3, default_output_len=opts.output_len, seed=opts.seed,
            cache_ram_mib=ns.cache_ram, cache_tokens=ns.ctx_size, kv_bytes_per_token=ns.sim_kv_bytes_per_token)
        # A GPT-2-style vocabulary: <|endoftext|> (0) is the BOS, the ChatML <|im_end|> (2) ends a turn.
        self.tok = Tokenizer(bos_id=0, eos_id=2)
        self.core = LlamaCore(cfg, self.tok, adapters)
        self.instant_abort: bool = ns.sim_instant_abort
        self.last_result = -math.inf  # when any HTTP thread last got a result (see _reap)
        self.runner = EngineRunner(_NotifyingCore(self))
        self.ready = False
        self._nursery: trio.Nursery | None = None
        self._routes = self._route_table()

    # -- HTTP ------------------------------------------------------------------------------
    async def handle(self, req: Request) -> Response:
        if not self.ready:
            # llama-server's state middleware runs before auth and routing: everything is 503.
            return _json(503, ls.middleware_error("unavailable_error", "Loading model"))
        if self.api_key and req.path not in _PUBLIC and not self._authorized(req):
            return _json(401, ls.middleware_error("authentication_error", "Invalid API Key"))
        entry = self._routes.get((req.method, req.path))
        if entry is None and req.method == "POST" and req.path.startswith("/slots/"):
            entry = self._slot_action
        if entry is None:
            return _json(404, ls.middleware_error("not_found_error", "File Not Found"))
        try:
            return await entry(req)
        except LlamaError as e:
            return _json(e.status, e.body())

    def _authorized(self, req: Request) -> bool:
        key = req.header("authorization") or req.header("x-api-key") or ""
        if key.startswith("Bearer "):
            key = key[len("Bearer "):]
        return key == self.api_key

    def _route_table(self) -> dict[tuple[str, str], Any]:
        # cpp-httplib routes by method and path: anything else, a wrong method included, is a 404
        return {
            ("GET", "/health"): self._health, ("GET", "/v1/health"): self._health,
            ("GET", "/metrics"): self._metrics, ("GET", "/props"): self._props,
            ("GET", "/models"): self._models, ("GET", "/v1/models"): self._models,
            ("POST", "/completion"): self._completion, ("POST", "/completions"): self._completion,
            ("POST", "/v1/completions"): self._oai_completions, ("POST", "/chat/completions"): self._chat,
            ("POST", "/v1/chat/completions"): self._chat, ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize, ("POST", "/apply-template"): self._apply_template,
            ("GET", "/lora-adapters"): self._get_lora, ("POST", "/lora-adapters"): self._post_lora,
            ("GET", "/slots"): self._slots,
        }

    def notify(self) -> None:
        self.last_result = trio.current_time()

    async def _health(self, req: Request) -> Response:
        return _json(200, {"status": "ok"})

    async def _metrics(self, req: Request) -> Response:
        if not self.metrics_on:
            raise LlamaError("not_supported_error",
                             "This server does not support metrics endpoint. Start it with `--metrics`")
        self.notify()  # /metrics, /slots and /lora-adapters are tasks whose results wake every HTTP thread
        return Response(200, [*_BASE, ("content-type", "text/plain; version=0.0.4"),
                              ("keep-alive", "timeout=5, max=100")],
                        ls.metrics_text(self.core).encode())

    async def _props(self, req: Request) -> Response:
        bos = self.tok.token_str(self.tok.bos_id) if self.tok.bos_id is not None else ""
        return _json(200, ls.props_json(self.model_name, self.model_path, len(self.core.slots), self.n_ctx_slot,
                                        self.slots_on, self.metrics_on, bos, self.tok.token_str(self.tok.eos_id)))

    async def _models(self, req: Request) -> Response:
        return _json(200, ls.models_json(self.model_name, self.n_ctx_slot, self.n_ctx_train, VOCAB_SIZE))

    async def _slots(self, req: Request) -> Response:
        if not self.slots_on:
            raise LlamaError("not_supported_error",
                             "This server does not support slots endpoint. Start it with `--slots`")
        if "fail_on_no_slot" in req.query_params() and not any(not s.is_processing for s in self.core.slots):
            raise LlamaError("unavailable_error", "no slot available")
        self.notify()
        return _json(200, [ls.slot_json(self.core, i) for i in range(len(self.core.slots))])

    async def _slot_action(self, req: Request) -> Response:
        """POST /slots/ID?action=save|restore|erase: the slot's kept tokens to and from a file."""
        if self.slot_save_path is None:
            raise LlamaError("not_supported_error",
                             "This server does not support slots action. Start it with `--slot-save-path`")
        action = req.query_params().get("action", "")
        if action not in ("save", "restore", "erase"):
            raise LlamaError("invalid_request_error", "Invalid action")
        try:
            i = int(req.path[len("/slots/"):])
        except ValueError:
            raise LlamaError("invalid_request_error", "Invalid slot id") from None
        if not 0 <= i < len(self.core.slots):
            return _json(200, {"id_slot": i, "n_erased": 0}) if action == "erase" else _json(
                400, ls.error_body("invalid_request_error", "Invalid slot id"))
        slot = self.core.slots[i]
        while slot.is_processing:  # llama-server defers a slot task until the slot is idle
            await trio.sleep(0.01)
        self.notify()
        if action == "erase":
            n = len(slot.tokens)
            slot.tokens = []
            return _json(200, {"id_slot": i, "n_erased": n})
        name = self._object(req).get("filename")
        if not isinstance(name, str):
            raise lp.type_error("string", name) if name is not None else LlamaError(
                "invalid_request_error", "[json.exception.out_of_range.403] key 'filename' not found")
        if not name or name in (".", "..") or any(c in name for c in "/\\:\0") or name.startswith(".."):
            raise LlamaError("invalid_request_error", "Invalid filename")
        path = Path(self.slot_save_path) / name
        t0 = time.perf_counter()
        if action == "save":
            data = json.dumps(slot.tokens).encode()
            path.write_bytes(data)
            return _json(200, {"id_slot": i, "filename": name, "n_saved": len(slot.tokens), "n_written": len(data),
                               "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}})
        try:
            data = path.read_bytes()
            tokens = json.loads(data)
            assert isinstance(tokens, list) and len(tokens) < slot.n_ctx
        except (OSError, ValueError, AssertionError):
            raise LlamaError("invalid_request_error", "Unable to restore slot: No available space in KV cache or "
                             "invalid slot save file") from None
        slot.tokens = tokens
        return _json(200, {"id_slot": i, "filename": name, "n_restored": len(tokens), "n_read": len(data),
                           "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}})

    def _object(self, req: Request) -> dict[str, Any]:
        body = lp.parse_json(req.body)
        if not isinstance(body, dict):
            raise LlamaError("invalid_request_error",
                             f"[json.exception.type_error.304] cannot use at() with {lp.jtype(body)}")
        return body

    # -- tokens ----------------------------------------------------------------------------
    async def _tokenize(self, req: Request) -> Response:
        body = lp.parse_json(req.body)
        if not isinstance(body, dict) or "content" not in body:
            return _json(200, {"tokens": []})
        ids = lp.tokenize_mixed(self.tok, body["content"], lp.lenient_flag(body, "add_special", False))
        if not lp.lenient_flag(body, "with_pieces", False):
            return _json(200, {"tokens": ids})
        pieces = []
        for i in ids:
            raw = self.tok.token_bytes(i) if self.tok.valid_id(i) else b""
            try:
                piece: object = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # not valid UTF-8 on its own: llama.cpp gives the bytes
            pieces.append({"id": i, "piece": piece})
        return _json(200, {"tokens": pieces})

    async def _detokenize(self, req: Request) -> Response:
        body = lp.parse_json(req.body)
        ids = body.get("tokens", []) if isinstance(body, dict) else []
        if not isinstance(ids, list):
            raise lp.type_error("array", ids)
        for i in ids:
            if not isinstance(i, (int, float)) or isinstance(i, bool):
                raise lp.type_error("number", i)
            if not self.tok.valid_id(i):  # llama.cpp indexes its vocab unchecked: a 500
                raise LlamaError("server_error", f"vector::_M_range_check: __n (which is {int(i) % 2**64}) >= "
                                 f"this->size() (which is {VOCAB_SIZE})")
        return _json(200, {"content": self.tok.decode(ids)})

    async def _apply_template(self, req: Request) -> Response:
        body = lp.parse_json(req.body)
        return _json(200, {"prompt": lp.render_chat(body if isinstance(body, dict) else {})})

    # -- LoRA ------------------------------------------------------------------------------
    async def _get_lora(self, req: Request) -> Response:
        self.notify()
        return _json(200, [{"id": a.id, "path": a.path, "scale": a.scale, "task_name": "", "prompt_prefix": ""}
                           for a in self.core.adapters])

    async def _post_lora(self, req: Request) -> Response:
        body = lp.parse_json(req.body)
        if not isinstance(body, list):
            raise LlamaError("invalid_request_error", "Request body must be an array")
        self.core.set_global_scales(lp.lora_map(body))
        self.notify()
        return _json(200, {"success": True})

    # -- generation ------------------------------------------------------------------------
    async def _completion(self, req: Request) -> Response:
        body = self._object(req)
        return await self._generate(body, lp.prompt_tokens(self.tok, body), "native")

    async def _oai_completions(self, req: Request) -> Response:
        body = self._object(req)
        return await self._generate(body, lp.prompt_tokens(self.tok, body), "completion")

    async def _chat(self, req: Request) -> Response:
        body = self._object(req)
        text = lp.render_chat(body)
        return await self._generate(body, self.tok.encode(text, add_special_tokens=True), "chat")

    def _make_request(self, body: dict[str, Any], prompt: list[int]) -> tuple[LlamaRequest, dict[str, Any]]:
        """server_schema's checks of the fields the simulator uses; the others are accepted as is."""
        stream = lp.flag(body, "stream", False)
        opts = body.get("stream_options")
        lp.flag(opts if isinstance(opts, dict) else {}, "include_usage", False)
        cache_prompt = lp.flag(body, "cache_prompt", True)
        n_predict = lp.num_int(body, ("n_predict", "max_completion_tokens", "max_tokens"), -1, -1, lp.INT32_MAX)
        n_cmpl = lp.num_int(body, ("n_cmpl", "n"), 1, 1, len(self.core.slots))
        lp.check_numbers(body)
        if n_cmpl != 1:
            raise LlamaError("invalid_request_error", "the simulator serves one completion per request (n=1)")
        lora = None
        if body.get("lora") is not None:
            if not isinstance(body["lora"], list):
                raise LlamaError("invalid_request_error", "Field 'lora': Error: 'lora' must be an array of "
                                 "objects with 'id' and 'scale' fields")
            lora = lp.lora_map(body["lora"])
        stop = body.get("stop")
        stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
        for w in stops:
            if not isinstance(w, str):
                raise lp.type_error("string", w, "stop")
        stops = tuple(w for w in stops if w)
        seed = lp.num_int(body, ("seed",), -1)
        seed_shown = _SEED_DEFAULT if seed < 0 else seed
        ignore_eos = lp.flag(body, "ignore_eos", False)
        id_slot = body.get("id_slot", -1)  # json_value(): a wrong type falls back to the default
        r = LlamaRequest(
            req_id=uuid.uuid4().hex, prompt=prompt, n_predict=n_predict, cache_prompt=cache_prompt,
            id_slot=id_slot if isinstance(id_slot, int) and not isinstance(id_slot, bool) else -1,
            lora=lora, ignore_eos=ignore_eos, text=TextStream(stops), seed=None if seed < 0 else seed,
            params=ls.task_params(n_predict, stream, lora, seed_shown, ignore_eos, stops, full=False))
        return r, ls.task_params(n_predict, stream, lora, seed_shown, ignore_eos, stops, full=True)

    async def _generate(self, body: dict[str, Any], prompt: list[int], kind: str) -> Response:
        r, settings = self._make_request(body, prompt)
        stream = lp.flag(body, "stream", False)
        opts = body.get("stream_options")
        include_usage = lp.flag(opts, "include_usage", False) if isinstance(opts, dict) else False
        send, recv = trio.open_memory_channel[Output](float("inf"))
        self.runner.submit(r, send)
        gen = _Gen(self, r, recv, kind, ls.completion_id(), include_usage, settings)
        streaming = False
        since = trio.current_time()
        try:
            # A stream's status waits for the slot too: an error before it is a plain JSON error.
            first = await recv.receive()
            if r.error is not None:
                raise LlamaError(r.error[0], r.error[1], n_prompt_tokens=len(r.prompt), n_ctx=self.n_ctx_slot)
            if stream:
                streaming = True
                return Response(200, list(_SSE), _Body(gen.sse(first), gen.abort))
            return _json(200, await gen.collect(first))
        finally:
            if not streaming and not r.finished:
                if self.instant_abort or self._nursery is None:
                    gen.abort()
                else:
                    self._nursery.start_soon(self._reap, r, recv, since, stream)

    async def _reap(self, r: LlamaRequest, recv: trio.MemoryReceiveChannel[Output], since: float,
                    stream: bool) -> None:
        """The client left while its HTTP thread waited for a result of its task (a non-streaming request,
        or a stream before its slot). llama-server only looks at the connection when that wait times out
        after HTTP_POLLING_S, and a result for *any* task restarts the wait: on a busy server the request
        runs on for nobody. A result of its own (a stream's start, a final answer) is written at once,
        and the failed write ends it."""
        wait_start = max(since, self.last_result)
        deadline = wait_start + (math.floor(trio.current_time() - wait_start) + 1) * HTTP_POLLING_S
        while not r.finished:
            with trio.move_on_at(deadline) as timer:
                out = await recv.receive()
                if stream or out.finished:
                    break
                continue  # a non-streaming request's own progress sends no result
            if timer.cancelled_caught and self.last_result <= wait_start:
                break  # a quiet poll interval: the HTTP thread sees the closed socket
            if timer.cancelled_caught:
                wait_start = self.last_result
                deadline = wait_start + HTTP_POLLING_S
        if not r.finished:
            self.runner.abort(r.req_id)

    # -- lifecycle -------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        if self.opts.start_seconds > 0:
            await trio.sleep(self.opts.start_seconds)  # the process starting: nothing listens yet
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            # llama-server listens at once and answers 503 "Loading model" until the model is in.
            port = await nursery.start(partial(serve_tcp, self.handle, self.host, self.port,
                                               error_body=_server_error_body, keepalive_timeout=_KEEPALIVE_S))
            nursery.start_soon(self.runner.run)
            task_status.started(port)
            if self.opts.load_seconds > 0:
                await trio.sleep(self.opts.load_seconds)
            self.ready = True
            log.info("simulated llama-server serving %s on %s:%s", self.model_name, self.host, port)


class _NotifyingCore:
    """The core as the runner drives it, noting each result llama-server would hand an HTTP thread:
    every token of a stream (and its start), and every final answer or error."""

    def __init__(self, sim: LlamaSim) -> None:
        self.sim, self.core = sim, sim.core
        self.add_request, self.abort, self.has_work, self.schedule = (
            self.core.add_request, self.core.abort, self.core.has_work, self.core.schedule)

    def complete(self, plan: Any, now: float) -> list[Output]:
        outs = self.core.complete(plan, now)
        if any(o.finished or o.req.params.get("stream") for o in outs):
            self.sim.last_result = now
        return outs


class _Gen:
    """One request's results, whole or as SSE; aborts the slot's task if the client leaves."""

    def __init__(self, sim: LlamaSim, r: LlamaRequest, recv: trio.MemoryReceiveChannel[Output], kind: str,
                 cid: str, include_usage: bool, settings: dict[str, Any]) -> None:
        self.sim, self.r, self.recv, self.kind = sim, r, recv, kind
        self.cid, self.include_usage, self.settings = cid, include_usage, settings
        self.text = ""

    def abort(self) -> None:
        if not self.r.finished:
            self.sim.runner.abort(self.r.req_id)

    async def _outputs(self, first: Output) -> AsyncIterator[Output]:
        out = first
        while True:
            if out.new_tokens or out.finished:
                yield out
            if out.finished:
                return
            out = await self.recv.receive()

    async def collect(self, first: Output) -> dict[str, Any]:
        async for out in self._outputs(first):
            self.text += out.text
        return self._final()

    def _final(self, stream: bool = False) -> dict[str, Any]:
        r, sim = self.r, self.sim
        if self.kind == "native":
            return ls.completion_final(r, self.text, sim.tok.decode(r.prompt), sim.model_name, r.n_kept, stream,
                                       self.settings)
        if self.kind == "completion":
            out = ls.oai_completion(r, "" if stream else self.text, self.cid, sim.model_name)
            return out
        return ls.chat_final(r, self.text, self.cid, sim.model_name)

    async def sse(self, first: Output) -> AsyncIterator[bytes]:
        r, sim, cid = self.r, self.sim, self.cid
        try:
            async for out in self._outputs(first):
                chunks: list[dict[str, Any]] = []
                if out.new_tokens:
                    if self.kind == "native":
                        chunks.append(ls.completion_partial(r, out.text, out.new_tokens[0]))
                    elif self.kind == "completion":
                        chunks.append(ls.oai_completion_chunk(r, out.text, cid, sim.model_name))
                    else:
                        chunks += ls.chat_chunks(r, out.text, cid, sim.model_name)
                if out.finished:
                    if self.kind == "chat":
                        chunks += ls.chat_final_chunks(r, cid, sim.model_name, self.include_usage)
                    else:
                        chunks.append(self._final(stream=True))
                for c in chunks:
                    yield b"data: " + ls.dumps(c) + b"\n\n"
            if self.kind != "native":
                yield b"data: [DONE]\n\n"
        finally:
            self.abort()


class _Body:
    """The SSE body; closing it aborts the request even if no chunk was ever pulled."""

    def __init__(self, agen: AsyncIterator[bytes], on_close: Any) -> None:
        self.agen, self.on_close = agen, on_close

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        return await self.agen.__anext__()

    async def aclose(self) -> None:
        try:
            await self.agen.aclose()  # type: ignore[attr-defined]
        finally:
            self.on_close()


def build(argv: list[str], env: Mapping[str, str] | None = None) -> LlamaSim:
    ns = build_llamacpp_parser().parse_args(argv)
    return LlamaSim(ns, os.environ if env is None else env)
