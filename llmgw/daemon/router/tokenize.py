"""Tier 2's step on the request path: the prompt's KV block hashes, for models whose deploy
profile has ``kv_events`` on (others skip this step entirely: no added latency).

The request's prompt (chat ``messages`` or a completion's string ``prompt``) is tokenized by one
of the model's replicas (vLLM's ``POST /tokenize``: the engine renders the chat template exactly
as it will for the request), within ``TIMEOUT_S``; the full blocks are hashed with the scheme of
the vLLM release that replica runs (``GET /version``, once per replica: engine_versions.py), as a
kv_events engine is started (``sha256_cbor``, its PYTHONHASHSEED, the block size its scrape
reports, else 16), with the request's ``cache_salt`` and LoRA adapter, and put in
``RequestInfo.kv_hashes`` in the events' 64-bit int form — the leading ones, as far as any replica
holds them (below); ``RequestInfo.kv_blocks`` is the prompt's full block count.

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
:attr:`Tier2Tokenizer.outcomes`.
"""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.config import Config
from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool
from llmgw.daemon.router.engine_versions import EngineVersions
from llmgw.fleet.engine_cmd import KV_HASH_ALGO, KV_HASH_SEED
from llmgw.kv.hashing import LORA_NAME_KEY_SINCE, HashContext, LoRA, VllmVersion
from llmgw.kv.prefix_chains import PrefixChains
from llmgw.route.dispatch import Plan

__all__ = ["OUTCOMES", "TIMEOUT_S", "Tier2Metrics", "Tier2Tokenizer"]

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


class Tier2Tokenizer:
    def __init__(self, cfg: Config, pool: UpstreamPool, *, timeout: float = TIMEOUT_S,
                 cache_entries: int = CACHE_ENTRIES) -> None:
        self.pool = pool
        self.timeout = timeout
        kv_models = [m for m in cfg.models if m.deploy is not None and m.deploy.kv_events]
        self.seeds = {m.name: _seed(m.deploy.env) for m in kv_models}  # type: ignore[union-attr]
        # (model, adapter) -> where the agent loads it from (vLLM's lora_path)
        self.adapters = {(m.name, a.name): a.source for m in kv_models for a in getattr(m, "adapters", ())}
        self.versions = EngineVersions(pool, timeout=timeout)
        self.cache: OrderedDict[bytes, _Cached] = OrderedDict()
        self.cache_entries = cache_entries
        self.cache_bytes = CACHE_BYTES
        self.cached_hashes = 0  # the hashes the cache holds ...
        self.cached_bytes = 0  # ... and their cost, with the partial entries' token ids (_Cached.cost)
        self.chains = PrefixChains()
        # "does any replica hold this block?" — the router's index (RouterKvIndex.holds_any), set
        # once the control plane has one: hashing stops where no replica's run can reach. None:
        # every block is hashed.
        self.held_any: Callable[[int], bool] | None = None
        self.contexts: dict[tuple[VllmVersion, int, str], HashContext] = {}
        self.outcomes: Counter[str] = Counter({o: 0 for o in OUTCOMES})
        self.hash_seconds = 0.0  # CPU spent hashing (the chains' cost), for the metrics

    def wants(self, plan: Plan) -> bool:
        """A kv_events model's request under a strategy that weighs tier 2 (``kv_cache``): only
        then are hashes worth their cost — and only then may tier 1 stand aside for tier 2."""
        return plan.entry.name in self.seeds and plan.strategy.weights.get("kv_cache", 0.0) > 0.0

    def _fail(self, plan: Plan, outcome: str, why: str) -> None:
        self.outcomes[outcome] += 1
        plan.info.kv_note = why
        plan.info.kv_outcome = outcome

    def _lora(self, plan: Plan, version: VllmVersion) -> LoRA | str:
        name = plan.info.adapter
        assert name is not None
        path = self.adapters.get((plan.entry.name, name))
        if path is None:
            return f"adapter {name} is not in the model's [[models.adapters]]: its LoRA path is unknown"
        if version < LORA_NAME_KEY_SINCE:
            return f"vLLM {version} hashes an adapter by the id the engine assigned it"
        return LoRA(name, None, path)

    async def annotate(self, plan: Plan) -> None:
        """Set ``plan.info.kv_hashes`` (or ``kv_note``): never raises for the engine's faults."""
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
        version = await self.versions.get(rep.id, rep.view.url)
        if isinstance(version, str):
            return self._fail(plan, "version", version)
        lora: LoRA | str | None = None if info.adapter is None else self._lora(plan, version)
        if isinstance(lora, str):
            return self._fail(plan, "unsupported", lora)
        scrape = rep.last_scrape
        bs = scrape.block_size if scrape is not None and scrape.block_size else DEFAULT_BLOCK_SIZE
        body = json.dumps(req, separators=(",", ":"), sort_keys=True).encode()
        ident = json.dumps([bs, info.cache_salt, str(version), lora and list(lora)]).encode()
        key = hashlib.sha256(ident + b"\0" + body).digest()
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            self.outcomes["cached"] += 1
            if hit.ids is not None and (self.held_any is None or self.held_any(hit.hashes[-1])):
                # partial, and an engine now holds its last block (it stored the prompt): extend
                self._extend(key, hit, self._context(version, bs, self.seeds[plan.entry.name]), lora,
                             info.cache_salt)
            info.kv_hashes, info.kv_blocks = hit.hashes, hit.blocks
            return None
        with trio.move_on_after(self.timeout) as scope:
            try:
                reply = await self.pool.request(rep.view.url, "POST", "/tokenize",
                                                [("content-type", "application/json")], body,
                                                max_body_bytes=MAX_ANSWER_BYTES)
            except UpstreamError as e:
                return self._fail(plan, "error", f"tokenize on {rep.id} failed ({type(e).__name__})")
        if scope.cancelled_caught:
            return self._fail(plan, "timeout", f"tokenize on {rep.id} timed out after {self.timeout:g} s")
        if reply.status != 200:
            return self._fail(plan, "error", f"tokenize on {rep.id} answered {reply.status}")
        try:
            tokens = json.loads(reply.body)["tokens"]
            if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS:
                raise ValueError
            ids = array("I", tokens)  # raises for anything but ints in 0..2^32-1, at C speed ...
            if (ids.count(0) or ids.count(1)) and any(type(t) is bool for t in tokens):
                raise ValueError  # ... except JSON true/false, which it takes for 1 and 0
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            return self._fail(plan, "garbage", f"tokenize on {rep.id} answered garbage")
        ctx = self._context(version, bs, self.seeds[plan.entry.name])
        t0 = time.perf_counter()
        blocks = min(len(tokens) // bs, MAX_BLOCKS)
        end = blocks * bs
        hashes = self.chains.hashes(ctx, tokens[:end], lora, info.cache_salt, ids=ids[:end],
                                    held_any=self.held_any)
        self.hash_seconds += time.perf_counter() - t0
        self.outcomes["ok"] += 1
        info.kv_hashes, info.kv_blocks = hashes, blocks
        entry = _Cached(hashes, blocks, ids[:end] if len(hashes) < blocks else None)
        self.cache[key] = entry
        self.cached_hashes += len(hashes)
        self.cached_bytes += entry.cost
        while len(self.cache) > self.cache_entries or self.cached_bytes > self.cache_bytes:
            old = self.cache.popitem(last=False)[1]
            self.cached_hashes -= len(old.hashes)
            self.cached_bytes -= old.cost
        return None

    def _extend(self, key: bytes, entry: _Cached, ctx: HashContext, lora: LoRA | None, salt: str | None) -> None:
        """Hash a cached partial entry further, through the remembered chains (only the blocks
        after the ones hashed before are hashed, while the chain is still remembered)."""
        assert entry.ids is not None
        t0 = time.perf_counter()
        hashes = self.chains.hashes(ctx, entry.ids, lora, salt, ids=entry.ids, held_any=self.held_any)
        self.hash_seconds += time.perf_counter() - t0
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


class Tier2Metrics(Collector):
    """llmgw_kv_tokenize_total{outcome}, llmgw_kv_tokenize_cache_entries, llmgw_kv_hash_blocks_total{how},
    llmgw_kv_hash_seconds_total."""

    def __init__(self, t: Tier2Tokenizer) -> None:
        self.t = t

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily("llmgw_kv_tokenize", "Tier 2's tokenize step per request of a kv_events model, "
                                "by outcome (ok, cached; else tier 1 decided).", labels=["outcome"])
        for o in OUTCOMES:
            c.add_metric([o], float(self.t.outcomes[o]))
        yield c
        g = GaugeMetricFamily("llmgw_kv_tokenize_cache_entries", "Prompts whose block hashes tier 2 keeps.")
        g.add_metric([], float(len(self.t.cache)))
        yield g
        b = CounterMetricFamily("llmgw_kv_hash_blocks", "Tier 2's prompt blocks by how their hash was had: "
                                "hashed, reused from a prompt with the same leading tokens, or skipped (no "
                                "replica held the block before them).", labels=["how"])
        b.add_metric(["hashed"], float(self.t.chains.hashed_blocks))
        b.add_metric(["reused"], float(self.t.chains.reused_blocks))
        b.add_metric(["skipped"], float(self.t.chains.skipped_blocks))
        yield b
        yield CounterMetricFamily("llmgw_kv_hash_seconds", "CPU seconds tier 2 spent hashing prompt blocks.",
                                  value=self.t.hash_seconds)
