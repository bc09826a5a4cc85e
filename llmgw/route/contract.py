"""The METRIC CONTRACT per engine kind: what the router reads from an engine's /metrics, and how.

Pure: samples in (from `llmgw.route.prom`), a `ScrapeResult` out. A missing mandatory metric is an
entry in `ScrapeResult.errors` (e.g. "missing mandatory metric vllm:num_requests_running"), never
an exception; the shell decides what an endpoint with errors means (stale, unroutable...).

vLLM (vllm-wire.md §3; every per-engine sample has labels model_name and engine)
  mandatory  running   vllm:num_requests_running      summed over all samples (DP engines)
             waiting   vllm:num_requests_waiting      summed
             kv_usage  vllm:kv_cache_usage_perc, else vllm:gpu_cache_usage_perc (≤ 0.11)
                       averaged over the samples (DP engines); a fraction 0..1
  optional   finished_total  vllm:request_success_total, summed over finished_reason (stop, length,
                       abort, error, repetition) and engines: every request that left the engine,
                       aborted ones included, since each freed its slot — the drain rate's input.
             prefix cache    vllm:prefix_cache_queries_total / _hits_total, else the old
                       vllm:gpu_prefix_cache_queries_total / _hits_total (tokens; never mixed)
             capacity        vllm:cache_config_info labels num_gpu_blocks × block_size, summed over
                       distinct engine label values
             LoRA            vllm:lora_requests_info: the sample with the largest value (its value is
                       the update time): max_lora, running/waiting adapter names
llama.cpp (llamacpp.md)
  mandatory  running   llamacpp:requests_processing
             waiting   llamacpp:requests_deferred
  kv_usage   current builds have NO KV-cache metric. Stand-in: kv_usage is None (the scheduler treats
             None as neutral) and the capacity measure is the slot count from /slots or -np, which
             the shell knows, not /metrics. An older build's llamacpp:kv_cache_usage_ratio is used
             when present. Not mandatory — unless the model config overrides the kv_usage name.
  finished   None: llama.cpp counts tokens and decode calls (tokens_predicted_total, n_decode_total)
             but no finished requests, and tokens are not requests. The shell feeds `DrainRate`
             with its own count of requests completed on that endpoint instead.
  prefix     queries = llamacpp:prompt_tokens_total (processed, excludes cached)
                       + llamacpp:prompt_tokens_cached_total; hits = prompt_tokens_cached_total.

Overrides (config `models[].metrics`, `MetricNames`): every name the contract reads can be
replaced for a model — `running`, `waiting`, `kv_usage`, `finished`, `prefix_queries` with
`prefix_hits` (a pair: both or neither; for llama.cpp `prefix_queries` names the uncached-tokens
counter, as above), `cache_info`, `lora_info`. An overridden name replaces every default
spelling of its role and is mandatory (the operator named it: its absence is an error on the
endpoint, never a silent fallback), whatever the role's default status.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from llmgw.route.prom import NotPrometheusText, ParseResult, Sample, index, parse

__all__ = ["MetricContract", "CONTRACTS", "contract_for", "ScrapeResult", "evaluate", "scrape",
           "DrainRate", "NameOverrides", "ROLES"]

VLLM, LLAMACPP = "vllm", "llamacpp"
_KV_SLACK = 1e-6  # kv usage this far above 1 is clamped; further above is an error


class NameOverrides(Protocol):
    running: str | None
    waiting: str | None
    kv_usage: str | None
    finished: str | None
    prefix_queries: str | None
    prefix_hits: str | None
    cache_info: str | None
    lora_info: str | None


ROLES = ("running", "waiting", "kv_usage", "finished", "prefix_queries", "prefix_hits", "cache_info", "lora_info")


@dataclass(frozen=True, slots=True)
class MetricContract:
    kind: str
    running: str
    waiting: str
    kv_usage: tuple[str, ...]  # candidates, the first present wins; () = the kind has none
    kv_mandatory: bool
    finished: str | None  # cumulative finished-request counter, summed over every label set
    # (first, second) name pairs, the first pair with both present wins;
    # prefix_kind "queries_hits": queries=first, hits=second;
    # "uncached_cached": queries=first+second, hits=second
    prefix_pairs: tuple[tuple[str, str], ...] = ()
    prefix_kind: str = "queries_hits"
    cache_info: str | None = None  # info gauge with num_gpu_blocks / block_size labels
    lora_info: str | None = None  # info gauge, newest sample = largest value
    notes: str = ""
    # optional roles whose name a model's config set: missing, they are errors like a mandatory one
    required: frozenset[str] = frozenset()

    def names(self) -> frozenset[str]:
        """Every sample name this contract may read (for prom.parse(names=...))."""
        out = {self.running, self.waiting, *self.kv_usage}
        out.update(n for pair in self.prefix_pairs for n in pair)
        out.update(n for n in (self.finished, self.cache_info, self.lora_info) if n)
        return frozenset(out)


CONTRACTS: dict[str, MetricContract] = {
    VLLM: MetricContract(
        kind=VLLM, running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), kv_mandatory=True,
        finished="vllm:request_success_total",
        prefix_pairs=(("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
                      ("vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total")),
        cache_info="vllm:cache_config_info", lora_info="vllm:lora_requests_info",
        notes="DP engines: running/waiting summed, kv usage averaged over the engine label"),
    LLAMACPP: MetricContract(
        kind=LLAMACPP, running="llamacpp:requests_processing", waiting="llamacpp:requests_deferred",
        kv_usage=("llamacpp:kv_cache_usage_ratio",), kv_mandatory=False, finished=None,
        prefix_pairs=(("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),),
        prefix_kind="uncached_cached",
        notes="no KV metric in current builds: kv_usage None (neutral), capacity = slots from /slots "
              "or -np; no finished-request counter: drain rate from the router's own completions"),
}


def _override(overrides: NameOverrides | Mapping[str, Any] | None, key: str) -> str | None:
    if overrides is None:
        return None
    v = overrides.get(key) if isinstance(overrides, Mapping) else getattr(overrides, key, None)
    return v or None


def contract_for(kind: str, overrides: NameOverrides | Mapping[str, Any] | None = None) -> MetricContract:
    """The contract for an engine kind with a model's name overrides applied. Unknown kind: ValueError
    (the config validates kinds, so this is a programming error)."""
    try:
        base = CONTRACTS[kind]
    except KeyError:
        raise ValueError(f"unknown engine kind {kind!r} (known: {', '.join(CONTRACTS)})") from None
    got = {k: _override(overrides, k) for k in ROLES}
    if not any(got.values()):
        return base
    kv, finished, cache_info, lora_info = got["kv_usage"], got["finished"], got["cache_info"], got["lora_info"]
    queries, hits = got["prefix_queries"], got["prefix_hits"]
    pairs = base.prefix_pairs
    if queries or hits:  # the config asks for both; one alone keeps the other's first default
        first = pairs[0] if pairs else ("", "")
        pairs = ((queries or first[0], hits or first[1]),)
    return replace(base, running=got["running"] or base.running, waiting=got["waiting"] or base.waiting,
                   kv_usage=(kv,) if kv else base.kv_usage, kv_mandatory=base.kv_mandatory or bool(kv),
                   finished=finished or base.finished, prefix_pairs=pairs,
                   cache_info=cache_info or base.cache_info, lora_info=lora_info or base.lora_info,
                   required=frozenset(k for k in ("finished", "prefix", "cache_info", "lora_info")
                                      if (got[k] if k != "prefix" else queries or hits)))


@dataclass(slots=True)
class ScrapeResult:
    kind: str
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # fraction 0..1; None = unknown (llama.cpp) or missing (see errors)
    engines: int = 1  # distinct `engine` label values on the running metric (vLLM data parallel)
    finished_total: float | None = None  # cumulative finished requests (feed DrainRate)
    prefix_queries_total: float | None = None  # tokens
    prefix_hits_total: float | None = None  # tokens
    kv_blocks: int | None = None
    block_size: int | None = None
    kv_capacity_tokens: int | None = None
    lora_max: int | None = None
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    names_used: dict[str, str] = field(default_factory=dict)  # role -> metric name actually read
    errors: list[str] = field(default_factory=list)
    malformed_lines: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors


def _finite(samples: list[Sample]) -> list[float]:
    return [s.value for s in samples if math.isfinite(s.value)]


def _gauge_sum(by: dict[str, list[Sample]], name: str, res: ScrapeResult, role: str,
               mandatory: bool) -> float | None:
    got = by.get(name)
    if not got:
        if mandatory:
            res.errors.append(f"missing mandatory metric {name}")
        return None
    vals = _finite(got)
    if not vals:
        res.errors.append(f"metric {name} has no finite value")
        return None
    res.names_used[role] = name
    return max(0.0, math.fsum(vals))


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        v = float(labels[key])
    except (KeyError, ValueError):
        return None
    return int(v) if math.isfinite(v) and v >= 0 else None


def evaluate(kind: str, overrides: NameOverrides | Mapping[str, Any] | None,
             samples: Iterable[Sample] | ParseResult) -> ScrapeResult:
    """Apply the contract of `kind` (with `overrides`) to one scrape's samples."""
    c = contract_for(kind, overrides)
    res = ScrapeResult(kind=kind)
    if isinstance(samples, ParseResult):
        res.malformed_lines = samples.malformed
        samples = samples.samples
    by = index(samples)

    res.running = _gauge_sum(by, c.running, res, "running", True)
    res.waiting = _gauge_sum(by, c.waiting, res, "waiting", True)
    engines = {s.labels.get("engine") for s in by.get(c.running, ())}
    res.engines = max(1, len(engines))

    kv_name = next((n for n in c.kv_usage if by.get(n)), None)
    if kv_name is None:
        if c.kv_mandatory:
            alts = " or ".join(c.kv_usage)
            res.errors.append(f"missing mandatory metric {alts}")
    else:
        vals = _finite(by[kv_name])
        kv = math.fsum(vals) / len(vals) if vals else None
        if kv is None:
            res.errors.append(f"metric {kv_name} has no finite value")
        elif kv > 1 + _KV_SLACK or kv < -_KV_SLACK:
            res.errors.append(f"metric {kv_name} = {kv:g} is not a fraction 0..1 (a percentage?)")
        else:
            res.kv_usage = min(1.0, max(0.0, kv))
            res.names_used["kv_usage"] = kv_name

    need = c.required
    if c.finished and by.get(c.finished):
        vals = _finite(by[c.finished])
        if vals:
            res.finished_total = math.fsum(vals)
            res.names_used["finished"] = c.finished
    if "finished" in need and "finished" not in res.names_used:
        _missing(res, by, c.finished)

    for first, second in c.prefix_pairs:
        a, b = _finite(by.get(first, [])), _finite(by.get(second, []))
        if a and b:
            fa, fb = math.fsum(a), math.fsum(b)
            res.prefix_queries_total = fa if c.prefix_kind == "queries_hits" else fa + fb
            res.prefix_hits_total = fb
            res.names_used["prefix_queries"], res.names_used["prefix_hits"] = first, second
            break
    if "prefix" in need and "prefix_hits" not in res.names_used:
        for name in c.prefix_pairs[0]:
            _missing(res, by, name)

    if c.cache_info and by.get(c.cache_info):
        blocks_by_engine: dict[str | None, int] = {}
        for s in by[c.cache_info]:
            blocks, bs = _int_label(s.labels, "num_gpu_blocks"), _int_label(s.labels, "block_size")
            if blocks is not None and bs:
                blocks_by_engine.setdefault(s.labels.get("engine"), blocks)
                res.block_size = res.block_size or bs
        if blocks_by_engine and res.block_size:
            res.kv_blocks = sum(blocks_by_engine.values())
            res.kv_capacity_tokens = res.kv_blocks * res.block_size
            res.names_used["cache_info"] = c.cache_info
    if "cache_info" in need and "cache_info" not in res.names_used:
        _missing(res, by, c.cache_info, "with num_gpu_blocks and block_size labels")

    if c.lora_info and by.get(c.lora_info):
        newest = max((s for s in by[c.lora_info] if not math.isnan(s.value)), key=lambda s: s.value,
                     default=None)
        if newest is not None:
            res.lora_max = _int_label(newest.labels, "max_lora")
            res.lora_running = _names(newest.labels.get("running_lora_adapters", ""))
            res.lora_waiting = _names(newest.labels.get("waiting_lora_adapters", ""))
            res.names_used["lora_info"] = c.lora_info
    if "lora_info" in need and "lora_info" not in res.names_used:
        _missing(res, by, c.lora_info)
    return res


def _missing(res: ScrapeResult, by: dict[str, list[Sample]], name: str | None, what: str = "") -> None:
    """A name the model's config chose is not usable in this scrape: an error naming it."""
    if not by.get(name or ""):
        res.errors.append(f"missing mandatory metric {name}")
    else:
        res.errors.append(f"metric {name} has no usable value" + (f" ({what})" if what else ""))


def _names(csv: str) -> tuple[str, ...]:
    return tuple(n for n in (p.strip() for p in csv.split(",")) if n)


def scrape(kind: str, overrides: NameOverrides | Mapping[str, Any] | None, body: bytes | str) -> ScrapeResult:
    """Parse a /metrics body and evaluate it; a body that is not Prometheus text becomes an error on
    the result (never an exception). Only the contract's names are parsed (fast path)."""
    c = contract_for(kind, overrides)
    try:
        parsed = parse(body, names=c.names())
    except NotPrometheusText as e:
        return ScrapeResult(kind=kind, errors=[f"not Prometheus text: {e}"])
    return evaluate(kind, overrides, parsed)


class DrainRate:
    """Requests finished per second over a sliding window, from (time, cumulative count) pairs.

    A counter that goes down means the engine restarted and its counter began again at 0 (the same
    rule as Prometheus' rate()): the new value is taken as the increase since the restart. A
    restart whose counter climbs past the old value before the next observation cannot be seen.
    Observations that do not move time forward, and non-finite counts, are ignored."""

    __slots__ = ("window", "_points", "_offset", "_last_raw", "resets")

    def __init__(self, window: float = 30.0) -> None:
        if window <= 0:
            raise ValueError("window must be > 0")
        self.window = window
        self._points: list[tuple[float, float]] = []  # (time, count adjusted for resets)
        self._offset = 0.0
        self._last_raw: float | None = None
        self.resets = 0

    def observe(self, now: float, total: float) -> None:
        if not math.isfinite(total) or not math.isfinite(now):
            return
        if self._points and now <= self._points[-1][0]:
            return
        if self._last_raw is not None and total < self._last_raw:
            self._offset += self._last_raw
            self.resets += 1
        self._last_raw = total
        self._points.append((now, self._offset + total))
        cut = now - self.window
        if self._points[0][0] < cut:
            self._points = [p for p in self._points if p[0] >= cut]

    def rate(self, now: float | None = None) -> float | None:
        """Requests/s between the oldest and newest observation inside the window ending at `now`
        (default: the newest observation). None with fewer than two observations there."""
        pts = self._points
        if now is not None:
            cut = now - self.window
            pts = [p for p in pts if cut <= p[0] <= now]
        if len(pts) < 2:
            return None
        (t0, c0), (t1, c1) = pts[0], pts[-1]
        return max(0.0, (c1 - c0) / (t1 - t0))

    def clear(self) -> None:
        self._points.clear()
        self._offset = 0.0
        self._last_raw = None
