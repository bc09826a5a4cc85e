"""The console's tables as plain data: columns, rows of strings and a tone per row, built from a
ConsoleState. Pure (no Textual, no clock: ages come from the data, wall times are formatted in a
zone the caller passes), so every view's content is tested without a terminal. A decision's
rationale is laid out by llmgw.admin_client.rationale, shared with `llmgw ctl explain`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import tzinfo
from typing import Any

from llmgw.admin_client.groups import groups_text
from llmgw.admin_client.rationale import DASH, explain, fmt_time, fmt_us
from llmgw.tui.autoscale_rows import autoscale_cell
from llmgw.tui.state import ConsoleState, Link, as_dict, as_list

__all__ = [
    "DECISIONS_SHOWN", "DECISION_COLUMNS", "MODEL_COLUMNS", "NODE_COLUMNS", "REPLICA_COLUMNS", "Column",
    "RationaleView", "Row", "banner_text", "decision_rows", "decisions_caption", "fmt_age", "fmt_count", "fmt_pct",
    "fmt_time", "fmt_us", "matches", "model_rows", "node_detail", "node_rows", "rationale", "replica_detail", "replica_rows",
    "sparkline", "status_line",
]

DECISIONS_SHOWN = 100  # rows in the live table: DataTable measures every cell of every row it is given,
# and redrawing all 500 kept decisions four times a second costs a busy router's host a core
REQUEST_ID_WIDTH = 14  # generated ids are 32 hex digits: the head is enough to tell them apart
SPARK_WIDTH = 20  # buckets shown in a table's sparkline (the newest; 10 s each by default)


@dataclass(frozen=True, slots=True)
class Column:
    label: str
    width: int | None = None  # None: as wide as the content
    toned: bool = False  # this column is coloured by the row's tone


@dataclass(frozen=True, slots=True)
class Row:
    key: str
    cells: tuple[str, ...]
    tone: str = ""  # good | warn | bad | busy | dim | "" — the view maps tones to colours
    search: str = ""  # what the filter matches besides the cells (e.g. an id shown shortened)


# -- formatting -------------------------------------------------------------------------------------
def fmt_age(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or seconds < 0:
        return DASH
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_pct(rate: Any) -> str:
    return f"{rate * 100:.0f}%" if isinstance(rate, (int, float)) else DASH


def fmt_mem(mb: Any) -> str:
    if not isinstance(mb, (int, float)):
        return DASH
    if mb >= 1024 * 1024:
        return f"{mb / 1024 / 1024:.1f}T"
    return f"{mb / 1024:.0f}G" if mb >= 1024 else f"{mb:.0f}M"


def fmt_count(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return DASH
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(series: Any, width: int = SPARK_WIDTH) -> str:
    """Rates in 0..1 as block characters, newest on the right; a bucket with no traffic (None) is
    a blank, and fewer buckets than ``width`` are padded on the left so columns line up."""
    points = series[-width:] if isinstance(series, list) else []
    out = []
    for p in points:
        if isinstance(p, (int, float)):
            out.append(BLOCKS[min(len(BLOCKS) - 1, max(0, round(p * (len(BLOCKS) - 1))))])
        else:
            out.append(" ")
    return "".join(out).rjust(width)


def matches(cells: Iterable[str], text: str) -> bool:
    """Every whitespace-separated term of ``text`` appears somewhere in the row (case-insensitive)."""
    terms = text.lower().split()
    if not terms:
        return True
    hay = "\x00".join(cells).lower()
    return all(t in hay for t in terms)


def _filtered(rows: list[Row], text: str) -> list[Row]:
    return [r for r in rows if matches((r.search, *r.cells), text)] if text.strip() else rows


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _str(v: Any, default: str = DASH) -> str:
    return v if isinstance(v, str) and v else default


def _num(v: Any, default: float = 0.0) -> float:
    return float(v) if isinstance(v, (int, float)) else default


def _strs(v: Any) -> list[str]:
    """A JSON list as strings (ids, flags, log lines); anything else as empty."""
    return [str(x) for x in v] if isinstance(v, list) else []


# -- tones ------------------------------------------------------------------------------------------
NODE_TONES = {"ready": "good", "not_ready": "warn", "lost": "bad"}
REPLICA_TONES = {"ready": "good", "pending": "busy", "starting": "busy", "stopping": "busy", "unhealthy": "warn",
                 "crashed": "bad", "failed": "bad", "crashloop": "bad", "stopped": "dim", "static": ""}
BREAKER_TONES = {"closed": "", "half_open": "warn", "open": "bad"}

# -- nodes ------------------------------------------------------------------------------------------
NODE_COLUMNS = (Column("node"), Column("state", toned=True), Column("for"), Column("location"), Column("gpus"),
                Column("engines"), Column("ready"), Column("reason"))


def _engines_by_replica(state: ConsoleState) -> dict[str, str]:
    engines = {str(m.get("name")): _str(m.get("engine"), "?") for m in state.models}
    return {str(r.get("replica")): engines.get(str(r.get("model")), "?") for r in state.replicas}


def _gpus(facts: Mapping[str, Any]) -> str:
    gpus = as_list(facts.get("gpus"))
    if not gpus:
        return DASH
    names = Counter(_str(g.get("name"), "gpu") for g in gpus)
    return ", ".join(f"{n}×{name}" for name, n in sorted(names.items()))


def node_rows(state: ConsoleState, text: str = "") -> list[Row]:
    engine_of = _engines_by_replica(state)
    replica_state = {str(r.get("replica")): r.get("state") for r in state.replicas}
    rows = []
    for n in state.nodes:
        name = _str(n.get("name"), "?")
        facts = as_dict(n.get("facts"))
        ids = _strs(n.get("replicas"))
        kinds = Counter(engine_of.get(r, "?") for r in ids)
        engines = ", ".join(f"{k}×{c}" for k, c in sorted(kinds.items())) or DASH
        ready = sum(1 for r in ids if replica_state.get(r) == "ready")
        st = _str(n.get("state"), "?")
        rows.append(Row(name, (
            name, st, fmt_age(n.get("since_s")), _str(n.get("location")), _gpus(facts), engines,
            f"{ready}/{len(ids)}" if ids else DASH, _str(n.get("reason"), ""),
        ), NODE_TONES.get(st, "")))
    return _filtered(rows, text)


def _labels_line(labels: Mapping[str, Any], mark: Mapping[str, Any]) -> str:
    if not labels:
        return DASH
    return "  ".join(f"{k}={v}{'*' if k in mark else ''}" for k, v in sorted(labels.items()))


def node_detail(node: Mapping[str, Any] | None) -> list[str]:
    """The selected node's labels (operator-set ones starred), facts and replicas."""
    if node is None:
        return ["no node selected"]
    facts = as_dict(node.get("facts"))
    ops = as_dict(node.get("operator_labels"))
    gpus = as_list(facts.get("gpus"))
    gpu_line = "  ".join(f"#{g.get('index', '?')} {_str(g.get('name'), 'gpu')} {fmt_mem(g.get('memory_mb'))}"
                         for g in gpus) or DASH
    replicas = _strs(node.get("replicas"))
    return [
        f"{_str(node.get('name'), '?')} — {_str(node.get('state'), '?')} for {fmt_age(node.get('since_s'))}"
        + (f": {node['reason']}" if node.get("reason") else ""),
        f"labels   {_labels_line(as_dict(node.get('labels')), ops)}",
        (f"host     {_str(facts.get('hostname'))}  {facts.get('cpus', DASH)} cpus  {fmt_mem(facts.get('memory_mb'))}"
         f"   agent {_str(facts.get('agent_version'))} {'connected' if node.get('connected') else 'disconnected'}, "
         f"last heard {fmt_age(node.get('last_seen_s'))} ago"),
        f"gpus     {gpu_line}",
        f"replicas {', '.join(replicas) or DASH}",
        *([f"held     {', '.join(_strs(node.get('held')))}: nothing new is placed here (llmgw ctl facility)"]
          if _strs(node.get("held")) else []),
        "(* = set by an operator, overriding the agent's; l edits)",
    ]


# -- models and replicas ----------------------------------------------------------------------------
# autoscale: count/ready/starting [min–max] and the autoscaler's mode or pin (autoscale_rows.py)
MODEL_COLUMNS = (Column("model"), Column("engine"), Column("source"), Column("ready", toned=True),
                 Column("desired"), Column("autoscale"), Column("static"), Column("unplaceable"))


def model_rows(state: ConsoleState, text: str = "") -> list[Row]:
    rows = []
    for m in state.models:
        name = _str(m.get("name"), "?")
        placed, ready = m.get("replicas", 0), m.get("ready", 0)
        desired = m.get("desired_replicas")
        why = _str(m.get("unplaceable"), "")
        tone = "bad" if why else ("good" if placed and ready == placed else ("warn" if placed else ""))
        rows.append(Row(name, (
            name, _str(m.get("engine"), "?"), _str(m.get("source"), "?"), f"{ready}/{placed}",
            DASH if desired is None else str(desired) + (f" ({g})" if (g := groups_text(m)) else ""),
            autoscale_cell(state.autoscale.get(name)),
            str(m.get("static_replicas", 0)), why or DASH,
        ), tone))
    return _filtered(rows, text)


REPLICA_COLUMNS = (Column("replica"), Column("model"), Column("node"), Column("state", toned=True),
                   Column("route"), Column("inflight"), Column("run/wait"), Column("kv"), Column("breaker"),
                   Column("restarts"), Column("detail"))


def _run_wait(ep: Mapping[str, Any]) -> str:
    run, wait = ep.get("running"), ep.get("waiting")
    if run is None and wait is None:
        return DASH
    return f"{fmt_count(run)}/{fmt_count(wait)}"


def replica_rows(state: ConsoleState, text: str = "") -> list[Row]:
    """Placed replicas with the router's view of each, then the static endpoints (no node)."""
    endpoints = {str(e.get("id")): e for e in state.endpoints}
    rows = []
    seen = set()
    for r in state.replicas:
        rid = _str(r.get("replica"), "?")
        seen.add(rid)
        ep = endpoints.get(rid, {})
        st = _str(r.get("state"), "?")
        desired = _str(r.get("desired"), "run")
        rows.append(Row(rid, (
            rid, _str(r.get("model"), "?"), _str(r.get("node")), st if desired == "run" else f"{st} ({desired})",
            "yes" if r.get("routable") else "no", str(r.get("inflight", ep.get("inflight", 0))), _run_wait(ep),
            fmt_pct(ep.get("kv_usage")), _str(as_dict(ep.get("breaker")).get("state")),
            str(r.get("restarts", 0)), _str(r.get("detail"), ""),
        ), REPLICA_TONES.get(st, "")))
    for e in state.endpoints:
        eid = _str(e.get("id"), "?")
        if eid in seen:
            continue
        breaker = _str(as_dict(e.get("breaker")).get("state"))
        detail = _str(e.get("scrape_error"), "") or ("metrics stale" if e.get("stale") else "")
        rows.append(Row(eid, (
            eid, _str(e.get("model"), "?"), _str(e.get("node"), "(static)"), "static",
            "no" if e.get("draining") else "yes", str(e.get("inflight", 0)), _run_wait(e),
            fmt_pct(e.get("kv_usage")), breaker, DASH, detail,
        ), BREAKER_TONES.get(breaker, "")))
    return _filtered(rows, text)


def replica_detail(state: ConsoleState, rid: str | None, tail: int = 4) -> list[str]:
    """The selected replica: where it runs, and the engine's last output lines."""
    if rid is None:
        return ["no replica selected"]
    r = next((x for x in state.replicas if x.get("replica") == rid), None)
    ep = next((x for x in state.endpoints if x.get("id") == rid), {})
    url = (r or {}).get("url") or ep.get("url")
    lines = [f"{rid}  url {_str(url)}"]
    if r is not None:
        gpus = ",".join(_strs(r.get("gpus")))
        lines[0] += f"  pid {r.get('pid') or DASH}  gpus {gpus or DASH}  generation {r.get('generation', DASH)}"
        if r.get("reason"):
            lines.append(f"reason   {r['reason']}")
        log = _strs(r.get("log_tail"))
        lines += [f"log      {x}" for x in log[-tail:]] or ["log      (no output)"]
    brk = as_dict(ep.get("breaker"))
    if brk.get("last_failure"):
        lines.append(f"breaker  {brk.get('state', '?')}, last failure {brk['last_failure']} "
                     f"({brk.get('failures_total', 0)} failures, opened {brk.get('opened_total', 0)}×)")
    return lines


# -- decisions --------------------------------------------------------------------------------------
DECISION_COLUMNS = (Column("time"), Column("request"), Column("model"), Column("chosen", toned=True),
                    Column("strategy"), Column("picker"), Column("cands"), Column("drops"), Column("took"),
                    Column("note"))


def decision_rows(state: ConsoleState, text: str = "", tz: tzinfo | None = None) -> list[Row]:
    rows = []
    for e in state.decisions:
        d = e.decision
        cands = as_list(d.get("candidates"))
        n = int(_num(d.get("n_candidates"), len(cands)))
        chosen = d.get("chosen")
        rid = _str(d.get("request_id"), "?")
        rows.append(Row(str(e.seq), (
            fmt_time(d.get("decided_at"), tz), _short(rid, REQUEST_ID_WIDTH), _str(d.get("model"), "?"),
            _str(chosen, "none"), _str(d.get("strategy")), _str(d.get("picker")), str(max(n, len(cands))),
            str(len(as_list(d.get("dropped")))), fmt_us(d.get("decide_us")), _note(d),
        ), "good" if isinstance(chosen, str) and chosen else "bad", rid))
    return _filtered(rows, text)


def _note(d: Mapping[str, Any]) -> str:
    """The decision's note; a split request's decision says its step first (prefill / decode)."""
    note = _str(d.get("note"), "")
    phase = d.get("phase")
    return f"{phase} step{'; ' + note if note else ''}" if isinstance(phase, str) and phase else note


def decisions_caption(shown: int, matching: int, kept: int, text: str) -> str:
    """What the decisions table holds: the filter searches all kept decisions, the table shows the newest."""
    if text.strip():
        head = f"{matching} of {kept} kept decisions match “{text.strip()}”"
    else:
        head = f"{kept} decisions kept"
    return head + (f", newest {shown} shown" if shown < matching else "")


@dataclass(frozen=True, slots=True)
class RationaleView:
    """One decision's rationale as the console shows it: llmgw.admin_client.rationale's layout (the
    one `llmgw ctl explain` prints), its rows toned — the chosen candidate good, the drops dim."""

    facts: list[tuple[str, str]]
    columns: tuple[str, ...]
    candidates: list[Row]
    hidden: int  # candidates scored but not kept in the decision (it keeps the best few)
    drops: list[Row] = field(default_factory=list)
    candidates_title: str = ""
    drops_title: str = ""


def rationale(d: Mapping[str, Any], tz: tzinfo | None = None) -> RationaleView:
    r = explain(d, tz)
    rows = [Row(str(i), c.cells, "good" if c.chosen else "") for i, c in enumerate(r.candidates)]
    drops = [Row(str(i), cells, "dim") for i, cells in enumerate(r.drops)]
    return RationaleView(r.facts, r.columns, rows, r.hidden, drops, r.candidates_title, r.drops_title)


# -- the link ---------------------------------------------------------------------------------------
def banner_text(where: str, link: Link) -> str | None:
    """The unreachable banner, or None while the stream is up (or before the first failure)."""
    if link.connected or link.attempt == 0:
        return None
    return f"daemon unreachable at {where} — retrying (attempt {link.attempt}): {link.reason}"


def status_line(state: ConsoleState, where: str) -> str:
    """The stream's state and the fleet in numbers (the header names the daemon; ``where`` is
    for the moments before any data)."""
    link = state.link
    if link.connected:
        head = f"● live, rev {state.rev}"
    elif state.snapshots:
        head = f"○ reconnecting (showing rev {state.rev})"
    elif link.attempt:
        head = "○ unreachable"
    else:
        head = f"○ connecting to {where}…"
        if not state.nodes:
            return head
    ready_nodes = sum(1 for n in state.nodes if n.get("state") == "ready")
    ready_reps = sum(1 for r in state.replicas if r.get("state") == "ready")
    parts = [head, f"nodes {ready_nodes}/{len(state.nodes)} ready", f"models {len(state.models)}",
             f"replicas {ready_reps}/{len(state.replicas)} ready", f"endpoints {len(state.endpoints)}",
             f"decisions {len(state.decisions)}"]
    if state.store.get("state") == "degraded":  # the router runs from memory: an operator must know
        parts.insert(1, f"store: degraded ({state.store.get('reason') or 'unknown'})")
    if (ha := routers_part(state.routers)) is not None:
        parts.insert(1, ha)
    return "  ·  ".join(parts)


def routers_part(r: dict[str, Any]) -> str | None:
    """Several routers on one store: which this one is, who leads, at what epoch, and the store's
    health as this router's calls find it (None for a router alone)."""
    if not r.get("ha"):
        return None
    live = sum(1 for x in as_list(r.get("routers")) if as_dict(x).get("role") != "gone")
    this, leader = _str(r.get("this_router"), "?"), r.get("leader")
    role = "leader" if leader == this else f"follower of {_str(leader, '?')}" if leader else "no leader"
    store = "" if r.get("store_ok", True) else f", store FAILING ({_str(r.get('store_error'), '?')})"
    return f"router {this}: {role} (epoch {r.get('epoch', 0)}, {live} routers{store})"
