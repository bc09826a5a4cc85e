"""Issue 21 item 15: what an error echoes of a client's input is bounded (llmgw.inputs.echo): a
1 MB `model`, a long path segment, header or field name comes back as its first 100 characters,
an ellipsis and its length — on the OpenAI surface and the admin API, over a real router."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.inputs.echo import ECHO_LIMIT, echo

from .test_router_integration import Daemon, procs, write_config  # noqa: F401 — procs is a fixture

HUGE = "m" * (1 << 20)  # in a body
LONG = "q" * 4000  # in a path or a header (under the HTTP server's line limits)
BOUND = 1200  # bytes of an error answer, whatever the input's size


def test_echo_keeps_short_input_and_cuts_long_input_saying_how_long() -> None:
    assert echo("abc") == "'abc'" and echo("abc", quote="`") == "`abc`" and echo(7, quote="") == "7"
    cut = echo("x" * 5000)
    assert cut == "'" + "x" * ECHO_LIMIT + "…' (5000 characters)"


def _bounded(r: httpx.Response, status: int, *, cut: bool = True) -> dict[str, Any]:
    assert r.status_code == status, r.text[:300]
    assert len(r.content) < BOUND, f"{len(r.content)} bytes: {r.text[:300]}"
    err = r.json()["error"]
    if cut:
        assert "characters)" in err["message"] or "characters)" in json.dumps(err), err
    return err


@pytest.fixture
def router(procs: list[Any], tmp_path: Path) -> Daemon:  # noqa: F811
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": "http://127.0.0.1:9"}]}]))
    procs.append(d)
    return d


def test_the_openai_surface_echoes_client_input_bounded(router: Daemon) -> None:
    url = router.url
    with httpx.Client(base_url=url, timeout=30) as c:
        err = _bounded(c.post("/v1/chat/completions", json={"model": HUGE, "messages": []}), 404)
        assert err["code"] == "model_not_found" and f"({len(HUGE)} characters)" in err["message"]
        _bounded(c.post("/v1/completions", json={"model": HUGE, "prompt": "x"}), 404)
        _bounded(c.get(f"/v1/models/{LONG}"), 404)
        _bounded(c.post(f"/v1/{LONG}", json={}), 404)
        _bounded(c.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers={"x-llmgw-strategy": LONG}), 400)


def test_the_admin_api_echoes_client_input_bounded(router: Daemon, tmp_path: Path) -> None:
    sock = tmp_path / "admin" / "admin.sock"
    bad: list[str] = []
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://llmgw", timeout=30) as a:
        asks = [("GET", p, None) for p in (
            f"/api/v1/models/{LONG}", f"/api/v1/nodes/{LONG}", f"/api/v1/jobs/{LONG}", f"/api/v1/suites/{LONG}",
            f"/api/v1/decisions/{LONG}", f"/api/v1/traces/{LONG}", f"/api/v1/placement/{LONG}",
            f"/api/v1/models/{LONG}/revisions", f"/api/v1/{LONG}", f"/api/v1/history?limit={LONG}")]
        asks += [("POST", f"/api/v1/models/{LONG}/scale", {"count": 1}),
                 ("POST", f"/api/v1/replicas/{LONG}/restart", None),
                 ("DELETE", f"/api/v1/facility/holds/{LONG}", None), ("PUT", f"/api/v1/facility/holds/{LONG}", {}),
                 ("POST", f"/api/v1/nodes/{LONG}/revoke", None),
                 ("PUT", f"/api/v1/nodes/{LONG}/labels", {"labels": {}}),
                 ("POST", f"/api/v1/models/{LONG}/update", {}), ("POST", f"/api/v1/models/{LONG}/promote", {}),
                 ("POST", f"/api/v1/models/{LONG}/eval", {"suite": LONG}), ("DELETE", f"/api/v1/models/{LONG}", None),
                 ("POST", "/api/v1/models", {"name": "x", "engine": "vllm", HUGE: 1}),
                 ("POST", "/api/v1/models", {"name": "x", "engine": HUGE}),
                 ("POST", "/api/v1/models", {"name": HUGE, "engine": "vllm"}),
                 ("PUT", f"/api/v1/models/{LONG}", {"name": "other", "engine": "vllm"}),
                 ("PUT", "/api/v1/nodes/n1/labels", {"labels": {HUGE: "x"}}),
                 ("PUT", "/api/v1/nodes/n1/labels", {"labels": {"x": HUGE}})]
        for method, path, body in asks:
            r = a.request(method, path, json=body)
            if not 400 <= r.status_code < 500 or len(r.content) >= BOUND:
                bad.append(f"{method} {path[:40]}: {r.status_code}, {len(r.content)} bytes: {r.text[:160]}")
    assert not bad, "\n".join(bad)
