"""Tenants in the store, on both backends: their documents, usage records added by several routers,
the hourly roll-up (idempotent, late records), retention, budgets' spent tokens, and the routers'
quota demand — none of it fenced, none of it moving the generation followers poll."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.rows import UNFENCED_OPS
from llmgw.tenants.model import ApiKey, Tenant, key_doc, key_from_doc, tenant_doc, tenant_from_doc
from llmgw.tenants.usage import UsageRecord

H = 3600
DAY0 = 1_767_225_600  # 2026-01-01T00:00:00Z
H10 = DAY0 + 10 * H


def rec(minute: int, tenant: str = "a", key: str = "k1", model: str = "m", requests: int = 1, prompt: int = 10,
        cached: int = 0, completion: int = 5, errors: int = 0) -> UsageRecord:
    return UsageRecord(minute, tenant, key, model, requests, prompt, cached, completion, errors)


def totals(rows: list[UsageRecord]) -> dict[tuple[int, str, str, str], tuple[int, ...]]:
    return {(r.minute, r.tenant, r.key, r.model): (r.requests, r.prompt_tokens, r.cached_tokens,
                                                   r.completion_tokens, r.errors) for r in rows}


def test_tenant_and_key_documents_round_trip(any_store: FleetStore) -> None:
    t = Tenant("team-a", band="high", weight=2.0, created_at=1.0)
    k = ApiKey("abcdefghij", "team-a", "0" * 64, "sk-llmgw-abcdefghij-…", name="ci", created_at=2.0)
    g0 = any_store.generation()
    any_store.put_doc("tenant", t.name, tenant_doc(t))
    any_store.put_doc("api_key", k.id, key_doc(k))
    assert tenant_from_doc(any_store.docs("tenant")["team-a"]) == t
    assert key_from_doc(any_store.docs("api_key")["abcdefghij"]) == k
    assert any_store.generation() == g0 + 2  # fenced admin changes: followers reload
    assert any_store.delete_doc("api_key", k.id) and any_store.docs("api_key") == {}


def test_usage_is_added_per_router_and_summed_per_hour(any_store: FleetStore) -> None:
    g0 = any_store.generation()
    any_store.add_usage("r1", [rec(H10 + 60), rec(H10 + 120, cached=3, errors=1)])
    any_store.add_usage("r1", [rec(H10 + 60)])  # the same minute again: added
    any_store.add_usage("r2", [rec(H10 + 60), rec(H10 + H, key="k2", model="n")])
    any_store.add_usage("r2", [])
    assert any_store.generation() == g0  # unfenced: followers do not reload for usage
    got = totals(any_store.usage(DAY0))
    assert got == {(H10, "a", "k1", "m"): (4, 40, 3, 20, 1), (H10 + H, "a", "k2", "n"): (1, 10, 0, 5, 0)}
    assert totals(any_store.usage(DAY0, key="k2")) == {(H10 + H, "a", "k2", "n"): (1, 10, 0, 5, 0)}
    assert totals(any_store.usage(DAY0, model="m", tenant="a")).keys() == {(H10, "a", "k1", "m")}
    assert any_store.usage(DAY0, tenant="b") == []
    assert totals(any_store.usage(H10 + 1800, until=H10 + H)).keys() == {(H10, "a", "k1", "m")}  # hour granularity
    assert any_store.usage(H10 + 2 * H) == []


def test_bad_records_are_refused_whole(any_store: FleetStore) -> None:
    with pytest.raises(ValueError):
        any_store.add_usage("r1", [rec(H10 + 60), rec(H10 + 61)])  # not a minute's start
    with pytest.raises(ValueError):
        any_store.add_usage("r1", [rec(H10, requests=-1)])
    assert any_store.usage(DAY0) == []


def test_rollup_is_idempotent_and_late_records_are_counted_once(any_store: FleetStore) -> None:
    any_store.add_usage("r1", [rec(H10 + 60), rec(H10 + H + 60)])
    any_store.add_usage("r2", [rec(H10 + 120, prompt=100)])
    before = totals(any_store.usage(DAY0))
    assert any_store.rollup_usage(H10 + H + 1800) == 2  # the raw rows of hour 10 (hour 11 is not over)
    assert any_store.rollup_usage(H10 + H + 1800) == 0  # again: nothing
    assert any_store.rollup_usage(H10) == 0  # an older hour: nothing
    assert totals(any_store.usage(DAY0)) == before
    any_store.add_usage("r2", [rec(H10 + 180, completion=7)])  # a late flush for an hour rolled up
    after = totals(any_store.usage(DAY0))
    assert after[(H10, "a", "k1", "m")] == (3, 120, 0, 17, 0)
    assert any_store.rollup_usage(H10 + 2 * H) == 1  # hour 11 now
    assert totals(any_store.usage(DAY0)) == after


def test_retention_prunes_rolled_up_raw_rows_and_old_hours_only(any_store: FleetStore) -> None:
    any_store.add_usage("r1", [rec(H10 + 60), rec(H10 + H + 60), rec(H10 + 2 * H)])
    any_store.rollup_usage(H10 + 2 * H)  # hours 10 and 11
    kept = totals(any_store.usage(DAY0))
    # raw rows before hour 12 may go (rolled up); the one of hour 12 is not rolled up and stays
    assert any_store.prune_usage(raw_before=H10 + 5 * H, hourly_before=DAY0) == 2
    assert totals(any_store.usage(DAY0)) == kept
    assert any_store.prune_usage(raw_before=H10 + 5 * H, hourly_before=H10 + H) == 1  # hour 10's roll-up
    assert totals(any_store.usage(DAY0)).keys() == {(H10 + H, "a", "k1", "m"), (H10 + 2 * H, "a", "k1", "m")}


def test_spent_counts_prompt_and_completion_per_tenant_and_key_for_the_day_and_month(any_store: FleetStore) -> None:
    yesterday = DAY0 + 86400 * 30 - 60  # 2026-01-30 23:59
    today = DAY0 + 86400 * 30  # 2026-01-31
    any_store.add_usage("r1", [rec(yesterday), rec(today + 60, key="k2", prompt=100, completion=50),
                               rec(DAY0 - 60, tenant="b")])  # last year's December: not this month
    any_store.add_usage("r2", [rec(today + 120)])
    any_store.rollup_usage(today)  # yesterday's hours rolled up: still counted
    spent = any_store.spent(today, DAY0)
    assert spent == {("tenant", "a", "day:2026-01-31"): 165, ("tenant", "a", "month:2026-01"): 180,
                     ("key", "k1", "day:2026-01-31"): 15, ("key", "k1", "month:2026-01"): 30,
                     ("key", "k2", "day:2026-01-31"): 150, ("key", "k2", "month:2026-01"): 150}


def test_demands_are_each_routers_last(any_store: FleetStore) -> None:
    any_store.put_demand("r1", {"tenant:a": 3.0, "key:abc": 1.5})
    any_store.put_demand("r2", {"tenant:a": 1.0})
    any_store.put_demand("r1", {"tenant:a": 4.0})
    assert any_store.demands() == {"r1": {"tenant:a": 4.0}, "r2": {"tenant:a": 1.0}}
    assert any_store.demands(max_age_s=3600) == any_store.demands()
    assert any_store.demands(max_age_s=-1) == {}
    with pytest.raises(ValueError):
        any_store.put_demand("r1", {"tenant:a": float("nan")})


def test_usage_writes_are_unfenced_and_survive_a_reopen(reopenable: Callable[[], FleetStore]) -> None:
    assert {"add_usage", "rollup_usage", "prune_usage", "put_demand"} <= UNFENCED_OPS
    st = reopenable()
    try:
        st.try_lead("other", 60)
        st.set_fence("me", 7)  # not the leader: fenced writes are refused, usage is not
        st.add_usage("me", [rec(H10)])
        st.rollup_usage(H10 + H)
        st.put_demand("me", {"tenant:a": 1.0})
    finally:
        st.close()
    st = reopenable()
    try:
        assert totals(st.usage(DAY0)) == {(H10, "a", "k1", "m"): (1, 10, 0, 5, 0)}
        assert st.rollup_usage(H10 + H) == 0  # the watermark was kept
    finally:
        st.close()


def test_write_docs_is_all_or_none(any_store: FleetStore) -> None:
    any_store.put_doc("tenant", "a", {"name": "a"})
    any_store.put_doc("api_key", "k1", {"id": "k1"})
    g0 = any_store.generation()
    with pytest.raises(ValueError):  # the second put's kind is unknown: the first is not kept either
        any_store.write_docs([("api_key", "k2", {"id": "k2"}), ("nope", "x", {})], [("tenant", "a")])
    assert set(any_store.docs("api_key")) == {"k1"} and set(any_store.docs("tenant")) == {"a"}
    any_store.write_docs([("api_key", "k2", {"id": "k2"})], [("api_key", "k1"), ("tenant", "a")])
    assert set(any_store.docs("api_key")) == {"k2"} and any_store.docs("tenant") == {}
    assert any_store.generation() == g0 + 1  # one transaction: followers reload once


def test_a_forwarded_answer_is_deleted_as_it_is_taken(any_store: FleetStore) -> None:
    qid = any_store.queue_admin(1, {"method": "POST"})
    assert any_store.take_admin_answer(qid) is None  # not answered yet: left for the leader
    any_store.answer_admin(qid, {"status": 201, "body": "c2stbGxtZ3ct"})
    assert any_store.take_admin_answer(qid) == {"status": 201, "body": "c2stbGxtZ3ct"}
    assert any_store.admin_answer(qid) is None and any_store.take_admin_answer(qid) is None


def test_a_store_of_the_schema_before_usage_is_migrated(tmp_path: Path, pg_url: str) -> None:
    """SQLite 5 -> 6 and PostgreSQL 1 -> 2: the usage tables added, what was there kept."""
    import psycopg

    from llmgw.daemon.control.store import pg_schema
    from llmgw.daemon.control.store.postgres import PgStore
    from llmgw.daemon.control.store.sqlite import MIGRATIONS, SCHEMA_VERSION, Store

    path = tmp_path / "llmgw" / "old.db"
    path.parent.mkdir(mode=0o700)
    conn = sqlite3.connect(path)
    for script in MIGRATIONS[:5]:
        conn.executescript(script)
    conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '5')")
    conn.execute("INSERT INTO models (name, spec, created_at, updated_at) VALUES ('m', '{}', 0, 0)")
    conn.commit()
    conn.close()
    with psycopg.connect(pg_url, autocommit=True) as pg:
        pg.execute(pg_schema.MIGRATIONS[0])
        pg.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '1')")
        pg.execute("INSERT INTO models (name, spec, created_at, updated_at) VALUES ('m', '{}', 0, 0)")
    for st in (Store.open(str(path)), PgStore.open(pg_url)):
        with st:
            assert st.models() == {"m": {}}
            st.add_usage("r1", [rec(H10)])
            assert st.rollup_usage(H10 + H) == 1 and len(st.usage(DAY0)) == 1
    assert SCHEMA_VERSION == 6 and pg_schema.SCHEMA_VERSION == 2
