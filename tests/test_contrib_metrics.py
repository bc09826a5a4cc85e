"""The Grafana dashboard (contrib/grafana/llmgw.json) and the Prometheus alerts
(contrib/prometheus/alerts.yml) name only metrics a running router exports: a router daemon in
front of a simulated vLLM, a request through it, then every ``llmgw_*`` name in the files is
looked up in its /metrics (counters as ``_total``/``_created``, histograms as
``_bucket``/``_count``/``_sum``). A renamed metric breaks this test, not an operator's dashboard."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # PyYAML: a test dependency through schemathesis

from .conftest import start_sim
from .test_router_integration import Daemon, write_config

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "contrib" / "grafana" / "llmgw.json"
ALERTS = ROOT / "contrib" / "prometheus" / "alerts.yml"
NAME = re.compile(r"\bllmgw_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("", "_count", "_sum", "_created"), "info": ("_info",)}


def dashboard_exprs() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in d["templating"]["list"] if "definition" in v]
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def sample_labels(text: str) -> dict[str, set[str]]:
    """The label names each sample name carries in the exposition."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("llmgw_"):
            name, _, rest = line.partition("{")
            name = name.split(" ")[0]
            labels = {kv.split("=", 1)[0] for kv in rest.rpartition("}")[0].split(",") if "=" in kv} if rest else set()
            out.setdefault(name, set()).update(labels)
    return out


def exported_names(text: str) -> set[str]:
    """Every sample name the exposition can carry, from its # TYPE lines (a family without
    samples yet still counts: its series appear with the first event)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            base = family.removesuffix("_total") if kind == "counter" else family
            names.update(base + s for s in SUFFIXES.get(kind, ("",)))
    return names


@pytest.fixture
def metrics_text(tmp_path: Path) -> Iterator[str]:
    started: list[Any] = []
    try:
        s = start_sim(["--engine", "vllm", "m", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost"])
        started.append(s)
        cfg = write_config(tmp_path, [{"name": "m", "replicas": [{"url": s.url}]}])
        # a router that accepts agents, so tier 2's index (and its metrics) exists too
        cfg.write_text(cfg.read_text().replace("[control]\n", '[control]\nlisten = "127.0.0.1:0"\n'
                                                              'join_token = "a-join-token-for-the-test-0123"\n'))
        d = Daemon(cfg)
        started.append(d)
        for _ in range(2):
            r = httpx.post(f"{d.url}/v1/chat/completions", timeout=30,
                           json={"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
        yield httpx.get(f"{d.url}/metrics").text
    finally:
        for p in reversed(started):
            p.stop()


def test_dashboard_and_alerts_parse_and_are_well_formed() -> None:
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in d["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
    rules = alert_rules()
    assert {"LlmgwPrefixZeroHits", "LlmgwAllBreakersOpen", "LlmgwReplicaStale", "LlmgwAdmissionRejecting",
            "LlmgwStoreDegraded"} <= {r["alert"] for r in rules}
    for r in rules:
        assert r["expr"].strip() and r["labels"]["severity"] and r["annotations"]["summary"], r["alert"]
        assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]


def test_every_metric_the_dashboard_and_alerts_name_exists(metrics_text: str) -> None:
    exported = exported_names(metrics_text)
    assert "llmgw_requests_total" in exported and "llmgw_time_to_first_byte_seconds_bucket" in exported
    for source, exprs in (("dashboard", dashboard_exprs()), ("alerts", [r["expr"] for r in alert_rules()])):
        used = {n for e in exprs for n in NAME.findall(e)}
        assert used, source
        missing = sorted(used - exported)
        assert not missing, f"{source} names metrics the router does not export: {missing}"


def test_the_labels_the_dashboard_and_alerts_use_exist(metrics_text: str) -> None:
    """Each ``by (...)`` and selector label is a label of a metric the expression names (checked
    for the metrics that have samples after a request; the rest have no series yet)."""
    have = sample_labels(metrics_text)
    exprs = dashboard_exprs() + [r["expr"] for r in alert_rules()]
    for e in exprs:
        names = [n for n in NAME.findall(e) if n in have]
        if not names:
            continue
        known = set().union(*(have[n] for n in names)) | {"instance", "job"}  # added by Prometheus
        used = {x.strip() for group in re.findall(r"\bby \(([^)]*)\)", e) for x in group.split(",") if x.strip()}
        for n in names:
            for sel in re.findall(re.escape(n) + r"\{([^}]*)\}", e):
                used |= {re.split(r"=~|!=|!~|=", kv)[0].strip() for kv in re.split(r",\s*", sel)
                         if re.search(r"=|!~", kv)}
        assert used <= known, f"{e}: labels {sorted(used - known)} not on {names}"
