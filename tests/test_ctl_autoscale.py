"""`llmgw ctl explain-scale [MODEL]` and `ctl scale MODEL N | --release` (llmgw.cli.ctl.autoscale):
what they print from the admin API's answers, the bodies they send, the bad input they name before
connecting, and the shell completion that follows their parsers. The daemon is a stand-in for
`Admin` (the admin routes themselves: tests/test_admin_autoscale.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.cli.ctl import main as ctl_main
from llmgw.cli.ctl.autoscale import autoscale_table, explain_scale_text, scale_text
from llmgw.cli.ctl.output import CtlError

T = 1_750_000_000.0


def _decision(current: int, desired: int, mode: str, reason: str, limits: list[str], t: float) -> dict[str, Any]:
    return {"t_wall": t, "current": current, "ready": current - 1 if current else 0, "starting": 1 if current else 0,
            "desired": desired, "raw": desired + 2, "mode": mode, "rule": f"concurrency: ceil(max(C_w 9.0, C_pred "
            f"13.2) / 4.0) = {desired + 2}", "limited_by": limits, "reason": reason}


VIEW: dict[str, Any] = {
    "model": "llama-8b", "min": 0, "max": 4, "metric": "concurrency", "target": 4.0, "pinned": None, "count": 4,
    "ready": 3, "starting": 1, "cold_start_s": 31.5, "cold_starts": 3,
    "inputs": {"concurrency": 9.0, "concurrency_predicted": 13.2, "slope_per_s": 0.14, "ttft_p90_s": None,
               "new_input": 1.0},
    "decision": _decision(4, 4, "stable", "", ["max 4"], T + 60),
    "history": [_decision(2, 4, "panic", "burst: 14 in flight over 2 replicas", ["up delay 0s"], T + 30),
                _decision(0, 1, "cold", "demand at zero", [], T)],
    "settings": {"window_s": 60.0, "down_delay_s": 120.0},
}


def test_explain_scale_text_has_the_inputs_rule_decision_limits_and_history() -> None:
    text = explain_scale_text(VIEW)
    lines = text.splitlines()
    assert lines[0] == "model      llama-8b: concurrency target 4 per replica, 0–4 replicas"
    assert lines[1] == "count      4 in force; 3 ready, 1 starting"
    assert "cold start 31.5 s placed → ready; woke from zero 3 times" in lines
    assert "  concurrency (window)         9" in lines and "  TTFT p90 (s)                 -" in lines
    assert "  new_input                    1" in lines  # an input this ctl does not know is still shown
    assert "rule       concurrency: ceil(max(C_w 9.0, C_pred 13.2) / 4.0) = 6" in lines
    assert any(ln.startswith("decision   ") and "4 (3 ready + 1 starting) unchanged 4 (recommended 6; mode stable)"
               in ln for ln in lines)
    assert "limited by max 4" in lines
    history = text[text.index("last decisions (newest first)"):]
    assert history.index("2 → 4") < history.index("0 → 1")  # newest first
    assert "panic" in history and "burst: 14 in flight over 2 replicas" in history and "up delay 0s" in history
    assert "settings   down_delay_s 120, window_s 60" in lines


def test_explain_scale_text_before_a_decision_and_when_pinned() -> None:
    text = explain_scale_text({**VIEW, "pinned": 2, "decision": None, "history": [], "cold_starts": 0, "inputs": {}})
    assert "PINNED at 2 (`llmgw ctl scale llama-8b --release` hands it back)" in text
    assert "decision   none yet" in text and "last decisions: none changed the count yet" in text
    assert "\ninputs" not in text
    prior = explain_scale_text({**VIEW, "settings": {"cold_start_s": 30.0}})
    assert "cold start 31.5 s placed → ready (the config's prior: 30 s); woke from zero 3 times" in prior


def test_the_autoscale_table_lists_every_autoscaled_model() -> None:
    text = autoscale_table([VIEW, {**VIEW, "model": "qwen", "pinned": 2, "decision": None}])
    header, first, second = text.splitlines()
    assert header.split() == ["MODEL", "BOUNDS", "TARGET", "COUNT", "READY", "STARTING", "PINNED", "MODE", "DECIDED",
                              "LIMITED", "BY"]
    assert first.split()[:8] == ["llama-8b", "0–4", "concurrency", "4", "4", "3", "1", "-"]
    assert second.split()[:9] == ["qwen", "0–4", "concurrency", "4", "4", "3", "1", "2", "-"]
    assert "no model has [models.autoscale]" in autoscale_table([])


def test_scale_text_says_pinned_and_how_to_release() -> None:
    assert scale_text("m", 3, {"name": "m", "deploy": {"count": 3}}) == "model m scaled to 3 replicas"
    assert scale_text("m", 3, {"name": "m", "deploy": {"count": 3}, "autoscale": None}) == "model m scaled to 3 replicas"
    assert scale_text("m", 3, {"autoscale": {"min": 0, "max": 4}}) == (
        "model m: pinned at 3 replicas; the autoscaler resumes after `llmgw ctl scale m --release`")
    assert "the pin is released" in scale_text("m", None, {"autoscale": {"max": 4}})


class FakeAdmin:
    """Stands in for main.Admin: answers by (method, path) and records the calls."""

    calls: list[tuple[str, str, Any]] = []
    answers: dict[tuple[str, str], Any] = {}

    def __init__(self, ns: Any) -> None:
        self.where, self.origin = "unix:/fake", "test"

    def call(self, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None) -> Any:
        FakeAdmin.calls.append((method, path, body))
        try:
            return FakeAdmin.answers[(method, path)]
        except KeyError:
            raise CtlError(f"{method} {path}: 404: No model.") from None


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[FakeAdmin]:
    monkeypatch.setattr(ctl_main, "Admin", FakeAdmin)
    FakeAdmin.calls, FakeAdmin.answers = [], {}
    return FakeAdmin


def test_ctl_commands_send_the_right_bodies(fake: type[FakeAdmin], capsys: pytest.CaptureFixture[str]) -> None:
    fake.answers = {("POST", "/models/org%2Fm/scale"): {"name": "org/m", "autoscale": {"max": 4}},
                    ("GET", "/models/org%2Fm/autoscale"): {**VIEW, "model": "org/m"},
                    ("GET", "/autoscale"): [VIEW]}
    assert ctl_main.main(["scale", "org/m", "2"]) == 0
    assert capsys.readouterr().out.startswith("model org/m: pinned at 2 replicas; the autoscaler resumes after")
    assert ctl_main.main(["scale", "org/m", "--release"]) == 0
    assert "the pin is released" in capsys.readouterr().out
    assert fake.calls == [("POST", "/models/org%2Fm/scale", {"replicas": 2}),
                          ("POST", "/models/org%2Fm/scale", {"release": True})]
    assert ctl_main.main(["explain-scale", "org/m"]) == 0
    assert capsys.readouterr().out.startswith("model      org/m: concurrency target 4 per")
    assert ctl_main.main(["explain-scale", "org/m", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {**VIEW, "model": "org/m"}
    assert ctl_main.main(["explain-scale"]) == 0
    assert capsys.readouterr().out.startswith("MODEL")
    assert ctl_main.main(["explain-scale", "nope"]) == 1
    assert "404" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "words"), [
    (["scale", "m"], "scale m: N is missing"),
    (["scale", "m", "2", "--release"], "not both"),
    (["scale", "m", "--", "-1"], "N must be 0 or more, got -1"),
])
def test_bad_scale_input_is_named_before_connecting(fake: type[FakeAdmin], capsys: pytest.CaptureFixture[str],
                                                    argv: list[str], words: str) -> None:
    assert ctl_main.main(argv) == 1
    assert words in capsys.readouterr().err and fake.calls == []


def test_a_non_integer_count_is_refused_by_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ctl_main.main(["scale", "m", "two"])
    assert "argument N: invalid int value: 'two'" in capsys.readouterr().err


def test_completion_offers_explain_scale_and_release() -> None:
    from llmgw.cli.entry import completion_contexts

    ctxs = completion_contexts()
    assert "explain-scale" in ctxs["ctl"].subcommands and "scale" in ctxs["ctl"].subcommands
    assert any("--release" in o.flags and not o.takes_value for o in ctxs["ctl scale"].options)
