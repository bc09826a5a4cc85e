"""The llama.cpp simulator's core: llama-server's slots, prompt cache and batching on a virtual clock.

Pure like the vLLM core: `schedule(now)` returns a plan with a `duration`, the shell waits it out and
calls `complete(plan, now)`, which returns per-request `Output`s. What it reproduces of llama-server
(tools/server/server-context.cpp, checked against a real build):

- `-np` slots of `n_ctx` tokens each; a slot keeps the tokens of its last prompt + generation (its KV).
- Slot choice: a pinned `id_slot`, else among idle slots the one whose kept tokens share the longest
  prefix with the prompt if lcp/len(prompt) > --slot-prompt-similarity, else the least recently used
  idle slot (ties go to the highest id, as llama.cpp's `<=` scan does). No idle slot: the request is
  deferred (requests_deferred) until one is released.
- Reuse = the LCP with the slot's kept tokens (cache_prompt), minus one when the whole prompt matches:
  llama.cpp evaluates at least the last prompt token. A prompt of n_ctx tokens or more fails in the
  slot with exceed_context_size_error.
- LoRA: a slot remembers the scale vector it last ran with. A request with a `lora` list builds a
  vector (ids left out get 0, unknown ids are ignored); if it differs from the slot's, the slot's KV is
  cleared. A request without one silently takes the global scales and keeps the KV (the quirk).
- Batching: each step decodes one token for every generating slot, then fills the rest of n_batch
  with prompt tokens; slots whose LoRA vectors differ are not batched together.
- The host-RAM prompt cache (--cache-ram, server_prompt_cache): when a slot is chosen by LRU, or
  its LCP keeps under half of its tokens, its tokens are saved to the cache and the cached prompt that
  best matches the new one (keeping >= 1/4 of itself) is loaded into the slot; each launch also saves
  the idle slots. Oldest entries go first beyond the byte limit (tokens x --sim-kv-bytes-per-token)
  and beyond max(n_ctx, limit / bytes per token) tokens. Saving and loading cost no time here.
- Launch is its own zero-duration step, so a stream gets its headers (or its error) before the
  prompt is computed, as llama-server sends them.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from llmgw.sim.textstream import TextStream
from llmgw.sim.tokenizer import OUTPUT_WORDS, Tokenizer

__all__ = ["LlamaConfig", "LlamaCore", "LlamaRequest", "LoraAdapter", "Slot", "Output", "Plan", "Metrics",
           "common_prefix"]


@dataclass(frozen=True)
class LlamaConfig:
    n_slots: int = 1
    n_ctx: int = 4096  # per slot
    n_batch: int = 2048
    slot_prompt_similarity: float = 0.1
    prefill_s_per_token: float = 0.0
    decode_s_per_step: float = 0.0
    decode_s_per_seq: float = 0.0
    default_output_len: int = 64  # where the simulated model "emits EOS" unless ignore_eos
    seed: int = 0
    cache_ram_mib: int = 0  # --cache-ram: 0 = no host prompt cache, < 0 = no byte limit
    cache_tokens: int = 4096  # the cache's token limit: the server's whole n_ctx
    kv_bytes_per_token: int = 131072  # one token's KV state (an 8B GQA model at f16)


class PromptCache:
    """server_prompt_cache: whole prompts saved from slots into host RAM, oldest first out."""

    def __init__(self, limit_mib: int, limit_tokens: int, bytes_per_token: int) -> None:
        self.limit_bytes = max(0, limit_mib) << 20  # 0: no byte limit
        self.limit_tokens = limit_tokens
        self.bpt = max(1, bytes_per_token)
        self.states: list[list[int]] = []

    def n_tokens(self) -> int:
        return sum(len(t) for t in self.states)

    def save(self, tokens: list[int]) -> bool:
        """alloc(): skip a prompt the cache already holds whole; drop the entries it extends."""
        if not tokens or any(common_prefix(t, tokens) == len(tokens) for t in self.states):
            return False
        new = len(tokens) * self.bpt
        if self.limit_bytes and new > self.limit_bytes:
            return False
        self.states = [t for t in self.states if common_prefix(t, tokens) != len(t)]
        while self.states and self.limit_bytes and (self.n_tokens() * self.bpt + new) > self.limit_bytes:
            self.states.pop(0)
        self.states.append(list(tokens))
        return True

    def load(self, current: list[int], prompt: list[int]) -> list[int] | None:
        """The cached prompt that keeps more of itself and matches more of `prompt` than `current`."""
        lcp = common_prefix(current, prompt)
        keep_best = lcp / len(current) if current else -1.0
        sim_best = lcp / len(prompt)
        best = -1
        for i, t in enumerate(self.states):
            n = common_prefix(t, prompt)
            keep, sim = n / len(t), n / len(prompt)
            if keep >= 0.25 and keep > keep_best and sim > sim_best:  # don't trash large prompts
                best, keep_best, sim_best = i, keep, sim
        return self.states.pop(best) if best >= 0 else None

    def update(self) -> None:
        while self.states and self.limit_bytes and self.n_tokens() * self.bpt > self.limit_bytes:
            self.states.pop(0)
        limit = max(self.limit_tokens, self.limit_bytes // self.bpt) if self.limit_bytes else self.limit_tokens
        while self.states and limit and self.n_tokens() > limit:
            self.states.pop(0)


@dataclass
class LoraAdapter:
    id: int
    path: str
    scale: float


@dataclass(eq=False)
class LlamaRequest:
    req_id: str
    prompt: list[int]
    n_predict: int = -1  # -1: until EOS or the slot's context is full
    cache_prompt: bool = True
    id_slot: int = -1
    lora: dict[int, float] | None = None  # the request's `lora` list; None or {} = none given
    ignore_eos: bool = False
    text: TextStream = field(default_factory=TextStream)
    seed: int | None = None
    params: dict[str, object] = field(default_factory=dict)  # shown in /slots
    arrival: float = 0.0
    # state
    id_task: int = -1
    slot: int = -1
    output: list[int] = field(default_factory=list)
    n_cached: int = 0
    n_processed: int = 0
    t_start: float = 0.0
    t_prompt_last: float = 0.0
    t_gen_last: float = 0.0
    started: bool = False  # has a slot (streams may send their headers)
    finished: bool = False
    stop_type: str = "none"  # none | eos | limit | word
    error: tuple[str, str] | None = None  # (type, message) of a request the slot rejected
    n_kept: int = 0  # the slot's KV length when the request ended (tokens_cached)
    truncated: bool = False  # stopped because the slot's context was full
    _natural_len: int = 0
    _rng: random.Random | None = None

    @property
    def n_gen(self) -> int:
        return len(self.output)

    def timings(self) -> dict[str, float | int]:
        """llama.cpp's server_slot_stats::to_json."""
        prompt_ms = (self.t_prompt_last - self.t_start) * 1e3 if self.t_prompt_last else 0.0
        gen_ms = max(1e-3, (self.t_gen_last - self.t_prompt_last) * 1e3) if self.t_gen_last else 0.0
        steps = max(0, self.n_gen - 1)  # the first token comes free with the prompt's last batch
        return {
            "cache_n": self.n_cached, "prompt_n": self.n_processed, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / self.n_processed if self.n_processed else 0.0,
            "prompt_per_second": 1e3 / prompt_ms * self.n_processed if prompt_ms > 0 else 0.0,
            "predicted_n": self.n_gen, "predicted_ms": gen_ms,
            "predicted_per_token_ms": gen_ms / steps if steps else 0.0,
            "predicted_per_second": 1e3 / gen_ms * steps if gen_ms > 0 else 0.0,
        }


@dataclass(eq=False)
class Slot:
    id: int
    n_ctx: int
    lora: tuple[float, ...]
    tokens: list[int] = field(default_factory=list)  # the KV: prompt.tokens in llama.cpp
    t_last_used: float = -1.0
    req: LlamaRequest | None = None
    prev: LlamaRequest | None = None  # task_prev: what /slots shows of an idle slot

    @property
    def is_processing(self) -> bool:
        return self.req is not None

    @property
    def shown(self) -> LlamaRequest | None:
        return self.req or self.prev


@dataclass(slots=True)
class Output:
    req: LlamaRequest
    new_tokens: list[int]
    text: str
    finished: bool


@dataclass
class Plan:
    duration: float
    decode: list[Slot]  # slots generating one token
    prefill: list[tuple[Slot, int]]  # slots and the number of prompt tokens they process
    events: list[Output]  # launches and rejections, delivered at once


@dataclass
class Metrics:
    """server_metrics: cumulative counters, plus the buckets /metrics resets at each scrape."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    prompt_cached: int = 0
    predicted_tokens: int = 0
    predicted_steps: int = 0
    predicted_seconds: float = 0.0
    n_decode: int = 0
    n_busy_slots: int = 0
    n_tokens_max: int = 0
    bucket_prompt_tokens: int = 0
    bucket_prompt_seconds: float = 0.0
    bucket_predicted_steps: int = 0
    bucket_predicted_seconds: float = 0.0

    def reset_bucket(self) -> None:
        self.bucket_prompt_tokens = self.bucket_predicted_steps = 0
        self.bucket_prompt_seconds = self.bucket_predicted_seconds = 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix; slice comparisons run in C (prompts are long)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first mismatch is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class LlamaCore:
    def __init__(self, cfg: LlamaConfig, tokenizer: Tokenizer, adapters: list[LoraAdapter] | None = None) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        self.adapters = adapters or []
        self.slots = [Slot(i, cfg.n_ctx, self.global_lora()) for i in range(cfg.n_slots)]
        self.waiting: deque[LlamaRequest] = deque()
        self.cache = PromptCache(cfg.cache_ram_mib, cfg.cache_tokens, cfg.kv_bytes_per_token) \
            if cfg.cache_ram_mib != 0 else None
        self._dirty = False  # a request arrived or a slot was released: retry the waiting ones
        self.metrics = Metrics()
        self._by_id: dict[str, LlamaRequest] = {}
        self._next_task = 0
        self._words = [self.tok.encode(w)[0] for w in OUTPUT_WORDS]

    # -- requests --------------------------------------------------------------------------
    def global_lora(self) -> tuple[float, ...]:
        return tuple(a.scale for a in self.adapters)

    def request_lora(self, lora: dict[int, float]) -> tuple[float, ...]:
        """construct_lora_list: every loaded adapter, scale from the request or 0."""
        return tuple(float(lora.get(a.id, 0.0)) for a in self.adapters)

    def set_global_scales(self, scales: dict[int, float]) -> None:
        """POST /lora-adapters: adapters left out go to 0 (same construct_lora_list)."""
        for a in self.adapters:
            a.scale = float(scales.get(a.id, 0.0))

    def add_request(self, req: LlamaRequest, now: float) -> None:
        if req.req_id in self._by_id:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        seed = req.seed if req.seed is not None else hash(tuple(req.prompt[-64:])) & 0xFFFFFFFF
        req._rng = random.Random((self.cfg.seed << 32) ^ seed)
        req._natural_len = max(1, int(self.cfg.default_output_len * (0.5 + req._rng.random())))
        req.id_task = self._next_task
        self._next_task += 1
        req.arrival = now
        self._by_id[req.req_id] = req
        self.waiting.append(req)
        self._dirty = True

    def abort(self, req_id: str, now: float) -> bool:
        """The client left: drop a deferred request, or release its slot (keeping its KV)."""
        req = self._by_id.pop(req_id, None)
        if req is None or req.finished:
            return False
        req.finished = True
        if req.slot >= 0:
            self._release(self.slots[req.slot], now)
        else:
            self.waiting.remove(req)
        return True

    def get(self, req_id: str) -> LlamaRequest | None:
        return self._by_id.get(req_id)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.is_processing for s in self.slots)

    @property
    def requests_processing(self) -> int:
        return sum(1 for s in self.slots if s.is_processing)

    @property
    def requests_deferred(self) -> int:
        return len(self.waiting)

    # -- slot choice -----------------------------------------------------------------------
    def pick_slot(self, req: LlamaRequest) -> tuple[Slot | None, bool]:
        """get_available_slot: (slot, whether to refresh it from the prompt cache). A pinned slot is
        returned even when busy (the caller defers)."""
        ret: Slot | None = None
        refresh = False
        if 0 <= req.id_slot < len(self.slots):
            ret = self.slots[req.id_slot]
        if self.cfg.slot_prompt_similarity != 0.0 and req.prompt:
            best = 0.0
            for s in self.slots:
                if (req.id_slot != -1 and s.id != req.id_slot) or s.is_processing or not s.tokens:
                    continue
                sim = common_prefix(s.tokens, req.prompt) / len(req.prompt)
                if sim > best and sim > self.cfg.slot_prompt_similarity:
                    best, ret = sim, s
            if best > 0 and ret is not None:
                refresh = best * len(req.prompt) / len(ret.tokens) < 0.5  # about to lose most of its KV
        if ret is None:
            t_last = -1.0
            for s in self.slots:
                if not s.is_processing and (ret is None or s.t_last_used <= t_last):
                    t_last, ret = s.t_last_used, s
            refresh = ret is not None
        return ret, refresh

    # -- the step --------------------------------------------------------------------------
    def schedule(self, now: float) -> Plan | None:
        events = self._launch(now)
        if events:
            return Plan(0.0, [], [], events)  # launches first, as process_single_task runs before update_slots
        busy = [s for s in self.slots if s.req is not None]
        if not busy:
            return None
        lead = busy[0].lora  # can_batch_with: one LoRA setting per batch
        decode = [s for s in busy if s.lora == lead and s.req is not None and s.req.output]
        budget = self.cfg.n_batch - len(decode)
        prefill: list[tuple[Slot, int]] = []
        for s in busy:
            r = s.req
            assert r is not None
            if s.lora != lead or r.output or budget <= 0:
                continue
            n = min(len(r.prompt) - len(s.tokens), budget)
            if not r.t_start:
                r.t_start = now
            prefill.append((s, n))
            budget -= n
        n_prefill = sum(n for _, n in prefill)
        duration = n_prefill * self.cfg.prefill_s_per_token
        if decode:
            duration += self.cfg.decode_s_per_step + len(decode) * self.cfg.decode_s_per_seq
        return Plan(duration, decode, prefill, [])

    def complete(self, plan: Plan, now: float) -> list[Output]:
        if plan.events:
            return plan.events
        m = self.metrics
        m.n_decode += 1
        m.n_busy_slots += self.requests_processing
        outputs: list[Output] = []
        n_prompt = 0
        for s in plan.decode:
            r = s.req
            if r is None or r.finished:
                continue  # aborted while the step ran
            s.tokens.append(r.output[-1])  # the sampled token enters the KV now
            outputs.append(self._token(s, r, now))
        for s, n in plan.prefill:
            r = s.req
            n_prompt += n
            if r is None or r.finished:
                continue
            s.tokens.extend(r.prompt[len(s.tokens):len(s.tokens) + n])
            r.n_processed += n
            r.t_prompt_last = now
            if len(s.tokens) < len(r.prompt):
                continue
            if r.n_predict == 0:  # the prompt is only evaluated into the cache
                r.stop_type = "limit"
                self._finish(s, r, now)
                outputs.append(Output(r, [], r.text.finish(), True))
            else:
                outputs.append(self._token(s, r, now))
        m.n_tokens_max = max([m.n_tokens_max, *(len(s.tokens) for s in self.slots)])
        if n_prompt:
            # llama.cpp times the whole llama_decode of a batch that holds prompt tokens
            m.prompt_tokens += n_prompt
            m.bucket_prompt_tokens += n_prompt
            m.prompt_seconds += plan.duration
            m.bucket_prompt_seconds += plan.duration
        return outputs

    # -- internals -------------------------------------------------------------------------
    def _launch(self, now: float) -> list[Output]:
        events: list[Output] = []
        if not self._dirty:
            return events
        self._dirty = False
        for req in list(self.waiting):
            slot, refresh = self.pick_slot(req)
            if slot is None or slot.is_processing:
                continue  # deferred: it waits for a release
            self.waiting.remove(req)
            if refresh and self.cache is not None and req.prompt:
                self.cache.save(slot.tokens)
                loaded = self.cache.load(slot.tokens, req.prompt)
                if loaded is not None:
                    slot.tokens = loaded  # the KV state restored from host RAM
                self.cache.update()
            events.append(self._start(slot, req, now))
            if self.cache is not None:  # cache_idle_slots: mirror the idle slots into host RAM
                for s in self.slots:
                    if not s.is_processing and self.cache.save(s.tokens):
                        self.cache.update()
        return events

    def _start(self, slot: Slot, req: LlamaRequest, now: float) -> Output:
        """launch_slot_with_task, then the slot's first look at its prompt in update_slots."""
        if req.lora:
            want = self.request_lora(req.lora)
            if want != slot.lora:
                # lora_should_clear_cache (no aLoRA here): a differing explicit list drops the KV.
                slot.tokens.clear()
                slot.lora = want
        else:
            slot.lora = self.global_lora()  # no list: the KV computed under other scales is kept
        slot.req = req
        req.slot = slot.id
        req.started = True
        n_prompt = len(req.prompt)
        if n_prompt >= slot.n_ctx:
            req.error = ("exceed_context_size_error",
                         f"request ({n_prompt} tokens) exceeds the available context size ({slot.n_ctx} tokens), "
                         "try increasing it")
            self._finish(slot, req, now)
            return Output(req, [], "", True)
        if not req.prompt:
            self._finish(slot, req, now)  # empty prompt: released with an empty response
            return Output(req, [], "", True)
        n_past = common_prefix(slot.tokens, req.prompt) if req.cache_prompt else 0
        if n_past == n_prompt:
            n_past -= 1  # at least one prompt token is evaluated, for its logits
        req.n_cached = n_past
        self.metrics.prompt_cached += n_past
        del slot.tokens[n_past:]
        return Output(req, [], "", False)

    def _token(self, slot: Slot, req: LlamaRequest, now: float) -> Output:
        tok = self._sample(req)
        req.output.append(tok)
        req.t_gen_last = now
        text = ""
        if tok == self.tok.eos_id:
            req.stop_type = "eos"
        else:
            text = req.text.feed(self.tok.token_str(tok))
            if req.text.stopped_on is not None:
                req.stop_type = "word"
            elif len(slot.tokens) + 1 >= slot.n_ctx:
                req.stop_type, req.truncated = "limit", True
            elif req.n_predict >= 0 and req.n_gen >= req.n_predict:
                req.stop_type = "limit"
        if req.stop_type != "none":
            text += req.text.finish()
            self._finish(slot, req, now)
        return Output(req, [tok], text, req.finished)

    def _sample(self, req: LlamaRequest) -> int:
        assert req._rng is not None
        if not req.ignore_eos and req.n_gen + 1 >= req._natural_len:
            return self.tok.eos_id
        return self._words[req._rng.randrange(len(self._words))]

    def _finish(self, slot: Slot, req: LlamaRequest, now: float) -> None:
        req.finished = True
        req.n_kept = len(slot.tokens)
        self._by_id.pop(req.req_id, None)
        if req.n_gen:
            m = self.metrics
            steps = req.n_gen - 1
            secs = max(1e-6, req.t_gen_last - req.t_prompt_last)
            m.predicted_tokens += req.n_gen
            m.predicted_steps += steps
            m.predicted_seconds += secs
            m.bucket_predicted_steps += steps
            m.bucket_predicted_seconds += secs
        self._release(slot, now)

    def _release(self, slot: Slot, now: float) -> None:
        slot.prev = slot.req
        slot.req = None
        slot.t_last_used = now
        self._dirty = True
