"""`llmgw ctl`'s commands on a model's count (docs/autoscaling.md): `scale MODEL N` (on an
autoscaled model it pins N), `scale MODEL --release` (the autoscaler decides again), and
`explain-scale [MODEL]`: the autoscaler's inputs, its rule, the decision, what limited it and the
last decisions (without MODEL: every autoscaled model, one line each). main registers them
(``register``); they print with output's functions."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from llmgw.cli.ctl.output import CtlError, age, emit, table

__all__ = ["autoscale_table", "check_scale", "explain_scale_text", "register", "scale_text"]

# the inputs, in the order a reader follows the rule: load, its trend, the SLO figures, capacity
_INPUTS = (("concurrency", "concurrency (window)"), ("concurrency_panic", "concurrency (panic window)"),
           ("concurrency_predicted", "concurrency (predicted)"), ("arrival_rate", "arrivals per second"),
           ("slope_per_s", "trend (per second)"), ("queue_per_replica", "queue per replica"),
           ("kv_usage", "KV cache use"), ("ttft_p90_s", "TTFT p90 (s)"),
           ("capacity_per_replica", "capacity per replica"), ("cold_start_s", "cold start (s)"), ("idle_s", "idle (s)"),
           ("raw_panic", "recommended in panic"))


def _m(name: str) -> str:
    return quote(name, safe="")


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _count(d: dict[str, Any]) -> str:
    """`count (ready + starting)`, the way a reader checks coming capacity."""
    return f"{d.get('current', d.get('count', '?'))} ({d.get('ready', 0)} ready + {d.get('starting', 0)} starting)"


def _when(t: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "-"


def explain_scale_text(v: dict[str, Any]) -> str:
    """GET /models/{name}/autoscale, readable in a terminal: where the model stands, the inputs,
    the rule, the decision and what limited it, then the decisions that changed the count."""
    pinned = v.get("pinned")
    lines = [f"model      {v.get('model')}: {v.get('metric')} target {_num(v.get('target'))} per replica, "
             f"{v.get('min')}–{v.get('max')} replicas",
             f"count      {v.get('count')} in force; {v.get('ready', 0)} ready, {v.get('starting', 0)} starting"
             + (f"; PINNED at {pinned} (`llmgw ctl scale {v.get('model')} --release` hands it back)"
                if pinned is not None else ""),
             f"cold start {_num(v.get('cold_start_s'))} s placed → ready"
             + (f" (the config's prior: {_num(prior)} s)" if (prior := (v.get("settings") or {}).get("cold_start_s"))
                is not None and prior != v.get("cold_start_s") else "")
             + f"; woke from zero {v.get('cold_starts', 0)} times"]
    inputs = v.get("inputs") or {}
    known = [k for k, _ in _INPUTS if k in inputs]
    if inputs:
        lines.append("inputs")
        names = dict(_INPUTS)
        for k in [*known, *sorted(k for k in inputs if k not in names)]:
            lines.append(f"  {names.get(k, k):<28} {_num(inputs[k])}")
    d = v.get("decision")
    if d is None:
        lines.append("decision   none yet (the leader decides every [control] autoscale_interval_s)")
    else:
        lines.append(f"rule       {d.get('rule') or '-'}")
        change = "unchanged" if d.get("desired") == d.get("current") else "→"
        lines.append(f"decision   {_when(d.get('t_wall'))} {_count(d)} {change} {d.get('desired')} "
                     f"(recommended {d.get('raw')}; mode {d.get('mode')})"
                     + (f": {d['reason']}" if d.get("reason") else ""))
        limits = d.get("limited_by") or []
        lines.append("limited by " + ("; ".join(map(str, limits)) if limits else "nothing"))
    history = v.get("history") or []
    if history:
        lines.append("last decisions (newest first)")
        lines.append(table([[_when(h.get("t_wall")), f"{h.get('current')} → {h.get('desired')}", h.get("mode"),
                             h.get("reason") or "", "; ".join(h.get("limited_by") or [])] for h in history],
                           ["TIME", "COUNT", "MODE", "REASON", "LIMITED BY"]))
    else:
        lines.append("last decisions: none changed the count yet")
    settings = v.get("settings") or {}
    if settings:
        lines.append("settings   " + ", ".join(f"{k} {_num(x)}" for k, x in sorted(settings.items())))
    return "\n".join(lines)


def autoscale_table(views: list[dict[str, Any]]) -> str:
    if not views:
        return "no model has [models.autoscale] (docs/autoscaling.md)"
    rows = []
    for v in views:
        d = v.get("decision") or {}
        rows.append([v.get("model"), f"{v.get('min')}–{v.get('max')}", f"{v.get('metric')} {_num(v.get('target'))}",
                     v.get("count"), v.get("ready", 0), v.get("starting", 0),
                     "-" if v.get("pinned") is None else v["pinned"], d.get("mode") or "-",
                     age(time.time() - d["t_wall"]) if isinstance(d.get("t_wall"), (int, float)) else "-",
                     "; ".join(d.get("limited_by") or []) or ""])
    return table(rows, ["MODEL", "BOUNDS", "TARGET", "COUNT", "READY", "STARTING", "PINNED", "MODE", "DECIDED",
                        "LIMITED BY"])


def cmd_explain_scale(api: Any, ns: argparse.Namespace) -> None:
    if ns.model is None:
        emit(ns, api.call("GET", "/autoscale"), autoscale_table)
        return
    emit(ns, api.call("GET", f"/models/{_m(ns.model)}/autoscale"), explain_scale_text)


def scale_text(model: str, replicas: int | None, answer: dict[str, Any]) -> str:
    """What `ctl scale` did, from the model's definition it answered."""
    if replicas is None:
        return (f"model {model}: the pin is released; its autoscaler decides the count again "
                f"(`llmgw ctl explain-scale {model}` shows why)")
    if answer.get("autoscale"):
        return (f"model {model}: pinned at {replicas} replicas; the autoscaler resumes after "
                f"`llmgw ctl scale {model} --release`")
    return f"model {model} scaled to {replicas} replicas"


def check_scale(ns: argparse.Namespace) -> None:
    """N or --release, one of them; N >= 0 (checked before connecting)."""
    if ns.release and ns.replicas is not None:
        raise CtlError(f"scale {ns.model}: give N (pin a count) or --release (unpin it), not both")
    if not ns.release and ns.replicas is None:
        raise CtlError(f"scale {ns.model}: N is missing: `llmgw ctl scale {ns.model} N`, or `--release` to hand an "
                       "autoscaled model's count back to its autoscaler")
    if ns.replicas is not None and ns.replicas < 0:
        raise CtlError(f"scale {ns.model}: N must be 0 or more, got {ns.replicas}")


def cmd_scale(api: Any, ns: argparse.Namespace) -> None:
    check_scale(ns)
    body = {"release": True} if ns.release else {"replicas": ns.replicas}
    answer = api.call("POST", f"/models/{_m(ns.model)}/scale", body=body)
    emit(ns, answer, lambda a: scale_text(ns.model, ns.replicas, a or {}))


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    sp = add("scale", cmd_scale, "set a model's replica count (on an autoscaled model: pin it; --release unpins)",
             "Sets the model's deploy count. On a model with [models.autoscale] the count is pinned: the autoscaler "
             "holds it until `llmgw ctl scale MODEL --release` hands it back (docs/autoscaling.md).")
    sp.add_argument("model", metavar="MODEL", help="the model's name")
    sp.add_argument("replicas", type=int, nargs="?", metavar="N",
                    help="the number of replicas it should have (0 stops them all)")
    sp.add_argument("--release", action="store_true",
                    help="instead of N: unpin an autoscaled model's count (its autoscaler decides again)")
    sp.set_defaults(check=check_scale)
    sp = add("explain-scale", cmd_explain_scale, "why an autoscaled model has the replicas it has (without MODEL: "
             "every autoscaled model)",
             "For an autoscaled model: the count in force, the inputs the autoscaler read (concurrency, trend, "
             "queue, KV use, TTFT, cold start), its rule in one sentence, the latest decision with what limited it "
             "(bounds, delays, a pin, placement), and the last decisions that changed the count. Without MODEL: "
             "one line per autoscaled model.")
    sp.add_argument("model", nargs="?", metavar="MODEL", help="the model's name")
