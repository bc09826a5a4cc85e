"""A node's KV event budget, the pure parts: the frame decoder's gate (frames turned away before
their fields are decoded, the seq still counted) and the router index's answer to a dropped
message (the replica waits for a reset: never a wrong index)."""

from __future__ import annotations

import msgpack
import pytest

from llmgw.daemon.router.kv_index import RouterKvIndex
from llmgw.fleet.wire import FROM_AGENT, FrameDecoder, Heartbeat, KvEvents, Skipped, WireProtocolError, encode
from llmgw.fleet.wire_peek import FrameHead, peek_frame


def kv(replica: str, *hashes: int, reset: bool = False, seq: int = 1) -> KvEvents:
    return KvEvents(replica, seq, reset, tuple((None, h) for h in hashes), ())


def test_the_gate_turns_frames_away_before_they_are_parsed() -> None:
    seen: list[tuple[str, str | None, int]] = []

    def gate(t: str, replica: str | None, blocks: int) -> Skipped | None:
        seen.append((t, replica, blocks))
        return Skipped(t, "budget", replica, blocks) if t == "kv_events" and replica == "flood" else None

    d = FrameDecoder(accept=FROM_AGENT, gate=gate)
    # a kv_events frame whose blocks would not even decode: turned away without looking at them
    body = msgpack.packb({"v": 1, "t": "kv_events", "seq": 1, "replica": "flood", "event_seq": 1, "reset": False,
                          "added": [["not", "a", "block"]] * 3, "removed": []}, use_bin_type=True)
    frames = len(body).to_bytes(4, "big") + body + encode(Heartbeat(), 2) + encode(kv("r1", 7), 3)
    out = d.feed(frames)
    assert out[0] == Skipped("kv_events", "budget", "flood", 3)
    assert isinstance(out[1], Heartbeat) and out[2] == kv("r1", 7)
    assert d.last_seq == 3 and seen == [("kv_events", "flood", 3), ("heartbeat", None, 0), ("kv_events", "r1", 1)]
    # a seq that skips is still an error: the gate comes after the frame's checks
    with pytest.raises(WireProtocolError, match="seq"):
        d.feed(encode(kv("flood", 1), 9))


def test_peek_reads_the_head_and_counts_blocks_without_building_them() -> None:
    body = msgpack.packb({"v": 1, "t": "kv_events", "seq": 4, "replica": "r", "added": [[None, 1]] * 70000,
                          "removed": [["gpu", b"x"]] * 20, "other": {"x": [1, 2]}}, use_bin_type=True)
    assert peek_frame(body) == FrameHead(1, "kv_events", 4, "r", 70020)
    assert peek_frame(msgpack.packb({"t": "kv_events", "replica": 7, "added": "junk"})) == \
        FrameHead(None, "kv_events", None, None, 0)
    assert peek_frame(b"\xc1") is None and peek_frame(msgpack.packb([1, 2])) is None


def test_a_dropped_message_empties_the_replica_until_a_reset() -> None:
    now = [0.0]
    idx = RouterKvIndex(clock=lambda: now[0])
    idx.apply(kv("r1", 1, 2, 3, reset=True))
    idx.apply(kv("r2", 9, reset=True))
    assert idx.size("r1") == 3
    idx.dropped("r1", 1000)
    assert idx.size("r1") == 0 and idx.size("r2") == 1  # another replica is untouched
    assert (idx.dropped_messages, idx.dropped_blocks, idx.gaps) == (1, 1000, 1)
    idx.apply(kv("r1", 4, seq=2))  # a delta on a view that missed changes: ignored, not half-applied
    assert idx.size("r1") == 0
    idx.dropped("r1", 10)  # already waiting: one gap, not two
    assert idx.gaps == 1 and idx.dropped_messages == 2
    idx.apply(kv("r1", 5, 6, reset=True, seq=3))  # the agent's next full copy
    assert idx.size("r1") == 2
    idx.dropped(None, 50)  # a foreign replica's: counted, no index touched
    assert idx.dropped_blocks == 1060 and idx.size("r1") == 2
