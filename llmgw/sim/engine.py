"""The simulator's engine core: vLLM v1-style continuous batching over a virtual clock.

Pure: it never sleeps and never reads a clock. The shell calls `schedule(now)`, waits the plan's
`duration` of real time, then `complete(plan, now)`, and hands each request its new tokens.

Per step, as vLLM's scheduler does: running requests first (decode takes one token, an
unfinished chunked prefill takes what the token budget leaves), then waiting requests in FIFO
order while fewer than max_num_seqs run; a running request that cannot get a block preempts the
newest running one (recompute); a waiting request that cannot get blocks stops admission (FIFO).
Step time = uncached prompt tokens computed × prefill cost + one decode cost (plus a small cost per
decoding sequence) when anything decodes: so caching, queueing and batch size all show in latency.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llmgw.sim.blockpool import BlockPool, PoolEvent, ReqBlocks
from llmgw.sim.kv_transfer import DEFAULT_ABORT_TIMEOUT_S, KvPins, Pinned, remote_prefill_computed
from llmgw.sim.textstream import TextStream
from llmgw.sim.tokenizer import OUTPUT_WORDS, Tokenizer

__all__ = ["EngineConfig", "EngineCore", "SimRequest", "StepPlan", "Output", "StatsSink", "LoraRef"]


@dataclass(frozen=True, slots=True)
class LoraRef:
    name: str
    int_id: int
    path: str


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    max_loras: int = 1
    prefix_caching: bool = True
    prefill_s_per_token: float = 0.0
    decode_s_per_step: float = 0.0
    decode_s_per_seq: float = 0.0
    default_output_len: int = 64  # where the simulated model "emits EOS" unless ignore_eos
    seed: int = 0
    kv_connector: bool = False  # a KV connector is configured: count external prefix-cache stats
    kv_pin_timeout: float = DEFAULT_ABORT_TIMEOUT_S  # a prefill's kept blocks are freed after this


class Hasher(Protocol):
    """Extends a request's block-hash chain over its full blocks (prompt and output tokens)."""

    def __call__(self, tokens: Sequence[int], hashes: list[bytes], n_blocks: int) -> None: ...


class StatsSink(Protocol):
    def request_started(self, req: SimRequest, now: float) -> None: ...
    def tokens(self, req: SimRequest, n_new: int, now: float) -> None: ...
    def request_finished(self, req: SimRequest, now: float) -> None: ...


@dataclass(eq=False)
class SimRequest:
    req_id: str
    prompt: list[int]
    max_tokens: int
    arrival: float
    ignore_eos: bool = False
    text: TextStream = field(default_factory=TextStream)
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    lora: LoraRef | None = None
    cache_salt: str | None = None
    seed: int | None = None
    hasher: Hasher | None = None
    lora_event_extra: Callable[[int], object] | None = None  # event extra_keys for block i
    # P/D (llmgw.sim.kv_transfer): keep the blocks for a remote decode if it finishes by length;
    # or the number of blocks loaded from a prefiller before this request was added
    remote_decode: bool = False
    remote_blocks: int = 0
    # engine state
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission
    blocks: ReqBlocks = field(default_factory=ReqBlocks)
    hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_block_ids: list[int] | None = None  # the blocks kept for a remote decode, when they were
    _rng: random.Random | None = None
    _natural_len: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.output[i - p]

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(slots=True)
class _Sched:
    req: SimRequest
    num_new: int


@dataclass
class StepPlan:
    scheduled: list[_Sched]
    duration: float
    prefill_tokens: int
    decode_seqs: int


@dataclass(slots=True)
class Output:
    req: SimRequest
    new_tokens: list[int]
    text: str  # what the client may be sent now (stop strings held back and cut)
    finished: bool


class EngineCore:
    def __init__(self, cfg: EngineConfig, tokenizer: Tokenizer, sink: StatsSink | None = None) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        self.sink = sink
        self.pool = BlockPool(cfg.num_blocks, cfg.block_size, caching=cfg.prefix_caching)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._by_id: dict[str, SimRequest] = {}
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.ext_queries = 0  # vllm:external_prefix_cache_queries/hits (tokens), with a KV connector
        self.ext_hits = 0
        self.kv_pins = KvPins(self.pool.free)
        self.deferred_lora = 0  # waiting requests held back by max_loras in the last step
        self._words = [self.tok.encode(w)[0] for w in OUTPUT_WORDS]

    # -- requests --------------------------------------------------------------------------
    def add_request(self, req: SimRequest, now: float) -> None:
        if req.req_id in self._by_id:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        seed = req.seed if req.seed is not None else hash(tuple(req.prompt[-64:])) & 0xFFFFFFFF
        req._rng = random.Random((self.cfg.seed << 32) ^ seed)
        # The simulated model's EOS point: near the configured mean, fixed per (seed, prompt).
        mean = self.cfg.default_output_len
        req._natural_len = max(1, int(mean * (0.5 + req._rng.random())))
        self._by_id[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str, now: float) -> bool:
        req = self._by_id.get(req_id)
        if req is None or req.finished:
            return False
        self._finish(req, "abort", None, now)
        return True

    def get(self, req_id: str) -> SimRequest | None:
        return self._by_id.get(req_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def kv_usage(self) -> float:
        return self.pool.usage()

    def running_loras(self) -> set[str]:
        return {r.lora.name for r in self.running if r.lora is not None}

    def waiting_loras(self) -> set[str]:
        return {r.lora.name for r in self.waiting if r.lora is not None}

    def take_kv_events(self) -> list[PoolEvent]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset()

    # -- P/D -------------------------------------------------------------------------------
    def local_hit_blocks(self, req: SimRequest) -> int:
        """Blocks of the request's prompt this engine's prefix cache holds now (a decoder pulls the rest)."""
        max_hit = (req.num_tokens - 1) // self.cfg.block_size
        self._extend_hashes(req, min(max_hit, req.num_tokens // self.cfg.block_size))
        return len(self.pool.lookup(req.hashes, max_hit))

    def read_pinned(self, req_id: str, block_ids: list[int] | None = None) -> Pinned | None:
        return self.kv_pins.read(req_id, block_ids)

    def expire_pinned(self, now: float) -> list[Pinned]:
        return self.kv_pins.expire(now)

    # -- the step --------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        scheduled: list[_Sched] = []
        taken: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                if victim is req:
                    break
            else:
                scheduled.append(_Sched(req, num_new))
                taken.add(id(req))
                budget -= num_new
                i += 1
                continue
            if req not in self.running:
                # The request preempted itself: nothing older can make room either.
                break
        self.deferred_lora = 0
        loras = self.running_loras()
        skipped: list[SimRequest] = []
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if req.lora is not None and req.lora.name not in loras and len(loras) >= cfg.max_loras:
                skipped.append(self.waiting.popleft())
                self.deferred_lora += 1
                continue
            max_hit = (req.num_tokens - 1) // cfg.block_size
            self._extend_hashes(req, min(max_hit, req.num_tokens // cfg.block_size))
            hit = self.pool.lookup(req.hashes, max_hit)
            num_computed = num_local = len(hit) * cfg.block_size
            external = 0
            if req.remote_blocks and req.num_preemptions == 0:
                num_computed, external = remote_prefill_computed(len(req.prompt), num_local, req.remote_blocks,
                                                                 cfg.block_size)
            num_new = min(req.num_tokens - num_computed, budget)
            if not self._admit(req, hit, num_computed, num_new):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                self.prefix_queries += req.num_tokens
                self.prefix_hits += num_local
                req.num_cached_prompt_tokens = num_computed  # local and loaded, as vLLM's num_cached_tokens
                if cfg.kv_connector:
                    self.ext_queries += req.num_tokens
                    self.ext_hits += external
            if req.first_scheduled is None:
                req.first_scheduled = now
                if self.sink:
                    self.sink.request_started(req, now)
            self.running.append(req)
            if req.lora is not None:
                loras.add(req.lora.name)
            scheduled.append(_Sched(req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        if not scheduled:
            return None
        decode = sum(1 for s in scheduled if s.req.output and s.req.num_computed == s.req.num_tokens - 1)
        prefill = sum(s.num_new for s in scheduled) - decode
        duration = prefill * cfg.prefill_s_per_token
        if decode:
            duration += cfg.decode_s_per_step + decode * cfg.decode_s_per_seq
        return StepPlan(scheduled, duration, prefill, decode)

    def complete(self, plan: StepPlan, now: float) -> list[Output]:
        outputs: list[Output] = []
        for s in plan.scheduled:
            req = s.req
            if req.finished or req.num_computed + s.num_new > req.num_tokens:
                continue  # aborted (or preempted and rescheduled) while the step ran
            if req not in self.running:
                continue
            req.num_computed += s.num_new
            if req.num_computed < req.num_tokens:
                continue  # a chunk of a long prefill: no token yet
            tok = self._sample(req)
            req.output.append(tok)
            if req.first_token is None:
                req.first_token = now
            if self.sink:
                self.sink.tokens(req, 1, now)
            req.last_token = now
            text = req.text.feed(self.tok.token_str(tok))
            reason, stop_reason = self._check_stop(req)
            if reason is not None:
                self._finish(req, reason, stop_reason, now)
                text += req.text.finish()
            outputs.append(Output(req, [tok], text, req.finished))
        return outputs

    # -- internals -------------------------------------------------------------------------
    def _admit(self, req: SimRequest, hit: list, num_computed: int, num_new: int) -> bool:
        """Take a waiting request in with its cache hit, if blocks for its first chunk exist."""
        need = -(-(num_computed + num_new) // self.cfg.block_size) - len(hit)
        if need > self.pool.num_evictable_for(hit):
            return False
        self.pool.touch(hit)
        req.blocks.blocks = list(hit)
        req.blocks.num_cached = len(hit)
        req.num_computed = num_computed
        return self._grow(req, num_new)

    def _grow(self, req: SimRequest, num_new: int) -> bool:
        """Give a request slots for `num_new` more tokens and cache the blocks that fill up."""
        bs = self.cfg.block_size
        total = req.num_computed + num_new
        need = -(-total // bs) - len(req.blocks.blocks)
        if need > 0:
            new = self.pool.allocate(need)
            if new is None:
                return False
            req.blocks.blocks.extend(new)
        n_full = total // bs
        if n_full > req.blocks.num_cached:
            self._extend_hashes(req, n_full)
            self.pool.cache_full_blocks(
                req.blocks,
                req.hashes,
                req.all_tokens() if n_full * bs > len(req.prompt) else req.prompt,
                lora_id=req.lora.int_id if req.lora else None,
                lora_name=req.lora.name if req.lora else None,
                event_extra_keys=_EventExtra(req),
            )
        return True

    def _extend_hashes(self, req: SimRequest, n_blocks: int) -> None:
        if req.hasher is not None and len(req.hashes) < n_blocks and self.cfg.prefix_caching:
            req.hasher(req.prompt if n_blocks * self.cfg.block_size <= len(req.prompt) else req.all_tokens(),
                       req.hashes, n_blocks)

    def _preempt(self, req: SimRequest) -> None:
        self.pool.free(req.blocks)
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _sample(self, req: SimRequest) -> int:
        assert req._rng is not None
        return self._words[req._rng.randrange(len(self._words))]

    def _check_stop(self, req: SimRequest) -> tuple[str | None, str | int | None]:
        n = len(req.output)
        if n >= req.min_tokens:
            last = req.output[-1]
            if last in req.stop_token_ids:
                return "stop", last
            if req.text.stopped_on is not None:
                return "stop", req.text.stopped_on
            if not req.ignore_eos and n >= req._natural_len:
                return "stop", None
        if n >= req.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            return "length", None
        return None, None

    def _finish(self, req: SimRequest, reason: str, stop_reason: str | int | None, now: float) -> None:
        req.finished = True
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        if reason == "length" and req.remote_decode and req.blocks.blocks:
            # a prefill for a remote decode: its blocks stay held until a decoder reads them
            blocks, req.blocks = req.blocks, ReqBlocks()
            req.kv_block_ids = self.kv_pins.pin(req.req_id, blocks, req.num_computed, now + self.cfg.kv_pin_timeout)
        else:
            self.pool.free(req.blocks)
        self._by_id.pop(req.req_id, None)
        if self.sink:
            self.sink.request_finished(req, now)


class _EventExtra:
    """Lazy per-block event extra_keys, computed only for blocks that get stored."""

    __slots__ = ("req",)

    def __init__(self, req: SimRequest) -> None:
        self.req = req

    def __getitem__(self, s: slice) -> list[object]:
        fn = self.req.lora_event_extra
        idx = range(*s.indices(1 << 30))
        return [fn(i) if fn else None for i in idx]
