"""Runs an eval suite against a model's revision through the router's own OpenAI port — the
normal request path, so routing, its rationale (the decisions ring) and the metrics apply. Each
case is one streamed chat completion; the time to the first content and to the end are measured
here, the answer judged by the pure rules (llmgw.lifecycle.evals).

Every request carries the router's internal header and token (only this process knows the
token) and the revision it is for: the candidate is reached so, the live revision is not diverted
to a canary, and the router counts these requests apart from client traffic. At most `suite.concurrency` cases
are in flight; each has `suite.timeout_s` (a timeout fails that case, the run goes on). What
an answer may hold is bounded (MAX_ANSWER_CHARS of text; the stream's size at MAX_STREAM_BYTES)."""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import trio

from llmgw.inputs.nesting import json_loads
from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool
from llmgw.daemon.router.proxy import INTERNAL_HEADER, REVISION_HEADER
from llmgw.lifecycle.evals import MAX_ANSWER_CHARS, Answer, judge
from llmgw.lifecycle.suites import Case, Suite

log = logging.getLogger("llmgw.lifecycle")

__all__ = ["EvalTarget", "run_cases"]

MAX_STREAM_BYTES = 8 << 20
MAX_ERROR_BYTES = 4096


@dataclass(frozen=True)
class EvalTarget:
    """Where and how the runner sends its requests: the router's OpenAI port (a loopback URL),
    the internal token, an API key when the router requires one."""

    base_url: str
    internal_token: str
    api_key: str | None = None


async def run_cases(pool: UpstreamPool, target: EvalTarget, suite: Suite, model: str, revision: str,
                    job_id: str = "") -> list[dict[str, Any]]:
    """Every case's verdict, in the suite's order. Case i's request id is ``case-HEX-i``, HEX
    being the eval job's (``eval-HEX``): a request's trace is never taken for a job's."""
    tag = job_id.removeprefix("eval-") or secrets.token_hex(4)
    results: list[dict[str, Any] | None] = [None] * len(suite.cases)
    limit = trio.Semaphore(suite.concurrency)

    async def one(i: int, case: Case) -> None:
        async with limit:
            answer = await _ask(pool, target, suite, case, model, revision, f"case-{tag}-{i}")
        results[i] = judge(case, answer)

    async with trio.open_nursery() as nursery:
        for i, case in enumerate(suite.cases):
            nursery.start_soon(one, i, case)
    return [r for r in results if r is not None]


async def _ask(pool: UpstreamPool, target: EvalTarget, suite: Suite, case: Case, model: str,
               revision: str, request_id: str) -> Answer:
    body = case.request_body(model)
    body["stream_options"] = {"include_usage": True}
    # Both revisions with the internal token: the router tells the runner's requests from clients'
    # (the canary's tally leaves them out) and never sends a live eval to the canary's candidate.
    headers = [("content-type", "application/json"), ("x-request-id", request_id),
               (REVISION_HEADER, "candidate" if revision == "candidate" else "live"),
               (INTERNAL_HEADER, target.internal_token)]
    if target.api_key:
        headers.append(("authorization", f"Bearer {target.api_key}"))
    start = trio.current_time()
    state = _Stream()
    with trio.move_on_after(suite.timeout_s) as scope:
        try:
            async with pool.stream(target.base_url, "POST", "/v1/chat/completions", headers,
                                   json.dumps(body).encode(), first_byte_timeout=suite.timeout_s,
                                   idle_timeout=suite.timeout_s) as resp:
                if resp.status != 200:
                    data = await resp.read(MAX_ERROR_BYTES * 16)
                    return Answer(error=f"HTTP {resp.status}: {_error_text(data)}",
                                  latency_ms=(trio.current_time() - start) * 1e3)
                async for piece in resp.iter_body():
                    state.feed(piece, trio.current_time())
                    if state.size > MAX_STREAM_BYTES:
                        return Answer(text=state.text, error=f"answer larger than {MAX_STREAM_BYTES} bytes")
        except UpstreamError as e:
            return Answer(text=state.text, error=f"request failed: {e.public}",
                          latency_ms=(trio.current_time() - start) * 1e3)
    end = trio.current_time()
    if scope.cancelled_caught:
        return Answer(text=state.text, error=f"timed out after {suite.timeout_s:g} s",
                      ttft_ms=None if state.first is None else (state.first - start) * 1e3)
    if state.error is not None:
        return Answer(text=state.text, error=state.error, latency_ms=(end - start) * 1e3)
    return Answer(text=state.text, tokens=state.tokens,
                  ttft_ms=None if state.first is None else (state.first - start) * 1e3,
                  latency_ms=(end - start) * 1e3)


class _Stream:
    """An SSE chat stream, parsed as it arrives: the content, when its first piece came, the
    usage's completion tokens, an in-band error."""

    def __init__(self) -> None:
        self.buf = b""
        self.parts: list[str] = []
        self.chars = 0
        self.size = 0
        self.first: float | None = None
        self.tokens: int | None = None
        self.error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def feed(self, piece: bytes, now: float) -> None:
        self.size += len(piece)
        self.buf += piece
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            try:
                obj = json_loads(data)
            except ValueError:  # not JSON, or nested too deeply
                self.error = "the stream held a line that is not JSON"
                continue
            if not isinstance(obj, dict):
                continue
            if isinstance(obj.get("error"), dict):
                self.error = f"error in the stream: {str(obj['error'].get('message'))[:500]}"
            usage = obj.get("usage")
            if isinstance(usage, dict) and type(usage.get("completion_tokens")) is int:
                self.tokens = usage["completion_tokens"]
            for ch in obj.get("choices") or []:
                delta = ch.get("delta") if isinstance(ch, dict) else None
                content = delta.get("content") if isinstance(delta, dict) else None
                if isinstance(content, str) and content:
                    if self.first is None:
                        self.first = now
                    if self.chars < MAX_ANSWER_CHARS:
                        self.parts.append(content[:MAX_ANSWER_CHARS - self.chars])
                        self.chars += len(self.parts[-1])


def _error_text(data: bytes) -> str:
    try:
        obj = json_loads(data)
        return str(obj["error"]["message"])[:MAX_ERROR_BYTES]
    except (ValueError, KeyError, TypeError):
        return data[:MAX_ERROR_BYTES].decode("utf-8", "replace")
