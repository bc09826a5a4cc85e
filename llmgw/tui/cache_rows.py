"""The Cache view's rows as plain data (see :mod:`.rows`): per model and per replica, how often
routing sent a request to a replica holding its prefix and the engines' own prefix-cache hit rate,
with sparklines; tier 2's decisions and parity per replica; the fleet's totals in a few lines."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.tui.rows import SPARK_WIDTH, Column, Row, _filtered, _str, fmt_age, fmt_count, fmt_pct, sparkline
from llmgw.tui.state import ConsoleState, as_dict, as_list

__all__ = ["CACHE_MODEL_COLUMNS", "CACHE_REPLICA_COLUMNS", "cache_model_rows", "cache_replica_rows",
           "cache_total_lines", "kv_total_line"]

CACHE_MODEL_COLUMNS = (Column("model"), Column("prefix hit", toned=True), Column("hit/miss"), Column("trend"),
                       Column("engine hit"), Column("tokens"), Column("trend"))
# tier 2/1: the replica's decisions made by tier 2 (KV events) / by tier 1; parity: tier 2's self-check
CACHE_REPLICA_COLUMNS = (Column("replica"), Column("model"), Column("tier 2/1"), Column("parity"),
                         *CACHE_MODEL_COLUMNS[1:])


def _rate_tone(rate: Any) -> str:
    if not isinstance(rate, (int, float)):
        return "dim"
    return "good" if rate >= 0.5 else ("warn" if rate > 0 else "bad")


def _cache_cells(c: Mapping[str, Any], width: int) -> tuple[str, ...]:
    return (fmt_pct(c.get("prefix_hit_rate")), f"{c.get('prefix_hits', 0)}/{c.get('prefix_misses', 0)}",
            sparkline(c.get("prefix_hit_rate_series"), width), fmt_pct(c.get("engine_hit_rate")),
            f"{fmt_count(c.get('engine_hit_tokens', 0))}/{fmt_count(c.get('engine_query_tokens', 0))}",
            sparkline(c.get("engine_hit_rate_series"), width))


def _cache_models(state: ConsoleState) -> list[dict[str, Any]]:
    """The cache summary's models that the daemon still has (a deleted model's counts stay in the
    window for a while, and in the totals)."""
    present = state.present_models()
    return [m for m in as_list(state.cache.get("models")) if m.get("model") in present]


def _cache_replicas(state: ConsoleState) -> list[dict[str, Any]]:
    """The cache summary's replicas that the daemon still has: one a scale-down removed leaves."""
    present = state.present_replicas()
    return [r for r in as_list(state.cache.get("replicas")) if r.get("replica") in present]


def cache_model_rows(state: ConsoleState, text: str = "", width: int = SPARK_WIDTH) -> list[Row]:
    rows = [Row(_str(m.get("model"), "?"), (_str(m.get("model"), "?"), *_cache_cells(m, width)),
                _rate_tone(m.get("prefix_hit_rate")))
            for m in _cache_models(state)]
    return _filtered(rows, text)


def _kv_replicas(state: ConsoleState) -> dict[str, dict[str, Any]]:
    return {r["replica"]: r for r in as_list(state.kv.get("replicas"))
            if isinstance(r, dict) and isinstance(r.get("replica"), str)}


def _tier_cells(kv: Mapping[str, Any] | None) -> tuple[str, str]:
    """Tier 2: how many of the replica's decisions each tier made (tier 2/tier 1), and its parity."""
    if kv is None:
        return "-", "-"
    t2, t1 = kv.get("tier2_decisions"), kv.get("tier1_decisions")
    parity = as_dict(kv.get("parity")).get("status")
    return f"{fmt_count(t2 or 0)}/{fmt_count(t1 or 0)}", "ALARM" if parity == "alarm" else _str(parity, "-")


def cache_replica_rows(state: ConsoleState, text: str = "", width: int = SPARK_WIDTH) -> list[Row]:
    kv = _kv_replicas(state)
    rows = []
    for r in _cache_replicas(state):
        k = kv.get(r.get("replica"))  # type: ignore[arg-type]
        tiers = _tier_cells(k)
        rows.append(Row(_str(r.get("replica"), "?"),
                        (_str(r.get("replica"), "?"), _str(r.get("model"), "?"), *tiers, *_cache_cells(r, width)),
                        "bad" if tiers[1] == "ALARM" else _rate_tone(r.get("prefix_hit_rate"))))
    return _filtered(rows, text)


def kv_total_line(state: ConsoleState) -> str | None:
    """Tier 2 in one line (None without kv_events replicas): the index, how decisions went, alarms."""
    kv = state.kv
    present = state.present_replicas()
    reps = [r for rid, r in _kv_replicas(state).items() if rid in present]
    if not kv.get("enabled") or not reps:
        return None
    dec = as_dict(kv.get("decisions"))
    decided = dec.get("decided", 0) if isinstance(dec.get("decided"), int) else 0
    fell = sum(v for k, v in dec.items() if k != "decided" and isinstance(v, int))
    alarms = [_str(r.get("replica"), "?") for r in reps if as_dict(r.get("parity")).get("status") == "alarm"]
    line = (f"tier 2: {fmt_count(kv.get('blocks') or 0)} blocks indexed · {decided} decisions by tier 2, {fell} fell "
            f"back to tier 1 · parity ")
    if alarms:
        return line + f"ALARM on {', '.join(alarms)}: their engines hash differently (see `llmgw ctl kv`)"
    return line + ("ok" if any(as_dict(r.get("parity")).get("status") == "ok" for r in reps) else "not checked yet")


def cache_total_lines(state: ConsoleState, width: int = SPARK_WIDTH) -> list[str]:
    """The whole fleet's figures, and how to read the columns."""
    c = state.cache
    if not c:
        return ["no cache summary yet"]
    t = as_dict(c.get("total"))
    hits, misses = t.get("prefix_hits", 0), t.get("prefix_misses", 0)
    shown = min(width, len(t.get("prefix_hit_rate_series") or [])) * (c.get("bucket_s") or 0)
    totals = (f"all models, last {fmt_age(c.get('window_s'))}: prefix hit {fmt_pct(t.get('prefix_hit_rate'))} "
              f"({hits} of {hits + misses} prefix-routed requests went to a replica holding their prefix) · "
              f"engine hit {fmt_pct(t.get('engine_hit_rate'))} of {fmt_count(t.get('engine_query_tokens', 0))} "
              "prompt tokens")
    trends = (f"{sparkline(t.get('prefix_hit_rate_series'), width)} prefix hit  "
              f"{sparkline(t.get('engine_hit_rate_series'), width)} engine hit   "
              f"(trends: a block per {fmt_age(c.get('bucket_s'))}, last {fmt_age(shown)}, newest right)")
    out = [totals, trends]
    tier2 = kv_total_line(state)
    if tier2 is not None:
        out.append(tier2)
    gone = len(as_list(c.get("replicas"))) - len(_cache_replicas(state))
    if gone > 0:
        out.append(f"{gone} replica{'s' if gone > 1 else ''} no longer in the fleet: not listed below, still counted "
                   "in these totals until they leave the window")
    return out
