"""The console's Tenants view: per tenant its band, weight, keys, today's use, quota use and
queue share, as plain rows (no terminal) from GET /api/v1/tenants answers (TenantView), then
driven with Textual's pilot over a fake daemon (`8` shows it, fetched while shown), and its
snapshot."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable

from llmgw.tui.app import ConsoleApp
from llmgw.tui.state import ConsoleState
from llmgw.tui.tenant_rows import fmt_quota, quota_used, tenant_detail, tenant_rows, tenant_summary_lines

from .test_console import SIZE, console, drive, loaded, table_rows, until
from .test_console_fakes import TENANTS, FakeClient


def test_tenant_rows_show_bands_first_quota_use_and_shares() -> None:
    st = ConsoleState()
    assert tenant_rows(st) == [] and "no tenants yet" in tenant_summary_lines(st)[0]
    assert st.put_tenants(TENANTS) == frozenset({"tenants"})
    rows = {r.key: r for r in tenant_rows(st)}
    assert list(rows) == ["chat", "search", "static", "batch-jobs"]  # highest band first, then by name
    assert rows["chat"].cells == ("chat", "high", "3", "4", "18.4k", "5.3M", "188/600", "—", "22/64", "—", "—",
                                  "2", "0.75")
    assert rows["chat"].tone == "busy"  # waiting, no quota near its limit
    assert rows["search"].cells[9] == "1.9M/2M" and rows["search"].tone == "warn"  # 92% of its day
    assert rows["batch-jobs"].cells[7] == "200k/200k" and rows["batch-jobs"].tone == "bad"
    assert rows["static"].cells[11:] == ("", "") and rows["static"].tone == ""  # static: no keys, not dim
    assert [r.key for r in tenant_rows(st, "nightly")] == ["batch-jobs"]  # the description is searched
    summary = "\n".join(tenant_summary_lines(st))
    assert summary.startswith("4 tenants (high 2 normal 1 batch 1) · today 32.7k requests") and "40 waiting" in summary
    assert "at a limit: batch-jobs" in summary
    detail = tenant_detail(st, "chat")
    assert detail[0] == "chat  band high, weight 3.0" and "models: qwen-7b, llama-70b" in detail
    assert "limits: rpm 600, concurrency 64" in detail and detail[-1] == "waiting: 2 requests, share of its band 0.75"
    assert tenant_detail(st, "nope") == []
    st.put_tenants([])
    assert "no tenants:" in tenant_summary_lines(st)[0]


def test_tenant_rows_survive_junk() -> None:
    st = ConsoleState()
    st.put_tenants([1, {"name": 7, "weight": "x", "keys": None, "quota_use": {"rpm": {"limit": "?"}},
                        "usage_today": "no", "queue": []}, None])
    (row,) = tenant_rows(st)
    assert row.cells[0] == "?" and row.cells[2] == "—" and row.cells[6] == "—" and row.tone == ""
    assert quota_used({"tpm": {"limit": 10, "remaining": 12}}, "tpm") == (0.0, 10.0)  # a refill past full
    assert fmt_quota(None, "day") == "—"
    st.put_tenants({"not": "a list"})
    assert tenant_rows(st) == [] and st.tenants_fetched


def test_the_tenants_view_fetches_while_shown() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        assert ("GET", "tenants", None) not in client.calls  # not fetched until shown
        await pilot.press("8")
        await until(pilot, lambda a: a.query_one("#tenants-table", DataTable).row_count == 4, "the tenant rows")
        assert [r[0] for r in table_rows(app, "#tenants-table")] == ["chat", "search", "static", "batch-jobs"]
        await pilot.press("down")
        await until(pilot, lambda a: "search  band high" in str(a.query_one("#tenants-detail").render()),
                    "the selected tenant's detail")

    drive(script)


def test_snapshot_tenants(request: pytest.FixtureRequest) -> None:
    pytest.importorskip("pytest_textual_snapshot")
    compare = request.getfixturevalue("snap_compare")
    app, _ = console()

    async def settle(pilot: Pilot[Any]) -> None:
        await until(pilot, loaded)
        await pilot.press("8")
        await until(pilot, lambda a: a.query_one("#tenants-table", DataTable).row_count == 4)

    assert compare(app, terminal_size=SIZE, run_before=settle)


def test_canned_tenants_match_the_admin_document() -> None:
    """Once the admin API documents TenantView (issue 24's store-admin part), the fake's answers
    must match it."""
    from llmgw.admin.openapi import document

    if "TenantView" not in document()["components"]["schemas"]:
        pytest.skip("the admin document has no TenantView yet")
    from .test_console_fakes import _validator

    v = _validator("TenantView")
    for t in asyncio.run(FakeClient().tenants()):
        errors = [f"{e.instance_path}: {e.message}" for e in v.iter_errors(t)]
        assert not errors, errors[:5]
