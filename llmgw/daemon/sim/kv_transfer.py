"""The simulated NixlConnector's I/O (prefill/decode disaggregation; the rules are in
llmgw.sim.kv_transfer): the side channel a decoder reads a prefiller's held blocks through, the
decoder's pull before it schedules a request, and the timer that frees blocks no decoder read.

The side channel is the simulator's stand-in for NIXL's (a ZMQ handshake, then RDMA reads and a
notification): ``POST /_sim/kv_transfer/read`` on the prefiller's own HTTP port, which it names as
``remote_port`` in its answers. No KV data moves: the read returns the block count and frees the
blocks, and the decoder then waits ``--sim-transfer-ms-per-block`` per block it did not hold."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

import trio

from llmgw.daemon.net.httpserver import Request, Response
from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool
from llmgw.daemon.sim.runner import EngineRunner
from llmgw.inputs.nesting import json_loads
from llmgw.sim import vllm_surface as vs
from llmgw.sim.engine import EngineCore, SimRequest
from llmgw.sim.kv_transfer import (
    DEFAULT_ABORT_TIMEOUT_S,
    READ_PATH,
    KvTransferConfig,
    RemotePrefill,
    default_engine_id,
    parse_read_body,
    prefill_answer_params,
    read_kv_transfer_params,
)
from llmgw.sim.kv_transfer_metrics import KvTransferMetrics
from llmgw.sim.vllm_metrics import VllmMetrics

__all__ = ["KvTransferShell", "request_kv_params", "pin_timeout"]

log = logging.getLogger("llmgw.sim.vllm")

_JSON = [("content-type", "application/json")]
_SSE = [("content-type", "text/event-stream; charset=utf-8"), ("cache-control", "no-cache")]
_READ_TIMEOUT_S = 5.0  # NIXL's handshake waits 5 s (RCVTIMEO) for the prefiller


def pin_timeout(flag: float | None, env: Mapping[str, str]) -> float:
    """--sim-kv-transfer-timeout-s, else VLLM_NIXL_ABORT_REQUEST_TIMEOUT as vLLM reads it, else 480 s."""
    if flag is not None:
        return flag
    try:
        return float(env.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", DEFAULT_ABORT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_ABORT_TIMEOUT_S


def request_kv_params(body: Mapping[str, Any],
                      shell: KvTransferShell | None) -> tuple[str | None, RemotePrefill | None]:
    """What a request's kv_transfer_params ask of this engine: ("decode", None) keep the blocks for
    a remote decode, ("prefill", where) pull them first, or nothing — always nothing without a
    modeled connector, as vLLM without one ignores the field."""
    try:
        kind, remote = read_kv_transfer_params(body.get("kv_transfer_params"))
    except ValueError as e:
        raise vs.VllmError(400, str(e), param="kv_transfer_params") from None
    if shell is None or kind is None:
        return None, None
    if kind == "invalid":
        log.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer",
                    body.get("kv_transfer_params"))
        return None, None
    return kind, remote


class KvTransferShell:
    def __init__(self, cfg: KvTransferConfig, core: EngineCore, runner: EngineRunner, metrics: VllmMetrics,
                 version: tuple[int, ...], *, ms_per_block: float, side_host: str | None, seed: int) -> None:
        self.cfg = cfg
        self.core, self.runner, self.vllm_metrics, self.version = core, runner, metrics, version
        self.ms_per_block = ms_per_block
        self.side_host = side_host  # VLLM_NIXL_SIDE_CHANNEL_HOST, when set
        self.seed = seed
        self.metrics = KvTransferMetrics(metrics.registry, metrics.labels, version, core.kv_pins,
                                         nixl=cfg.modeled)
        self.engine_id = cfg.engine_id or ""
        self.host = "127.0.0.1"
        self.port = 0
        self._pool: UpstreamPool | None = None
        self._timer: trio.CancelScope | None = None

    def bound(self, listen_host: str, port: int) -> None:
        """The HTTP server is listening: the side channel is there, and the engine id is known."""
        self.port = port
        self.host = self.side_host or (listen_host if listen_host not in ("0.0.0.0", "::", "") else "127.0.0.1")
        self.engine_id = self.cfg.engine_id or default_engine_id(self.seed, self.host, port)
        log.info("KV transfer: %s, role %s, engine id %s, side channel http://%s:%d%s, load failure policy %s",
                 self.cfg.kv_connector, self.cfg.kv_role, self.engine_id, self.host, port, READ_PATH,
                 self.cfg.kv_load_failure_policy)

    def routes(self) -> dict[str, tuple[tuple[str, ...], Any]]:
        return {READ_PATH: (("POST",), self._read)}

    # -- the prefiller's side ----------------------------------------------------------------
    def answer_params(self, req: SimRequest) -> dict[str, Any] | None:
        """The prefill answer's kv_transfer_params: only when its blocks are held (finished by length)."""
        if req.kv_block_ids is None or self.core.kv_pins.get(req.req_id) is None:
            return None
        return prefill_answer_params(req.kv_block_ids, self.engine_id, req.req_id, self.host, self.port)

    async def _read(self, req: Request) -> Response:
        try:
            obj = json_loads(req.body or b"null")  # depth-bounded: a deep body is a 400, not a RecursionError
            rid, block_ids = parse_read_body(obj)
        except (ValueError, UnicodeDecodeError) as e:
            return Response(400, list(_JSON), vs.dumps({"detail": str(e)}))
        engine = obj.get("remote_engine_id")
        if engine is not None and engine != self.engine_id:
            return Response(409, list(_JSON), vs.dumps(
                {"detail": f"this engine is {self.engine_id!r}, not {engine!r}"}))
        try:
            pinned = self.core.read_pinned(rid, block_ids)
        except ValueError as e:
            return Response(409, list(_JSON), vs.dumps({"detail": str(e)}))
        if pinned is None:
            return Response(404, list(_JSON), vs.dumps(
                {"detail": f"no KV blocks held for request {rid!r} (unknown, read already, or expired)"}))
        self.runner.wake()  # freed blocks may admit a waiting request
        out = {"remote_request_id": rid, "remote_engine_id": self.engine_id, "num_blocks": len(pinned.block_ids),
               "num_tokens": pinned.num_tokens}
        return Response(200, list(_JSON), vs.dumps(out))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The outbound client for pulls, and the timer that frees held blocks no decoder read."""
        async with UpstreamPool(connect_timeout=_READ_TIMEOUT_S, first_byte_timeout=_READ_TIMEOUT_S) as pool:
            self._pool = pool
            task_status.started()
            while True:
                deadline = self.core.kv_pins.next_deadline()
                with trio.move_on_at(math.inf if deadline is None else deadline) as self._timer:
                    await trio.sleep_forever()
                self._timer = None
                for p in self.core.expire_pinned(trio.current_time()):
                    log.warning("Releasing expired KV blocks for request %s which were retrieved by 0 decode "
                                "worker(s) within the timeout", p.req_id)
                    self.runner.wake()

    def after_step(self) -> None:
        """A step may have held a prefill's blocks: bring the timer forward to their deadline."""
        deadline = self.core.kv_pins.next_deadline()
        if self._timer is not None and deadline is not None and deadline < self._timer.deadline:
            self._timer.deadline = deadline

    # -- the decoder's side --------------------------------------------------------------------
    async def pull(self, reqs: list[SimRequest], remote: RemotePrefill) -> bool:
        """Read the prompt's blocks from the prefiller, wait the modeled transfer, and mark the
        requests of that prompt as loaded. False when the read failed (counted, logged)."""
        t0 = trio.current_time()
        reason = await self._read_remote(remote)
        if reason is not None:
            self.metrics.failed_transfer(reason)
            log.warning("KV transfer from %s:%d for request %s failed (%s); %s", remote.host, remote.port,
                        remote.request_id, reason, "recomputing the prompt locally"
                        if self.cfg.kv_load_failure_policy == "recompute" else "failing the request")
            return False
        first = reqs[0]
        prompt_blocks = -(-len(first.prompt) // self.core.cfg.block_size)
        to_pull = max(0, min(len(remote.block_ids), prompt_blocks) - self.core.local_hit_blocks(first))
        if to_pull and self.ms_per_block > 0:
            await trio.sleep(to_pull * self.ms_per_block / 1e3)
        for r in reqs:
            if r.prompt is first.prompt:
                r.remote_blocks = len(remote.block_ids)
        self.metrics.transferred(to_pull, trio.current_time() - t0)
        return True

    async def _read_remote(self, remote: RemotePrefill) -> str | None:
        assert self._pool is not None, "KvTransferShell.run is not running"
        body = vs.dumps({"remote_request_id": remote.request_id, "remote_block_ids": list(remote.block_ids),
                         "remote_engine_id": remote.engine_id})
        try:
            reply = await self._pool.request(f"http://{_url_host(remote.host)}:{remote.port}", "POST", READ_PATH,
                                             list(_JSON), body)
        except (UpstreamError, OSError):
            return "unreachable"
        if reply.status == 404:
            return "not_found"
        try:
            ok = reply.status == 200 and isinstance(reply.json().get("num_blocks"), int)
        except (ValueError, AttributeError, UnicodeDecodeError):
            ok = False
        return None if ok else "error"

    def failed_answer(self, stream: bool) -> Response:
        """kv_load_failure_policy "fail": the request ends with finish_reason "error", which vLLM's
        OpenAI layer turns into a 500 "Internal server error" (in a stream: an error event)."""
        if self.version >= (0, 13):
            success = self.vllm_metrics.success
            success["error"] = success.get("error", 0) + 1
        err = vs.error_body(500, "Internal server error", "InternalServerError")
        if not stream:
            return Response(500, list(_JSON), vs.dumps(err))

        async def events() -> AsyncIterator[bytes]:
            yield b"data: " + json.dumps(err).encode() + b"\n\n"  # json.dumps' spacing, as vLLM's
            yield b"data: [DONE]\n\n"
        return Response(200, list(_SSE), events())


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
