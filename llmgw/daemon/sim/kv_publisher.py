"""A KV-event publisher that looks like vLLM's ``ZmqEventPublisher`` on the wire, on trio.

Wire behaviour (vllm-wire.md §1.2):

* PUB socket, ``set_hwm(hwm)``; bound when the endpoint contains ``*`` or ``::`` or starts with
  ``ipc://``/``inproc://``, otherwise *connected* (vLLM dials out to a consumer that binds).
  ``tcp://*:0`` binds an OS-chosen port; :attr:`KVEventPublisher.endpoint` is the resolved address.
* Every batch is one 3-frame message ``[topic utf-8, seq u64 big-endian, payload]``; seq starts at 0.
* Optional ROUTER replay socket: a request of exactly 3 frames ``[identity, b"", start_seq8]`` is
  answered with every buffered batch whose seq >= start, then an end marker (seq ``ff``×8). Layout:
  vLLM < 0.26 ``[id, b"", seq8, payload]`` / ``[id, b"", ff8, b""]``;
  vLLM >= 0.26 ``[id, b"", topic, seq8, payload]`` / ``[id, b"", b"", ff8, b""]``.

The payload is opaque here: the caller encodes the ``KVEventBatch`` (this module knows no codec).

Differences from vLLM, on purpose: ``publish()`` never blocks. vLLM's queue blocks the engine when it is
full; here a full queue drops the batch and counts it. The seq is taken when ``publish()`` is called, so
a dropped batch leaves a *visible gap* in the sequence (and in the replay buffer), which consumers
already have to handle because PUB drops at its high-water mark.

Faults on demand (tests): ``drop_every=N`` / ``drop_seqs`` keep those batches off the PUB socket (a
subscriber sees a gap) while they stay in the replay buffer, so a replay covers them; with
``drop_lost=True`` they are missing from the buffer too, so a replay cannot (the subscriber must reset).
``delay_s`` sends each batch that long after :meth:`publish` (a slow event path: consumers lag the cache).
"""

from __future__ import annotations

import logging
import math
from collections import deque

import trio
import zmq

from llmgw.daemon.net.zmqio import AsyncSocket

__all__ = [
    "END_SEQ",
    "SHUTDOWN_TIMEOUT",
    "KVEventPublisher",
    "is_bind_endpoint",
    "offset_endpoint_port",
]

log = logging.getLogger(__name__)

#: Sequence number of the replay end marker: ``(-1).to_bytes(8, "big", signed=True)``.
END_SEQ = b"\xff" * 8
#: vLLM's ``ZmqEventPublisher.SHUTDOWN_TIMEOUT``: how long shutdown waits for the queue to drain.
SHUTDOWN_TIMEOUT = 1.0


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind on a wildcard/IPv6 address or a local transport, otherwise connect."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's per-DP-rank endpoint: tcp port + rank, inproc suffix ``_dp{rank}``.

    Rank 0 (and None/empty) is unchanged; tcp port 0 is unchanged (vLLM 0.31+). Like vLLM, any other
    transport with rank > 0 raises ValueError (an ipc path cannot be offset).
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"cannot offset endpoint {endpoint!r}: must be tcp:// or inproc://")


class KVEventPublisher:
    """vLLM-compatible KV-event publisher. Constructor arguments mirror ``KVEventsConfig``.

    Sockets are created and bound in the constructor, so :attr:`endpoint` / :attr:`replay_endpoint`
    are resolved before :meth:`run` starts. Usage::

        pub = KVEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", topic="kv")
        async with trio.open_nursery() as nursery:
            await nursery.start(pub.run)
            pub.publish(encoded_batch)
            ...
            await pub.stop()          # graceful: bounded drain, then close

    ``publish`` must be called from the trio thread that runs :meth:`run`. The sockets are owned by
    the tasks of :meth:`run` (one task per socket, see :mod:`llmgw.daemon.net.zmqio`).
    """

    SHUTDOWN_TIMEOUT = SHUTDOWN_TIMEOUT
    END_SEQ = END_SEQ

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        replay_with_topic: bool = True,
        data_parallel_rank: int = 0,
        context: zmq.Context | None = None,
        drop_every: int | None = None,
        drop_seqs: frozenset[int] = frozenset(),
        drop_lost: bool = False,
        delay_s: float = 0.0,
    ) -> None:
        if drop_every is not None and drop_every < 1:
            raise ValueError("drop_every must be >= 1")
        if not delay_s >= 0:
            raise ValueError("delay_s must be >= 0")
        self.delay_s = delay_s
        self.drop_every = drop_every
        self.drop_seqs = frozenset(drop_seqs)
        self.drop_lost = drop_lost
        self.skipped = 0  #: batches kept off the PUB socket on purpose (drop_every / drop_seqs)
        self.topic = topic
        self.replay_with_topic = replay_with_topic
        self.buffer_steps = buffer_steps
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.dropped = 0  #: batches refused because the queue was full
        self.sent = 0  #: batches handed to the PUB socket
        # vLLM uses queue.Queue(maxsize=...), where <= 0 means unbounded.
        size = max_queue_size if max_queue_size > 0 else math.inf
        self._send_ch, self._recv_ch = trio.open_memory_channel[tuple[int, bytes, float]](size)
        self._closing = False
        self._closed = False
        self._started = False
        self._scope = trio.CancelScope()
        self._drained = trio.Event()
        self._done = trio.Event()

        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        assert endpoint is not None
        self._pub: AsyncSocket | None = None
        self._replay: AsyncSocket | None = None
        try:
            pub = self._ctx.socket(zmq.PUB)
            self._pub = AsyncSocket(pub)
            pub.set_hwm(hwm)
            if is_bind_endpoint(endpoint):
                self.endpoint = self._bind(pub, endpoint)
            else:
                pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                router = self._ctx.socket(zmq.ROUTER)
                self._replay = AsyncSocket(router)
                router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a full replay fits (0.33)
                self.replay_endpoint = self._bind(router, replay_endpoint)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str) -> str:
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # -- producer side ---------------------------------------------------------------------------

    def publish(self, payload: bytes) -> int | None:
        """Queue one encoded batch; never blocks. Returns its seq, or None if the queue was full
        (the seq is consumed anyway, so subscribers see the gap). Raises RuntimeError once stopped."""
        if self._closing:
            raise RuntimeError("Publisher is closed")
        if not isinstance(payload, bytes):
            payload = bytes(payload)  # a copy: the replay buffer must not alias a mutable buffer
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._send_ch.send_nowait((seq, payload, trio.current_time() + self.delay_s if self.delay_s else 0.0))
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8, ...: don't flood the log
                log.warning("KV event queue full: dropped %d batches so far (seq %d)", self.dropped, seq)
            return None
        return seq

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def queue_size(self) -> int:
        return self._recv_ch.statistics().current_buffer_used

    def buffered(self) -> list[tuple[int, bytes]]:
        """A copy of the replay ring buffer: the last ``buffer_steps`` sent ``(seq, payload)``."""
        return list(self._buffer)

    # -- lifecycle --------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Drain the queue to the PUB socket and serve replays until cancelled or :meth:`stop`.

        The sockets are closed (linger 0) when this returns, whatever the reason."""
        if self._started or self._closed:
            raise RuntimeError("KVEventPublisher.run() can only be called once")
        self._started = True
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._drain)
                    if self._replay is not None:
                        nursery.start_soon(self._serve_replay)
                    task_status.started()
        finally:
            self.close()
            self._done.set()

    async def stop(self, timeout: float = SHUTDOWN_TIMEOUT) -> bool:
        """Graceful stop like vLLM's ``shutdown()``: refuse new batches, wait up to ``timeout`` s for
        the queue to reach the PUB socket, then stop :meth:`run` and close the sockets with linger 0
        (as vLLM does; frames still inside libzmq may be lost). Returns True if the queue drained."""
        self._closing = True
        self._send_ch.close()  # the drain task finishes once the buffer is empty
        if not self._started or self._done.is_set():
            drained = self.queue_size == 0
            self.close()
            return drained
        with trio.move_on_after(timeout):
            await self._drained.wait()
        drained = self._drained.is_set()
        if not drained:
            log.warning(
                "KV event queue still has %d batches after %.1f s; dropping them", self.queue_size, timeout
            )
        self._scope.cancel()
        await self._done.wait()
        return drained

    def close(self) -> None:
        """Close the sockets now (linger 0) and the owned context. Idempotent; :meth:`run` calls it."""
        if self._closed:
            return
        self._closed = self._closing = True
        self._scope.cancel()
        self._send_ch.close()
        self._recv_ch.close()
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    # -- tasks ------------------------------------------------------------------------------------

    async def _drain(self) -> None:
        assert self._pub is not None
        pub, topic, buffer = self._pub, self._topic, self._buffer
        try:
            async for seq, payload, due in self._recv_ch:
                if due:  # --sim-kv-events-delay-ms: sent that long after it was made (in order)
                    await trio.sleep_until(due)
                if self._skip(seq):
                    self.skipped += 1
                    if not self.drop_lost:
                        buffer.append((seq, payload))
                    continue
                await pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                buffer.append((seq, payload))
                self.sent += 1
        except trio.ClosedResourceError:  # close() called while running
            return
        self._drained.set()  # only reached after stop() closed the send side and the queue is empty

    def _skip(self, seq: int) -> bool:
        every = self.drop_every
        return seq in self.drop_seqs or (every is not None and seq % every == every - 1)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        router = self._replay
        while True:
            try:
                frames = await router.recv_multipart()
            except trio.ClosedResourceError:  # close() called while running
                return
            if len(frames) != 3:
                log.warning("Invalid replay request (%d frames, expected 3); ignored", len(frames))
                continue
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            # Snapshot: the drain task appends to the deque while we await sends.
            batches = [item for item in self._buffer if item[0] >= start]
            try:
                for seq, payload in batches:
                    if self.replay_with_topic:
                        msg = (identity, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    else:
                        msg = (identity, b"", seq.to_bytes(8, "big"), payload)
                    await router.send_multipart(msg)
                if self.replay_with_topic:
                    await router.send_multipart((identity, b"", b"", END_SEQ, b""))
                else:
                    await router.send_multipart((identity, b"", END_SEQ, b""))
            except zmq.ZMQError:
                log.exception("Error while serving a KV event replay")
