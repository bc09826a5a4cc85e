"""`llmgw ctl tenants|keys|usage` against a running one-process daemon (router + agent + simulated
engines): tables and -o json, a key's secret printed once and never again, bad flags named,
and usage from the store (written as a router's flush writes it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from llmgw.cli.ctl.tenants import parse_expiry
from llmgw.daemon.control.store.sqlite import Store
from llmgw.tenants.usage import UsageRecord

from .test_router_integration import Daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ctl-tenants")
    sock = tmp / "admin" / "admin.sock"
    cfg = tmp / "llmgw.toml"
    cfg.write_text(f"""
[server]
host = "127.0.0.1"
[admin]
socket = {json.dumps(str(sock))}
[control]
listen = "127.0.0.1:0"
store = {json.dumps(str(tmp / "llmgw" / "router.db"))}
[agent]
node = "box-1"
state_dir = {json.dumps(str(tmp / "agent"))}
[sim]
replicas = 1
""")
    d = Daemon(cfg, role="router,agent")
    try:
        yield {"socket": str(sock), "db": str(tmp / "llmgw" / "router.db")}
    finally:
        d.stop()


def ctl(d: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", d["socket"], *args], capture_output=True,
                          text=True, timeout=30)


def ok(d: dict[str, Any], *args: str) -> str:
    r = ctl(d, *args)
    assert r.returncode == 0, (args, r.stderr)
    return r.stdout


def test_tenants_create_list_show_update_delete(daemon: dict[str, Any]) -> None:
    out = ok(daemon, "tenants", "create", "team-a", "--band", "high", "--weight", "2", "--rpm", "60",
             "--tokens-per-day", "100000", "--models", "sim-model,other", "--description", "the A team")
    assert "tenant       team-a" in out and "band         high, weight 2" in out
    assert "quota        rpm=60 tokens_per_day=100000" in out and "models       sim-model, other" in out
    header, row = ok(daemon, "tenants").splitlines()[:2]
    assert header.split()[:4] == ["TENANT", "BAND", "WEIGHT", "KEYS"]
    assert row.split()[:4] == ["team-a", "high", "2", "0"]
    j = json.loads(ok(daemon, "tenants", "list", "-o", "json"))
    assert [t["name"] for t in j] == ["team-a"] and j[0]["quota"] == {"rpm": 60, "tokens_per_day": 100000}
    out = ok(daemon, "tenants", "update", "team-a", "--rpm", "none", "--tpm", "5000", "--models", "all")
    assert "quota        tpm=5000 tokens_per_day=100000" in out and "models       all" in out
    assert json.loads(ok(daemon, "tenants", "show", "team-a", "-o", "json"))["quota"]["tpm"] == 5000
    assert "deleted" in ok(daemon, "tenants", "delete", "team-a")
    gone = ctl(daemon, "tenants", "show", "team-a")
    assert gone.returncode == 1 and "404" in gone.stderr and "No tenant" in gone.stderr


def test_bad_input_is_named(daemon: dict[str, Any]) -> None:
    for args, said in ((("tenants", "create", "Bad Name"), "name"), (("tenants", "create", "x", "--rpm", "-3"), "--rpm"),
                       (("tenants", "create", "x", "--weight", "0"), "weight"), (("tenants", "show"), "which tenant"),
                       (("tenants", "update", "nobody", "--rpm", "5"), "No tenant"),
                       (("keys", "create", "nobody"), "No tenant"), (("keys", "rotate", "x", "--grace", "soon"), "--grace"),
                       (("tenants", "frob"), "expected one of"), (("tenants", "update", "x"), "nothing to change")):
        r = ctl(daemon, *args)
        assert r.returncode == 1 and said in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_a_keys_secret_is_printed_once(daemon: dict[str, Any]) -> None:
    ok(daemon, "tenants", "create", "team-k")
    out = ok(daemon, "keys", "create", "team-k", "--name", "ci", "--expires", "30d", "--models", "sim-model",
             "--rpm", "5")
    secret = next(ln.split()[1] for ln in out.splitlines() if ln.startswith("key "))
    assert secret.startswith("sk-llmgw-") and "not kept and cannot be shown again" in out
    kid = secret.split("-")[2]
    listing = ok(daemon, "keys", "--tenant", "team-k")
    assert kid in listing and secret not in listing and "active" in listing
    shown = ok(daemon, "keys", "show", kid)
    assert secret not in shown and "state        active" in shown and "quota        rpm=5" in shown
    as_json = json.loads(ok(daemon, "keys", "show", kid, "-o", "json"))
    assert "key" not in as_json and "hash" not in as_json
    assert as_json["expires_at"] == pytest.approx(time.time() + 30 * 86400, abs=120)

    rotated = ok(daemon, "keys", "rotate", kid, "--grace", "1h")
    new_secret = next(ln.split()[1] for ln in rotated.splitlines() if ln.startswith("key "))
    assert new_secret != secret and f"replaces     {kid}" in rotated
    old = json.loads(ok(daemon, "keys", "show", kid, "-o", "json"))
    assert old["state"] == "active" and old["expires_at"] == pytest.approx(time.time() + 3600, abs=120)
    revoked = ok(daemon, "keys", "revoke", kid)
    assert "state        revoked" in revoked
    created = json.loads(ok(daemon, "keys", "create", "team-k", "-o", "json"))
    assert created["key"].startswith("sk-llmgw-") and created["state"] == "active"  # the one place it is
    states = {k["id"]: k["state"] for k in json.loads(ok(daemon, "keys", "list", "-o", "json"))}
    assert states[kid] == "revoked" and list(states.values()).count("active") == 2


def test_usage_table_and_json(daemon: dict[str, Any]) -> None:
    now = int(time.time()) // 60 * 60
    with Store.open(daemon["db"]) as st:  # what a router's flush writes (WAL: the daemon's file is shared)
        st.add_usage("other-router", [UsageRecord(now - 60, "team-u", "k1", "sim-model", 3, 300, 100, 30, 1),
                                      UsageRecord(now - 120, "team-u", "k2", "m2", 1, 10, 0, 5, 0)])
    rep = json.loads(ok(daemon, "usage", "--tenant", "team-u", "--by", "model", "--since", "1d", "-o", "json"))
    assert [(g["model"], g["requests"], g["total_tokens"]) for g in rep["rows"]] == [("m2", 1, 15),
                                                                                     ("sim-model", 3, 330)]
    assert rep["total"]["requests"] == 4 and rep["filters"] == {"tenant": "team-u"}
    table = ok(daemon, "usage", "--by", "key", "--since", "2h")
    lines = table.splitlines()
    assert lines[0].startswith("usage from ") and "by key" in lines[0]
    assert lines[1].split()[:3] == ["TENANT", "KEY", "REQUESTS"]
    assert any(ln.split()[:3] == ["team-u", "k1", "3"] for ln in lines) and lines[-1].split()[:2] == ["total", "4"]
    bad = ctl(daemon, "usage", "--since", "yesterday")
    assert bad.returncode == 1 and "since" in bad.stderr


def test_expiry_forms() -> None:
    assert parse_expiry("30d", 1000.0) == 1000.0 + 30 * 86400
    assert parse_expiry("2027-01-31", 0) == 1801353600.0  # 2027-01-31T00:00Z
    assert parse_expiry("never", 0) is None and parse_expiry("1800000000", 0) == 1800000000.0
    with pytest.raises(Exception, match="--expires"):
        parse_expiry("soon", 0)
