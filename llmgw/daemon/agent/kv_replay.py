"""Asking a vLLM engine's replay ROUTER for KV event batches it published earlier (vllm-wire.md §1.2):
a DEALER sends ``[b"", start_seq8]`` and receives every buffered batch with ``seq >= start``, then an
end marker; the layout with or without the topic frame (vLLM < 0.26 / >= 0.26) is told apart by
the frame count (llmgw.kv.events.parse_replay_reply).

:func:`fetch_replay` feeds each batch to a callback as it arrives (so memory holds one batch, not the
whole replay) and says how the replay ended with one of llmgw.kv.mirror.REPLAY_OUTCOMES. It never
raises for what the engine sends; the caller bounds it in time (a cancel scope with a deadline).

A fresh DEALER per replay: a late answer to an abandoned replay (timed out, cancelled) can never be
taken for the next one's. Its receive queue is bounded (RCV_HWM): a ROUTER does not wait for a slow
DEALER but drops at the high-water mark, which shows as a hole in the replayed sequence (``missed``).
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from llmgw.daemon.net.zmqio import AsyncSocket
from llmgw.kv.events import (
    EventBatch,
    KVEventDecodeError,
    decode_batch,
    parse_replay_reply,
    replay_request_frames,
)

__all__ = ["MAX_REPLAY_MESSAGES", "fetch_replay"]

MAX_REPLAY_MESSAGES = 10_000  # replayed batches at most: vLLM's default buffer_steps
MAX_REPLAY_MESSAGE = 16 << 20  # bytes of one replayed ZMQ message; larger ones are dropped by libzmq
RCV_HWM = 1_000  # replayed messages queued in libzmq before the ROUTER drops (seen as a hole)

# What the callback says about one applied batch.
APPLIED, HOLE, FULL = "applied", "hole", "full"


async def fetch_replay(ctx: zmq.Context, endpoint: str, start: int, *, need_start: bool,
                       apply: Callable[[int, EventBatch], str],
                       max_messages: int = MAX_REPLAY_MESSAGES) -> tuple[str, int]:
    """Replay from ``start`` and hand each batch to ``apply(seq, batch)`` in order, which answers
    APPLIED, HOLE (the sequence skipped a number: the engine's buffer has a hole) or FULL (the
    mirror overflowed). Returns ``(outcome, batches applied)``.

    ``need_start``: the first batch must be ``start`` itself (a gap: anything later means the engine
    no longer has the missing batch, and nothing is applied); otherwise any first batch is taken
    (the start of a subscription: what the buffer still covers), and a later one than ``start``
    makes the outcome ``missed`` though everything was applied."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, RCV_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_MESSAGE)
    with AsyncSocket(sock) as a:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            return "unavailable", 0
        try:
            return await _exchange(a, start, need_start, apply, max_messages)
        except zmq.ZMQError:  # the socket failed under us: the caller resets, like for a timeout
            return "unavailable", 0


async def _exchange(a: AsyncSocket, start: int, need_start: bool, apply: Callable[[int, EventBatch], str],
                    max_messages: int) -> tuple[str, int]:
    n = 0
    await a.send_multipart(replay_request_frames(start))
    first, partial = True, False
    while True:
        frames = await a.recv_multipart()
        try:
            reply = parse_replay_reply(frames)
            if reply is None:  # the end marker
                break
            seq, payload = reply
            batch = decode_batch(payload)
        except KVEventDecodeError:
            return "bad", n
        if first:
            first = False
            if seq < start:
                return "bad", n  # not what was asked for
            if seq != start:
                if need_start:
                    return "missed", n
                partial = True  # the buffer no longer starts at `start`: take what it covers
        if n >= max_messages:
            return "overflow", n
        got = apply(seq, batch)
        if got == HOLE:
            return "missed", n
        n += 1
        if got == FULL:
            return "overflow", n
    if need_start and n == 0:
        return "missed", 0  # the engine has nothing from `start` on, though a later batch was seen
    return ("missed" if partial else "ok"), n
