"""Tier 2's step on the request path: the prompt's KV block hashes, for models whose deploy
profile has ``kv_events`` on (others skip this step entirely: no added latency).

The request's prompt (chat ``messages`` or a completion's string ``prompt``) is tokenized by one
of the model's replicas (vLLM's ``POST /tokenize``: the engine renders the chat template exactly
as it will for the request), within ``TIMEOUT_S``; the full blocks are hashed with the scheme a
kv_events engine runs with (``sha256_cbor``, its PYTHONHASHSEED, the block size its scrape
reports, else 16) and the request's ``cache_salt``, and put in ``RequestInfo.kv_hashes`` in the
events' 64-bit int form. A bounded LRU keyed by a digest of what was tokenized (model, prompt,
template flags, block size, salt) spares a repeated prompt the round trip.

Every failure — no replica, timeout, an error answer, garbage, too many tokens, an adapter (its
LoRA id is the engine's, unknown here) — leaves no hashes and a reason in ``kv_note``: the
decision falls back to tier 1 and its note says why. Counted in :attr:`Tier2Tokenizer.outcomes`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import trio

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.config import Config
from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool
from llmgw.fleet.engine_cmd import KV_HASH_ALGO, KV_HASH_SEED
from llmgw.kv.hashing import HashContext, event_hash
from llmgw.route.dispatch import Plan

__all__ = ["Tier2Tokenizer", "Tier2Metrics", "OUTCOMES", "TIMEOUT_S"]

TIMEOUT_S = 0.5  # a /tokenize slower than this is not worth waiting for: tier 1 decides
CACHE_ENTRIES = 1024  # prompts whose hashes are kept for a repeat
CACHE_HASHES = 1 << 18  # ... and at most this many hashes in all (~12 MB)
MAX_BLOCKS = 4096  # the leading blocks hashed (64k tokens at 16): the share is of these
MAX_TOKENS = 1 << 20  # an answer with more tokens than this is garbage
MAX_ANSWER_BYTES = 16 << 20
DEFAULT_BLOCK_SIZE = 16
# The vLLM release the hashing follows (the simulator's default; 0.31+ hash alike for sha256_cbor).
VLLM_VERSION = "0.33.0"
# llmgw_tier2_tokenize_total{outcome}
OUTCOMES = ("ok", "cached", "timeout", "error", "garbage", "no_replica", "unsupported")
_TEMPLATE_KEYS = ("add_generation_prompt", "continue_final_message", "chat_template",
                  "chat_template_kwargs", "add_special_tokens", "tools")


def _seed(env: tuple[str, ...]) -> str:
    for kv in env:
        k, _, v = kv.partition("=")
        if k == "PYTHONHASHSEED":
            return v
    return KV_HASH_SEED


class Tier2Tokenizer:
    def __init__(self, cfg: Config, pool: UpstreamPool, *, timeout: float = TIMEOUT_S,
                 cache_entries: int = CACHE_ENTRIES) -> None:
        self.pool = pool
        self.timeout = timeout
        self.seeds = {m.name: _seed(m.deploy.env) for m in cfg.models
                      if m.deploy is not None and m.deploy.kv_events}
        self.cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self.cache_entries = cache_entries
        self.cached_hashes = 0
        self.contexts: dict[tuple[int, str], HashContext] = {}
        self.outcomes: Counter[str] = Counter({o: 0 for o in OUTCOMES})

    def wants(self, plan: Plan) -> bool:
        return plan.entry.name in self.seeds

    def _fail(self, plan: Plan, outcome: str, why: str) -> None:
        self.outcomes[outcome] += 1
        plan.info.kv_note = why

    async def annotate(self, plan: Plan) -> None:
        """Set ``plan.info.kv_hashes`` (or ``kv_note``): never raises for the engine's faults."""
        info, obj = plan.info, plan.body or {}
        if info.adapter is not None:
            return self._fail(plan, "unsupported", "an adapter's LoRA id is the engine's own")
        if isinstance(obj.get("messages"), list):
            req: dict[str, Any] = {"model": obj.get("model"), "messages": obj["messages"]}
            req.update((k, obj[k]) for k in _TEMPLATE_KEYS if k in obj)
        elif isinstance(obj.get("prompt"), str):
            req = {"model": obj.get("model"), "prompt": obj["prompt"]}
        else:
            return self._fail(plan, "unsupported", "no chat messages or string prompt to tokenize")
        rep = next((r for r in plan.entry.replicas if r.view.available), None)
        if rep is None:
            return self._fail(plan, "no_replica", "no replica to tokenize with")
        scrape = rep.last_scrape
        bs = scrape.block_size if scrape is not None and scrape.block_size else DEFAULT_BLOCK_SIZE
        body = json.dumps(req, separators=(",", ":"), sort_keys=True).encode()
        key = hashlib.sha256(b"%d\0%s\0" % (bs, (info.cache_salt or "").encode()) + body).digest()
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            self.outcomes["cached"] += 1
            info.kv_hashes = hit
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
            if not (isinstance(tokens, list) and len(tokens) <= MAX_TOKENS
                    and all(type(t) is int and 0 <= t < 1 << 32 for t in tokens)):
                raise ValueError
        except (ValueError, KeyError, TypeError, RecursionError):
            return self._fail(plan, "garbage", f"tokenize on {rep.id} answered garbage")
        ctx = self._context(bs, self.seeds[plan.entry.name])
        head = tokens[:MAX_BLOCKS * bs]
        hashes: tuple[int, ...] = tuple(event_hash(d) for d in ctx.hash_tokens(head, None, info.cache_salt))  # type: ignore[misc]
        self.outcomes["ok"] += 1
        info.kv_hashes = hashes
        self.cache[key] = hashes
        self.cached_hashes += len(hashes)
        while len(self.cache) > self.cache_entries or self.cached_hashes > CACHE_HASHES:
            self.cached_hashes -= len(self.cache.popitem(last=False)[1])
        return None

    def _context(self, block_size: int, seed: str) -> HashContext:
        ctx = self.contexts.get((block_size, seed))
        if ctx is None:
            ctx = self.contexts[(block_size, seed)] = HashContext.create(VLLM_VERSION, KV_HASH_ALGO,
                                                                         block_size, seed)
        return ctx


class Tier2Metrics(Collector):
    """llmgw_kv_tokenize_total{outcome} and llmgw_kv_tokenize_cache_entries."""

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
