"""A pytest plugin that closes the run with what was skipped and why, grouped by reason, so that a
run which skipped the real-engine tests says so at the end instead of passing quietly.

scripts/test loads it (`-p tests.skip_summary`) and tells it, in LLMGW_LLAMA_WHY, why there is no
llama-server (LLMGW_SKIP_LLAMA was set, or the build failed and where its log is)."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

REAL_ENGINE_MARK = "realengine"
NO_SERVER = "LLMGW_LLAMA_SERVER is not set; scripts/test builds one with scripts/build-llama-server"


def skip_reason(report: Any) -> str:
    """The reason a skip report gives (pytest keeps it as (path, line, "Skipped: why"))."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def is_real_engine(report: Any, reason: str) -> bool:
    return REAL_ENGINE_MARK in getattr(report, "keywords", {}) or "LLMGW_LLAMA_SERVER" in reason


def summary_lines(reports: list[Any], why_no_server: str | None) -> list[str]:
    """The closing block's lines for these skip reports."""
    real: list[Any] = []
    other: dict[str, int] = {}
    for rep in reports:
        reason = skip_reason(rep)
        if is_real_engine(rep, reason):
            real.append(rep)
        else:
            other[reason] = other.get(reason, 0) + 1
    if not real and not other:
        return ["nothing was skipped"]
    lines = []
    if real:
        reasons = sorted({skip_reason(r) for r in real})
        unset = all("LLMGW_LLAMA_SERVER is not set" in r for r in reasons)
        why = why_no_server or (NO_SERVER if unset else "; ".join(reasons))
        lines.append(f"{_tests(len(real))} against a real llama-server skipped: no llama-server ({why})")
    for reason, n in sorted(other.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"{_tests(n)} skipped: {reason}")
    return lines


def _tests(n: int) -> str:
    return f"{n} test" if n == 1 else f"{n} tests"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: Any) -> Generator[None, None, None]:
    yield  # after pytest's own summaries (the -rs list included): this block is the last before the totals
    reports = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "skipped", False)]
    terminalreporter.section("what was skipped, and why", sep="=")
    for line in summary_lines(reports, os.environ.get("LLMGW_LLAMA_WHY") or None):
        terminalreporter.write_line(line)
