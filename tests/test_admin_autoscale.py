"""The admin API's autoscaling routes over the admin stack (admin_support): GET /autoscale and
/models/{name}/autoscale from the plane's autoscaling shell (a stand-in here, with the lead's two
methods), POST /models/{name}/scale with `release`, and the bad-input answers naming the field.
Every JSON answer is checked against the generated document (admin_support)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmgw.admin.schema import AutoscaleView, ScaleBody, ScaleDecisionView
from llmgw.admin.validate import Invalid, from_json
from llmgw.daemon.control.plane.plane import ModelError

from .admin_support import admin_stack

pytestmark = pytest.mark.anyio

DEPLOYED = {"name": "org/auto", "engine": "llamacpp", "deploy": {"count": 1, "simulate": True}}


def decision(t: float, current: int, desired: int, mode: str = "stable", reason: str = "") -> ScaleDecisionView:
    return ScaleDecisionView(t_wall=t, current=current, ready=current, starting=0, desired=desired, raw=desired,
                             mode=mode, rule=f"concurrency: ceil(9.0 / 4.0) = {desired}",
                             limited_by=["max 4"] if desired == 4 else [], reason=reason)


def view(model: str, **over: Any) -> AutoscaleView:
    latest = decision(1_750_000_100.0, 2, 3, reason="concurrency 9.0 over target 4.0 × 2")
    base: dict[str, Any] = dict(
        model=model, min=0, max=4, metric="concurrency", target=4.0, pinned=None, count=3, ready=2, starting=1,
        cold_start_s=12.5, cold_starts=2,
        inputs={"concurrency_stable": 9.0, "concurrency_panic": 10.0, "ttft_p90_s": None, "idle_s": 0.0},
        decision=latest, history=[latest, decision(1_750_000_000.0, 0, 1, "cold", "demand at zero")],
        settings={"window_s": 60.0, "down_delay_s": 120.0, "idle_to_zero_s": 300.0})
    base.update(over)
    return AutoscaleView(**base)


class FakeAutoscaling:
    """The lead's shell's two methods: view(model) (KeyError: no model; None: not autoscaled), views()."""

    def __init__(self, plane: Any, autoscaled: dict[str, AutoscaleView]) -> None:
        self.plane, self.autoscaled = plane, autoscaled

    def view(self, model: str) -> AutoscaleView | None:
        if model not in self.plane.models:
            raise KeyError(model)
        return self.autoscaled.get(model)

    def views(self) -> list[AutoscaleView]:
        return list(self.autoscaled.values())


def test_scale_body_needs_replicas_or_release_and_names_the_field() -> None:
    assert from_json(ScaleBody, {"replicas": 3}) == ScaleBody(3, False)
    assert from_json(ScaleBody, {"release": True}) == ScaleBody(None, True)
    assert from_json(ScaleBody, {"replicas": None, "release": True}) == ScaleBody(None, True)
    for body, field, words in (({}, "replicas", "required"), ({"release": False}, "replicas", "required"),
                               ({"replicas": None}, "replicas", "required"),
                               ({"replicas": 2, "release": True}, "release", "not both"),
                               ({"release": "yes"}, "release", "expected a boolean"),
                               ({"replicas": -1}, "replicas", "must be >= 0")):
        with pytest.raises(Invalid) as e:
            from_json(ScaleBody, body)
        assert [p.field for p in e.value.problems] == [field], body
        assert words in e.value.problems[0].message, body


async def test_a_daemon_without_autoscaling_lists_none_and_says_why(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        assert getattr(s.control, "autoscaling", None) is None or s.control.autoscaling.views() == []
        r = await c.get("/api/v1/autoscale")
        assert r.status_code == 200 and r.json() == []
        r = await c.get("/api/v1/models/m/autoscale")
        assert r.status_code == 409 and "Model 'm' has no [models.autoscale]" in r.json()["error"]["message"]
        assert (await c.get("/api/v1/models/nope/autoscale")).status_code == 404
        r = await c.post("/api/v1/models/m/scale", json={"release": True})
        assert r.status_code == 409 and "[models.autoscale]" in r.json()["error"]["message"]
        assert (await c.post("/api/v1/models/nope/scale", json={"release": True})).status_code == 404


async def test_autoscale_views_come_from_the_plane_shell(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        assert (await c.post("/api/v1/models", json=DEPLOYED)).status_code == 201
        s.control.autoscaling = FakeAutoscaling(s.control, {"org/auto": view("org/auto")})  # type: ignore[attr-defined]
        listed = (await c.get("/api/v1/autoscale")).json()
        assert [v["model"] for v in listed] == ["org/auto"]
        one = (await c.get("/api/v1/models/org/auto/autoscale")).json()
        assert one == (await c.get("/api/v1/models/org%2Fauto/autoscale")).json() == listed[0]
        assert one["count"] == 3 and one["ready"] == 2 and one["starting"] == 1 and one["pinned"] is None
        assert one["decision"]["desired"] == 3 and one["history"][1]["mode"] == "cold"
        assert one["inputs"]["ttft_p90_s"] is None and one["settings"]["window_s"] == 60.0
        r = await c.get("/api/v1/models/m/autoscale")  # a model the shell does not autoscale
        assert r.status_code == 409 and "[models.autoscale]" in r.json()["error"]["message"]
        assert (await c.get("/api/v1/models/nope/autoscale")).status_code == 404  # the shell's KeyError


async def test_scale_pins_and_release_unpins_through_the_plane(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        assert (await c.post("/api/v1/models", json=DEPLOYED)).status_code == 201
        released: list[str] = []

        def release_scale(name: str) -> None:  # the lead's PlaneActions.release_scale: KeyError / ModelError
            if name not in s.control.models:
                raise KeyError(name)
            if name == "m":
                raise ModelError(f"model {name} has no [models.autoscale]: nothing to release")
            released.append(name)

        s.control.actions.release_scale = release_scale  # type: ignore[attr-defined]
        r = await c.post("/api/v1/models/org/auto/scale", json={"release": True})
        assert r.status_code == 200 and r.json()["name"] == "org/auto" and released == ["org/auto"]
        r = await c.post("/api/v1/models/m/scale", json={"release": True})
        assert r.status_code == 409 and "nothing to release" in r.json()["error"]["message"]
        assert (await c.post("/api/v1/models/nope/scale", json={"release": True})).status_code == 404
        r = await c.post("/api/v1/models/org/auto/scale", json={"replicas": 2})  # a count, as before
        assert r.status_code == 200 and r.json()["deploy"]["count"] == 2 and released == ["org/auto"]
        r = await c.post("/api/v1/models/org/auto/scale", json={"replicas": 2, "release": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "release"
        r = await c.post("/api/v1/models/org/auto/scale", json={"release": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "replicas"
