"""An eval run's arithmetic: one case's answer against its checks, the run's totals and verdict,
and its comparison with the live revision's last result. Pure: the control plane's runner
(llmgw/daemon/control/lifecycle/eval_runner.py) sends the requests and measures; this judges.

A result is plain data (what the store keeps and the admin API answers):
``{"suite", "model", "revision", "revision_id", "started_at", "ended_at", "passed", "pass_rate",
"threshold", "totals": {...}, "cases": [{"name", "passed", "failures", "excerpt", "ttft_ms",
"latency_ms", "tokens", "error"}], "compare": {...} | None}``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from llmgw.inputs.nesting import json_loads
from llmgw.lifecycle.json_schema import validate
from llmgw.lifecycle.suites import Case, Suite

__all__ = ["EXCERPT_CHARS", "MAX_ANSWER_CHARS", "Answer", "compare", "judge", "summarize"]

MAX_ANSWER_CHARS = 256 * 1024  # what the runner keeps of an answer (checks see at most this)
EXCERPT_CHARS = 300  # what a result keeps of it
MAX_FAILURES = 12  # failed checks listed per case
MAX_FAILURE_CHARS = 300


@dataclass(frozen=True)
class Answer:
    """What one case's request gave: the text (capped), the completion's token count as the
    engine reported it (None if it did not), times from sending to the first content and to the
    end, and an error (a status, a timeout, a broken stream) instead of an answer."""

    text: str = ""
    tokens: int | None = None
    ttft_ms: float | None = None
    latency_ms: float | None = None
    error: str | None = None


def judge(case: Case, a: Answer) -> dict[str, Any]:
    """One case's verdict, with every check that failed (not only the first)."""
    fails: list[str] = []
    if a.error is not None:
        fails.append(a.error)
    else:
        c = case.checks
        text = a.text
        fails += [f"does not contain {s[:60]!r}" for s in c.contains if s not in text]
        fails += [f"contains {s[:60]!r}" for s in c.not_contains if s in text]
        if c.regex is not None and re.search(c.regex, text) is None:
            fails.append(f"does not match /{c.regex[:60]}/")
        if c.equals is not None and text.strip() != c.equals.strip():
            fails.append(f"does not equal {c.equals[:60]!r}")
        if c.json or c.json_schema is not None:
            try:
                doc = json_loads(_strip_fence(text))
            except ValueError as e:  # not JSON, or nested too deeply (a model's answer is untrusted)
                fails.append(f"not JSON: {e}")
            else:
                if c.json_schema is not None and (why := validate(doc, c.json_schema)) is not None:
                    fails.append(f"JSON schema: {why}")
        if c.max_tokens is not None:
            if a.tokens is None:
                fails.append("the engine reported no token count")
            elif a.tokens > c.max_tokens:
                fails.append(f"{a.tokens} tokens > {c.max_tokens}")
        if c.max_ttft_ms is not None and (a.ttft_ms is None or a.ttft_ms > c.max_ttft_ms):
            fails.append(f"TTFT {_ms(a.ttft_ms)} > {c.max_ttft_ms:g} ms")
        if c.max_latency_ms is not None and (a.latency_ms is None or a.latency_ms > c.max_latency_ms):
            fails.append(f"latency {_ms(a.latency_ms)} > {c.max_latency_ms:g} ms")
    if len(fails) > MAX_FAILURES:
        fails = fails[:MAX_FAILURES - 1] + [f"and {len(fails) - MAX_FAILURES + 1} more"]
    fails = [f if len(f) <= MAX_FAILURE_CHARS else f[:MAX_FAILURE_CHARS - 1] + "…" for f in fails]
    return {"name": case.name, "passed": not fails, "failures": fails, "excerpt": a.text[:EXCERPT_CHARS],
            "ttft_ms": _round(a.ttft_ms), "latency_ms": _round(a.latency_ms), "tokens": a.tokens,
            "error": a.error}


def summarize(suite: Suite, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals and the verdict: passed when the share of passing cases reaches the threshold."""
    n = len(cases)
    passed = sum(1 for c in cases if c["passed"])
    rate = passed / n if n else 0.0
    ttfts = sorted(c["ttft_ms"] for c in cases if c["ttft_ms"] is not None)
    lats = sorted(c["latency_ms"] for c in cases if c["latency_ms"] is not None)
    totals = {"cases": n, "passed": passed, "failed": n - passed,
              "errors": sum(1 for c in cases if c["error"] is not None),
              "ttft_ms_p50": _pct(ttfts, 0.5), "ttft_ms_p90": _pct(ttfts, 0.9),
              "latency_ms_p50": _pct(lats, 0.5), "latency_ms_p90": _pct(lats, 0.9)}
    return {"passed": n > 0 and rate + 1e-9 >= suite.pass_threshold, "pass_rate": round(rate, 4),
            "threshold": suite.pass_threshold, "totals": totals}


def compare(result: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any] | None:
    """This result beside the live revision's last one of the same suite: the pass rates, the
    p50 TTFT and latency, and the cases that pass on one and not the other."""
    if live is None:
        return None
    mine = {c["name"]: c["passed"] for c in result["cases"]}
    cases = live.get("cases")  # a stored result: what the disk holds is checked, not trusted
    theirs = {c.get("name"): c.get("passed") for c in cases if isinstance(c, dict)} if isinstance(cases, list) else {}
    t, lt = result["totals"], live.get("totals") if isinstance(live.get("totals"), dict) else {}
    return {"live_revision_id": live.get("revision_id"), "live_at": live.get("ended_at"),
            "pass_rate": result["pass_rate"], "live_pass_rate": live.get("pass_rate"),
            "ttft_ms_p50": t.get("ttft_ms_p50"), "live_ttft_ms_p50": lt.get("ttft_ms_p50"),
            "latency_ms_p50": t.get("latency_ms_p50"), "live_latency_ms_p50": lt.get("latency_ms_p50"),
            "newly_failing": sorted(n for n, ok in mine.items() if not ok and theirs.get(n) is True),
            "newly_passing": sorted(n for n, ok in mine.items() if ok and theirs.get(n) is False)}


def _strip_fence(text: str) -> str:
    """Models often wrap JSON in a ``` fence: the fenced part, if the whole answer is one."""
    s = text.strip()
    m = re.fullmatch(r"```[A-Za-z0-9]*\n(.*)\n```", s, re.DOTALL)
    return m.group(1) if m else s


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def _ms(v: float | None) -> str:
    return "none" if v is None else f"{v:.0f} ms"
