"""A disaggregated model's prefill and decode groups over real processes: a router daemon, agents
labelled with racks, simulated engines. The groups come up with their own args, inside one rack
([models.pd] keep_within), are routed with their roles, and `llmgw ctl models` shows each group's
ready count. A long prompt is then prefilled on the placed prefiller and decoded on the placed
decoder: the whole path, from the config's groups to one answer."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx

from .test_facility_integration import ctl, make_fleet  # noqa: F401 — the fixture
from .test_fleet_integration import fleet_factory  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for

KV = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"})
MODEL = {
    "name": "m", "engine": "vllm",
    "pd": {"keep_within": "rack", "min_prompt_tokens": 64},
    "deploy": {"simulate": True, "health_timeout_s": 20.0, "args": ["--max-num-seqs", "64", "--kv-transfer-config", KV],
               "roles": [{"role": "prefill", "count": 1, "args": ["--seed", "11"]},
                         {"role": "decode", "count": 1, "args": ["--seed", "22"], "env": ["PD_ROLE=decode"]}]},
}


def test_prefill_and_decode_groups_come_up_in_one_rack_and_are_routed_with_their_roles(
        make_fleet: Any, tmp_path: Path) -> None:
    f = make_fleet([MODEL])
    for node, rack in (("a", "r1"), ("b", "r1"), ("c", "r2"), ("d", "r2")):
        f.start_agent(node, labels={"llmgw.io/rack": rack})

    def groups() -> dict[str, tuple[int, int, int]]:
        [view] = [m for m in f.get("/api/v1/models") if m["name"] == "m"]
        return {g["role"]: (g["ready"], g["replicas"], g["desired"]) for g in view["groups"]}

    wait_for(lambda: groups() == {"prefill": (1, 1, 1), "decode": (1, 1, 1)}, 40)
    [view] = [m for m in f.get("/api/v1/models") if m["name"] == "m"]
    assert (view["desired_replicas"], view["ready"], view["unplaceable"]) == (2, 2, None)
    reps = f.replicas("m")
    assert sorted(r["role"] for r in reps) == ["decode", "prefill"]
    assert len({f.rack_of(r["node"]) for r in reps}) == 1  # keep_within rack
    # routed with their roles: the router's endpoints say so
    wait_for(lambda: sorted(e["role"] for e in f.get("/api/v1/endpoints") if e["model"] == "m")
             == ["decode", "prefill"], 20)
    # each group's engines were launched with the profile's args, then the group's
    launched = {}
    for rec in tmp_path.glob("agent-*/engines/*.json"):
        d = json.loads(rec.read_text())
        launched[d["spec"]["role"]] = (d["cmd"], dict(d["spec"]["env"]))
    cmd, env = launched["prefill"]
    assert cmd[cmd.index("--max-num-seqs") + 1] == "64" and cmd[cmd.index("--seed") + 1] == "11"
    assert "PD_ROLE" not in env
    cmd, env = launched["decode"]
    assert cmd[cmd.index("--seed") + 1] == "22" and env["PD_ROLE"] == "decode"
    # a long prompt: prefilled on the prefiller, decoded on the decoder, one answer
    rid_of = {r["role"]: r["replica"] for r in reps}
    r = httpx.post(f"{f.router.url}/v1/chat/completions", timeout=30, headers={"x-request-id": "placed-pd"},
                   json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "long prompt " * 200}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert r.headers["x-llmgw-endpoint"] == rid_of["decode"]
    decisions = f.get("/api/v1/decisions/placed-pd")
    decisions = decisions.get("decisions", decisions) if isinstance(decisions, dict) else decisions
    assert [(d["phase"], d["chosen"]) for d in decisions] == [("prefill", rid_of["prefill"]),
                                                               ("decode", rid_of["decode"])]
    # what an operator sees
    out = ctl(f, "models")
    assert out.returncode == 0, out.stderr
    [row] = [line for line in out.stdout.splitlines() if line.startswith("m ")]
    assert "2/2 (prefill 1/1, decode 1/1)" in row
    out = ctl(f, "models", "m")
    assert out.returncode == 0 and "prefill 1/1, decode 1/1" in out.stdout, out.stderr
    out = ctl(f, "replicas")
    assert out.returncode == 0 and out.stdout.splitlines()[0].split()[:4] == ["REPLICA", "NODE", "STATE", "ROLE"]
    # a group's count is its definition's: `ctl scale` says how to change it
    out = ctl(f, "scale", "m", "3")
    assert out.returncode != 0 and "prefill/decode groups" in out.stderr


def test_a_disaggregated_model_is_updated_and_promoted_under_load_with_its_groups(fleet_factory: Any) -> None:  # noqa: F811
    """Lifecycle × disaggregation: an update makes a candidate with both groups (each its own count),
    the eval runner's requests are split on the candidate's own prefiller and decoder, and a
    promote under split load fails no request; the promoted groups then serve split requests."""
    from .test_lifecycle_integration import api, wait_job

    f = fleet_factory([])
    f.start_agent("a")
    model = {"name": "m", "engine": "vllm", "pd": {"min_prompt_tokens": 64},
             "deploy": {"simulate": True, "health_timeout_s": 20.0, "args": ["--kv-transfer-config", KV],
                        "roles": [{"role": "prefill", "count": 1}, {"role": "decode", "count": 2}]}}
    assert api(f, "POST", "/models", json=model).status_code == 201
    wait_for(lambda: len(f.ready("m")) == 3, 30)
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "long prompt " * 200}]}
    done = {"ok": 0, "failed": []}
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=20) as c:
            while not stop.is_set() and done["ok"] < 2000:
                r = c.post(f"{f.router.url}/v1/chat/completions", json=body)
                if r.status_code == 200:
                    done["ok"] += 1
                else:
                    done["failed"].append(f"{r.status_code} {r.text[:200]}")

    t = threading.Thread(target=load, daemon=True)
    t.start()
    try:
        up = api(f, "POST", "/models/m/update", json={"deploy": {"args": ["--kv-transfer-config", KV, "--seed", "7"]}})
        assert up.status_code in (200, 201, 202), up.text
        assert wait_job(f, up.json()["id"], 60)["state"] == "succeeded"
        cand = f.replicas("m#candidate")
        assert sorted(r["role"] for r in cand) == ["decode", "decode", "prefill"]
        assert api(f, "POST", "/models/m/promote").status_code == 200
        wait_for(lambda: not f.replicas("m#candidate") and len(f.ready("m")) == 3, 40)
        assert "--seed" in f.get("/api/v1/models/m")["deploy"]["args"]
    finally:
        stop.set()
        t.join(30)
    assert done["ok"] > 0 and not done["failed"], done["failed"][:3]
    # the promoted groups serve split requests
    r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, headers={"x-request-id": "after-promote"},
                   timeout=30)
    assert r.status_code == 200
    decisions = f.get("/api/v1/decisions/after-promote")
    decisions = decisions.get("decisions", decisions) if isinstance(decisions, dict) else decisions
    assert [d["phase"] for d in decisions] == ["prefill", "decode"]
    roles = {x["replica"]: x["role"] for x in f.replicas("m")}
    assert roles[decisions[0]["chosen"]] == "prefill" and roles[decisions[1]["chosen"]] == "decode"
