"""`llmgw ctl`'s commands on routing: the router's endpoints, LoRA adapters per replica, recent
decisions and why each went where it did, tier 2's index and parity, and a request's trace. The
parsers and handlers, which main registers (``register``); they print with output's functions."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from llmgw.admin_client.rationale import rationale_lines
from llmgw.admin_client.trace_view import trace_lines
from llmgw.cli.ctl.views import ADAPTER_HEADERS, KV_HEADERS, adapter_rows, adapters_footer, kv_rows, kv_summary_lines
from llmgw.cli.ctl.output import emit, table

__all__ = ["register"]

def cmd_endpoints(api: Any, ns: argparse.Namespace) -> None:
    def render(eps: list[dict[str, Any]]) -> str:
        rows = []
        for e in eps:
            b = e.get("breaker") or {}
            kv = e.get("kv_usage")
            rows.append([e["id"], e.get("model"), e.get("url"), b.get("state", "-"), e.get("inflight", 0),
                         e.get("running"), e.get("waiting"), None if kv is None else f"{kv:.0%}",
                         "stale" if e.get("stale") else "", e.get("scrape_error") or ""])
        return table(rows, ["ENDPOINT", "MODEL", "URL", "BREAKER", "INFLIGHT", "RUNNING", "WAITING", "KV",
                            "", "ERROR"])

    emit(ns, api.call("GET", "/endpoints", params={"model": ns.model}), render)


def cmd_adapters(api: Any, ns: argparse.Namespace) -> None:
    emit(ns, api.call("GET", "/adapters", params={"model": ns.model}),
         lambda d: table(adapter_rows(d), ADAPTER_HEADERS) + "\n" + adapters_footer(d))


def cmd_decisions(api: Any, ns: argparse.Namespace) -> None:
    def render(ds: list[dict[str, Any]]) -> str:
        rows = []
        for d in ds:
            best = max((c.get("total", 0.0) for c in d.get("candidates", [])), default=None)
            rows.append([time.strftime("%H:%M:%S", time.localtime(d.get("decided_at", 0))), d["request_id"],
                         d.get("model"), d.get("strategy"), d.get("chosen"), best,
                         len(d.get("dropped", [])), f"{d.get('decide_us', 0):.0f}µs"])
        return table(rows, ["TIME", "REQUEST", "MODEL", "STRATEGY", "CHOSEN", "SCORE", "DROPPED", "TOOK"])

    emit(ns, api.call("GET", "/decisions", params={"model": ns.model, "replica": ns.replica, "limit": ns.limit}),
         render)


def cmd_kv(api: Any, ns: argparse.Namespace) -> None:
    def render(d: dict[str, Any]) -> str:
        rows = kv_rows(d, ns.model)
        head = table(rows, KV_HEADERS) if rows else "no replica of a kv_events model"
        return "\n".join([head, "", *kv_summary_lines(d, ns.model)])

    emit(ns, api.call("GET", "/kv"), render)


def cmd_explain(api: Any, ns: argparse.Namespace) -> None:
    data = api.call("GET", f"/decisions/{quote(ns.request_id, safe='')}")
    decisions = data.get("decisions", [data]) if isinstance(data, dict) else data
    emit(ns, data, lambda _: "\n\n".join("\n".join(rationale_lines(d)) for d in decisions))


def cmd_trace(api: Any, ns: argparse.Namespace) -> None:
    if ns.request_id is not None:
        emit(ns, api.call("GET", f"/traces/{quote(ns.request_id, safe='')}"), lambda t: "\n".join(trace_lines(t)))
        return

    def render(ts: list[dict[str, Any]]) -> str:
        rows = [[time.strftime("%H:%M:%S", time.localtime(t.get("started_at", 0))), t.get("id"), t.get("kind"),
                 t.get("model"), t.get("outcome"), t.get("status"), t.get("attempts"), t.get("replica"),
                 "-" if t.get("total_ms") is None else f"{t['total_ms']:.1f}ms"] for t in ts]
        return table(rows, ["TIME", "ID", "KIND", "MODEL", "OUTCOME", "STATUS", "TRIES", "REPLICA", "TOOK"])

    emit(ns, api.call("GET", "/traces", params={"model": ns.model, "outcome": ns.outcome, "limit": ns.limit}),
         render)


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    sp = add("endpoints", cmd_endpoints, "the router's endpoints: breaker, scraped metrics, inflight")
    sp.add_argument("--model", help="only this model's endpoints")
    sp = add("adapters", cmd_adapters, "LoRA adapters per vLLM replica: held, loading, failed")
    sp.add_argument("--model", help="only this model's replicas")
    sp = add("decisions", cmd_decisions, "recent routing decisions")
    sp.add_argument("--model", help="only decisions for this model")
    sp.add_argument("--replica", help="only decisions that chose this replica")
    sp.add_argument("--limit", type=int, default=20, metavar="N", help="at most N, newest first (default: 20)")
    sp = add("explain", cmd_explain, "why a request went where it did: candidates × scorers, and the drops")
    sp.add_argument("request_id", metavar="REQUEST_ID",
                    help="the request's id: its x-request-id, which every response carries "
                         "(`llmgw ctl decisions` lists recent ones)")
    sp = add("kv", cmd_kv, "tier 2: each replica's KV index, event feed and parity check",
             "Tier 2 of cache-aware routing, per replica: the blocks the router's KV index holds for it (! when "
             "it overflowed), the time since its last KV-event message (LAG), messages, resets and gaps (resets "
             "that lost events), the decisions tier 1 and tier 2 made for it, and its parity check (do the "
             "engine's reported blocks carry the hashes the router computes? ok, suspect, ALARM, unchecked). "
             "Then the index's totals, tier 2's decision outcomes and each model's mismatch rate.")
    sp.add_argument("--model", help="only this model's replicas")
    sp = add("trace", cmd_trace, "a request's timeline: phases, attempts and why one was retried (or recent traces)",
             "A request's trace as a timeline: prepare, queued, decide, connect, head, first byte, body, each "
             "attempt with its replica and why it was retried. Without REQUEST_ID: the recent traces.")
    sp.add_argument("request_id", nargs="?", metavar="REQUEST_ID",
                    help="the request's id (its x-request-id); leave out to list recent traces")
    sp.add_argument("--model", help="with no REQUEST_ID: only this model's traces")
    sp.add_argument("--outcome", help="with no REQUEST_ID: only traces that ended so (ok, upstream_failed, ...)")
    sp.add_argument("--limit", type=int, default=20, metavar="N", help="at most N, newest first (default: 20)")
