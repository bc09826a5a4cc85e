"""The partition guard's rule (llmgw.fleet.nodes NodeRegistry.tick) and the token bucket that
bounds new node names (llmgw.fleet.budget): pure, with an injected clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.fleet.budget import TokenBucket
from llmgw.fleet.nodes import NodeRegistry, NodeTimeouts, failure_domain
from llmgw.fleet.types import NodeFacts

T = NodeTimeouts(not_ready_after_s=5, lost_after_s=30, max_lost_fraction=0.5, partition_lost_interval_s=60)


def join(r: NodeRegistry, name: str, now: float = 0.0, rack: str = "") -> None:
    labels = {"llmgw.io/rack": rack} if rack else {}
    r.connected(name, f"agent-{name}", labels=labels, facts=NodeFacts(), now=now)


def drop(r: NodeRegistry, name: str, now: float) -> None:
    r.disconnected(name, f"agent-{name}", "gone", now)


def beat(r: NodeRegistry, names: str | list[str], now: float) -> None:
    for n in names:
        r.heard(n, f"agent-{n}", now)


def lost(r: NodeRegistry) -> set[str]:
    return {n.name for n in r.nodes.values() if n.state == "lost"}


def test_ghosts_holding_nothing_neither_trigger_the_guard_nor_survive_it() -> None:
    r = NodeRegistry(T, 0.0)
    for n in ("a", "b"):
        join(r, n)
    for i in range(10):  # registered with the join token, then gone
        join(r, f"g{i}", 1.0)
        drop(r, f"g{i}", 1.5)
    drop(r, "a", 2.0)  # a real node dies, holding a replica
    beat(r, "b", 32.0)
    ts = r.tick(32.0, holding={"a"})
    assert not r.partition_suspected
    assert lost(r) == {"a"} | {f"g{i}" for i in range(10)}
    assert next(t for t in ts if t.node == "a").reason == "not ready for 30s"


def test_a_router_that_reaches_no_node_that_matters_declares_nothing_lost() -> None:
    r = NodeRegistry(T, 0.0)
    for n in "abc":
        join(r, n)
        drop(r, n, 1.0)
    assert r.tick(500.0, holding={"a", "b"}) != []  # c holds nothing: it alone is lost
    assert lost(r) == {"c"} and r.partition_suspected
    join(r, "c", 501.0)  # one node that could take the replicas answers: the guard lets go
    r.tick(501.0, holding={"a", "b"})
    assert lost(r) == {"a", "b"} and not r.partition_suspected


def test_a_mostly_silent_domain_loses_one_node_per_interval_not_none_forever() -> None:
    r = NodeRegistry(T, 0.0)
    for n in "abcd":
        join(r, n)
    for n in "abc":
        drop(r, n, 1.0)
    held = set("abcd")
    beat(r, "d", 31.0)
    assert r.tick(31.0, held) == [] and r.partition_suspected
    assert r.disrupted == {"": "3 of its 4 nodes holding replicas silent"}
    beat(r, "d", 90.0)
    assert r.tick(90.0, held) == []  # 59 s into the disruption
    beat(r, "d", 91.0)
    [t] = r.tick(91.0, held)
    assert t.node == "a" and t.new == "lost" and "one node lost per 60s" in t.reason
    beat(r, "d", 150.0)
    assert r.tick(150.0, held) == []
    beat(r, "d", 151.0)
    assert [t.node for t in r.tick(151.0, held)] == ["b"]
    # b and a lost: 1 silent of the 2 that matter is no longer a disruption — c goes at once
    beat(r, "d", 152.0)
    assert [t.node for t in r.tick(152.0, held)] == ["c"] and not r.partition_suspected


def test_a_whole_rack_silent_while_another_answers_is_that_racks_failure() -> None:
    r = NodeRegistry(T, 0.0)
    for n in "abc":
        join(r, n, rack="r1")
    for n in "de":
        join(r, n, rack="r2")
    for n in "abc":
        drop(r, n, 1.0)
    beat(r, "de", 31.0)
    r.tick(31.0, holding=set("abcde"))
    assert lost(r) == set("abc") and not r.partition_suspected


def test_domains_are_judged_apart() -> None:
    r = NodeRegistry(T, 0.0)
    for n in "abcd":
        join(r, n, rack="r1")
    for n in "ef":
        join(r, n, rack="r2")
    for n in "abc":  # r1 mostly silent: held back
        drop(r, n, 1.0)
    drop(r, "e", 1.0)  # r2: 1 of 2 silent — its own failure, acted on
    beat(r, "df", 31.0)
    r.tick(31.0, holding=set("abcdef"))
    assert lost(r) == {"e"} and set(r.disrupted) == {"r1"}
    assert failure_domain({"llmgw.io/site": "s", "llmgw.io/rack": "r1", "llmgw.io/pdu": "p"}) == "s/r1"


def test_without_holdings_every_node_counts_as_holding_replicas() -> None:
    r = NodeRegistry(T, 0.0)
    for n in "abcde":
        join(r, n)
    for n in "abc":
        drop(r, n, 1.0)
    beat(r, "de", 31.0)
    assert r.tick(31.0) == [] and r.partition_suspected


@settings(max_examples=60, deadline=None)
@given(real=st.integers(2, 6), dead=st.integers(0, 6), ghosts=st.integers(0, 30),
       ghost_ready=st.integers(0, 3), racks=st.integers(1, 3))
def test_ghosts_never_change_what_happens_to_real_nodes(real: int, dead: int, ghosts: int, ghost_ready: int,
                                                         racks: int) -> None:
    """The same real fleet, with and without any number of names that hold nothing, decides the
    same for every real node; and while one real node answers, every dead one is lost in bounded
    time (one per interval per domain at worst)."""
    dead = min(dead, real - 1)
    names = [f"n{i}" for i in range(real)]

    def run(with_ghosts: bool) -> dict[str, list[tuple[float, str]]]:
        r = NodeRegistry(T, 0.0)
        for i, n in enumerate(names):
            join(r, n, rack=f"r{i % racks}")
        if with_ghosts:
            for i in range(ghosts):
                join(r, f"g{i}", 0.5, rack=f"r{i % racks}")
                if i >= ghost_ready:
                    drop(r, f"g{i}", 0.6)
        for n in names[:dead]:
            drop(r, n, 1.0)
        seen: dict[str, list[tuple[float, str]]] = {}
        t = 1.0
        while t < 31.0 + 60.0 * (real + 1):
            t += 1.0
            live = [f"g{i}" for i in range(min(ghost_ready, ghosts))] if with_ghosts else []
            beat(r, names[dead:] + live, t)
            for tr in r.tick(t, holding=set(names)):
                if tr.node in names:
                    seen.setdefault(tr.node, []).append((t, tr.new))
        assert {n.name for n in r.nodes.values() if n.state == "lost"} >= set(names[:dead])
        return seen

    without = run(False)
    if ghost_ready == 0 or ghosts == 0:
        assert run(True) == without
    else:  # ready ghosts are reachable nodes: they may only make losses come sooner, never later
        with_ = run(True)
        assert set(with_) == set(without)
        assert all(with_[n][-1][0] <= without[n][-1][0] for n in without)


def test_token_bucket_bounds_a_rate_with_a_burst() -> None:
    b = TokenBucket(rate=1.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not b.take(0.5) and b.take(1.0)
    assert b.available(100.0) == 3  # never more than the burst saved up
    big = TokenBucket(rate=10.0, burst=5, now=0.0)
    assert big.take(0.0, 50)  # larger than the burst: allowed from a full bucket ...
    assert not big.take(1.0, 1) and big.take(6.0, 1)  # ... and paid back before anything else
