"""Tier 2's failure cases over real processes: a router, an agent and `llmgw sim --engine vllm` with
kv_events. Dropped events are replayed (the router's index then equals the engine's blocks) or,
when the engine no longer has them, reset; an engine restart resets its replica; an agent that
comes back and a router that restarts get full copies without any new request.

"The engine's blocks" are read the way the agent reads them: every batch in the simulator's replay
buffer (it keeps all of them here), applied to a fresh mirror."""

from __future__ import annotations

import hashlib
import os
import re
import signal
from typing import Any

import httpx
import zmq

from llmgw.kv.events import decode_batch, parse_replay_reply, replay_request_frames
from llmgw.kv.mirror import BlockMirror

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_kv_stream_integration import index_blocks
from .test_sim_vllm import wait_for


def metric(f: Any, name: str, labels: str = "") -> float:
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def replays(f: Any, reason: str, outcome: str) -> float:
    return metric(f, "llmgw_kv_replays_total", f'{{outcome="{outcome}",reason="{reason}"}}')


def engine_batches(f: Any, replica: str, node: str = "a") -> list[tuple[int, Any]]:
    """Every batch in the engine's replay buffer (its ipc socket in the agent's state_dir/kv)."""
    base = f.tmp / f"agent-{node}" / "kv" / hashlib.sha256(replica.encode()).hexdigest()[:16]
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(f"ipc://{base}.replay")
        s.send_multipart(replay_request_frames(0))
        out = []
        while (r := parse_replay_reply(s.recv_multipart())) is not None:
            out.append((r[0], decode_batch(r[1])))
        return out
    finally:
        ctx.destroy(linger=0)


def engine_blocks(f: Any, replica: str, after: int = -1) -> int:
    """How many blocks the engine holds by its buffered batches (those with seq > after)."""
    m = BlockMirror(1 << 20)
    for seq, batch in engine_batches(f, replica):
        if seq > after:
            m.last_seq = None  # every batch the engine still has, in order, across its own holes
            m.apply(seq, batch)
    return len(m)


def chat(f: Any, i: int) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": f"question {i}: " + "about caches " * 30}],
            "max_tokens": 2}
    r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text


def one_replica(f: Any) -> str:
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    rid = f.ready("m")[0]["replica"]
    # the agent asks the engine's replay buffer when it serves (empty yet): then it is following
    wait_for(lambda: replays(f, "start", "ok") >= 1, 15)
    return rid


def sequences(f: Any, rid: str) -> list[int]:
    return [seq for seq, _ in engine_batches(f, rid)]


def test_dropped_events_are_replayed_and_the_index_equals_the_engine(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, kv_events=True, args=["--sim-kv-drop-seqs", "1"])])
    rid = one_replica(f)
    i = 0
    while max(sequences(f, rid), default=-1) < 2:  # seq 1 never reaches the SUB; a later one shows the gap
        chat(f, i)
        i += 1
    wait_for(lambda: replays(f, "gap", "ok") == 1, 10)
    wait_for(lambda: index_blocks(f).get(rid) == engine_blocks(f, rid), 10)
    assert engine_blocks(f, rid) > 0
    assert metric(f, "llmgw_kv_gaps_total") == 1
    assert metric(f, "llmgw_kv_index_resets_total") == 1  # only the new engine's first message
    assert replays(f, "gap", "missed") == 0


def test_events_the_engine_no_longer_has_reset_the_replica(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, kv_events=True, args=["--sim-kv-drop-seqs", "1", "--sim-kv-drop-lost"])])
    rid = one_replica(f)
    i = 0
    while max(sequences(f, rid), default=-1) < 2:
        chat(f, i)
        i += 1
    wait_for(lambda: replays(f, "gap", "missed") == 1, 10)
    # the router cleared the replica: it holds what came after the gap, not what came before
    after = engine_blocks(f, rid, after=1)
    wait_for(lambda: index_blocks(f).get(rid) == after, 10)
    assert 0 < after < engine_blocks(f, rid)
    assert metric(f, "llmgw_kv_index_resets_total") == 2 and replays(f, "gap", "ok") == 0


def test_an_engine_restart_clears_its_replica_then_it_refills(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, kv_events=True)])
    rid = one_replica(f)
    chat(f, 0)
    wait_for(lambda: index_blocks(f).get(rid, 0) > 0, 10)
    pid = f.ready("m")[0]["pid"]
    os.kill(pid, signal.SIGKILL)  # the agent restarts it: a new engine with an empty cache
    wait_for(lambda: [r["pid"] for r in f.ready("m")] not in ([], [pid]), 20)
    wait_for(lambda: index_blocks(f).get(rid, 0) == 0, 10)  # cleared, not the old engine's blocks
    assert metric(f, "llmgw_kv_index_resets_total") >= 2
    # a new prompt each attempt: events the restarted engine published before the agent's SUB had
    # joined are not replayed (no later event shows the gap), and a repeated prompt is a cache hit
    # that publishes none
    asked = iter(range(1, 1000))
    wait_for(lambda: chat(f, next(asked)) or (index_blocks(f).get(rid, 0) > 0
                                               and index_blocks(f)[rid] == engine_blocks(f, rid)), 20)


def test_a_returning_agent_and_a_restarted_router_get_full_copies(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=2, kv_events=True)], lost_after=10.0)
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    rids = sorted(r["replica"] for r in f.ready("m"))
    wait_for(lambda: replays(f, "start", "ok") >= 2, 15)
    i = 0
    while not all(index_blocks(f).get(r, 0) > 0 for r in rids):  # the router spreads them
        chat(f, i)
        i += 1
    truth = {r: engine_blocks(f, r) for r in rids}
    wait_for(lambda: {r: index_blocks(f).get(r) for r in rids} == truth, 10)

    # the agent dies (its engines keep serving, idle) and comes back: it adopts them and, from their
    # replay buffers, sends everything they hold — no request needed
    os.killpg(f.agents["a"].proc.pid, signal.SIGKILL)
    f.agents["a"].proc.wait(5)
    wait_for(lambda: not any(r in index_blocks(f) for r in rids), 10)  # its stream ended: dropped
    f.start_agent("a")
    wait_for(lambda: {r: index_blocks(f).get(r) for r in rids} == truth, 15)

    # the router restarts: every agent's next session starts with a full copy
    f.stop_router()
    f.start_router()
    wait_for(lambda: {r: index_blocks(f).get(r) for r in rids} == truth, 15)
    assert metric(f, "llmgw_kv_index_resets_total") == 2  # one full copy per replica, nothing else


def test_a_health_flap_keeps_the_replicas_index(fleet_factory: Any) -> None:  # noqa: F811
    """An engine that misses its health checks for a while (a long GC pause, a starved host) is
    withdrawn from routing while it is unhealthy, but its agent goes on following its KV events: the
    router keeps its index, and when it is ready again the index still equals the engine's blocks
    (the agent sends only changes: an index dropped on withdrawal would stay blind to every block the
    engine stored before)."""
    f = fleet_factory([sim_model(count=1, kv_events=True)])
    rid = one_replica(f)
    chat(f, 0)
    wait_for(lambda: index_blocks(f).get(rid, 0) > 0 and index_blocks(f)[rid] == engine_blocks(f, rid), 10)
    held = index_blocks(f)[rid]
    pid = f.ready("m")[0]["pid"]
    os.kill(pid, signal.SIGSTOP)  # its /health stops answering; the process, its cache and its PUB stay
    try:
        wait_for(lambda: [r["state"] for r in f.replicas("m")] == ["unhealthy"], 30)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: [r["pid"] for r in f.ready("m")] == [pid], 30)  # ready again, the same engine
    assert index_blocks(f).get(rid) == held == engine_blocks(f, rid)
    assert metric(f, "llmgw_kv_index_resets_total") == 1  # only the new engine's first message
