"""Routing as one, the shell's half: the peer feed. Each router publishes its routing decisions'
prefix-tree inserts (the core's outbox, :mod:`llmgw.route.prefix_share`) on a ZeroMQ PUB socket
and subscribes to every other router's, applying theirs to its own tree; docs/ha.md, "Routing
as one".

- **Publish**: every ``flush_s`` (20 ms) the outbox is drained into messages of at most
  ``batch`` (256) inserts and ``batch_bytes`` (512 KiB) each, encoded and MAC'd
  (:mod:`llmgw.route.prefix_wire`) and sent. A PUB socket never blocks: past its high-water
  mark libzmq drops a slow subscriber's messages (the subscriber sees the gap in ``seq``).
- **Subscribe**: one SUB socket connected to every peer :meth:`PeerFeed.set_peers` names
  (the lead refreshes it from the store's ``routers`` table). A message is dropped and counted
  when it is too large, malformed, of another version, badly MAC'd, the router's own, from a
  router not (or no longer) among the peers, or an old one replayed; each insert of a good one
  goes to the core (applied, or counted as for a replica this router does not route to).
- Nothing here raises into the router: the loops count what they drop, and a bug in handling
  one message is logged (rate-limited) and that message dropped.

Connecting and disconnecting happen in the receiving task (the socket's one owner: its
notification fd is edge-triggered, see :mod:`llmgw.daemon.net.zmqio`); ``set_peers`` records
the wanted set and wakes that task.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.config import Config
from llmgw.config.fields import host_port
from llmgw.daemon.net.log_limit import LogLimiter, repeats
from llmgw.daemon.net.zmqio import AsyncSocket
from llmgw.daemon.router.metrics import RouterMetrics
from llmgw.route.dispatch import RouterCore
from llmgw.route.prefix_share import PrefixInsert
from llmgw.route.prefix_wire import (
    DROP_REASONS, MAX_MESSAGE_BYTES, FeedMessage, decode, encode, insert_bytes, overhead_bytes,
)

log = logging.getLogger("llmgw.router.peer_feed")

__all__ = ["FeedHost", "FeedStats", "PeerFeed", "PeerFeedMetrics", "SharePort", "start_peer_feed", "zmq_endpoint"]

_APPLY_SLICE = 16  # a peer's inserts applied between two yields to the router's other tasks
# Inserts dropped on the way (besides whole messages, DROP_REASONS): pushed out of the outbox
# before they were sent, too large for a message, lost between two routers (a gap in seq: counted
# in messages), a peer's insert for a replica this router does not route to, or for another
# model; and messages a bug kept from being handled (logged).
INSERT_DROPS = ("outbox_full", "too_large", "gap", "unknown_replica", "other_model", "error")


class SharePort(Protocol):
    """What the feed needs of the core (``RouterCore.prefix_share()``)."""

    def take(self, most: int | None = None) -> list[PrefixInsert]: ...

    def apply(self, ins: PrefixInsert, now: float) -> str: ...

    def counts(self) -> dict[str, int]: ...


@dataclass(slots=True)
class FeedStats:
    sent: int = 0  # inserts published
    sent_messages: int = 0
    sent_bytes: int = 0
    received: int = 0  # peers' inserts in messages that passed every check
    received_messages: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys((*DROP_REASONS, *INSERT_DROPS), 0))


def zmq_endpoint(addr: str) -> str:
    """``host:port`` (``[v6]:port``) as a ZeroMQ TCP endpoint; port 0 binds an ephemeral one."""
    host, _, port = addr.rpartition(":")
    return f"tcp://{host}:{'*' if port == '0' else port}"


def _host_port(endpoint: str) -> str:
    return endpoint.removeprefix("tcp://")


class PeerFeed:
    """One router's feed: its PUB socket, its SUB socket and the two tasks that own them."""

    def __init__(self, router_id: str, key: bytes, share: SharePort, *, listen: str = "127.0.0.1:0",
                 advertise: str = "", flush_s: float = 0.02, batch: int = 256, batch_bytes: int = 512 << 10,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, hwm: int = 128,
                 context: zmq.Context | None = None) -> None:
        if not router_id or not key:
            raise ValueError("the peer feed needs a router id and a key")
        if batch_bytes + overhead_bytes(router_id) > max_message_bytes:
            raise ValueError("batch_bytes leaves no room in max_message_bytes")
        self.router_id = router_id
        self.key = bytes(key)
        self.share = share
        self.flush_s = flush_s
        self.batch = batch
        self.batch_bytes = batch_bytes
        self.max_message_bytes = max_message_bytes
        self.stats = FeedStats()
        self.incarnation = secrets.randbits(63)
        self._seq = 0
        self._ctx = context or zmq.Context.instance()
        self._log = LogLimiter(60.0)
        # peers: wanted (set_peers: id -> endpoint) and the endpoints connected (by the receiving task)
        self._want: dict[str, str] = {}
        self._connected: set[str] = set()
        self._last: dict[str, tuple[int, int]] = {}  # sender -> (incarnation, last seq)
        self._wake: trio.CancelScope | None = None
        self._closed = False
        pub = self._ctx.socket(zmq.PUB)
        sub = self._ctx.socket(zmq.SUB)
        try:
            for s in (pub, sub):
                s.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.IPV6, 1)  # [v6] peers too (IPv4 ones as before)
            if listen.startswith("["):
                pub.setsockopt(zmq.IPV6, 1)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            # Memory, bounded: at most `hwm` messages queued for each subscriber (a stalled peer
            # router: past it, what is published is lost for that peer, which sees the gap), and
            # `hwm` received ones of at most twice the cap (libzmq drops a connection sending more)
            pub.setsockopt(zmq.SNDHWM, hwm)
            sub.setsockopt(zmq.RCVHWM, hwm)
            sub.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
            sub.setsockopt(zmq.RECONNECT_IVL, 100)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            pub.bind(zmq_endpoint(listen))
        except BaseException as e:
            pub.close(0)
            sub.close(0)
            if isinstance(e, zmq.ZMQError):
                raise OSError(f"the peer feed cannot bind [ha] feed_listen = {listen!r}: {e}") from None
            raise
        self._pub = pub
        self._sub = AsyncSocket(sub)
        self.bound = _host_port(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        self.address = _advertised(self.bound, advertise)

    # -- peers ------------------------------------------------------------------------------------
    def set_peers(self, peers: Mapping[str, str]) -> None:
        """The routers to subscribe to, ``{router_id: "host:port"}`` (this router's own id, and
        addresses that are not host:port, are left out; routers sharing an address share one
        connection). Messages from a router no longer named are dropped from now on, even
        those already queued."""
        want: dict[str, str] = {}
        for rid, addr in peers.items():
            if rid == self.router_id or not isinstance(addr, str) or host_port(addr) is not None:
                continue
            want[rid] = zmq_endpoint(addr)
        if want == self._want:
            return
        self._want = want
        for rid in [r for r in self._last if r not in want]:
            del self._last[rid]
        if self._wake is not None:
            self._wake.cancel()

    def peer_count(self) -> int:
        """Addresses subscribed to now."""
        return len(self._connected)

    def peers(self) -> dict[str, str]:
        """The peers named and subscribed to now: id -> host:port."""
        return {rid: _host_port(ep) for rid, ep in self._want.items() if ep in self._connected}

    def _apply_peers(self) -> None:
        wanted = set(self._want.values())
        have = self._connected
        sub = self._sub.socket
        for ep in [e for e in have if e not in wanted]:
            try:
                sub.disconnect(ep)
            except zmq.ZMQError:
                pass
            have.discard(ep)
        for ep in sorted(wanted - have):
            try:
                sub.connect(ep)
            except zmq.ZMQError as e:
                if self._log.hit(("connect", ep), trio.current_time()) is not None:
                    log.warning("peer feed: cannot subscribe to %s: %s", _host_port(ep), e)
                continue
            have.add(ep)

    # -- the tasks ----------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish and subscribe until cancelled; then the sockets are closed."""
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._publish_loop)
                n.start_soon(self._receive_loop)
                task_status.started()
        finally:
            self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sub.close(0)
            self._pub.close(0)

    async def _publish_loop(self) -> None:
        while True:
            await trio.sleep(self.flush_s)
            try:
                self.flush()
            except Exception:  # noqa: BLE001 — a bug here must not stop the feed or the router
                self.stats.dropped["error"] += 1
                n = self._log.hit("flush", trio.current_time())
                if n is not None:
                    log.exception("peer feed: the outbox could not be sent%s", repeats(n))

    def flush(self) -> int:
        """Send what the outbox holds now; the messages sent."""
        inserts = self.share.take()
        if not inserts:
            return 0
        st = self.stats
        room = self.max_message_bytes - overhead_bytes(self.router_id)
        sent = 0
        batch: list[PrefixInsert] = []
        size = 0
        for ins in inserts:
            b = insert_bytes(ins)
            if b > room:
                st.dropped["too_large"] += 1
                continue
            if batch and (len(batch) >= self.batch or size + b > self.batch_bytes):
                sent += self._send(batch)
                batch, size = [], 0
            batch.append(ins)
            size += b
        if batch:
            sent += self._send(batch)
        return sent

    def _send(self, batch: list[PrefixInsert]) -> int:
        self._seq += 1
        frame = encode(self.key, self.router_id, self.incarnation, self._seq, batch)
        try:
            self._pub.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # PUB does not block; a closed or broken socket may still refuse
            if self._log.hit("send", trio.current_time()) is not None:
                log.warning("peer feed: cannot publish: %s", e)
            return 0
        st = self.stats
        st.sent += len(batch)
        st.sent_messages += 1
        st.sent_bytes += len(frame)
        return 1

    async def _receive_loop(self) -> None:
        sub = self._sub
        while True:
            self._apply_peers()
            frames = None
            with trio.CancelScope() as wake:
                self._wake = wake
                frames = await sub.recv_multipart(copy=True)
            self._wake = None
            if frames is None:  # woken: the peers changed
                continue
            try:
                msg = self.checked(frames)
                if msg is not None:
                    await self._apply(msg.inserts)
            except Exception:  # noqa: BLE001 — a bug here must not stop the feed or the router
                self.stats.dropped["error"] += 1
                n = self._log.hit("handle", trio.current_time())
                if n is not None:
                    log.exception("peer feed: a message could not be handled%s", repeats(n))

    def checked(self, frames: list[Any]) -> FeedMessage | None:
        """One message from the SUB socket, if it passes every check (else counted)."""
        st = self.stats
        if len(frames) != 1:
            st.dropped["malformed"] += 1
            return None
        msg = decode(self.key, frames[0], max_bytes=self.max_message_bytes)
        if isinstance(msg, str):
            st.dropped[msg] += 1
            return None
        why = self._check_sender(msg)
        if why is not None:
            st.dropped[why] += 1
            return None
        st.received_messages += 1
        st.received += len(msg.inserts)
        return msg

    async def _apply(self, inserts: list[PrefixInsert]) -> None:
        """A message's inserts into the core, yielding to the router's requests every
        ``_APPLY_SLICE`` of them (a message of 256 can take milliseconds of tree inserts)."""
        apply = self.share.apply
        drop = self.stats.dropped
        for k in range(0, len(inserts), _APPLY_SLICE):
            if k:
                await trio.lowlevel.checkpoint()
            now = trio.current_time()
            for ins in inserts[k:k + _APPLY_SLICE]:
                outcome = apply(ins, now)
                if outcome != "applied":
                    drop[outcome] = drop.get(outcome, 0) + 1

    def _check_sender(self, msg: FeedMessage) -> str | None:
        s = msg.sender
        if s == self.router_id:
            return "own"
        if s not in self._want:
            return "unknown_peer"
        last = self._last.get(s)
        if last is not None and last[0] == msg.incarnation:
            if msg.seq <= last[1]:
                return "replay"
            self.stats.dropped["gap"] += msg.seq - last[1] - 1
        self._last[s] = (msg.incarnation, msg.seq)
        return None


def _advertised(bound: str, advertise: str) -> str:
    """What other routers dial: ``advertise`` ("" = the bound address; a host alone = that host
    with the bound port)."""
    if not advertise:
        return bound
    if host_port(advertise) is None:
        return advertise
    return f"{advertise}:{bound.rpartition(':')[2]}"


class PeerFeedMetrics(Collector):
    """llmgw_peer_feed_sent_total, _sent_bytes_total, _received_total, _dropped_total{reason},
    _peers (docs/ha.md, "Routing as one")."""

    def __init__(self, feed: PeerFeed) -> None:
        self.feed = feed

    def collect(self) -> Iterable[Metric]:
        f = self.feed
        st = f.stats
        yield CounterMetricFamily("llmgw_peer_feed_sent", "Prefix-tree inserts this router published to its "
                                  "peers.", value=float(st.sent))
        yield CounterMetricFamily("llmgw_peer_feed_sent_bytes", "Bytes of the messages this router published "
                                  "to its peers.", value=float(st.sent_bytes))
        yield CounterMetricFamily("llmgw_peer_feed_received", "Prefix-tree inserts received from peer routers "
                                  "in messages that passed every check.", value=float(st.received))
        c = CounterMetricFamily("llmgw_peer_feed_dropped", "What the peer feed dropped, by reason: whole messages "
                                "(oversize, malformed, version, bad_mac, own, unknown_peer, replay, error), messages "
                                "lost between routers (gap), or inserts (outbox_full, too_large, unknown_replica, "
                                "other_model).", labels=["reason"])
        drops = dict(st.dropped)
        drops["outbox_full"] = f.share.counts().get("outbox_dropped", 0)
        for reason, n in drops.items():
            c.add_metric([reason], float(n))
        yield c
        yield GaugeMetricFamily("llmgw_peer_feed_peers", "Peer routers this router subscribes to.",
                                value=float(f.peer_count()))


class FeedHost(Protocol):
    """What :func:`start_peer_feed` needs of the router (``llmgw.daemon.router.proxy.Router``)."""

    cfg: Config
    core: RouterCore
    metrics: RouterMetrics
    peer_feed: PeerFeed | None


def start_peer_feed(router: FeedHost, nursery: trio.Nursery, key: bytes, *, router_id: str,
                    listen: str | None = None, advertise: str | None = None) -> PeerFeed:
    """Share this router's tier 1 with its peers: its core keeps each decision's insert from now
    on, the feed binds at ``listen`` (default ``[ha] feed_listen``; a taken address raises
    OSError) and runs in ``nursery``, and its metrics join the router's. The feed's ``address``
    is what to advertise (``[ha] feed_advertise``, or the bound address); the other routers'
    feeds are set with ``set_peers`` (or ``RouterPort.set_feed_peers``)."""
    if router.peer_feed is not None:
        raise RuntimeError("this router's peer feed is already started")
    ha = router.cfg.ha
    feed = PeerFeed(router_id, key, router.core.prefix_share(),
                    listen=ha.feed_listen if listen is None else listen,
                    advertise=ha.feed_advertise if advertise is None else advertise)
    router.peer_feed = feed
    router.metrics.registry.register(PeerFeedMetrics(feed))
    nursery.start_soon(feed.run)
    log.info("peer feed of router %s: publishing at %s (bound %s)", router_id, feed.address, feed.bound)
    return feed
