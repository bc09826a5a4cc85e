"""A fake daemon for the console tests: canned, deterministic admin-API data (a small fleet, its
routing decisions, cache hits) and a fake client that plays it as event-stream lines. The tests
here hold the canned data to the admin API's own document, so the fakes cannot drift from what
the daemon really sends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from llmgw.config import model_from_dict, model_to_dict
from llmgw.tui.client import AdminRefused, DaemonUnreachable

WHERE = "unix:/run/user/1000/llmgw-1000/admin.sock"
T0 = 1_750_000_000.0  # decided_at of the first decision (Unix time; shown in UTC by the tests)
WEIGHTS = {"prefix": 3.0, "load": 2.0, "kv": 1.0}


def _facts(host: str, cpus: int, mem_gb: int, gpus: list[tuple[str, int]]) -> dict[str, Any]:
    return {"cpus": cpus, "memory_mb": mem_gb * 1024, "hostname": host, "agent_version": "0.1.0",
            "gpus": [{"index": i, "name": n, "memory_mb": m} for i, (n, m) in enumerate(gpus)]}


def _node(name: str, state: str, since: float, reason: str, connected: bool, loc: tuple[str, ...],
          facts: dict[str, Any], replicas: list[str], operator: dict[str, str] | None = None) -> dict[str, Any]:
    keys = ("llmgw.io/site", "llmgw.io/room", "llmgw.io/row", "llmgw.io/rack", "llmgw.io/pdu")
    agent = dict(zip(keys, loc))
    operator = operator or {}
    labels = {**agent, **operator}
    return {"name": name, "state": state, "since_s": since, "reason": reason, "connected": connected,
            "agent_id": f"{name}-agent" if connected else None, "last_seen_s": 0.4 if connected else since,
            "labels": labels, "agent_labels": agent, "operator_labels": operator,
            "location": "/".join(labels[k] for k in keys if labels.get(k)), "facts": facts, "replicas": replicas}


A100 = ("A100-SXM4-80GB", 81920)
L4 = ("L4", 23034)

NODES = [
    _node("cpu-b1", "not_ready", 12.5, "no heartbeat for 6s", True, ("dc1", "hall-b", "row1", "r02", "pdu-1"),
          _facts("cpu-b1", 64, 256, []), []),
    _node("gpu-a1", "ready", 3723.0, "", True, ("dc1", "hall-a", "row3", "r12", "pdu-2"),
          _facts("gpu-a1", 96, 1024, [A100, A100]), ["llama-8b/1a2b3c", "llama-8b/7a8b9c"],
          operator={"tier": "prod"}),
    _node("gpu-a2", "ready", 86500.0, "", True, ("dc1", "hall-a", "row3", "r13", "pdu-1"),
          _facts("gpu-a2", 48, 512, [L4, L4, L4, L4]), ["llama-8b/4d5e6f", "qwen-7b/c0ffee"]),
    _node("gpu-c1", "lost", 1830.0, "silent for 30s", False, ("dc2", "hall-1"),
          _facts("gpu-c1", 32, 256, [A100]), []),
]


def _model(name: str, engine: str, source: str, desired: int | None, placed: int, ready: int,
           unplaceable: str | None = None, static: list[str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "engine": engine}
    if desired is not None:
        spec["deploy"] = {"count": desired, "gpus": 1}
    if static:
        spec["replicas"] = [{"url": u} for u in static]
    return {"name": name, "engine": engine, "source": source, "desired_replicas": desired, "replicas": placed,
            "ready": ready, "static_replicas": len(static or []), "unplaceable": unplaceable,
            "definition": model_to_dict(model_from_dict(spec))}


MODELS = [
    _model("ext-model", "vllm", "config", None, 0, 0, static=["http://10.0.0.9:8000"]),
    _model("llama-8b", "vllm", "config", 3, 3, 2),
    _model("mistral-7b", "vllm", "api", 2, 0, 0, unplaceable="needs 1 GPU with 40000 MB free: no ready node has it"),
    _model("qwen-7b", "llamacpp", "api", 1, 1, 1),
]


def _replica(rid: str, node: str, state: str, port: int, gpus: list[int], inflight: int, detail: str = "",
             restarts: int = 0, log: list[str] | None = None) -> dict[str, Any]:
    return {"replica": rid, "model": rid.split("/")[0], "node": node, "desired": "run", "state": state,
            "url": f"http://{node}:{port}" if state != "pending" else None, "pid": 4000 + port % 1000,
            "restarts": restarts, "detail": detail, "log_tail": log or [], "adopted": False, "gpus": gpus,
            "generation": restarts, "reason": "", "routable": state == "ready", "inflight": inflight,
            "created_at": T0 - 4000}


REPLICAS = [
    _replica("llama-8b/1a2b3c", "gpu-a1", "ready", 9001, [0], 3,
             log=["INFO Starting vLLM API server on http://0.0.0.0:9001",
                  "INFO [api_server] Application startup complete."]),
    _replica("llama-8b/4d5e6f", "gpu-a2", "ready", 9002, [0], 1),
    _replica("llama-8b/7a8b9c", "gpu-a1", "starting", 9003, [1], 0, detail="loading weights", restarts=1),
    _replica("qwen-7b/c0ffee", "gpu-a2", "ready", 9004, [1], 0),
]


def _breaker(state: str = "closed", failures: int = 0, last: str | None = None) -> dict[str, Any]:
    return {"state": state, "retry_at": None, "cooldown": 0.0, "consecutive_failures": failures,
            "probes_in_flight": 0, "half_open_successes": 0, "changed_at": None, "opened_total": 1 if last else 0,
            "failures_total": failures, "successes_total": 120, "last_failure": last, "last_failure_at": None}


def _endpoint(eid: str, model: str, url: str, node: str | None, inflight: int, running: float | None,
              waiting: float | None, kv: float | None, breaker: dict[str, Any] | None = None,
              scrape_error: str | None = None) -> dict[str, Any]:
    return {"id": eid, "model": model, "url": url, "pool": "default", "inflight": inflight, "running": running,
            "waiting": waiting, "kv_usage": kv, "stale": scrape_error is not None, "scrape_age_s": 0.8,
            "scrape_error": scrape_error, "drain_rate": 2.5, "breaker": breaker or _breaker(), "adapters": [],
            "node": node, "draining": False, "wall": T0, "scrape": None}


ENDPOINTS = [
    _endpoint("http://10.0.0.9:8000", "ext-model", "http://10.0.0.9:8000", None, 0, None, None, None,
              _breaker("open", 5, "connect"), scrape_error="connect: connection refused"),
    _endpoint("llama-8b/1a2b3c", "llama-8b", "http://gpu-a1:9001", "gpu-a1", 3, 3, 1, 0.42),
    _endpoint("llama-8b/4d5e6f", "llama-8b", "http://gpu-a2:9002", "gpu-a2", 1, 1, 0, 0.18),
    _endpoint("qwen-7b/c0ffee", "qwen-7b", "http://gpu-a2:9004", "gpu-a2", 0, 0, 0, 0.05),
]

LLAMA = ("llama-8b/1a2b3c", "llama-8b/4d5e6f")


def decision(i: int, model: str = "llama-8b", chosen: str | None = "llama-8b/1a2b3c",
             prefix_hit: bool = True) -> dict[str, Any]:
    """The i-th canned decision: two scored candidates (three for llama), and the filters' drops."""
    if model == "qwen-7b":
        cands = [{"endpoint": "qwen-7b/c0ffee", "scores": {"prefix": 0.0, "load": 1.0, "kv": 0.95},
                  "total": 2.95, "flags": []}]
        dropped: list[dict[str, str]] = []
    else:
        other = LLAMA[0] if chosen == LLAMA[1] else LLAMA[1]
        cands = [{"endpoint": chosen or LLAMA[0],
                  "scores": {"prefix": 1.0 if prefix_hit else 0.0, "load": 0.5, "kv": 0.58},
                  "total": (3.0 if prefix_hit else 0.0) + 1.58, "flags": ["prefix 12/16 blocks"] if prefix_hit else []},
                 {"endpoint": other, "scores": {"prefix": 0.25, "load": 0.83, "kv": 0.82},
                  "total": 3.23, "flags": []}]
        dropped = [{"filter": "breaker", "endpoint": "http://10.0.0.9:8000", "reason": "breaker open until probe"},
                   {"filter": "ready", "endpoint": "llama-8b/7a8b9c", "reason": "starting: not ready"}]
    return {"request_id": f"req-{i:04d}", "model": model, "strategy": "chat", "picker": "max-score",
            "chosen": chosen, "weights": WEIGHTS, "candidates": cands,
            "n_candidates": len(cands) + (1 if i == 3 else 0),  # one more scored than kept, for the rationale
            "dropped": dropped, "decided_at": T0 + i * 0.25, "decide_us": 40.0 + 7 * i,
            "note": ("prefix hit" if prefix_hit else "prefix miss") if model == "llama-8b" else ""}


DECISIONS = [
    decision(1), decision(2, chosen=LLAMA[1], prefix_hit=False), decision(3), decision(4, model="qwen-7b",
    chosen="qwen-7b/c0ffee"), decision(5), decision(6, chosen=None, prefix_hit=False),
]
LIVE_DECISIONS = [decision(7, chosen=LLAMA[1]), decision(8, model="qwen-7b", chosen="qwen-7b/c0ffee")]


def _series(pattern: Sequence[float | None], n: int = 30) -> list[float | None]:
    return [pattern[i % len(pattern)] for i in range(n)]


def _counts(hits: int, misses: int, eh: float, eq: float, p1: Sequence[float | None],
            p2: Sequence[float | None]) -> dict[str, Any]:
    return {"prefix_hits": hits, "prefix_misses": misses,
            "prefix_hit_rate": hits / (hits + misses) if hits + misses else None,
            "engine_hit_tokens": eh, "engine_query_tokens": eq, "engine_hit_rate": eh / eq if eq else None,
            "prefix_hit_rate_series": _series(p1), "engine_hit_rate_series": _series(p2)}


RISE = [None, None, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0, 0.8, 0.6]
STEADY = [0.6, 0.65, 0.7, 0.62, 0.58]
LOW = [0.0, None, 0.1, 0.0, 0.2]

CACHE = {
    "window_s": 300.0, "bucket_s": 10.0,
    "total": _counts(180, 60, 96000.0, 150000.0, RISE, STEADY),
    "models": [{**_counts(170, 40, 90000.0, 130000.0, RISE, STEADY), "model": "llama-8b"},
               {**_counts(10, 20, 6000.0, 20000.0, LOW, LOW), "model": "qwen-7b"}],
    "replicas": [{**_counts(120, 10, 70000.0, 90000.0, RISE, STEADY), "replica": "llama-8b/1a2b3c",
                  "model": "llama-8b"},
                 {**_counts(50, 30, 20000.0, 40000.0, STEADY, LOW), "replica": "llama-8b/4d5e6f", "model": "llama-8b"},
                 {**_counts(10, 20, 6000.0, 20000.0, LOW, LOW), "replica": "qwen-7b/c0ffee", "model": "qwen-7b"}],
}


STORE = {"state": "ok", "path": "/var/lib/llmgw/router.db", "reason": None, "detail": None, "since_s": None,
         "errors": 0, "pending_history": 0, "history_dropped": 0}


ADAPTERS = {
    "replicas": [
        {"replica": "llama-8b/1a2b3c", "model": "llama-8b", "cap": 2, "used": 2, "failed": [],
         "adapters": [{"adapter": "sql-lora", "state": "loaded", "inflight": 3, "idle_s": 0.0, "waiting": 0,
                       "unloading": None},
                      {"adapter": "chat-lora", "state": "loading", "inflight": 0, "idle_s": None, "waiting": 4,
                       "unloading": "old-lora"}]},
        {"replica": "llama-8b/4d5e6f", "model": "llama-8b", "cap": 2, "used": 1,
         "adapters": [{"adapter": "sql-lora", "state": "loaded", "inflight": 0, "idle_s": 42.0, "waiting": 0,
                       "unloading": None}],
         "failed": [{"adapter": "bad-lora", "reason": "Loading lora bad-lora failed: No adapter found for /x",
                     "failures": 2, "retry_in_s": 8.0}]},
    ],
    "loads": {"ok": 5, "failed": 2, "timeout": 0, "not_listed": 0}, "unloads": {"ok": 1, "failed": 0},
    "waiting": 4,
}


def _kv_replica(rid: str, tier2: int, tier1: int, status: str, failed: int = 0) -> dict[str, Any]:
    return {"replica": rid, "model": "llama-8b", "node": "gpu-01", "blocks": 4200, "bytes": 323400,
            "overflowed": False, "messages": 310, "block_events": 9000, "resets": 1, "gaps": 0, "event_seq": 4411,
            "lag_s": 0.3, "tier1_decisions": tier1, "tier2_decisions": tier2,
            "parity": {"passed": tier2, "failed": failed, "unknown": 2, "status": status, "pending": 0,
                       "mismatch_rate": failed / (tier2 + failed) if tier2 + failed else None}}


# tier 2 on llama-8b: one replica healthy, one whose engine hashes differently (the parity alarm)
KV = {"enabled": True, "blocks": 8400, "bytes": 646800, "messages": 620, "gaps": 0,
      "refused": {"unknown_replica": 0, "other_node": 0},
      "decisions": {"decided": 112, "miss": 9, "no_events": 3, "timeout": 1},
      "replicas": [_kv_replica("llama-8b/1a2b3c", 112, 13, "ok"), _kv_replica("llama-8b/4d5e6f", 0, 46, "alarm", 7)],
      "models": [{"model": "llama-8b", "passed": 112, "failed": 7, "unknown": 4, "mismatch_rate": 7 / 119}]}


def snapshot(rev: int = 1) -> dict[str, Any]:
    return {"type": "snapshot", "rev": rev, "nodes": NODES, "models": MODELS, "replicas": REPLICAS,
            "endpoints": ENDPOINTS, "decisions": DECISIONS, "cache": CACHE, "store": STORE, "adapters": ADAPTERS, "kv": KV}


def stream() -> list[dict[str, Any]]:
    """One connection's lines: a snapshot, two live decisions, an update, a ping (revs 1..5)."""
    return [snapshot(), {"type": "decision", "rev": 2, "decision": LIVE_DECISIONS[0]},
            {"type": "decision", "rev": 3, "decision": LIVE_DECISIONS[1]},
            {"type": "update", "rev": 4, "cache": CACHE}, {"type": "ping", "rev": 5}]


def _scale_decision(t: float, current: int, desired: int, mode: str, reason: str, limits: list[str],
                    ready: int | None = None, starting: int = 0) -> dict[str, Any]:
    return {"t_wall": t, "current": current, "ready": current - starting if ready is None else ready,
            "starting": starting, "desired": desired, "raw": desired, "mode": mode,
            "rule": f"concurrency: ceil(max(C_w {desired * 3.5:.1f}, C_pred {desired * 3.5:.1f}) / 4.0) = {desired}",
            "limited_by": limits, "reason": reason}


def _autoscale(model: str, lo: int, hi: int, count: int, ready: int, starting: int, pinned: int | None,
               decision: dict[str, Any] | None, history: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "min": lo, "max": hi, "metric": "concurrency", "target": 4.0, "pinned": pinned,
            "count": count, "ready": ready, "starting": starting, "cold_start_s": 28.0, "cold_starts": 4,
            "inputs": {"concurrency": 10.5, "concurrency_panic": 11.0, "concurrency_predicted": 11.9,
                       "slope_per_s": 0.03, "ttft_p90_s": None, "idle_s": 0.0},
            "decision": decision, "history": history,
            "settings": {"window_s": 60.0, "panic_window_s": 6.0, "down_delay_s": 120.0, "idle_to_zero_s": 0.0}}


# GET /api/v1/autoscale: llama-8b scaled up (one replica still starting); mistral-7b pinned by ctl scale
AUTOSCALE = [
    _autoscale("llama-8b", 1, 4, 3, 2, 1, None,
               _scale_decision(T0 + 40, 3, 3, "stable", "", [], starting=1),
               [_scale_decision(T0 + 10, 2, 3, "stable", "concurrency 10.5 over target 4.0 × 2", ["up delay 0s"]),
                _scale_decision(T0 - 600, 1, 2, "panic", "burst: 9 in flight on 1 replica", [])]),
    _autoscale("mistral-7b", 0, 4, 2, 0, 0, 2,
               _scale_decision(T0 + 40, 2, 2, "pinned", "", ["pinned at 2 (llmgw ctl scale)",
                                                             "placement: needs 1 GPU with 40000 MB free"], ready=0),
               []),
]


# -- the fake client ------------------------------------------------------------------------------------
@dataclass
class Connection:
    """One scripted connection: its lines, then either stay open (None) or fail with ``then``."""

    lines: list[dict[str, Any]]
    then: Exception | None = None


@dataclass
class FakeClient:
    """Plays scripted connections to /events; once they run out every connection is refused.
    Records the label calls, and answers them with the node as the daemon would."""

    connections: list[Connection] = field(default_factory=lambda: [Connection(stream())])
    where: str = WHERE
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    refuse_labels: str | None = None  # an error message to answer label calls with
    attempts: int = 0
    closed: bool = False
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    autoscaled: list[dict[str, Any]] | None = field(default_factory=lambda: [dict(v) for v in AUTOSCALE])  # None: 404

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        self.attempts += 1
        if not self.connections:
            raise DaemonUnreachable("[Errno 111] Connection refused")
        conn = self.connections.pop(0)
        for line in conn.lines:
            yield line
            await asyncio.sleep(0)
        if conn.then is not None:
            raise conn.then
        await asyncio.Event().wait()  # an idle but open stream

    def _node(self, name: str) -> dict[str, Any]:
        """The daemon's node, as changed by the calls so far (a node may be labelled before it joins)."""
        if name not in self.nodes:
            self.nodes[name] = next((dict(n) for n in NODES if n["name"] == name),
                                    _node(name, "ready", 0, "", False, (), _facts(name, 0, 0, []), []))
        return self.nodes[name]

    async def set_labels(self, node: str, labels: dict[str, str]) -> dict[str, Any]:
        self.calls.append(("PUT", node, labels))
        if self.refuse_labels:
            raise AdminRefused(400, self.refuse_labels)
        n = self._node(node)
        n["operator_labels"] = {**n["operator_labels"], **labels}
        n["labels"] = {**n["agent_labels"], **n["operator_labels"]}
        return dict(n)

    async def remove_labels(self, node: str, keys: list[str]) -> dict[str, Any]:
        self.calls.append(("DELETE", node, keys))
        n = self._node(node)
        n["operator_labels"] = {k: v for k, v in n["operator_labels"].items() if k not in keys}
        n["labels"] = {**n["agent_labels"], **n["operator_labels"]}
        return dict(n)

    async def trace(self, request_id: str) -> dict[str, Any]:
        """A two-attempt trace for the scripted decisions' requests; 404 for any other."""
        self.calls.append(("GET", "trace", request_id))
        if not request_id.startswith("req-"):
            raise AdminRefused(404, f"No recent trace for request {request_id!r}.")
        return trace_of(request_id)

    async def hold(self, domain: str, reason: str, drain: bool) -> dict[str, Any]:
        self.calls.append(("HOLD", domain, (reason, drain)))
        return {"domain": domain, "reason": reason, "drain": drain, "created_at": 0.0, "replicas": 0}

    async def release(self, domain: str) -> dict[str, Any]:
        self.calls.append(("RELEASE", domain, None))
        return {}

    async def facility(self) -> dict[str, Any]:
        """Two racks on their PDUs; a rack held by a HOLD call so far shows as held."""
        held = {c[1]: c[2] for c in self.calls if c[0] == "HOLD"}
        for c in self.calls:
            if c[0] == "RELEASE":
                held.pop(c[1], None)

        def dom(name: str, level: str, parent: str | None, draw: float, cap: float | None) -> dict[str, Any]:
            reason, drain = held.get(name, ("", False))
            return {"domain": name, "level": level, "parent": parent, "nodes": 2, "ready_nodes": 2, "replicas": 3,
                    "held": name in held, "hold_reason": reason, "hold_drain": drain, "draw_w": draw,
                    "cap_w": cap, "unknown_power_nodes": 0}

        return {"domains": [dom("rack=r12", "rack", "row=row3", 2800.0, None),
                            dom("rack=r13", "rack", "row=row3", 1400.0, None),
                            dom("pdu=pdu-2", "pdu", "rack=r12", 10900.0, 11000.0)],
                "holds": [{"domain": d, "reason": r, "drain": dr, "created_at": 0.0, "replicas": 3}
                          for d, (r, dr) in held.items()],
                "budgets_without_nodes": [], "warnings": []}

    async def explain_placement(self, target: str) -> dict[str, Any]:
        self.calls.append(("EXPLAIN", target, None))
        return {"model": target.split("/")[0], "replica": target if "/" in target else None, "node": "gpu-a1",
                "domains": ["rack=r1"], "why": f"placed on gpu-a1 (rack=r1): fewest of {target}",
                "counts": {"chosen": 1, "held": 1}, "truncated": 0, "warnings": [],
                "candidates": [{"node": "gpu-a1", "verdict": "chosen", "detail": "0 in rack=r1", "domains": ["rack=r1"]},
                               {"node": "cpu-b1", "verdict": "held", "detail": "in held domain rack=r2",
                                "domains": ["rack=r2"]}]}

    async def tenants(self) -> list[dict[str, Any]]:
        """Four tenants as GET /api/v1/tenants answers (TenantView): bands, quota use, waiters."""
        self.calls.append(("GET", "tenants", None))
        return [dict(t) for t in TENANTS]

    async def autoscale(self) -> list[dict[str, Any]] | None:
        """GET /api/v1/autoscale as AdminClient answers it (None: a daemon without the route)."""
        self.calls.append(("GET", "autoscale", None))
        return None if self.autoscaled is None else [dict(v) for v in self.autoscaled]

    async def aclose(self) -> None:
        self.closed = True


def _tenant(name: str, band: str, weight: float, keys: int, requests: int, prompt: int, completion: int,
            quota: dict[str, int], use: dict[str, Any], waiting: int = 0, share: float = 1.0,
            static: bool = False, models: list[str] | None = None, description: str = "") -> dict[str, Any]:
    return {"name": name, "band": band, "weight": weight, "quota": quota, "models": models,
            "description": description, "created_at": 1796030000.0, "static": static, "keys": keys,
            "usage_today": {"requests": requests, "prompt_tokens": prompt, "cached_tokens": prompt // 3,
                            "completion_tokens": completion, "errors": requests // 50},
            "quota_use": use, "queue": {"waiting": waiting, "share": share}}


TENANTS = [
    _tenant("batch-jobs", "batch", 1.0, 1, 5200, 9_800_000, 2_100_000, {"tpm": 200000},
            {"tpm": {"limit": 200000, "remaining": 0}}, waiting=37, share=1.0, description="nightly evals"),
    _tenant("chat", "high", 3.0, 4, 18400, 3_400_000, 1_900_000, {"rpm": 600, "concurrency": 64},
            {"rpm": {"limit": 600, "remaining": 412}, "concurrency": {"limit": 64, "inflight": 22}},
            waiting=2, share=0.75, models=["qwen-7b", "llama-70b"], description="the support chat"),
    _tenant("search", "high", 1.0, 2, 9100, 1_200_000, 300_000, {"tokens_per_day": 2000000},
            {"day": {"limit": 2000000, "used": 1_850_000}}, waiting=1, share=0.25),
    _tenant("static", "normal", 1.0, 0, 40, 12000, 3000, {}, {}, static=True),
]


@dataclass(frozen=True)
class StopAfter:
    """A backoff for tests: no delay for the first ``n`` attempts, then an hour (so a snapshot
    sees a settled attempt count)."""

    n: int

    def delay(self, attempt: int) -> float:
        return 0.0 if attempt < self.n else 3600.0


# -- the canned data is what the daemon would send -------------------------------------------------------
def _validator(schema: str) -> Any:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    from llmgw.admin.openapi import document

    doc = document()
    return jsonschema_rs.validator_for({"$ref": f"#/components/schemas/{schema}", "components": doc["components"]})


@pytest.mark.parametrize("line", stream(), ids=lambda line: f"{line['type']}-{line['rev']}")
def test_canned_lines_match_the_admin_document(line: dict[str, Any]) -> None:
    schema = {"snapshot": "SnapshotEvent", "decision": "DecisionEvent", "update": "UpdateEvent",
              "ping": "PingEvent"}[line["type"]]
    errors = [f"{e.instance_path}: {e.message}" for e in _validator(schema).iter_errors(line)]
    assert not errors, errors[:5]


@pytest.mark.parametrize("view", AUTOSCALE, ids=lambda v: v["model"])
def test_canned_autoscale_answer_matches_the_admin_document(view: dict[str, Any]) -> None:
    errors = [f"{e.instance_path}: {e.message}" for e in _validator("AutoscaleView").iter_errors(view)]
    assert not errors, errors[:5]


def test_canned_node_answer_matches_the_admin_document() -> None:
    n = asyncio.run(FakeClient().set_labels("gpu-a1", {"llmgw.io/rack": "r99"}))
    errors = [f"{e.instance_path}: {e.message}" for e in _validator("NodeView").iter_errors(n)]
    assert not errors, errors[:5]
    assert n["labels"]["llmgw.io/rack"] == "r99"


def trace_of(request_id: str) -> dict[str, Any]:
    """A trace as GET /api/v1/traces/{id} answers it: a connect failure, then a retry that streamed."""
    phases = [("prepare", 0, 0.0, 0.1, ""), ("decide", 0, 0.1, 0.2, ""), ("connect", 1, 0.3, 1.0, ""),
              ("decide", 0, 1.3, 0.2, "retry after attempt 1: connect: replica llama-8b/1a2b3c: connection refused"),
              ("connect", 2, 1.5, 0.1, ""), ("head", 2, 1.6, 0.4, ""), ("first_byte", 2, 2.0, 30.0, ""),
              ("body", 2, 32.0, 88.0, "")]
    return {"id": request_id, "kind": "request", "name": "chat", "model": "llama-8b", "stream": True,
            "started_at": 1_767_225_600.25, "total_ms": 120.0, "outcome": "ok", "status": 200, "revision": "",
            "bytes_out": 812, "bytes_in": 20480, "retries": 1,
            "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "span_id": "53995c3f42cd8ad8", "parent_span_id": "",
            "phases": [{"name": n, "attempt": a, "start_ms": s, "duration_ms": d, "note": note}
                       for n, a, s, d, note in phases],
            "attempts": [{"n": 1, "replica": "llama-8b/1a2b3c", "node": "gpu-a1", "revision": "", "decision": 0,
                          "sent_ms": 0.3, "connected_ms": None, "head_ms": None, "first_byte_ms": None,
                          "ended_ms": 1.3, "status": None, "outcome": "connect",
                          "error": "replica llama-8b/1a2b3c: connection refused", "retried": True, "bytes_in": 0,
                          "span_id": "00f067aa0ba902b7"},
                         {"n": 2, "replica": "llama-8b/4d5e6f", "node": "gpu-a2", "revision": "", "decision": 1,
                          "sent_ms": 1.5, "connected_ms": 1.6, "head_ms": 2.0, "first_byte_ms": 32.0,
                          "ended_ms": 120.0, "status": 200, "outcome": "ok", "error": "", "retried": False,
                          "bytes_in": 20480, "span_id": "b7ad6b7169203331"}]}
