"""The agent's side of tier-2 routing: one ZMQ SUB per running engine that publishes KV events,
feeding a :class:`llmgw.kv.mirror.BlockMirror`, whose net changes the session sends up the agent
stream as ``kv_events`` messages (:meth:`KvSubscribers.take`).

* A subscriber follows the engine's reports: it starts when a report names a ``kv_endpoint`` and
  a pid, and stops when the engine stops. A new pid (the engine restarted) is a new subscriber
  with an empty mirror whose first message is a reset: the router clears the replica first.
* An undecodable message (garbage or truncated frames, an unsupported payload) or a sequence gap
  (ZMQ's high-water mark drops messages silently; the engine's sequence numbers show it) resets
  the mirror: it starts again from the next batch and the router clears the replica. Replay
  through the engine's DEALER is not attempted (a reset loses only what is cached so far; the
  index refills as the engine stores blocks). Each is counted and logged at most every 10 s.
* On a new session (a welcome) :meth:`KvSubscribers.resend_all` makes every mirror send a reset
  and then all its blocks, in bounded messages.

Bounds: at most ``max_blocks`` blocks per mirror (an overflow resets it); frames over
MAX_ZMQ_MESSAGE bytes are dropped by libzmq (and show as a gap); at most MAX_BLOCKS_PER_MESSAGE
blocks in one kv_events message and MAX_MESSAGES_PER_FLUSH messages per flush.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio
import zmq

from llmgw.daemon.net.zmqio import AsyncSocket
from llmgw.fleet.types import EngineReport
from llmgw.fleet.wire import KvEvents
from llmgw.kv.events import KVEventDecodeError, decode_batch, parse_pub_frames
from llmgw.kv.mirror import BlockMirror, Outcome

__all__ = ["DEFAULT_MAX_BLOCKS", "FLUSH_S", "KvSubscribers", "SubscriberStats"]

log = logging.getLogger("llmgw.agent.kv")

DEFAULT_MAX_BLOCKS = 1 << 20  # per engine: more than any GPU's KV cache holds at vLLM's block sizes
MAX_BLOCKS_PER_MESSAGE = 1024  # ~40 KB with 32-byte hashes: far under any router's max_message_bytes
MAX_MESSAGES_PER_FLUSH = 32  # so one flush sends at most 32k blocks; the rest waits for the next
FLUSH_S = 0.1  # how often the session sends the mirrors' changes
MAX_ZMQ_MESSAGE = 16 << 20  # bytes of one ZMQ message from an engine; larger ones are dropped
RCV_HWM = 10_000  # ZMQ messages queued before libzmq drops (a drop shows as a sequence gap)
LOG_EVERY_S = 10.0


@dataclass
class SubscriberStats:
    batches: int = 0  # batches applied
    bad_frames: int = 0  # undecodable ZMQ messages (each resets the mirror)
    gaps: int = 0  # sequence gaps (each resets the mirror)
    overflows: int = 0  # more blocks than max_blocks (the mirror reset itself)


@dataclass
class _Sub:
    replica: str
    endpoint: str
    pid: int
    mirror: BlockMirror
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    stats: SubscriberStats = field(default_factory=SubscriberStats)
    next_log: float = 0.0


class KvSubscribers:
    def __init__(self, *, max_blocks: int = DEFAULT_MAX_BLOCKS, context: zmq.Context | None = None) -> None:
        self.max_blocks = max_blocks
        self._ctx = context
        self._subs: dict[str, _Sub] = {}
        self._latest: dict[str, EngineReport] = {}
        self._nursery: trio.Nursery | None = None
        self._next = 0  # where take() starts
        self.totals = SubscriberStats()  # over every subscriber this agent ran

    # ---- following the engines --------------------------------------------------------------------
    def on_report(self, report: EngineReport) -> None:
        """Every engine report (synchronous, from the supervisor's callback)."""
        self._latest[report.replica] = report
        if self._nursery is not None:
            self._follow(report)

    def _follow(self, r: EngineReport) -> None:
        want = r.kv_endpoint is not None and r.pid is not None and r.state in ("starting", "ready", "unhealthy")
        sub = self._subs.get(r.replica)
        if sub is not None and (not want or (sub.endpoint, sub.pid) != (r.kv_endpoint, r.pid)):
            sub.scope.cancel()
            del self._subs[r.replica]
            sub = None
        if not want:
            self._latest.pop(r.replica, None)
            return
        if sub is None:
            assert r.kv_endpoint is not None and r.pid is not None and self._nursery is not None
            mirror = BlockMirror(self.max_blocks)
            mirror.reset()  # the router may hold this replica from an earlier engine: clear it first
            sub = self._subs[r.replica] = _Sub(r.replica, r.kv_endpoint, r.pid, mirror)
            self._nursery.start_soon(self._subscribe, sub)

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
    async def _subscribe(self, sub: _Sub) -> None:
        ctx = self._ctx or zmq.Context.instance()
        with sub.scope:
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
        """One ZMQ message from the engine: never raises; what cannot be used resets the mirror."""
        m, st = sub.mirror, sub.stats
        try:
            _topic, seq, payload = parse_pub_frames(frames)
            batch = decode_batch(payload)
        except KVEventDecodeError as e:
            st.bad_frames += 1
            self.totals.bad_frames += 1
            m.reset()
            self._warn(sub, f"undecodable KV event message ({e}); mirror reset")
            return
        out = m.apply(seq, batch)
        if out is Outcome.GAP:
            st.gaps += 1
            self.totals.gaps += 1
            self._warn(sub, f"KV events {m.last_seq} → {seq}: a gap (dropped messages); mirror reset")
            m.reset()
            out = m.apply(seq, batch)
        if out is Outcome.OVERFLOW:
            st.overflows += 1
            self.totals.overflows += 1
            self._warn(sub, f"more than {self.max_blocks} KV blocks; mirror reset")
        elif out is Outcome.APPLIED:
            st.batches += 1
            self.totals.batches += 1

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
        """The mirrors' net changes, as at most `max_messages` kv_events messages."""
        out: list[KvEvents] = []
        subs = list(self._subs.values())
        if subs:  # start after where the last take stopped: one busy engine cannot starve the others
            self._next %= len(subs)
            subs = subs[self._next:] + subs[:self._next]
            self._next += 1
        for sub in subs:
            m = sub.mirror
            while m.pending and len(out) < max_messages:
                d = m.take_delta(MAX_BLOCKS_PER_MESSAGE)
                out.append(KvEvents(sub.replica, d.seq, d.reset, tuple(d.added), tuple(d.removed)))
            if len(out) >= max_messages:
                break
        return out

    def mirrors(self) -> dict[str, BlockMirror]:
        return {r: s.mirror for r, s in self._subs.items()}
