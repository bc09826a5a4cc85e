"""Tier 2's step of the core (pure): the prompt's KV block hashes, for models whose deploy profile
has ``kv_events`` on (others skip this step entirely: no added latency). RouterCore.next asks the
shell for what it cannot know itself — a :class:`Tokenize` step: an HTTP call to one replica —
and takes the answer back (RouterCore.tokenized); caching, extending and hashing happen here.

The request's prompt (chat ``messages`` or a completion's string ``prompt``) is tokenized by one
of the model's replicas (vLLM's ``POST /tokenize``: the engine renders the chat template exactly
as it will for the request), within ``TIMEOUT_S``; the full blocks are hashed with the scheme of
the vLLM release that replica runs (``GET /version``, asked once per replica and remembered:
engine_releases.py), as a kv_events engine is started (``sha256_cbor``, its PYTHONHASHSEED, the
block size its scrape reports, else 16), with the request's ``cache_salt`` and LoRA adapter, and
put in ``RequestInfo.kv_hashes`` in the events' 64-bit int form — the leading ones, as far as any
replica holds them (below); ``RequestInfo.kv_blocks`` is the prompt's full block count.

What is reused, and the rule that makes it safe:

- The **same request head** (model, messages or prompt, template options, block size, salt,
  adapter, engine release) is not tokenized again: a bounded LRU keyed by its digest holds its
  hashes.
- **Only as far as a replica can hold**: hashing stops where no replica's engine holds the block
  before (the router's index, ``held_any``; llmgw.kv.prefix_chains), so a prompt never seen costs
  one chunk of blocks, not all of them; ``RequestInfo.kv_blocks`` keeps the prompt's full block
  count for the share. A cached head whose hashes stopped short keeps its token ids (4 B a token,
  counted in the cache's bound) and, once an engine holds its last hashed block (it stored the
  prompt), is hashed further through the remembered chains — only the new blocks — rather than
  tokenized again: a ``/tokenize`` round trip costs milliseconds, extending it microseconds, and
  the ids are exactly what the engine answered for this very head.
- A **conversation's next turn** is tokenized again, whole: the router cannot render the engine's
  chat template, and a template may render earlier turns differently once a turn follows (drop an
  earlier answer's reasoning, mark the last message, number tool calls), and a tokenizer merges
  across any text boundary — so tokens are never spliced from pieces. What the next turn reuses is
  the *hashing*: the blocks whose tokens equal, token for token, those of a prompt hashed before
  keep their hashes (llmgw.kv.prefix_chains), and only the blocks after them are hashed.

LoRA: an adapter is hashed with the key its release uses (vllm-wire.md §2.5): its name (0.12 to
0.30), or ``("lora", name, path)`` from 0.31, the path being the adapter's ``source`` in
``[[models.adapters]]`` (what the agent gives vLLM as ``lora_path``). Before 0.12 the key is the
int id the engine assigned at load time, which the router cannot know: tier 1 decides. The prompt
is tokenized with the base model's name (the adapter shares its tokenizer and template).

Every failure — no replica, timeout, an error answer, garbage, too many tokens, an unknown or
unsupported engine release, an adapter the router cannot hash — leaves no hashes and a reason in
``kv_note``: the decision falls back to tier 1 and its note says why. Counted in
:attr:`Tier2.outcomes`.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from llmgw.config import Config
from llmgw.fleet.engine_cmd import KV_HASH_ALGO, KV_HASH_SEED
from llmgw.kv.hashing import LORA_NAME_KEY_SINCE, HashContext, LoRA, VllmVersion
from llmgw.kv.prefix_chains import PrefixChains

from .engine_releases import MAX_ANSWER_BYTES as VERSION_ANSWER_BYTES
from .engine_releases import EngineReleases, read_version
from .plan import Plan

__all__ = ["OUTCOMES", "TIMEOUT_S", "Tier2", "Tokenize"]

TIMEOUT_S = 0.5  # a /tokenize slower than this is not worth waiting for: tier 1 decides
CACHE_ENTRIES = 1024  # request heads whose hashes are kept for a repeat
CACHE_BYTES = 12 << 20  # ... and at most this much memory in all: their hashes, and the token ids of
HASH_BYTES = 44  # ... the partially hashed ones (a hash: a tuple slot and a 64-bit int object, measured)
MAX_BLOCKS = 4096  # the leading blocks hashed (64k tokens at 16): the share is of these
MAX_TOKENS = 1 << 20  # an answer with more tokens than this is garbage
MAX_ANSWER_BYTES = 16 << 20
DEFAULT_BLOCK_SIZE = 16
# llmgw_kv_tokenize_total{outcome}
OUTCOMES = ("ok", "cached", "timeout", "error", "garbage", "no_replica", "version", "unsupported")
_TEMPLATE_KEYS = ("add_generation_prompt", "continue_final_message", "chat_template",
                  "chat_template_kwargs", "add_special_tokens", "tools")


@dataclass(frozen=True, slots=True, eq=False)
class Tokenize:
    """The core's ask of the shell: ``POST path`` with `body` (``GET`` when `body` is None) to
    replica `rid` at `url`, within `timeout` seconds, reading at most `max_bytes`. The shell
    answers with ``RouterCore.tokenized(plan, step, status, body, error)`` — the answer's
    status and body, or (status None) ``error``: "timeout" or the failure's name — and asks
    ``next`` again. The rest is the core's own, for when the answer comes."""

    rid: str
    url: str
    path: str  # "/version" (the release to hash for is not known yet) or "/tokenize"
    body: bytes | None
    timeout: float
    max_bytes: int
    key: bytes = b""  # the request head's digest (the cache's key)
    version: VllmVersion | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    lora: LoRA | None = None


_sorted = msgspec.json.Encoder(order="sorted").encode


def _key_bytes(req: dict[str, Any]) -> bytes:
    """The head's canonical bytes for the cache key, every request (a repeat is found by them):
    msgspec's sorted encoding, several times json's speed on a long prompt; json's where msgspec
    cannot encode (a lone surrogate). NaN and ±inf encode as null there, which only a body that
    spells them (not JSON) can hold: such a head may share its key with null's — a routing hint."""
    try:
        return _sorted(req)
    except (TypeError, ValueError, UnicodeEncodeError, OverflowError):
        return json.dumps(req, separators=(",", ":"), sort_keys=True).encode()


def _seed(env: tuple[str, ...]) -> str:
    for kv in env:
        k, _, v = kv.partition("=")
        if k == "PYTHONHASHSEED":
            return v
    return KV_HASH_SEED


@dataclass(slots=True)
class _Cached:
    """A request head's hashes; ``ids`` (its full blocks' tokens) while they are partial, to
    extend them once an engine holds their last block."""

    hashes: tuple[int, ...]
    blocks: int  # the prompt's full blocks (RequestInfo.kv_blocks)
    ids: array[int] | None

    @property
    def cost(self) -> int:
        return len(self.hashes) * HASH_BYTES + (0 if self.ids is None else len(self.ids) * self.ids.itemsize)


class Tier2:
    """`clock`: seconds for measuring (the hashing's CPU, the step's time), injected; None: not
    measured. `observe` (the shell's histogram): called with each request's step time, from its
    first ask to its end (a cached head's: microseconds)."""

    def __init__(self, cfg: Config, *, timeout: float = TIMEOUT_S, cache_entries: int = CACHE_ENTRIES,
                 clock: Callable[[], float] | None = None) -> None:
        self.timeout = timeout
        kv_models = [m for m in cfg.models if m.deploy is not None and m.deploy.kv_events]
        self.seeds = {m.name: _seed(m.deploy.env) for m in kv_models}  # type: ignore[union-attr]
        # (model, adapter) -> where the agent loads it from (vLLM's lora_path)
        self.adapters = {(m.name, a.name): a.source for m in kv_models for a in getattr(m, "adapters", ())}
        self.releases = EngineReleases()
        self.cache: OrderedDict[bytes, _Cached] = OrderedDict()
        self.cache_entries = cache_entries
        self.cache_bytes = CACHE_BYTES
        self.cached_hashes = 0  # the hashes the cache holds ...
        self.cached_bytes = 0  # ... and their cost, with the partial entries' token ids (_Cached.cost)
        self.chains = PrefixChains()
        # "does any replica hold this block?" — the router's index (RouterKvIndex.holds_any):
        # hashing stops where no replica's run can reach. None: every block is hashed.
        self.held_any: Callable[[int], bool] | None = None
        self.contexts: dict[tuple[VllmVersion, int, str], HashContext] = {}
        self.outcomes: Counter[str] = Counter({o: 0 for o in OUTCOMES})
        self.hash_seconds = 0.0  # CPU spent hashing (the chains' cost), for the metrics
        self.clock = clock
        self.observe: Callable[[float], None] | None = None

    def wants(self, plan: Any) -> bool:
        """A kv_events model's request under a strategy that weighs tier 2 (``kv_cache``): only
        then are hashes worth their cost — and only then may tier 1 stand aside for tier 2."""
        return plan.entry.name in self.seeds and plan.strategy.weights.get("kv_cache", 0.0) > 0.0

    # -- the step -----------------------------------------------------------------------------
    def step(self, plan: Plan, now: float) -> Tokenize | None:
        """What to ask the shell, or None: the step is over (``plan.info`` has the hashes or a
        ``kv_note``). Never raises for the engine's faults."""
        if self.clock is not None and plan.tier2_started is None:
            plan.tier2_started = self.clock()
        info, obj = plan.info, plan.body or {}
        model = plan.entry.name if info.adapter is not None else obj.get("model")
        if isinstance(obj.get("messages"), list):
            req: dict[str, Any] = {"model": model, "messages": obj["messages"]}
            req.update((k, obj[k]) for k in _TEMPLATE_KEYS if k in obj)
        elif isinstance(obj.get("prompt"), str):
            req = {"model": model, "prompt": obj["prompt"]}
        else:
            return self._fail(plan, "unsupported", "no chat messages or string prompt to tokenize")
        rep = next((r for r in plan.entry.replicas if r.view.available), None)
        if rep is None:
            return self._fail(plan, "no_replica", "no replica to tokenize with")
        url = rep.view.url
        version = self.releases.get(url, now)
        if version is None:
            return Tokenize(rep.id, url, "/version", None, self.timeout, VERSION_ANSWER_BYTES)
        if isinstance(version, str):
            return self._fail(plan, "version", version)
        lora: LoRA | str | None = None if info.adapter is None else self._lora(plan, version)
        if isinstance(lora, str):
            return self._fail(plan, "unsupported", lora)
        scrape = rep.last_scrape
        bs = scrape.block_size if scrape is not None and scrape.block_size else DEFAULT_BLOCK_SIZE
        ident = json.dumps([bs, info.cache_salt, str(version), lora and list(lora)]).encode()
        h = hashlib.sha256(ident)
        h.update(b"\0")
        h.update(_key_bytes(req))
        key = h.digest()
        hit = self.cache.get(key)
        if hit is None:  # the engine's body (json's: what vLLM is sent, byte for byte as before)
            body = json.dumps(req, separators=(",", ":"), sort_keys=True).encode()
            return Tokenize(rep.id, url, "/tokenize", body, self.timeout, MAX_ANSWER_BYTES, key, version, bs, lora)
        self.cache.move_to_end(key)
        self.outcomes["cached"] += 1
        if hit.ids is not None and (self.held_any is None or self.held_any(hit.hashes[-1])):
            # partial, and an engine now holds its last block (it stored the prompt): extend
            self._extend(hit, self._context(version, bs, self.seeds[plan.entry.name]), lora, info.cache_salt)
        info.kv_hashes, info.kv_blocks = hit.hashes, hit.blocks
        return self._done(plan)

    def answer(self, plan: Plan, ask: Tokenize, status: int | None, body: bytes, error: str, now: float) -> None:
        """The shell's answer to `ask` (see :class:`Tokenize`)."""
        if ask.path == "/version":  # the next step hashes, or says why not
            self.releases.put(ask.url, read_version(ask.rid, ask.timeout, status, body, error), now)
            return None
        info = plan.info
        if status is None:
            if error == "timeout":
                return self._fail(plan, "timeout", f"tokenize on {ask.rid} timed out after {ask.timeout:g} s")
            return self._fail(plan, "error", f"tokenize on {ask.rid} failed ({error})")
        if status != 200:
            return self._fail(plan, "error", f"tokenize on {ask.rid} answered {status}")
        try:
            tokens = json.loads(body)["tokens"]
            if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS:
                raise ValueError
            ids = array("I", tokens)  # raises for anything but ints in 0..2^32-1, at C speed ...
            if (ids.count(0) or ids.count(1)) and any(type(t) is bool for t in tokens):
                raise ValueError  # ... except JSON true/false, which it takes for 1 and 0
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            return self._fail(plan, "garbage", f"tokenize on {ask.rid} answered garbage")
        assert ask.version is not None
        bs = ask.block_size
        ctx = self._context(ask.version, bs, self.seeds[plan.entry.name])
        blocks = min(len(tokens) // bs, MAX_BLOCKS)
        end = blocks * bs
        hashes = self._hash(ctx, tokens[:end], ask.lora, info.cache_salt, ids[:end])
        self.outcomes["ok"] += 1
        info.kv_hashes, info.kv_blocks = hashes, blocks
        entry = _Cached(hashes, blocks, ids[:end] if len(hashes) < blocks else None)
        old = self.cache.pop(ask.key, None)  # two requests of one head asked at once: the last answer stays
        if old is not None:
            self.cached_hashes -= len(old.hashes)
            self.cached_bytes -= old.cost
        self.cache[ask.key] = entry
        self.cached_hashes += len(hashes)
        self.cached_bytes += entry.cost
        while len(self.cache) > self.cache_entries or self.cached_bytes > self.cache_bytes:
            old = self.cache.popitem(last=False)[1]
            self.cached_hashes -= len(old.hashes)
            self.cached_bytes -= old.cost
        self._done(plan)
        return None

    # -- the parts ----------------------------------------------------------------------------
    def _done(self, plan: Plan) -> None:
        plan.tier2 = False
        if self.clock is not None and self.observe is not None and plan.tier2_started is not None:
            self.observe(self.clock() - plan.tier2_started)

    def _fail(self, plan: Plan, outcome: str, why: str) -> None:
        self.outcomes[outcome] += 1
        plan.info.kv_note = why
        plan.info.kv_outcome = outcome
        self._done(plan)

    def _lora(self, plan: Plan, version: VllmVersion) -> LoRA | str:
        name = plan.info.adapter
        assert name is not None
        path = self.adapters.get((plan.entry.name, name))
        if path is None:
            return f"adapter {name} is not in the model's [[models.adapters]]: its LoRA path is unknown"
        if version < LORA_NAME_KEY_SINCE:
            return f"vLLM {version} hashes an adapter by the id the engine assigned it"
        return LoRA(name, None, path)

    def _hash(self, ctx: HashContext, tokens: Any, lora: LoRA | None, salt: str | None,
              ids: array[int]) -> tuple[int, ...]:
        clock = self.clock
        t0 = clock() if clock is not None else 0.0
        hashes = self.chains.hashes(ctx, tokens, lora, salt, ids=ids, held_any=self.held_any)
        if clock is not None:
            self.hash_seconds += clock() - t0
        return hashes

    def _extend(self, entry: _Cached, ctx: HashContext, lora: LoRA | None, salt: str | None) -> None:
        """Hash a cached partial entry further, through the remembered chains (only the blocks
        after the ones hashed before are hashed, while the chain is still remembered)."""
        assert entry.ids is not None
        hashes = self._hash(ctx, entry.ids, lora, salt, entry.ids)
        self.cached_hashes -= len(entry.hashes)
        self.cached_bytes -= entry.cost
        entry.hashes = hashes
        if len(hashes) >= entry.blocks:
            entry.ids = None
        self.cached_hashes += len(hashes)
        self.cached_bytes += entry.cost

    def _context(self, version: VllmVersion, block_size: int, seed: str) -> HashContext:
        ctx = self.contexts.get((version, block_size, seed))
        if ctx is None:
            if len(self.contexts) >= 64:  # releases x block sizes x seeds: a handful in practice
                self.contexts.clear()
            ctx = self.contexts[(version, block_size, seed)] = HashContext.create(version, KV_HASH_ALGO,
                                                                                  block_size, seed)
        return ctx
