"""The simulated vLLM's answers: engine outputs turned into an OpenAI response, streamed (SSE)
or whole, with vLLM's chunk order and usage; and its deterministic embeddings."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import AsyncIterator
from typing import Any, Protocol

import trio

from llmgw.daemon.sim.runner import EngineRunner
from llmgw.sim import vllm_surface as vs
from llmgw.sim.engine import SimRequest

__all__ = ["ResponseWriter", "embed", "sse_data"]


class _Sim(Protocol):
    """What a response needs of the server: its engine runner, its load gauge, its settings."""

    runner: EngineRunner
    server_load: int
    prompt_details: bool


class ResponseWriter:
    """Turns engine outputs into an OpenAI response, streamed or whole; aborts what the client left."""

    def __init__(self, sim: _Sim, reqs: list[SimRequest], recv: trio.MemoryReceiveChannel[Any], rid: str,
                 created: int, model: str, chat: bool, include_usage: bool, continuous: bool) -> None:
        self.sim, self.reqs, self.recv, self.rid = sim, reqs, recv, rid
        self.created, self.model, self.chat = created, model, chat
        self.include_usage, self.continuous = include_usage, continuous
        self.done = 0
        self.closed = False

    def abort_rest(self) -> None:
        if self.closed:
            return
        self.closed = True
        for r in self.reqs:
            if not r.finished:
                self.sim.runner.abort(r.req_id)
        self.sim.server_load -= 1

    def _usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in {id(r.prompt): r.prompt for r in self.reqs}.values())
        completion = sum(len(r.output) for r in self.reqs)
        cached = sum(r.num_cached_prompt_tokens for r in self.reqs) if self.sim.prompt_details else None
        return vs.usage(prompt, completion, cached)

    async def collect(self) -> dict[str, Any]:
        texts = {r.index: "" for r in self.reqs}  # type: ignore[attr-defined]
        async for out in self.recv:
            texts[out.req.index] += out.text
            if out.finished:
                self.done += 1
                if self.done == len(self.reqs):
                    break
        choices = [(texts[r.index], r.finish_reason, r.stop_reason) for r in self.reqs]  # type: ignore[attr-defined]
        build = vs.chat_response if self.chat else vs.completion_response
        return build(self.rid, self.created, self.model, choices, self._usage())

    async def sse(self) -> AsyncIterator[bytes]:
        rid, created, model = self.rid, self.created, self.model
        try:
            chunk_fn = vs.chat_chunk if self.chat else vs.completion_chunk
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            first = self.chat
            async for out in self.recv:
                r = out.req
                if first:
                    # vLLM sends the role chunks with the first engine output, not before: so
                    # the first byte of a stream marks time to first token, as a router sees it.
                    first = False
                    for q in self.reqs:
                        yield sse_data(vs.chat_first_chunk(rid, created, model, q.index))  # type: ignore[attr-defined]
                if out.finished:
                    self.done += 1
                if not out.text and not out.finished:
                    continue
                chunk = chunk_fn(rid, created, model, r.index, out.text,  # type: ignore[attr-defined]
                                 r.finish_reason if out.finished else None, r.stop_reason)
                if self.continuous:
                    chunk["usage"] = vs.usage(len(r.prompt), len(r.output), None)
                yield sse_data(chunk)
                if self.done == len(self.reqs):
                    break
            if self.include_usage:
                yield sse_data(vs.usage_chunk(rid, created, model, obj, self._usage()))
            yield b"data: [DONE]\n\n"
        finally:
            self.abort_rest()


def sse_data(obj: Any) -> bytes:
    return b"data: " + vs.dumps(obj) + b"\n\n"


def embed(ids: list[int], dim: int) -> list[float]:
    """A deterministic unit vector: the same input always embeds the same, different ones differ."""
    seed = hashlib.blake2b(struct.pack(f"<{len(ids)}I", *ids), digest_size=16).digest()
    raw: list[float] = []
    block = seed
    while len(raw) < dim:
        block = hashlib.blake2b(block, digest_size=64).digest()
        raw.extend(b / 127.5 - 1.0 for b in block)
    raw = raw[:dim]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]
