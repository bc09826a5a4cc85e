"""`llmgw ctl`'s lifecycle commands against a one-process daemon (router + agent + simulated
engines): suites put (a bad file names its line), models update --set --wait, revisions, eval
(exit status follows the verdict), promote --require-suite, jobs, rollback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_ctl import ctl
from .test_router_integration import Daemon
from .test_sim_vllm import wait_for

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "suites"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ctl-lifecycle")
    sock = tmp / "admin" / "admin.sock"
    cfg = tmp / "llmgw.toml"
    cfg.write_text(f"""
[server]
host = "127.0.0.1"
[router]
scrape_interval_s = 0.2
[admin]
socket = {json.dumps(str(sock))}
[control]
listen = "127.0.0.1:0"
drain_timeout_s = 5.0
store = {json.dumps(str(tmp / "router.db"))}
[agent]
node = "box-1"
state_dir = {json.dumps(str(tmp / "agent"))}
[sim]
replicas = 1
""")
    d = Daemon(cfg, role="router,agent")
    try:
        admin = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x")
        r = admin.post("/api/v1/models", json={"name": "m", "engine": "vllm", "deploy": {
            "count": 1, "simulate": True, "args": ["--sim-decode-ms-per-token", "1"]}})
        assert r.status_code == 201, r.text
        wait_for(lambda: any(x["model"] == "m" and x["state"] == "ready" for x in admin.get("/api/v1/replicas").json()),
                 30)
        yield {"socket": str(sock), "tmp": tmp, "daemon": d}
    finally:
        d.stop()


def test_the_whole_cycle_from_ctl(daemon: dict[str, Any]) -> None:
    s = ["--socket", daemon["socket"]]
    bad = daemon["tmp"] / "bad.toml"
    bad.write_text('name = "bad"\n[[cases]]\nprompt = "x"\nchecks = { contians = ["a"] }\n')
    r = ctl(*s, "suites", "put", "bad", str(bad))
    assert r.returncode == 1 and "suite bad:4: cases[0].checks.contians: unknown check" in r.stderr, r.stderr
    r = ctl(*s, "suites", "put", "other", str(EXAMPLES / "smoke.toml"))
    assert r.returncode == 1 and "smoke.toml names suite 'smoke', not 'other'" in r.stderr, r.stderr
    r = ctl(*s, "suites", "put", str(EXAMPLES / "smoke.toml"))  # the name is the file's
    assert r.returncode == 0 and "suite smoke stored: 2 cases" in r.stdout, r.stderr
    r = ctl(*s, "suites", "put", "smoke", str(EXAMPLES / "smoke.toml"))  # the same name given: fine
    assert r.returncode == 0 and "suite smoke stored: 2 cases" in r.stdout, r.stderr
    strict = daemon["tmp"] / "strict.toml"  # no name in the file: its stem
    strict.write_text('[[cases]]\nprompt = "answer JSON"\nparams = { max_tokens = 4 }\nchecks = { json = true }\n')
    r = ctl(*s, "suites", "put", str(strict))
    assert r.returncode == 0 and "suite strict stored: 1 cases" in r.stdout, r.stderr
    assert "smoke" in ctl(*s, "suites").stdout
    assert ctl(*s, "suites", "smoke").stdout.startswith("# A smoke suite")

    r = ctl(*s, "models", "promote", "m")
    assert r.returncode == 1 and "no candidate to promote" in r.stderr
    r = ctl(*s, "models", "update", "m", "--set", 'deploy.args=["--sim-decode-ms-per-token", "2"]', "--wait")
    assert r.returncode == 0, r.stderr
    assert "update m r2 — succeeded" in r.stdout and "placing candidate replicas" in r.stdout
    rev = json.loads(ctl(*s, "models", "revisions", "m", "-o", "json").stdout)
    assert rev["live"] == "r1" and rev["candidate"]["id"] == "r2"
    assert "candidate r2: 1/1 replicas ready" in ctl(*s, "models", "revisions", "m").stdout

    r = ctl(*s, "eval", "m", "--suite", "smoke")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "suite smoke on candidate r2: PASSED 2/2" in r.stdout and "greets" in r.stdout
    assert "eval m r2 — succeeded: suite smoke passed" in r.stdout
    r = ctl(*s, "eval", "m", "--suite", "strict")  # a suite that fails: the job says so
    assert r.returncode == 1 and "eval m r2 — failed: suite strict did not pass: 0/1 cases" in r.stdout, r.stdout
    job_id = r.stdout.split()[1].rstrip(":")
    row = next(line for line in ctl(*s, "jobs", "--model", "m").stdout.splitlines() if line.startswith(job_id))
    assert row.split()[1:5] == ["eval", "m", "r2", "failed"], row
    r = ctl(*s, "models", "promote", "m", "--require-suite", "smoke")
    assert r.returncode == 0 and "r2 is live" in r.stdout, r.stderr
    jobs = ctl(*s, "jobs", "--model", "m").stdout
    assert jobs.splitlines()[0].split()[:2] == ["JOB", "KIND"] and "promote" in jobs and "eval" in jobs
    r = ctl(*s, "models", "rollback", "m", "--wait")
    assert r.returncode == 0, r.stderr
    # one rollback job: r1's definition back as r3 (saying so), placed, then made live
    assert "rollback m r3 — succeeded: r3 (restored from r1) is live" in r.stdout, r.stdout
    assert "update" not in r.stdout.splitlines()[0]
    assert "placing candidate replicas" in r.stdout and "making the candidate live" in r.stdout
    rev = json.loads(ctl(*s, "models", "revisions", "m", "-o", "json").stdout)
    assert rev["live"] == "r3" and rev["live_restored_from"] == "r1"
    assert "live r3 (restored from r1)" in ctl(*s, "models", "revisions", "m").stdout
    assert json.loads(ctl(*s, "models", "m", "-o", "json").stdout)["deploy"]["args"] == [
        "--sim-decode-ms-per-token", "1"]


def test_bad_input_says_what_to_do(daemon: dict[str, Any]) -> None:
    s = ["--socket", daemon["socket"]]
    r = ctl(*s, "models", "update", "m", "--set", "deploy.count")
    assert r.returncode == 1 and "expected key=value" in r.stderr
    r = ctl(*s, "models", "update", "m", "--set", "deploy.count=-1")
    assert r.returncode == 1 and "deploy.count" in r.stderr
    r = ctl(*s, "models", "update", "nope")
    assert r.returncode == 1 and "No model 'nope'" in r.stderr
    r = ctl(*s, "models", "update", "sim-model")
    assert r.returncode == 1 and "defined in the config file" in r.stderr
    r = ctl(*s, "eval", "m", "--suite", "nope")
    assert r.returncode == 1 and "No suite 'nope'" in r.stderr
    r = ctl(*s, "models", "update", "m", "--canary", "150%")
    assert r.returncode == 2 and "0% to 100%" in r.stderr


def test_input_nested_500_deep_is_a_clear_error_never_a_traceback(daemon: dict[str, Any]) -> None:
    """Issue 21 item 8: a suite, a --set value, a profile file and an admin JSON body nested 500
    deep each get an error naming the field and the limit (64 levels): never a 500, a
    RecursionError or a traceback, in ctl or in the daemon's log."""
    s = ["--socket", daemon["socket"]]
    logged = len(daemon["daemon"].err)  # the log lines of this test's requests come after
    deep = "[" * 500 + "]" * 500
    admin = httpx.Client(transport=httpx.HTTPTransport(uds=daemon["socket"]), base_url="http://x")
    r = admin.put("/api/v1/suites/x", json={"toml": f"a = {deep}\n"})
    assert r.status_code == 400, r.text
    assert "a: nested deeper than 64 levels" in r.json()["error"]["message"], r.text
    r = admin.put("/api/v1/suites/x", json={"toml": 'name = "x"\n[[cases]]\nprompt = "p"\n' + "q." * 300 + "r = 1\n"})
    assert r.status_code == 400 and "nested deeper than 64 levels" in r.text, r.text
    r = admin.post("/api/v1/models/m/update", content=b'{"deploy": {"env": ' + b"[" * 100000 + b"]" * 100000 + b"}}",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "deploy.env" in r.text and "nested deeper than 64 levels" in r.text, r.text
    r = admin.post("/api/v1/models/m/update", json={"deploy": {"env": json.loads(deep[:140] + deep[-140:])}})
    assert r.status_code == 400 and "deploy.env" in r.text and "nested deeper than 64 levels" in r.text, r.text
    r = ctl(*s, "models", "update", "m", "--set", f"deploy.env={deep}")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "deploy.env: nested deeper than 64 levels" in r.stderr, r.stderr
    prof = daemon["tmp"] / "deep-profile.toml"
    prof.write_text(f"[deploy]\nenv = {deep}\n")
    r = ctl(*s, "models", "update", "m", "--file", str(prof))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "deploy.env: nested deeper than 64 levels" in r.stderr, r.stderr
    suite = daemon["tmp"] / "deep-suite.toml"
    suite.write_text(f'name = "deep"\n[[cases]]\nprompt = "p"\nparams = {{ stop = {deep} }}\n')
    r = ctl(*s, "suites", "put", "deep", str(suite))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "nested deeper than 64 levels" in r.stderr, r.stderr
    assert "x" not in ctl(*s, "suites").stdout.split()  # nothing was stored
    assert not [line for line in daemon["daemon"].err[logged:] if "Traceback" in line or "RecursionError" in line]


def test_a_config_file_nested_500_deep_is_a_clear_error(tmp_path: Path) -> None:
    deep = "[" * 500 + "]" * 500
    cfg = tmp_path / "deep.toml"
    cfg.write_text(f"[server]\nhost = \"127.0.0.1\"\n[[models]]\nname = \"m\"\n[models.deploy]\nenv = {deep}\n")
    r = subprocess.run([sys.executable, "-m", "llmgw", "config", "check", str(cfg)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "models[0].deploy.env: nested deeper than 64 levels" in r.stderr + r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--config", str(cfg), "--port", "0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "nested deeper than 64 levels" in r.stderr, r.stderr


def test_a_profile_file_and_set_pairs_make_one_change(tmp_path: Path) -> None:
    import argparse

    from llmgw.cli.ctl import main as ctl  # registers the helpers ctl_lifecycle uses
    from llmgw.cli.ctl.lifecycle import _change

    ctl.parser()
    prof = tmp_path / "p.toml"
    prof.write_text('[[models]]\nstrategy = "batch"\n[models.deploy]\ncount = 3\nargs = ["--a"]\n')
    ns = argparse.Namespace(file=str(prof), set=["deploy.count=4", "deploy.env=[\"X=1\"]"])
    assert _change(ns) == {"strategy": "batch", "deploy": {"count": 4, "args": ["--a"], "env": ["X=1"]}}
    assert _change(argparse.Namespace(file=None, set=None)) is None
    prof.write_text("count = ")
    with pytest.raises(ctl.CtlError, match="not valid TOML"):
        _change(argparse.Namespace(file=str(prof), set=None))
    with pytest.raises(ctl.CtlError, match="No such file"):
        _change(argparse.Namespace(file=str(tmp_path / "none.toml"), set=None))
