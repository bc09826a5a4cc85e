"""How `llmgw ctl` shows one object as readable `key  value` lines: the daemon's status and one
model. Plain data in, text out (no I/O), so each rendering is tested without a daemon.

The admin API's answers may grow fields (clients ignore what they do not know); a field this file
does not know yet is still shown, readably (`value_text`), never dropped and never as JSON."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from llmgw.admin_client.groups import groups_text
from llmgw.admin_client.printable import printable

__all__ = ["ADAPTER_HEADERS", "KEY_WIDTH", "adapter_rows", "adapters_footer", "groups_text", "model_text",
           "status_text", "store_line", "value_text"]

KEY_WIDTH = 20  # the key column; "partition suspected" is the longest status key
NONE = "none"


def value_text(v: Any) -> str:
    """One value on one line: no quotes, yes/no for booleans, `-` for null, `k=v, k=v` for a mapping,
    `a, b` for a list (nested values in brackets)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, Mapping):
        return ", ".join(f"{printable(str(k))}={_nested(x)}" for k, x in v.items()) or NONE
    if isinstance(v, list | tuple):
        return ", ".join(_nested(x) for x in v) or NONE
    return printable(str(v))


def _nested(v: Any) -> str:
    if isinstance(v, Mapping | list | tuple) and v:
        return "{" + value_text(v) + "}" if isinstance(v, Mapping) else "[" + value_text(v) + "]"
    return value_text(v)


def _line(key: str, value: str) -> str:
    return f"{key:{KEY_WIDTH}s} {value}".rstrip()


def _lines(key: str, values: list[str]) -> Iterator[str]:
    """The key on the first line, each further value under the first (aligned), `none` if empty."""
    if not values:
        yield _line(key, NONE)
        return
    for i, v in enumerate(values):
        yield _line(key if i == 0 else "", v)


# -- status -----------------------------------------------------------------------------------
def store_line(store: Any) -> str:
    """`ok`, or `degraded (disk full) for 42s: …` — as `ctl status` and the console show it."""
    if not isinstance(store, Mapping):
        return "?"
    if store.get("state") != "degraded":
        out = str(store.get("state", "?"))
        if store.get("path"):
            out += f" ({store['path']})"
        if store.get("errors"):
            out += f"; {store['errors']} store errors since the daemon started"
        return out
    since = store.get("since_s")
    out = f"degraded ({store.get('reason') or 'unknown'})"
    if isinstance(since, int | float):
        out += f" for {since:.0f}s"
    out += f": {store.get('detail') or ''}; running from memory, admin changes refused until it can write"
    if store.get("pending_history"):
        out += f"; {store['pending_history']} history events waiting"
    if store.get("history_dropped"):
        out += f", {store['history_dropped']} dropped"
    return out


def _nodes(v: Any) -> str:
    if not isinstance(v, Mapping):
        return value_text(v)
    return ", ".join(f"{n} {state}" for state, n in sorted(v.items())) or NONE


def _partition(v: Any) -> str:
    if v is True:
        return ("YES: most of a rack's nodes holding replicas went silent at once (one is declared lost per "
                "control.partition_lost_interval_s), or no node answers (none is); the router's log names the domains")
    return value_text(v)


def _control_port(v: Any) -> str:
    return "none: no control listener, agents cannot join" if v is None else value_text(v)


def _per_key(v: Any, fmt: str) -> list[str]:
    if not isinstance(v, Mapping):
        return [value_text(v)]
    return [fmt.format(k=printable(str(k)), v=value_text(x)) for k, x in sorted(v.items())]


_STATUS_KEYS = {"router_id": "router", "assignments": "replicas placed", "unknown_engines": "unknown engines",
                "partition_suspected": "partition suspected", "control_port": "control port",
                "kv_parity_alarms": "kv parity"}


def status_text(d: Mapping[str, Any]) -> str:
    """`GET /status` as aligned `key  value` lines, in the answer's order."""
    out: list[str] = []
    for k, v in d.items():
        key = _STATUS_KEYS.get(k, k.replace("_", " "))
        if k == "store":
            out.append(_line(key, store_line(v)))
        elif k == "nodes":
            out.append(_line(key, _nodes(v)))
        elif k == "partition_suspected":
            out.append(_line(key, _partition(v)))
        elif k == "control_port":
            out.append(_line(key, _control_port(v)))
        elif k == "unplaceable":
            out.extend(_lines(key, _per_key(v, "{k}: {v}")))
        elif k == "unknown_engines":
            out.extend(_lines(key, _per_key(v, "{k}: {v} — left running, not routed; restart the router "
                                                 "with --adopt to adopt them")))
        elif k == "kv_parity_alarms":
            out.extend(_lines(key, _per_key(v, "ALARM {k} (model {v}): its engine hashes KV blocks differently "
                                               "from the router; tier 2 cannot route to it — `llmgw ctl kv`")
                              if v else ["no alarm"]))
        elif k == "adopt":
            out.append(_line(key, "yes: engines the store does not know are adopted" if v is True
                             else value_text(v)))
        else:
            out.append(_line(key, value_text(v)))
    return "\n".join(out)


def routers_text(d: Mapping[str, Any]) -> str:
    """`GET /routers`: a table of the routers, then the lease and the store as this router sees them."""
    if not d.get("ha"):
        return (f"router {d.get('this_router')} is alone on its store: it leads the control plane (several routers "
                "share a PostgreSQL store, or `llmgw daemon --workers N` one file: docs/ha.md)")
    rows = [["ROUTER", "ROLE", "HOST", "PID", "AGENTS", "SEEN", "URL", "CONTROL"]]
    for r in d.get("routers", []):
        rows.append([f"{r['id']}{' *' if r.get('this') else ''}", r.get("role", ""), r.get("host", ""),
                     str(r.get("pid") or "-") + (f"/w{r['worker']}" if r.get("worker") is not None else ""),
                     "-" if r.get("agents") is None else str(r["agents"]), f"{r.get('seen_s', 0):.1f}s ago",
                     r.get("url") or "-", r.get("control") or "-"])
    widths = [max(len(printable(row[i])) for row in rows) for i in range(len(rows[0]))]
    out = ["  ".join(printable(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lat = d.get("store_latency_ms")
    out += ["", _line("leader", f"{d.get('leader') or 'none'} (epoch {d.get('epoch')}, lease {d.get('lease_s')}s; "
                                f"{d.get('leadership_changes')} changes seen here)"),
            _line("store", ("ok" if d.get("store_ok") else f"FAILING: {d.get('store_error')}")
                  + (f", {lat:.2f} ms a call" if lat is not None else "")),
            "(* the router that answered)"]
    return "\n".join(out)


# -- one model --------------------------------------------------------------------------------
def _flat(prefix: str, v: Any) -> Iterator[tuple[str, str]]:
    """A definition's leaves as dotted keys, as in the config file: deploy.count, replicas[0].url."""
    if isinstance(v, Mapping) and v:
        for k, x in v.items():
            yield from _flat(f"{prefix}.{k}" if prefix else str(k), x)
    elif isinstance(v, list | tuple) and v and any(isinstance(x, Mapping) for x in v):
        for i, x in enumerate(v):
            yield from _flat(f"{prefix}[{i}]", x)
    elif isinstance(v, bool):
        yield prefix, "true" if v else "false"  # as the config file spells it
    elif isinstance(v, float):
        yield prefix, repr(v)
    else:
        yield prefix, value_text(v)


def model_text(definition: Mapping[str, Any], view: Mapping[str, Any] | None = None) -> str:
    """`GET /models/{name}` (the definition) with, when given, the model's row of `GET /models`
    (readiness and why replicas cannot be placed) above it."""
    out = [_line("model", str(definition.get("name", "?")))]
    if view:
        out.append(_line("source", value_text(view.get("source"))))
        if view.get("desired_replicas") is not None:
            out.append(_line("ready", f"{view.get('ready', 0)}/{view['desired_replicas']} replicas"))
        if groups := groups_text(view):
            out.append(_line("roles", groups))
        if view.get("static_replicas"):
            out.append(_line("static endpoints", value_text(view["static_replicas"])))
        if view.get("unplaceable"):
            out.append(_line("problem", str(view["unplaceable"])))
    adapters = definition.get("adapters")
    if isinstance(adapters, list) and adapters:  # each in full under the definition below
        out.append(_line("adapters", ", ".join(adapter_text(a) for a in adapters)))
    pairs = [(k, v) for k, v in _flat("", definition) if k != "name"]
    width = max([KEY_WIDTH - 2, *(len(k) for k, _ in pairs)])
    if pairs:
        out.append("definition")
        out.extend(f"  {k:{width}s} {v}".rstrip() for k, v in pairs)
    return "\n".join(out)


def adapter_text(a: Any) -> str:
    """One declared LoRA adapter, short: its name, and "(static)" when vLLM loads it at start."""
    if not isinstance(a, Mapping):
        return value_text(a)
    return f"{value_text(a.get('name'))}{' (static)' if a.get('static') else ''}"


ADAPTER_HEADERS = ["REPLICA", "MODEL", "SLOTS", "ADAPTER", "STATE", "INFLIGHT", "IDLE", "NOTE"]


def adapter_rows(d: Mapping[str, Any]) -> list[list[Any]]:
    """``GET /adapters`` as table rows: one per (replica, adapter), loads in progress and failed
    loads included; a replica that holds none gets one row."""
    rows: list[list[Any]] = []
    for r in d.get("replicas", []):
        head = [r.get("replica"), r.get("model"), f"{r.get('used', 0)}/{r.get('cap', 0)}"]
        items = []
        for a in r.get("adapters", []):
            idle = a.get("idle_s")
            note = ""
            if a.get("state") == "loading":
                note = f"{a.get('waiting', 0)} waiting" + (f", unloading {a['unloading']}" if a.get("unloading") else "")
            items.append([a.get("adapter"), a.get("state"), a.get("inflight", 0),
                          "-" if idle is None else f"{idle:.0f}s", note])
        for f in r.get("failed", []):
            items.append([f.get("adapter"), "failed", 0, "-",
                          f"retry in {f.get('retry_in_s', 0):.0f}s ({f.get('failures', 1)}x): {f.get('reason', '')}"])
        for i, item in enumerate(items or [["-", "", "", "", ""]]):
            rows.append((head if i == 0 else ["", "", ""]) + item)
    return rows


def adapters_footer(d: Mapping[str, Any]) -> str:
    loads = ", ".join(f"{k} {v}" for k, v in (d.get("loads") or {}).items() if v) or "none"
    unloads = ", ".join(f"{k} {v}" for k, v in (d.get("unloads") or {}).items() if v) or "none"
    return f"loads: {loads}; unloads: {unloads}; waiting for a load: {d.get('waiting', 0)}"

# -- tier 2: `llmgw ctl kv` ---------------------------------------------------------------------
KV_HEADERS = ["REPLICA", "MODEL", "NODE", "BLOCKS", "LAG", "MSGS", "RESETS", "GAPS", "TIER1", "TIER2",
              "PARITY", "PASS", "FAIL", "UNKNOWN", "MISMATCH"]


def _pct(v: Any) -> str:
    return "-" if not isinstance(v, int | float) or isinstance(v, bool) else f"{v:.0%}"


def _lag(v: Any) -> str:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return "-"
    return f"{v:.1f}s" if v < 120 else f"{int(v) // 60}m"


def _mb(v: Any) -> str:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return "-"
    return f"{v / (1 << 20):.1f} MB" if v >= 1 << 20 else f"{v / 1024:.0f} kB"


def kv_rows(d: Mapping[str, Any], model: str | None = None) -> list[list[str]]:
    """One row per replica of `GET /api/v1/kv` (KV_HEADERS), optionally one model's."""
    rows = []
    for r in d.get("replicas") or []:
        if not isinstance(r, Mapping) or (model is not None and r.get("model") != model):
            continue
        p = r.get("parity") if isinstance(r.get("parity"), Mapping) else {}
        rows.append([value_text(r.get("replica")), value_text(r.get("model")), value_text(r.get("node")),
                     value_text(r.get("blocks")) + ("!" if r.get("overflowed") else ""), _lag(r.get("lag_s")),
                     value_text(r.get("messages")), value_text(r.get("resets")), value_text(r.get("gaps")),
                     value_text(r.get("tier1_decisions")), value_text(r.get("tier2_decisions")),
                     value_text(p.get("status")).upper() if p.get("status") == "alarm" else value_text(p.get("status")),
                     value_text(p.get("passed")), value_text(p.get("failed")), value_text(p.get("unknown")),
                     _pct(p.get("mismatch_rate"))])
    return rows


def kv_summary_lines(d: Mapping[str, Any], model: str | None = None) -> list[str]:
    """What follows the table: the index's totals, tier 2's decision outcomes, each model's
    mismatch rate, and what an alarm means."""
    if not d.get("enabled"):
        return ["tier 2 index: none (the router accepts no agents: no control.join_token)"]
    out = [_line("index", f"{value_text(d.get('blocks'))} blocks, ~{_mb(d.get('bytes'))}; "
                          f"{value_text(d.get('messages'))} messages, {value_text(d.get('gaps'))} gaps")]
    dec = {k: v for k, v in (d.get("decisions") or {}).items() if v}
    out.append(_line("decisions", value_text(dec) if dec else NONE))
    refused = {k: v for k, v in (d.get("refused") or {}).items() if v}
    if refused:
        out.append(_line("refused", value_text(refused)))
    for m in d.get("models") or []:
        if isinstance(m, Mapping) and (model is None or m.get("model") == model):
            out.append(_line(f"parity {value_text(m.get('model'))}",
                             f"{_pct(m.get('mismatch_rate'))} mismatched ({value_text(m.get('failed'))} of "
                             f"{value_text((m.get('passed') or 0) + (m.get('failed') or 0))} checks; "
                             f"{value_text(m.get('unknown'))} unknown)"))
    if any(isinstance(r, Mapping) and isinstance(r.get("parity"), Mapping) and r["parity"].get("status") == "alarm"
           for r in d.get("replicas") or []):
        out.append("ALARM: those engines' KV events never carry the block hashes the router computes, so tier 2 "
                   "cannot route to them: check their --prefix-caching-hash-algo (sha256_cbor), PYTHONHASHSEED, "
                   "block size and vLLM version (see docs/prefix-routing.md, `llmgw kv hash`, `llmgw kv watch`)")
    return out
