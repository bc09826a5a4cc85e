"""`llmgw ctl status` and `llmgw ctl models NAME` as readable key-value lines (llmgw.cli.ctl.views):
no JSON quoting, nested values spelled out, fields the renderer does not know still shown."""

from __future__ import annotations

from typing import Any

from llmgw.admin_client.printable import printable
from llmgw.cli.ctl.views import groups_text, model_text, status_text, store_line, value_text

STATUS: dict[str, Any] = {
    "version": "0.1.0", "router_id": "51cb1d44d4d5", "nodes": {"ready": 2, "lost": 1}, "assignments": 3,
    "partition_suspected": False, "control_port": 40193, "unplaceable": {},
    "store": {"state": "ok", "path": "/var/lib/llmgw/router.db", "reason": None, "detail": None,
              "since_s": None, "errors": 0, "pending_history": 0, "history_dropped": 0},
    "unknown_engines": {}, "adopt": False, "kv_parity_alarms": {},
}


def lines(text: str) -> dict[str, str]:
    """`key  value` lines as a dict (the key column is 20 wide)."""
    return {ln[:20].strip(): ln[21:] for ln in text.splitlines() if ln[:20].strip()}


def test_status_has_no_json_quoting_and_reads_as_words() -> None:
    out = status_text(STATUS)
    assert '"' not in out and "{" not in out
    kv = lines(out)
    assert kv["version"] == "0.1.0" and kv["router"] == "51cb1d44d4d5"
    assert kv["nodes"] == "1 lost, 2 ready"
    assert kv["replicas placed"] == "3"
    assert kv["partition suspected"] == "no" and kv["adopt"] == "no"
    assert kv["control port"] == "40193"
    assert kv["unplaceable"] == "none" and kv["unknown engines"] == "none"
    assert kv["store"] == "ok (/var/lib/llmgw/router.db)"
    # the keys keep the answer's order
    assert kv["kv parity"] == "no alarm"
    assert [k for k in kv] == ["version", "router", "nodes", "replicas placed", "partition suspected",
                               "control port", "unplaceable", "store", "unknown engines", "adopt", "kv parity"]


def test_status_nested_sections_one_line_each_aligned() -> None:
    d = {**STATUS, "partition_suspected": True, "control_port": None, "adopt": True,
         "unplaceable": {"big": "needs 8 GPUs, the largest node has 4", "a": "held: 2 unknown engines"},
         "unknown_engines": {"n2": ["e-1", "e-2"], "n1": ["e-9"]},
         "store": {"state": "degraded", "reason": "disk full", "detail": "database or disk is full",
                   "since_s": 42.4, "errors": 3, "pending_history": 7, "history_dropped": 0}}
    out = status_text(d).splitlines()
    i = next(n for n, ln in enumerate(out) if ln.startswith("unplaceable"))
    assert out[i] == f"{'unplaceable':20s} a: held: 2 unknown engines"
    assert out[i + 1] == f"{'':20s} big: needs 8 GPUs, the largest node has 4"
    j = next(n for n, ln in enumerate(out) if ln.startswith("unknown engines"))
    assert out[j].startswith(f"{'unknown engines':20s} n1: e-9 — left running, not routed")
    assert out[j + 1].startswith(f"{'':20s} n2: e-1, e-2 — left running") and "--adopt" in out[j + 1]
    kv = lines("\n".join(out))
    assert kv["partition suspected"].startswith("YES")
    assert kv["control port"].startswith("none")
    assert kv["adopt"].startswith("yes")
    assert kv["store"].startswith("degraded (disk full) for 42s: database or disk is full; running from memory")
    assert "7 history events waiting" in kv["store"]


def test_status_names_each_replica_in_parity_alarm() -> None:
    out = status_text({**STATUS, "kv_parity_alarms": {"m/2": "m", "m/1": "m"}}).splitlines()
    i = next(n for n, ln in enumerate(out) if ln.startswith("kv parity"))
    assert out[i].startswith(f"{'kv parity':20s} ALARM m/1 (model m): its engine hashes KV blocks differently")
    assert out[i + 1].startswith(f"{'':20s} ALARM m/2 (model m)") and "llmgw ctl kv" in out[i + 1]


def test_status_shows_fields_it_does_not_know_readably() -> None:
    d = {**STATUS, "queue": {"depth": 3, "by_model": {"m": 2}}, "zones": ["a", "b"], "ratio": 0.25,
         "note": None}
    kv = lines(status_text(d))
    assert kv["queue"] == "depth=3, by_model={m=2}"
    assert kv["zones"] == "a, b" and kv["ratio"] == "0.25" and kv["note"] == "-"


def test_value_text() -> None:
    assert value_text({}) == "none" and value_text([]) == "none"
    assert value_text([{"a": 1}, [2, 3]]) == "{a=1}, [2, 3]"
    assert value_text(True) == "yes" and value_text("x y") == "x y"


def test_store_line_ok_mentions_errors() -> None:
    assert store_line({"state": "ok", "errors": 2}) == "ok; 2 store errors since the daemon started"
    assert store_line("junk") == "?"


DEFN = {"name": "llama", "engine": "vllm", "strategy": "chat", "pools": ["fast", "cheap"],
        "deploy": {"count": 2, "gpus": 1, "simulate": False, "health_timeout_s": 60.0},
        "replicas": [{"url": "http://10.0.0.5:8000", "weight": 1.0}],
        "metrics": {}}


def test_model_text_is_not_json_and_spells_the_definition_as_config_keys() -> None:
    view = {"name": "llama", "source": "api", "ready": 1, "desired_replicas": 2, "static_replicas": 1,
            "unplaceable": "1 replica: no node has a free GPU"}
    out = model_text(DEFN, view)
    assert '"' not in out and not out.lstrip().startswith("{")
    kv = lines(out)
    assert kv["model"] == "llama" and kv["source"] == "api" and kv["ready"] == "1/2 replicas"
    assert kv["problem"] == "1 replica: no node has a free GPU" and kv["static endpoints"] == "1"
    body = [ln.split(None, 1) for ln in out.split("definition\n", 1)[1].splitlines()]
    got = dict(body)
    assert got == {"engine": "vllm", "strategy": "chat", "pools": "fast, cheap", "deploy.count": "2",
                   "deploy.gpus": "1", "deploy.simulate": "false", "deploy.health_timeout_s": "60.0",
                   "replicas[0].url": "http://10.0.0.5:8000", "replicas[0].weight": "1.0", "metrics": "none"}
    # the values form one column
    assert len({ln.index(v) for ln, (_, v) in zip(out.split("definition\n", 1)[1].splitlines(), body)}) == 1


def test_model_text_without_its_row() -> None:
    out = model_text({"name": "m", "engine": "llamacpp"})
    assert out.splitlines() == [f"{'model':20s} m", "definition", f"  {'engine':18s} llamacpp"]


def test_text_from_the_daemon_cannot_drive_the_terminal() -> None:
    """Node names, reasons and engines' messages come from agents: an escape sequence, a bidi
    override or a newline in them is shown, not obeyed, and a value stays on its line."""
    evil = "n1\x1b]0;owned\x07\x1b[2J\u202egpj.exe\nstore                ok"
    kv = status_text({**STATUS, "unknown_engines": {evil: [evil]}, "unplaceable": {"m": evil}})
    assert "\x1b" not in kv and "\x07" not in kv and "\u202e" not in kv
    assert "\\x1b]0;owned\\x07\\x1b[2J\\u202egpj.exe\\x0astore" in kv
    assert sum(ln.startswith("store ") for ln in kv.splitlines()) == 1  # no forged line
    assert printable("a\tb\nc", keep_newlines=True) == "a\\x09b\nc"
    assert printable("ünïcode ✓ 名前") == "ünïcode ✓ 名前"


def test_ctl_tables_and_errors_escape_control_characters() -> None:
    from llmgw.cli.ctl.output import _cell, table

    assert _cell("r1\x1b[31m") == "r1\\x1b[31m" and _cell(["a\nb"]) == "a\\x0ab"
    assert "\x1b" not in table([["x\x1b[2J", 1]], ["NAME", "N"])


def test_model_text_names_its_lora_adapters() -> None:
    d = {"name": "m", "engine": "vllm", "adapters": [{"name": "sql", "source": "/l/sql", "static": True},
                                                     {"name": "chat\x1b[2J", "source": "org/chat", "static": False}]}
    out = model_text(d)
    assert lines(out)["adapters"] == "sql (static), chat\\x1b[2J"
    assert "\x1b" not in out and "adapters[1].source" in out


def test_adapters_table_shows_holdings_loads_and_failures() -> None:
    from llmgw.cli.ctl.views import adapter_rows, adapters_footer

    d = {"replicas": [
        {"replica": "m/0", "model": "m", "cap": 2, "used": 2, "failed": [],
         "adapters": [{"adapter": "a", "state": "loaded", "inflight": 3, "idle_s": 1.4},
                      {"adapter": "b", "state": "loading", "inflight": 0, "idle_s": None, "waiting": 5,
                       "unloading": "c"}]},
        {"replica": "m/1", "model": "m", "cap": 2, "used": 0, "adapters": [],
         "failed": [{"adapter": "x", "reason": "No adapter found for /x", "failures": 2, "retry_in_s": 9.6}]},
        {"replica": "m/2", "model": "m", "cap": 2, "used": 0, "adapters": [], "failed": []}],
        "loads": {"ok": 3, "failed": 2, "timeout": 0}, "unloads": {"ok": 1}, "waiting": 5}
    rows = adapter_rows(d)
    assert rows[0] == ["m/0", "m", "2/2", "a", "loaded", 3, "1s", ""]
    assert rows[1] == ["", "", "", "b", "loading", 0, "-", "5 waiting, unloading c"]
    assert rows[2][:5] == ["m/1", "m", "0/2", "x", "failed"] and "retry in 10s (2x): No adapter found" in rows[2][7]
    assert rows[3][:4] == ["m/2", "m", "0/2", "-"]
    assert adapters_footer(d) == "loads: ok 3, failed 2; unloads: ok 1; waiting for a load: 5"

KV: dict[str, Any] = {
    "enabled": True, "blocks": 120, "bytes": 9240, "messages": 40, "gaps": 1,
    "refused": {"unknown_replica": 0, "other_node": 2},
    "decisions": {"decided": 30, "miss": 4, "no_events": 0, "timeout": 1},
    "replicas": [
        {"replica": "m/aa", "model": "m", "node": "n1", "blocks": 100, "bytes": 7700, "overflowed": False,
         "messages": 30, "block_events": 150, "resets": 1, "gaps": 0, "event_seq": 77, "lag_s": 0.4,
         "tier1_decisions": 5, "tier2_decisions": 30,
         "parity": {"passed": 30, "failed": 0, "unknown": 2, "mismatch_rate": 0.0, "status": "ok", "pending": 0}},
        {"replica": "m/bb\x1b[2J", "model": "m", "node": "n2", "blocks": 20, "bytes": 1540, "overflowed": True,
         "messages": 10, "block_events": 20, "resets": 2, "gaps": 1, "event_seq": 9, "lag_s": None,
         "tier1_decisions": 4, "tier2_decisions": 0,
         "parity": {"passed": 0, "failed": 4, "unknown": 0, "mismatch_rate": 1.0, "status": "alarm", "pending": 1}},
    ],
    "models": [{"model": "m", "passed": 30, "failed": 4, "unknown": 2, "mismatch_rate": 4 / 34}],
}


def test_kv_rows_and_summary() -> None:
    from llmgw.cli.ctl.views import KV_HEADERS, kv_rows, kv_summary_lines

    rows = kv_rows(KV)
    assert all(len(r) == len(KV_HEADERS) for r in rows)
    ok, bad = (dict(zip(KV_HEADERS, r)) for r in rows)
    assert ok["PARITY"] == "ok" and ok["LAG"] == "0.4s" and ok["TIER2"] == "30" and ok["MISMATCH"] == "0%"
    assert bad["PARITY"] == "ALARM" and bad["BLOCKS"] == "20!" and bad["LAG"] == "-" and bad["MISMATCH"] == "100%"
    assert "\x1b" not in bad["REPLICA"]
    assert kv_rows(KV, "other") == []
    text = "\n".join(kv_summary_lines(KV))
    kv = lines(text)
    assert kv["index"] == "120 blocks, ~9 kB; 40 messages, 1 gaps"
    assert kv["decisions"] == "decided=30, miss=4, timeout=1" and kv["refused"] == "other_node=2"
    assert kv["parity m"] == "12% mismatched (4 of 34 checks; 2 unknown)"
    assert "ALARM:" in text and "PYTHONHASHSEED" in text
    assert kv_summary_lines({"enabled": False})[0].startswith("tier 2 index: none")
    assert kv_rows({"replicas": [None, {"parity": "x"}]})  # odd answers do not crash it


def test_a_disaggregated_models_roles_read_ready_over_desired() -> None:
    view = {"name": "m", "ready": 2, "desired_replicas": 3,
            "groups": [{"role": "prefill", "desired": 1, "replicas": 1, "ready": 1, "static": 0},
                       {"role": "decode", "desired": 2, "replicas": 2, "ready": 1, "static": 1},
                       {"role": "decode\x1b[2J", "desired": 0, "replicas": 0, "ready": 0, "static": 2}]}
    assert groups_text(view) == "prefill 1/1, decode 1/2 + 1 static, decode\\x1b[2J 2 static"
    assert lines(model_text({"name": "m"}, view))["roles"] == groups_text(view)
    assert groups_text({"name": "m"}) == "" and "roles" not in lines(model_text({"name": "m"}, {"ready": 1}))
