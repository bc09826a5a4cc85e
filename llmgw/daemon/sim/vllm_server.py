"""`llmgw sim --engine vllm`: one simulated vLLM replica — OpenAI HTTP surface, Prometheus
metrics, runtime LoRA and KV cache events over ZMQ — around the pure engine core."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from llmgw.daemon.net.httpserver import Request, Response, serve_tcp
from llmgw.daemon.sim.kv_transfer import KvTransferShell, pin_timeout, request_kv_params
from llmgw.daemon.sim.runner import EngineRunner
from llmgw.daemon.sim.vllm_responses import ResponseWriter, embed
from llmgw.inputs.nesting import json_loads
from llmgw.kv import events as kvev
from llmgw.kv.hashing import HashContext, LoRA, VllmVersion
from llmgw.sim import vllm_surface as vs
from llmgw.sim.args import (
    ArgError,
    parse_kv_events_config,
    parse_lora_modules,
    sim_options,
)
from llmgw.sim.engine import EngineConfig, EngineCore, LoraRef, SimRequest
from llmgw.sim.kv_transfer import parse_kv_transfer_config
from llmgw.sim.openai_params import GenParams, ParamError, parse_gen_params
from llmgw.sim.textstream import TextStream
from llmgw.sim.tokenizer import ChatTemplateError, Tokenizer, render_chat
from llmgw.sim.vllm_events import bind_hasher, event_extra, kv_event
from llmgw.sim.vllm_metrics import VllmMetrics

log = logging.getLogger("llmgw.sim.vllm")

_JSON = [("content-type", "application/json")]
_SSE = [("content-type", "text/event-stream; charset=utf-8"), ("cache-control", "no-cache")]


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true")


class VllmSim:
    def __init__(self, ns: argparse.Namespace, dotted: dict[str, str], env: Mapping[str, str]) -> None:
        self.opts = opts = sim_options(ns)
        self.version = VllmVersion.parse(opts.vllm_version)
        model = ns.model_tag or ns.model_flag
        if not model:
            raise ArgError("a model is required: llmgw sim --engine vllm MODEL [flags]")
        self.model_path = model
        self.served: list[str] = ns.served_model_name or [model]
        self.host = ns.host or "0.0.0.0"
        self.port = ns.port
        self.api_key = ns.api_key or env.get("VLLM_API_KEY")
        self.max_model_len = ns.max_model_len
        self.prompt_details = ns.enable_prompt_tokens_details
        self.force_usage = ns.enable_force_include_usage
        self.load_tracking = ns.enable_server_load_tracking
        self.runtime_lora = _truthy(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING"))
        self.dev_mode = _truthy(env.get("VLLM_SERVER_DEV_MODE"))
        self.int_hashes = env.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
        self.block_size = ns.block_size or 16
        self.pooling = ns.runner == "pooling" or ns.task in ("embed", "embedding")
        kv_blocks = opts.kv_blocks or max(2, int(8192 * ns.gpu_memory_utilization / 0.9))
        if (kv_blocks - 1) * self.block_size < self.max_model_len:
            raise ArgError(
                f"To serve at least one request with the model's max seq len ({self.max_model_len}), "
                f"{-(-self.max_model_len // self.block_size) + 1} KV blocks are needed, but --sim-kv-blocks "
                f"gives {kv_blocks}. Increase --sim-kv-blocks or decrease --max-model-len.")
        kvt = parse_kv_transfer_config(ns.kv_transfer_config, getattr(ns, "kv_transfer_dotted", {}), self.version)
        try:
            seed = opts.hash_seed if opts.hash_seed is not None else env.get("PYTHONHASHSEED")
            self.hash_ctx = HashContext.create(self.version, ns.prefix_caching_hash_algo, self.block_size, seed)
        except ValueError as e:
            raise ArgError(str(e)) from None
        self.enable_lora = ns.enable_lora
        self.loras = vs.LoraRegistry(self.served, ns.max_lora_rank, ns.max_cpu_loras or ns.max_loras, self.version)
        self._lora_loading: dict[str, trio.Event] = {}  # adapters being loaded into the worker cache now
        self.lora_waits = 0  # requests that waited for a worker-cache load
        for m in parse_lora_modules(ns.lora_modules):
            if not self.enable_lora:
                raise ArgError("--lora-modules needs --enable-lora")
            try:
                self.loras.load(m.name, m.path, rank=1, base_model_name=m.base_model_name)
            except vs.VllmError as e:
                raise ArgError(f"--lora-modules {m.name}: {e.message}") from None
        cfg = EngineConfig(
            block_size=self.block_size, num_blocks=kv_blocks, max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=max(ns.max_num_batched_tokens, 1), max_model_len=self.max_model_len,
            max_loras=ns.max_loras, prefix_caching=ns.enable_prefix_caching,
            prefill_s_per_token=opts.prefill_ms_per_token / 1e3, decode_s_per_step=opts.decode_ms_per_token / 1e3,
            decode_s_per_seq=opts.decode_ms_per_seq / 1e3, default_output_len=opts.output_len, seed=opts.seed,
            kv_connector=kvt is not None, kv_pin_timeout=pin_timeout(opts.kv_transfer_timeout_s, env))
        self.tok = Tokenizer()
        self.core = EngineCore(cfg, self.tok)
        cache_info = {"block_size": str(self.block_size), "num_gpu_blocks": str(kv_blocks),
                      "enable_prefix_caching": str(ns.enable_prefix_caching),
                      "prefix_caching_hash_algo": ns.prefix_caching_hash_algo,
                      "gpu_memory_utilization": str(ns.gpu_memory_utilization)}
        self.metrics = VllmMetrics(self.core, self.served[0], self.version,
                                   show_hidden_old=ns.show_hidden_metrics_for_version is not None,
                                   lora_enabled=self.enable_lora, max_loras=ns.max_loras, cache_info=cache_info)
        self.core.sink = self.metrics
        self.kv_cfg = parse_kv_events_config(ns.kv_events_config, dotted, self.version)
        # --sim-kv-drop-*: batches kept off the PUB socket so tests can make sequence gaps;
        # --sim-kv-events-delay-ms: each batch sent that late (the index lags the cache)
        self.kv_faults = {"drop_every": getattr(ns, "sim_kv_drop_every", None),
                          "drop_seqs": getattr(ns, "sim_kv_drop_seqs", frozenset()),
                          "drop_lost": getattr(ns, "sim_kv_drop_lost", False),
                          "delay_s": getattr(ns, "sim_kv_events_delay_ms", 0.0) / 1000.0}
        self.publisher: Any = None
        # <= 0.11 builds the batch in schedule(), 0.12+ after the step (vllm-wire.md §1.2).
        late = self.version >= (0, 12)
        self.runner = EngineRunner(self.core, on_step=self._after_step, on_schedule=None if late else self._publish)
        # P/D as NixlConnector (docs/simulator.md); other connectors are accepted without effect
        self.kvt: KvTransferShell | None = None
        if kvt is not None and kvt.modeled:
            self.kvt = KvTransferShell(kvt, self.core, self.runner, self.metrics, self.version,
                                       ms_per_block=opts.transfer_ms_per_block, seed=opts.seed,
                                       side_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST"))
        elif kvt is not None:
            log.warning("--kv-transfer-config: the simulator models NixlConnector only; %s has no effect",
                        kvt.kv_connector)
        self.server_load = 0
        # the W3C trace headers of the last requests (GET /sim/trace_headers, dev mode: the tests' view)
        self.trace_headers: deque[dict[str, str | None]] = deque(maxlen=64)
        self.ready = False
        self.bound_port: int | None = None

    # -- KV events -------------------------------------------------------------------------
    def _after_step(self, now: float) -> None:
        if self.version >= (0, 12):
            self._publish(now)
        if self.kvt is not None:
            self.kvt.after_step()

    def _publish(self, now: float) -> None:
        events = self.core.take_kv_events()
        if not events or self.publisher is None:
            return
        batch = kvev.EventBatch(ts=time.time(), events=[kv_event(e, self.version, self.int_hashes) for e in events],
                                data_parallel_rank=0)
        self.publisher.publish(kvev.encode_batch(batch, self.version))

    # -- HTTP ------------------------------------------------------------------------------
    async def handle(self, req: Request) -> Response:
        if self.dev_mode and req.method == "POST" and req.path.startswith("/v1/"):
            self.trace_headers.append({k: req.header(k) for k in ("traceparent", "tracestate", "x-request-id")})
        try:
            return await self._route(req)
        except vs.VllmError as e:
            return Response(e.status, list(_JSON), vs.dumps(e.body()))

    async def _route(self, req: Request) -> Response:
        path, method = req.path, req.method
        if self.api_key and path.startswith("/v1") and req.header("authorization") != f"Bearer {self.api_key}":
            return Response(401, list(_JSON), vs.dumps({"error": "Unauthorized"}))
        routes = self._routes()
        entry = routes.get(path)
        if entry is None:
            return Response(404, list(_JSON), b'{"detail":"Not Found"}')
        methods, fn = entry
        if method not in methods:
            return Response(405, list(_JSON), b'{"detail":"Method Not Allowed"}')
        return await fn(req)

    def _routes(self) -> dict[str, tuple[tuple[str, ...], Any]]:
        r: dict[str, tuple[tuple[str, ...], Any]] = {
            "/health": (("GET",), self._health), "/ping": (("GET", "POST"), self._health),
            "/version": (("GET",), self._version), "/v1/models": (("GET",), self._models),
            "/metrics": (("GET",), self._metrics), "/load": (("GET",), self._load),
            "/tokenize": (("POST",), self._tokenize), "/detokenize": (("POST",), self._detokenize),
            "/v1/chat/completions": (("POST",), self._chat), "/v1/completions": (("POST",), self._completions),
            "/v1/embeddings": (("POST",), self._embeddings),
        }
        if self.runtime_lora:
            r["/v1/load_lora_adapter"] = (("POST",), self._load_lora)
            r["/v1/unload_lora_adapter"] = (("POST",), self._unload_lora)
        if self.dev_mode:
            r["/reset_prefix_cache"] = (("POST",), self._reset_prefix_cache)
            r["/sim/trace_headers"] = (("GET",), self._trace_headers)
        if self.version >= (0, 31):
            r["/kv_event_sources"] = (("GET",), self._kv_sources)
        if self.kvt is not None:
            r.update(self.kvt.routes())
        return r

    async def _health(self, req: Request) -> Response:
        return Response(200 if self.ready else 503)

    async def _trace_headers(self, req: Request) -> Response:
        return Response(200, list(_JSON), vs.dumps(list(self.trace_headers)))

    async def _version(self, req: Request) -> Response:
        return Response(200, list(_JSON), vs.dumps({"version": str(self.version)}))

    async def _load(self, req: Request) -> Response:
        return Response(200, list(_JSON), vs.dumps({"server_load": self.server_load}))

    async def _metrics(self, req: Request) -> Response:
        body = self.metrics.render()
        if self.enable_lora:  # the simulator's own counters (no vLLM has them): what LoRA benchmarks read
            body += (b"# HELP llmgw_sim_lora_loads_total Simulator only: adapter loads into the worker's LoRA cache.\n"
                     b"# TYPE llmgw_sim_lora_loads_total counter\n"
                     b"llmgw_sim_lora_loads_total %d\n"
                     b"# HELP llmgw_sim_lora_load_waits_total Simulator only: requests that waited for such a load.\n"
                     b"# TYPE llmgw_sim_lora_load_waits_total counter\n"
                     b"llmgw_sim_lora_load_waits_total %d\n" % (self.loras.loads, self.lora_waits))
        return Response(200, [("content-type", "text/plain; version=0.0.4; charset=utf-8")], body)

    async def _kv_sources(self, req: Request) -> Response:
        if self.publisher is None:
            return Response(200, list(_JSON), b"{}")
        cfg = dict(self.kv_cfg, endpoint=self.publisher.endpoint,
                   replay_endpoint=self.publisher.replay_endpoint)
        return Response(200, list(_JSON), vs.dumps({"0": cfg}))

    async def _models(self, req: Request) -> Response:
        created = int(time.time())
        body = vs.model_list(self.served, self.model_path, self.max_model_len,
                             list(self.loras.adapters.values()), created)
        return Response(200, list(_JSON), vs.dumps(body))

    def _body(self, req: Request) -> dict[str, Any]:
        try:
            body = json_loads(req.body or b"null")  # depth-bounded (TooDeep is a ValueError)
        except (ValueError, UnicodeDecodeError) as e:
            raise vs.VllmError(400, f"JSON decode error: {e}") from None
        if not isinstance(body, dict):
            raise vs.VllmError(400, "Input should be a valid dictionary or object to extract fields from")
        return body

    def _resolve_model(self, name: object) -> LoraRef | None:
        if name is None or name in self.served:
            return None
        if isinstance(name, str) and name in self.loras.adapters:
            e = self.loras.adapters[name]
            return LoraRef(e.name, e.int_id, e.path)
        raise vs.model_not_found(name)

    async def _tokenize(self, req: Request) -> Response:
        body = self._body(req)
        self._resolve_model(body.get("model"))
        if "messages" in body:
            try:
                text = render_chat(body["messages"], add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                                   continue_final_message=bool(body.get("continue_final_message", False)))
            except ChatTemplateError as e:
                raise vs.VllmError(400, str(e)) from None
            ids = self.tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
        elif isinstance(body.get("prompt"), str):
            ids = self.tok.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
        else:
            raise vs.VllmError(400, "Either 'prompt' (a string) or 'messages' must be given.")
        strs = [self.tok.token_str(i) for i in ids] if body.get("return_token_strs") else None
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}
        return Response(200, list(_JSON), vs.dumps(out))

    async def _detokenize(self, req: Request) -> Response:
        body = self._body(req)
        self._resolve_model(body.get("model"))
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(self.tok.valid_id(i) for i in ids):
            raise vs.VllmError(400, "'tokens' must be a list of valid token ids", param="tokens")
        return Response(200, list(_JSON), vs.dumps({"prompt": self.tok.decode(ids)}))

    async def _load_lora(self, req: Request) -> Response:
        body = self._body(req)
        path = body.get("lora_path")
        exists, rank = self._inspect_adapter(path)
        if not self.enable_lora:
            raise vs.VllmError(400, "LoRA is not enabled. Please start the server with --enable-lora.")
        name = body.get("lora_name")
        if (exists and self.opts.lora_load_ms > 0 and isinstance(name, str) and name not in self.loras.adapters
                and name not in self.loras.resident):
            await trio.sleep(self.opts.lora_load_ms / 1e3)  # the weights are read before the call answers
        msg = self.loras.load(body.get("lora_name"), path, load_inplace=bool(body.get("load_inplace", False)),
                              exists=exists, rank=rank)
        return Response(200, [("content-type", "text/plain; charset=utf-8")], msg.encode())

    def _inspect_adapter(self, path: object) -> tuple[bool, int]:
        if not isinstance(path, str) or not path:
            return True, 1
        p = Path(path)
        if not p.exists():
            return (not self.opts.lora_require_path), 8
        try:
            return True, int(json.loads((p / "adapter_config.json").read_text()).get("r", 8))
        except (OSError, ValueError, AttributeError):
            return True, 8

    async def _lora_ready(self, name: str) -> None:
        """A cold adapter is loaded into the worker cache before its request runs, once: requests for
        it that arrive during the load wait for that same load. Counted (the simulator's own
        llmgw_sim_lora_* metrics, which benchmarks read)."""
        while (ev := self._lora_loading.get(name)) is not None:
            self.lora_waits += 1
            await ev.wait()
        if not self.loras.touch(name) or self.opts.lora_load_ms <= 0:
            return
        self.lora_waits += 1
        ev = self._lora_loading[name] = trio.Event()
        try:
            await trio.sleep(self.opts.lora_load_ms / 1e3)
        finally:
            del self._lora_loading[name]
            ev.set()

    async def _unload_lora(self, req: Request) -> Response:
        msg = self.loras.unload(self._body(req).get("lora_name"))
        return Response(200, [("content-type", "text/plain; charset=utf-8")], msg.encode())

    async def _reset_prefix_cache(self, req: Request) -> Response:
        ok = self.core.reset_prefix_cache()
        self._publish(trio.current_time())
        if not ok:
            raise vs.VllmError(400, "Failed to reset prefix cache: blocks are still in use.")
        return Response(200)

    async def _embeddings(self, req: Request) -> Response:
        """A pooling model's /v1/embeddings: a deterministic unit vector per input (from its
        token ids), with vLLM's response shape and usage."""
        body = self._body(req)
        self._resolve_model(body.get("model"))
        if not self.pooling:
            raise vs.VllmError(400, "The model does not support Embeddings API", param="model")
        try:
            prompts = self._prompts(body.get("input"))
        except ParamError as e:
            raise vs.VllmError(400, e.message.replace("'prompt'", "'input'"), param="input") from None
        n_tokens = 0
        data = []
        for i, ids in enumerate(prompts):
            if len(ids) > self.max_model_len:
                raise vs.VllmError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                   f"However, your request has {len(ids)} input tokens.", param="input_tokens")
            n_tokens += len(ids)
            data.append({"index": i, "object": "embedding", "embedding": embed(ids, 384)})
        out = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
               "model": body.get("model") or self.served[0], "data": data,
               "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0,
                         "prompt_tokens_details": None}}
        return Response(200, list(_JSON), vs.dumps(out))

    # -- generation ------------------------------------------------------------------------
    async def _chat(self, req: Request) -> Response:
        body = self._body(req)
        lora = self._resolve_model(body.get("model"))
        try:
            params = parse_gen_params(body, chat=True, strict_cache_salt=self.version >= (0, 30))
            if "messages" not in body:
                raise ParamError("Field required: 'messages'", "messages")
            text = render_chat(body["messages"], add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                               continue_final_message=bool(body.get("continue_final_message", False)))
        except ParamError as e:
            raise vs.VllmError(e.status, e.message, param=e.param) from None
        except ChatTemplateError as e:
            raise vs.VllmError(400, str(e)) from None
        prompt = self.tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
        return await self._generate(body, params, [prompt], lora, chat=True)

    async def _completions(self, req: Request) -> Response:
        body = self._body(req)
        lora = self._resolve_model(body.get("model"))
        try:
            params = parse_gen_params(body, chat=False, strict_cache_salt=self.version >= (0, 30))
            prompts = self._prompts(body.get("prompt"))
        except ParamError as e:
            raise vs.VllmError(e.status, e.message, param=e.param) from None
        return await self._generate(body, params, prompts, lora, chat=False)

    def _prompts(self, p: object) -> list[list[int]]:
        if isinstance(p, str):
            return [self.tok.encode(p, add_special_tokens=True)]
        if isinstance(p, list) and p:
            if all(isinstance(x, str) for x in p):
                return [self.tok.encode(x, add_special_tokens=True) for x in p]
            if all(self.tok.valid_id(x) for x in p):
                return [list(p)]  # type: ignore[arg-type]
            if all(isinstance(x, list) and x and all(self.tok.valid_id(i) for i in x) for x in p):
                return [list(x) for x in p]  # type: ignore[union-attr]
        raise ParamError("'prompt' must be a string, a list of strings, or a list of token ids", "prompt")

    def _check_len(self, n_prompt: int, params: GenParams) -> int:
        mml = self.max_model_len
        if n_prompt > mml or (params.max_tokens is None and n_prompt >= mml):
            raise vs.VllmError(400, f"This model's maximum context length is {mml} tokens. However, your request "
                               f"has {n_prompt} input tokens. Please reduce the length of the input messages.",
                               param="input_tokens")
        if params.max_tokens is None:
            return mml - n_prompt
        if n_prompt + params.max_tokens > mml:
            raise vs.VllmError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. "
                               f"This model's maximum context length is {mml} tokens and your request has "
                               f"{n_prompt} input tokens ({params.max_tokens} > {mml} - {n_prompt}).",
                               param="max_tokens")
        return params.max_tokens

    async def _generate(self, body: dict[str, Any], params: GenParams, prompts: list[list[int]],
                        lora: LoraRef | None, *, chat: bool) -> Response:
        max_tokens = [self._check_len(len(p), params) for p in prompts]
        pd, remote = request_kv_params(body, self.kvt)
        if lora is not None:
            await self._lora_ready(lora.name)
        model = body.get("model") or self.served[0]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        hl = LoRA(lora.name, lora.int_id, lora.path) if lora else None
        send, recv = trio.open_memory_channel[Any](float("inf"))
        reqs: list[SimRequest] = []
        for pi, prompt in enumerate(prompts):
            for i in range(params.n):
                bh = self.hash_ctx.hasher(hl, params.cache_salt)
                r = SimRequest(
                    req_id=f"{rid}-{pi * params.n + i}", prompt=prompt, max_tokens=max_tokens[pi],
                    arrival=trio.current_time(), ignore_eos=params.ignore_eos,
                    text=TextStream(params.stop, params.include_stop_str_in_output),
                    stop_token_ids=params.stop_token_ids, min_tokens=params.min_tokens, lora=lora,
                    cache_salt=params.cache_salt,
                    seed=None if params.seed is None and params.n == 1 else (params.seed or 0) + i,
                    hasher=bind_hasher(bh, self.block_size), lora_event_extra=event_extra(bh, self.version))
                r.hashes = bh.block_hashes
                r.index = pi * params.n + i  # type: ignore[attr-defined]
                r.remote_decode = pd == "decode"
                reqs.append(r)
        if remote is not None and self.kvt is not None and not await self.kvt.pull(reqs, remote):
            if self.kvt.cfg.kv_load_failure_policy == "fail":
                return self.kvt.failed_answer(params.stream)
        self.server_load += 1
        for r in reqs:
            self.runner.submit(r, send)
        include_usage = params.include_usage or self.force_usage
        gen = ResponseWriter(self, reqs, recv, rid, created, str(model), chat, include_usage,
                   params.continuous_usage or (self.force_usage and params.stream))
        if params.stream:
            return Response(200, list(_SSE), gen.sse())
        try:
            body_out = await gen.collect()
        finally:
            gen.abort_rest()
        if pd == "decode" and self.kvt is not None:
            body_out["kv_transfer_params"] = self.kvt.answer_params(reqs[0])
        return Response(200, list(_JSON), vs.dumps(body_out))

    # -- lifecycle -------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        from llmgw.daemon.sim.kv_publisher import KVEventPublisher

        if self.opts.start_seconds > 0:
            await trio.sleep(self.opts.start_seconds)  # the process starting: nothing bound yet
        async with trio.open_nursery() as nursery:
            if self.kv_cfg["enable_kv_cache_events"] and self.kv_cfg["publisher"] == "zmq":
                self.publisher = KVEventPublisher(
                    self.kv_cfg["endpoint"], replay_endpoint=self.kv_cfg["replay_endpoint"],
                    buffer_steps=self.kv_cfg["buffer_steps"], hwm=self.kv_cfg["hwm"],
                    max_queue_size=self.kv_cfg["max_queue_size"], topic=self.kv_cfg["topic"],
                    replay_with_topic=self.version >= (0, 26), **self.kv_faults)
                await nursery.start(self.publisher.run)
            if self.opts.load_seconds > 0:
                await trio.sleep(self.opts.load_seconds)  # vLLM answers nothing while the model loads
            nursery.start_soon(self.runner.run)
            if self.kvt is not None:
                await nursery.start(self.kvt.run)
            self.ready = True
            self.bound_port = await nursery.start(serve_tcp, self.handle, self.host, self.port)
            if self.kvt is not None:
                self.kvt.bound(self.host, self.bound_port)
            log.info("simulated vLLM %s serving %s on %s:%s", self.version, self.served[0], self.host,
                     self.bound_port)
            task_status.started(self.bound_port)


def build(argv: list[str], env: Mapping[str, str] | None = None) -> VllmSim:
    from llmgw.sim.args import build_vllm_parser, split_dotted

    rest, dotted = split_dotted(argv, "--kv-events-config")
    rest, ns_kvt = split_dotted(rest, "--kv-transfer-config")
    ns = build_vllm_parser().parse_args(rest)
    ns.kv_transfer_dotted = ns_kvt
    return VllmSim(ns, dotted, os.environ if env is None else env)
