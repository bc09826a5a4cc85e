"""The agent's side of tier-2 routing: one ZMQ SUB per running engine that publishes KV events,
feeding a :class:`llmgw.kv.mirror.BlockMirror`, whose net changes the session sends up the agent
stream as ``kv_events`` messages (:meth:`KvSubscribers.take`).

* A subscriber follows the engine's reports: it starts when a report names a ``kv_endpoint`` and
  a pid, and stops when the engine stops. A new pid (the engine restarted) is a new subscriber
  with an empty mirror whose first message is a reset: the router clears the replica first.
* **Start**: a SUB sees only what is published after it joins, so a new subscriber (an agent that
  restarted and adopted its engines, an engine that started before the agent followed it) asks the
  engine's replay ROUTER (``kv_replay``) for everything from seq 0: the mirror then holds what the
  engine's buffer covers, and the router gets it as a full copy without waiting for new requests.
* **Gap** (ZMQ's high-water mark drops messages silently; the engine's sequence numbers show it):
  the subscriber asks the replay ROUTER through a DEALER for the batches from the first missing
  seq (llmgw.daemon.agent.kv_replay) and applies them in order; only when the engine no longer has
  them (the replay starts later, is empty, has a hole, times out, or is garbage) the mirror resets
  (the router clears the replica and the index refills as the engine stores blocks). SUB messages
  that arrive during a replay are held (bounded) and applied after it. One replay in flight per
  engine, a deadline (REPLAY_TIMEOUT_S), a cap on replayed messages, and at least
  REPLAY_MIN_INTERVAL_S between two gap replays of one engine (a gap sooner resets at once).
* An undecodable message (garbage or truncated frames, an unsupported payload) resets the mirror.
  Each problem is counted and logged at most every 10 s.
* Counters (gaps, bad frames, replays by reason and outcome: llmgw.kv.mirror.AGENT_COUNTS) travel
  in the next kv_events message of the replica as increments, each sent once (a restarted engine's
  subscriber takes over what the last one had not sent; a stopped engine's go in a message with no
  blocks); the router adds them to its metrics. An increment in a message lost with a broken stream is not sent again (never
  counted twice; a stream that breaks may lose the last flush's).
* On a new session (a welcome) :meth:`KvSubscribers.resend_all` makes every mirror send a reset
  and then all its blocks, in bounded messages.

Bounds: at most ``max_blocks`` blocks per mirror (an overflow resets it); frames over
MAX_ZMQ_MESSAGE bytes are dropped by libzmq (and show as a gap); at most MAX_HELD messages and
MAX_HELD_BYTES bytes held during a replay (beyond: the replay is abandoned and the mirror resets);
at most MAX_BLOCKS_PER_MESSAGE blocks in one kv_events message and MAX_MESSAGES_PER_FLUSH messages
per flush.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from dataclasses import dataclass, field

import trio
import zmq

from llmgw.daemon.agent.kv_replay import APPLIED, FULL, HOLE, fetch_replay
from llmgw.daemon.net.zmqio import AsyncSocket
from llmgw.fleet.types import KV_FOLLOWED_STATES, EngineReport
from llmgw.fleet.wire import KvEvents
from llmgw.kv.events import (
    EventBatch,
    KVEventDecodeError,
    decode_batch,
    parse_pub_frames,
)
from llmgw.kv.mirror import BlockMirror, Outcome, replay_count

__all__ = ["DEFAULT_MAX_BLOCKS", "FLUSH_S", "KvSubscribers", "SubscriberStats"]

log = logging.getLogger("llmgw.agent.kv")

DEFAULT_MAX_BLOCKS = 1 << 20  # per engine: more than any GPU's KV cache holds at vLLM's block sizes
MAX_BLOCKS_PER_MESSAGE = 1024  # ~40 KB with 32-byte hashes: far under any router's max_message_bytes
MAX_MESSAGES_PER_FLUSH = 32  # so one flush sends at most 32k blocks; the rest waits for the next
FLUSH_S = 0.1  # how often the session sends the mirrors' changes
MAX_ZMQ_MESSAGE = 16 << 20  # bytes of one ZMQ message from an engine; larger ones are dropped
RCV_HWM = 10_000  # ZMQ messages queued before libzmq drops (a drop shows as a sequence gap)
LOG_EVERY_S = 10.0
REPLAY_TIMEOUT_S = 2.0  # a replay (connect, ask, receive up to the end marker) ends by then
REPLAY_MIN_INTERVAL_S = 1.0  # between the starts of two gap replays of one engine
MAX_HELD = 4096  # SUB messages held while a replay runs
MAX_HELD_BYTES = 8 << 20  # their payload bytes (decoded, several times that in Python objects)

_BAD = None  # a held SUB message that could not be decoded (it resets the mirror in its turn)


@dataclass
class SubscriberStats:
    batches: int = 0  # batches applied (from the SUB and from replays)
    bad_frames: int = 0  # undecodable ZMQ messages (each resets the mirror)
    gaps: int = 0  # sequence gaps seen on the SUB (each replayed, or the mirror reset)
    overflows: int = 0  # more blocks than max_blocks (the mirror reset itself)
    replays: Counter[str] = field(default_factory=Counter)  # by replay_count(reason, outcome)


@dataclass
class _Sub:
    replica: str
    endpoint: str
    pid: int
    mirror: BlockMirror
    replay_endpoint: str | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    stats: SubscriberStats = field(default_factory=SubscriberStats)
    next_log: float = 0.0
    received: int = 0  # messages the SUB received
    counts: Counter[str] = field(default_factory=Counter)  # not sent to the router yet
    # the replay in flight (its reason), the SUB messages held meanwhile, and its cancel scope
    replaying: str | None = None
    held: deque[tuple[int, EventBatch | None, int]] = field(default_factory=deque)
    held_bytes: int = 0
    held_overflow: bool = False
    replay_scope: trio.CancelScope | None = None
    next_gap_replay: float = -math.inf
    synced: bool = False  # the start replay was asked for, or the first batch seen was seq 0
    expect: int | None = None  # the seq an empty mirror must start at (an empty start replay: 0)
    # the replay task's inbox: (start seq, reason); one replay at a time, so size 1 suffices
    ask: trio.MemorySendChannel[tuple[int, str]] | None = None


class KvSubscribers:
    def __init__(self, *, max_blocks: int = DEFAULT_MAX_BLOCKS, context: zmq.Context | None = None,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S, replay_min_interval_s: float = REPLAY_MIN_INTERVAL_S
                 ) -> None:
        self.max_blocks = max_blocks
        self.replay_timeout_s = replay_timeout_s
        self.replay_min_interval_s = replay_min_interval_s
        self._ctx = context
        self._subs: dict[str, _Sub] = {}
        self._latest: dict[str, EngineReport] = {}
        self._nursery: trio.Nursery | None = None
        self._next = 0  # where take() starts
        self._orphans: dict[str, Counter[str]] = {}  # counts of engines that stopped, not sent yet
        self.totals = SubscriberStats()  # over every subscriber this agent ran

    # ---- following the engines --------------------------------------------------------------------
    def on_report(self, report: EngineReport) -> None:
        """Every engine report (synchronous, from the supervisor's callback)."""
        self._latest[report.replica] = report
        if self._nursery is not None:
            self._follow(report)

    def _follow(self, r: EngineReport) -> None:
        want = r.kv_endpoint is not None and r.pid is not None and r.state in KV_FOLLOWED_STATES
        sub = self._subs.get(r.replica)
        carried: Counter[str] = Counter()
        if sub is not None and (not want or (sub.endpoint, sub.pid, sub.replay_endpoint)
                                != (r.kv_endpoint, r.pid, r.kv_replay)):
            sub.scope.cancel()
            del self._subs[r.replica]
            carried = sub.counts  # a restarted engine's subscriber sends what the last one counted
            sub = None
        if not want:
            self._latest.pop(r.replica, None)
            if carried:
                self._orphans.setdefault(r.replica, Counter()).update(carried)  # sent by the next take()
            return
        if sub is None:
            assert r.kv_endpoint is not None and r.pid is not None and self._nursery is not None
            mirror = BlockMirror(self.max_blocks)
            mirror.reset()  # the router may hold this replica from an earlier engine: clear it first
            carried.update(self._orphans.pop(r.replica, Counter()))
            sub = self._subs[r.replica] = _Sub(r.replica, r.kv_endpoint, r.pid, mirror, r.kv_replay,
                                               counts=carried)
            recv = None
            if sub.replay_endpoint is not None:
                sub.ask, recv = trio.open_memory_channel[tuple[int, str]](1)
            self._nursery.start_soon(self._engine, sub, recv)
        if r.state == "ready" and not sub.synced and sub.ask is not None and sub.replaying is None:
            # An engine that serves may have published before the SUB joined (an adopted engine, an
            # agent that followed it late): bring the mirror up to date from its replay buffer.
            sub.synced = True
            self._start_replay(sub, 0, "start")

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for r in list(self._latest.values()):
                self._follow(r)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    # ---- one engine --------------------------------------------------------------------------------
    async def _engine(self, sub: _Sub, asks: trio.MemoryReceiveChannel[tuple[int, str]] | None) -> None:
        with sub.scope:
            async with trio.open_nursery() as nursery:
                if asks is not None:
                    nursery.start_soon(self._replayer, sub, asks)
                await self._subscribe(sub)
                nursery.cancel_scope.cancel()

    async def _subscribe(self, sub: _Sub) -> None:
        ctx = self._ctx or zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_ZMQ_MESSAGE)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        with AsyncSocket(sock) as a:
            try:
                sock.connect(sub.endpoint)
            except zmq.ZMQError as e:
                log.warning("engine %s: cannot subscribe to its KV events at %s: %s", sub.replica,
                            sub.endpoint, e)
                return
            log.info("engine %s: following its KV events", sub.replica)
            while True:
                frames = await a.recv_multipart()
                self.feed(sub, frames)

    def feed(self, sub: _Sub, frames: list[bytes]) -> None:
        """One ZMQ message from the engine's PUB: never raises; what cannot be used resets the mirror."""
        sub.received += 1
        try:
            _topic, seq, payload = parse_pub_frames(frames)
            batch: EventBatch | None = decode_batch(payload)
        except KVEventDecodeError as e:
            if sub.replaying is not None:
                self._hold(sub, -1, _BAD, 0)
                return
            self._bad_frame(sub, str(e))
            return
        if sub.replaying is not None:
            self._hold(sub, seq, batch, len(payload))
            return
        assert batch is not None
        self._apply(sub, seq, batch)

    def _bad_frame(self, sub: _Sub, why: str) -> None:
        sub.stats.bad_frames += 1
        self.totals.bad_frames += 1
        sub.counts["bad_frames"] += 1
        sub.mirror.reset()
        self._warn(sub, f"undecodable KV event message ({why}); mirror reset")

    def _apply(self, sub: _Sub, seq: int, batch: EventBatch) -> None:
        """A SUB batch, in order: applied, or a gap that starts a replay (this batch is held until it
        ends) or, when no replay can be asked for, resets the mirror and starts from this batch."""
        m, st = sub.mirror, sub.stats
        start = None  # where a gap starts
        if m.last_seq is None:
            if not sub.synced:
                sub.synced = True
                if seq > 0 and sub.ask is not None:  # the SUB joined late: what came before is in the buffer
                    self._start_replay(sub, 0, "start")
                    self._hold(sub, seq, batch, 0)
                    return
            elif sub.expect is not None and seq > sub.expect:
                start = sub.expect  # the engine had published nothing: this SUB missed the first ones
            sub.expect = None
        out = Outcome.GAP if start is not None else m.apply(seq, batch)
        if out is Outcome.GAP:
            st.gaps += 1
            self.totals.gaps += 1
            sub.counts["gaps"] += 1
            if start is None:
                assert m.last_seq is not None
                start = m.last_seq + 1
            why = self._why_no_replay(sub)
            if why is None:
                self._start_replay(sub, start, "gap")
                self._hold(sub, seq, batch, 0)
                return
            self._count_replay(sub, "gap", why)
            self._warn(sub, f"KV events {m.last_seq} → {seq}: a gap (dropped messages), "
                            f"{'no replay endpoint' if why == 'unavailable' else 'replayed too recently'}; "
                            f"mirror reset")
            m.reset()
            out = m.apply(seq, batch)
        self._outcome(sub, out)

    def _outcome(self, sub: _Sub, out: Outcome) -> None:
        if out is Outcome.OVERFLOW:
            sub.stats.overflows += 1
            self.totals.overflows += 1
            self._warn(sub, f"more than {self.max_blocks} KV blocks; mirror reset")
        elif out is Outcome.APPLIED:
            sub.stats.batches += 1
            self.totals.batches += 1

    def _why_no_replay(self, sub: _Sub) -> str | None:
        if sub.ask is None:
            return "unavailable"
        if trio.current_time() < sub.next_gap_replay:
            return "throttled"
        return None

    # ---- replays -----------------------------------------------------------------------------------
    def _start_replay(self, sub: _Sub, start: int, reason: str) -> None:
        assert sub.ask is not None and sub.replaying is None
        sub.replaying = reason
        if reason == "gap":
            sub.next_gap_replay = trio.current_time() + self.replay_min_interval_s
        sub.ask.send_nowait((start, reason))  # never blocks: the replayer is idle when replaying is None

    def _hold(self, sub: _Sub, seq: int, batch: EventBatch | None, size: int) -> None:
        if sub.held_overflow:
            return  # the replay is being abandoned: the mirror resets, these are lost (a reset covers them)
        if len(sub.held) >= MAX_HELD or sub.held_bytes + size > MAX_HELD_BYTES:
            sub.held_overflow = True
            sub.held.clear()
            sub.held_bytes = 0
            if sub.replay_scope is not None:
                sub.replay_scope.cancel()
            return
        sub.held.append((seq, batch, size))
        sub.held_bytes += size

    async def _replayer(self, sub: _Sub, asks: trio.MemoryReceiveChannel[tuple[int, str]]) -> None:
        """The engine's replay task: one replay at a time, each bounded by replay_timeout_s."""
        ctx = self._ctx or zmq.Context.instance()
        assert sub.replay_endpoint is not None
        def apply(seq: int, batch: EventBatch) -> str:
            out = sub.mirror.apply(seq, batch)
            self._outcome(sub, out)
            return HOLE if out is Outcome.GAP else FULL if out is Outcome.OVERFLOW else APPLIED

        async for start, reason in asks:
            outcome, n = "timeout", 0
            if sub.held_overflow:  # abandoned before it began
                self.finish_replay(sub, "overflow", 0)
                continue
            with trio.move_on_after(self.replay_timeout_s) as cs:
                sub.replay_scope = cs
                outcome, n = await fetch_replay(ctx, sub.replay_endpoint, start, need_start=reason == "gap",
                                                apply=apply)
            sub.replay_scope = None
            if sub.held_overflow:
                outcome = "overflow"
            self.finish_replay(sub, outcome, n)

    def finish_replay(self, sub: _Sub, outcome: str, applied: int) -> None:
        """The replay in flight ended: count it, reset the mirror unless it can be trusted, then apply
        the SUB messages held meanwhile (which may start the next replay)."""
        reason = sub.replaying
        assert reason is not None
        self._count_replay(sub, reason, outcome)
        keep = outcome == "ok" or (reason == "start" and outcome == "missed")
        if not keep:
            sub.mirror.reset()
            self._warn(sub, f"KV event replay from the engine ({reason}): {outcome} after {applied} batches; "
                            "mirror reset")
        elif reason == "gap":
            log.info("engine %s: replayed %d KV event batches over a gap", sub.replica, applied)
        sub.replaying = None
        if reason == "start" and outcome == "ok" and applied == 0 and sub.mirror.last_seq is None:
            sub.expect = 0  # the engine has published nothing yet: its first batch is seq 0
        held, sub.held, sub.held_bytes, sub.held_overflow = sub.held, deque(), 0, False
        while held:
            seq, batch, size = held.popleft()
            if sub.replaying is not None:  # a gap among the held started the next replay
                self._hold(sub, seq, batch, size)
            elif batch is _BAD:
                self._bad_frame(sub, "held during a replay")
            else:
                self._apply(sub, seq, batch)

    def _count_replay(self, sub: _Sub, reason: str, outcome: str) -> None:
        key = replay_count(reason, outcome)
        sub.stats.replays[key] += 1
        self.totals.replays[key] += 1
        sub.counts[key] += 1

    def _warn(self, sub: _Sub, what: str) -> None:
        now = trio.current_time()
        if now >= sub.next_log:
            sub.next_log = now + LOG_EVERY_S
            log.warning("engine %s: %s (bad %d, gaps %d so far)", sub.replica, what, sub.stats.bad_frames,
                        sub.stats.gaps)

    # ---- for the session ---------------------------------------------------------------------------
    def resend_all(self) -> None:
        """A new session: the router has not seen these mirrors (or not all of them)."""
        for sub in self._subs.values():
            sub.mirror.resend_all()

    def take(self, max_messages: int = MAX_MESSAGES_PER_FLUSH) -> list[KvEvents]:
        """The mirrors' net changes and the counters' increments, as at most `max_messages` kv_events
        messages."""
        out: list[KvEvents] = []
        while self._orphans and len(out) < max_messages:  # a stopped engine's last counts: no blocks
            replica, counts = self._orphans.popitem()
            out.append(KvEvents(replica, None, False, (), (), tuple(sorted(counts.items()))))
        subs = list(self._subs.values())
        if subs:  # start after where the last take stopped: one busy engine cannot starve the others
            self._next %= len(subs)
            subs = subs[self._next:] + subs[:self._next]
            self._next += 1
        for sub in subs:
            m = sub.mirror
            while (m.pending or sub.counts) and len(out) < max_messages:
                d = m.take_delta(MAX_BLOCKS_PER_MESSAGE)
                counts = tuple(sorted(sub.counts.items()))  # each increment travels once
                sub.counts.clear()
                out.append(KvEvents(sub.replica, d.seq, d.reset, tuple(d.added), tuple(d.removed), counts))
            if len(out) >= max_messages:
                break
        return out

    def mirrors(self) -> dict[str, BlockMirror]:
        return {r: s.mirror for r, s in self._subs.items()}
