"""`llmgw ctl` against a running one-process daemon (router + agent + simulated engines), in both
output modes, over the Unix socket and over TCP with the token."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_router_integration import Daemon, free_port
from .test_sim_vllm import wait_for

TOKEN = "adm-Token-77"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ctl")
    sock = tmp / "admin" / "admin.sock"
    tcp = f"127.0.0.1:{free_port()}"
    cfg = tmp / "llmgw.toml"
    cfg.write_text(f"""
[server]
host = "127.0.0.1"
[router]
scrape_interval_s = 0.2
[admin]
socket = {json.dumps(str(sock))}
tcp = "{tcp}"
token = "{TOKEN}"
[control]
listen = "127.0.0.1:0"
store = {json.dumps(str(tmp / "router.db"))}
[agent]
node = "box-1"
state_dir = {json.dumps(str(tmp / "agent"))}
labels = {{ "llmgw.io/site" = "lab", "llmgw.io/rack" = "r1" }}
[sim]
replicas = 2
""")
    d = Daemon(cfg, role="router,agent")
    try:
        admin = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x")
        wait_for(lambda: sum(r["state"] == "ready" for r in admin.get("/api/v1/replicas").json()) == 2, 30)
        for i in range(3):
            r = httpx.post(f"{d.url}/v1/chat/completions", headers={"x-request-id": f"req-{i}"},
                           json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2})
            assert r.status_code == 200
        yield {"socket": str(sock), "tcp": f"http://{tcp}", "config": str(cfg), "url": d.url}
    finally:
        d.stop()


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", *args], capture_output=True, text=True, timeout=30)


def test_nodes_table_and_json_with_location(daemon: dict[str, Any]) -> None:
    r = ctl("--socket", daemon["socket"], "nodes")
    assert r.returncode == 0, r.stderr
    header, row = r.stdout.splitlines()[:2]
    assert header.split()[:4] == ["NAME", "STATE", "LOCATION", "GPUS"]
    assert row.split()[:3] == ["box-1", "ready", "lab/r1"]
    j = json.loads(ctl("nodes", "-o", "json", "--socket", daemon["socket"]).stdout)
    assert j[0]["name"] == "box-1" and len(j[0]["replicas"]) == 2
    assert ctl("--socket", daemon["socket"], "nodes", "--domain", "rack=r1").stdout.count("box-1") == 1
    assert "box-1" not in ctl("--socket", daemon["socket"], "nodes", "--domain", "rack=r2").stdout
    assert "box-1" in ctl("--socket", daemon["socket"], "nodes", "--domain", "lab").stdout


def test_status_readable_and_json(daemon: dict[str, Any]) -> None:
    r = ctl("--socket", daemon["socket"], "status")
    assert r.returncode == 0, r.stderr
    assert '"' not in r.stdout and "{" not in r.stdout
    kv = {ln[:20].strip(): ln[21:] for ln in r.stdout.splitlines() if ln[:20].strip()}
    assert kv["nodes"] == "1 ready" and kv["partition suspected"] == "no" and kv["unknown engines"] == "none"
    assert kv["store"].startswith("ok (") and kv["version"] and kv["router"]
    j = json.loads(ctl("--socket", daemon["socket"], "status", "-o", "json").stdout)
    assert j["nodes"] == {"ready": 1} and j["store"]["state"] == "ok" and j["partition_suspected"] is False


def test_label_sets_and_removes(daemon: dict[str, Any]) -> None:
    r = ctl("--socket", daemon["socket"], "label", "box-1", "llmgw.io/pdu=p9", "team=infer")
    assert r.returncode == 0, r.stderr
    assert "label      llmgw.io/pdu=p9  (operator)" in r.stdout
    assert "lab/r1/p9" in ctl("--socket", daemon["socket"], "nodes").stdout
    r = ctl("--socket", daemon["socket"], "label", "box-1", "team-")
    assert "team=" not in r.stdout
    bad = ctl("--socket", daemon["socket"], "label", "box-1", "=x")
    assert bad.returncode == 1 and "expected key=value" in bad.stderr


def test_models_replicas_endpoints(daemon: dict[str, Any]) -> None:
    s = ["--socket", daemon["socket"]]
    out = ctl(*s, "models").stdout
    assert "sim-model" in out and "2/2" in out
    defn = json.loads(ctl(*s, "models", "sim-model", "-o", "json").stdout)
    assert defn["name"] == "sim-model" and defn["deploy"]["count"] == 2
    one = ctl(*s, "models", "sim-model")
    assert one.returncode == 0, one.stderr
    assert not one.stdout.startswith("{") and '"' not in one.stdout
    assert f"{'model':20s} sim-model" in one.stdout and f"{'ready':20s} 2/2 replicas" in one.stdout
    assert "\n  deploy.count" in one.stdout and "\n  engine " in one.stdout
    reps = json.loads(ctl(*s, "replicas", "-o", "json").stdout)
    assert {r["state"] for r in reps} == {"ready"} and {r["node"] for r in reps} == {"box-1"}
    assert ctl(*s, "replicas").stdout.splitlines()[0].split()[:3] == ["REPLICA", "NODE", "STATE"]
    eps = json.loads(ctl(*s, "endpoints", "-o", "json").stdout)
    assert len(eps) == 2 and all(e["model"] == "sim-model" for e in eps)
    assert "BREAKER" in ctl(*s, "endpoints").stdout
    ads = json.loads(ctl(*s, "adapters", "-o", "json").stdout)  # vLLM replicas, none held
    assert len(ads["replicas"]) == 2 and all(r["used"] == 0 and r["cap"] == 4 for r in ads["replicas"])
    out = ctl(*s, "adapters").stdout
    assert out.split()[:3] == ["REPLICA", "MODEL", "SLOTS"] and "0/4" in out and "loads: none" in out


def test_decisions_and_explain(daemon: dict[str, Any]) -> None:
    s = ["--socket", daemon["socket"]]
    out = ctl(*s, "decisions").stdout
    assert "req-2" in out and "sim-model" in out
    r = ctl(*s, "explain", "req-1")
    assert r.returncode == 0, r.stderr
    assert "request   req-1" in r.stdout and "\nendpoint " in r.stdout and "dropped by filters" in r.stdout
    assert json.loads(ctl(*s, "explain", "req-1", "-o", "json").stdout)
    missing = ctl(*s, "explain", "no-such-request")
    assert missing.returncode == 1 and "404" in missing.stderr


def test_tcp_needs_the_token(daemon: dict[str, Any]) -> None:
    ok = ctl("--url", daemon["tcp"], "--token", TOKEN, "nodes", "-o", "json")
    assert ok.returncode == 0 and json.loads(ok.stdout)[0]["name"] == "box-1"
    bad = ctl("--url", daemon["tcp"], "--token", "wrong", "nodes")
    assert bad.returncode == 1 and "refused the token" in bad.stderr and "wrong" not in bad.stderr.split(":")[0]
    none = ctl("--url", daemon["tcp"], "nodes")
    assert none.returncode == 1 and "--url needs a token" in none.stderr


def test_scale_through_ctl(daemon: dict[str, Any]) -> None:
    s = ["--socket", daemon["socket"]]
    assert ctl(*s, "scale", "sim-model", "1").returncode == 0
    wait_for(lambda: len([r for r in json.loads(ctl(*s, "replicas", "-o", "json").stdout)
                          if r["desired"] == "run"]) == 1, 20)
    assert ctl(*s, "scale", "sim-model", "2").returncode == 0
    wait_for(lambda: sum(r["state"] == "ready" and r["desired"] == "run"
                         for r in json.loads(ctl(*s, "replicas", "-o", "json").stdout)) == 2, 30)


def test_help_reads_well() -> None:
    """Every option and argument of every command says what it is for; the shared options are
    grouped apart from a command's own; the top help ends with examples."""
    import argparse

    from llmgw.cli.ctl.main import COMMON_TITLE, parser

    top = parser()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in {"": top, **subs.choices}.items():
        for a in sp._actions:
            if isinstance(a, argparse._SubParsersAction) or a.dest == "help":
                continue
            assert a.help and a.help != argparse.SUPPRESS, f"ctl {name} {a.option_strings or a.dest}: no help"
            assert a.metavar or a.option_strings or a.choices, f"ctl {name} {a.dest}: a lowercase placeholder"
        text = sp.format_help()
        assert COMMON_TITLE in text and "--timeout SECONDS" in text
        if name:
            assert len(sp.description or "") > 15, f"ctl {name}: no description"
    top_help = top.format_help()
    assert "examples:" in top_help and "llmgw ctl explain REQUEST_ID" in top_help
    assert set(subs.choices) == {"status", "routers", "nodes", "join-info", "join-token", "label", "models", "scale",
                                 "replicas", "restart", "endpoints", "adapters", "decisions", "explain", "kv", "trace",
                                 "facility", "explain-placement", "explain-scale", "eval", "jobs", "suites", "config", "tenants", "keys",
                                 "usage"}


def test_kv_the_embedded_default_runs_tier2(daemon: dict[str, Any]) -> None:
    """Issue 21 item 22: the embedded default (no [[models]]: `[sim]`'s simulated vLLM replicas)
    publishes KV events, so tier 2 feeds, decides, and its parity check passes out of the box."""
    s = ("--socket", daemon["socket"])
    admin = httpx.Client(transport=httpx.HTTPTransport(uds=daemon["socket"]), base_url="http://x")
    text = "You are a helpful assistant for the embedded default. " * 12  # many KV blocks

    def tier2_decided() -> bool:
        r = httpx.post(f"{daemon['url']}/v1/chat/completions", timeout=10,
                       json={"model": "sim-model", "messages": [{"role": "user", "content": text}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        kv = admin.get("/api/v1/kv").json()
        return sum(x["tier2_decisions"] for x in kv["replicas"]) > 0

    wait_for(tier2_decided, 30)
    wait_for(lambda: any(x["parity"]["status"] == "ok" for x in admin.get("/api/v1/kv").json()["replicas"]), 30)
    data = json.loads(ctl(*s, "kv", "-o", "json").stdout)
    assert data["enabled"] is True and len(data["replicas"]) == 2 and data["decisions"]["decided"] > 0
    assert all(x["model"] == "sim-model" and x["lag_s"] is not None for x in data["replicas"])
    assert sum(x["messages"] for x in data["replicas"]) > 0 and data["blocks"] > 0
    r = ctl(*s, "kv")
    assert r.returncode == 0, r.stderr
    assert "no replica of a kv_events model" not in r.stdout and "sim-model/" in r.stdout and " ok " in r.stdout
    status = ctl(*s, "status").stdout
    assert any(ln.startswith("kv parity") and ln.endswith("no alarm") for ln in status.splitlines()), status


def test_errors_say_what_to_do(tmp_path: Path) -> None:
    r = ctl("--socket", str(tmp_path / "nope.sock"), "nodes")
    assert r.returncode == 1 and "is the daemon running?" in r.stderr and "llmgw daemon" in r.stderr
    r = ctl("--config", str(tmp_path / "missing.toml"), "nodes")
    assert r.returncode == 1 and "cannot read" in r.stderr
