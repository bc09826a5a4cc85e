"""The kv_events message of the agent stream: round trip, field checks and bounds."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from llmgw.fleet.wire import (
    AGENT_FEATURES,
    FEATURE_KV_EVENTS,
    FROM_AGENT,
    FROM_ROUTER,
    ROUTER_FEATURES,
    FrameDecoder,
    KvEvents,
    Welcome,
    WireProtocolError,
    encode,
)
from llmgw.fleet.wire_fields import MAX_KV_BLOCKS

KV = KvEvents(replica="llama-8b/3f9a1c", event_seq=41, reset=True,
              added=(("GPU", 2**63 + 5), (None, b"\x01" * 32), ("CPU", -3)), removed=((None, 7),))


def frame(**changes: Any) -> bytes:
    d = {"v": 1, "t": KV.TYPE, "seq": 1, **KV.to_dict(), **changes}
    body = msgpack.packb(d, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def refused(data: bytes, **kw: Any) -> str:
    with pytest.raises(WireProtocolError) as e:
        FrameDecoder(**kw).feed(data)
    return str(e.value)


def test_round_trip() -> None:
    assert FrameDecoder(accept=FROM_AGENT).feed(encode(KV, 1)) == [KV]
    empty = KvEvents("r", None, False, (), ())
    assert FrameDecoder().feed(encode(empty, 1)) == [empty]


def test_agents_list_the_feature_and_only_routers_accept_it() -> None:
    assert FEATURE_KV_EVENTS in AGENT_FEATURES
    assert "unexpected kv_events" in refused(encode(KV, 1), accept=FROM_ROUTER)


@pytest.mark.parametrize(("changes", "error"), [
    ({"replica": ""}, "kv_events.replica: empty"),
    ({"replica": 3}, "kv_events.replica: expected str, got int"),
    ({"event_seq": "1"}, "kv_events.event_seq: expected int, got str"),
    ({"reset": 1}, "kv_events.reset: expected bool, got int"),
    ({"added": {"a": 1}}, "kv_events.added: expected list, got dict"),
    ({"added": [[None]]}, "kv_events.added[0]: expected a [medium, hash] pair"),
    ({"added": [5]}, "kv_events.added[0]: expected a [medium, hash] pair"),
    ({"added": [[None, "abc"]]}, "kv_events.added[0][1]: expected int or bytes, got str"),
    ({"added": [[None, 1.5]]}, "kv_events.added[0][1]: expected int or bytes, got float"),
    ({"removed": [[None, True]]}, "kv_events.removed[0][1]: expected int or bytes, got bool"),
    ({"added": [[None, b"x" * 65]]}, "kv_events.added[0][1]: a hash of 65 bytes, at most 64"),
    ({"added": [[1, 2]]}, "kv_events.added[0][0]: expected str, got int"),
    ({"added": [["G" * 33, 2]]}, "kv_events.added[0][0]: 33 chars, at most 32"),
    ({"added": [[None, 1]] * (MAX_KV_BLOCKS + 1)}, f"kv_events.added: {MAX_KV_BLOCKS + 1} items, at most"),
    ({"added": [[None, 1]] * MAX_KV_BLOCKS, "removed": [[None, 2]]},
     f"kv_events: {MAX_KV_BLOCKS + 1} blocks, at most {MAX_KV_BLOCKS}"),
    ({"reset": None}, "kv_events.reset: expected bool"),
    ({"counts": [1]}, "kv_events.counts: expected dict, got list"),
    ({"counts": {"gaps": -1}}, "kv_events.counts.gaps: -1 is not in [0, 4294967296]"),
    ({"counts": {"gaps": 2**32 + 1}}, "kv_events.counts.gaps: 4294967297 is not in"),
    ({"counts": {"gaps": 1.0}}, "kv_events.counts.gaps: expected int, got float"),
    ({"counts": {"": 1}}, "kv_events.counts key: empty"),
    ({"counts": {"x" * 65: 1}}, "kv_events.counts key: 65 chars, at most 64"),
    ({"counts": {f"c{i}": 1 for i in range(33)}}, "kv_events.counts: 33 counters, at most 32"),
])
def test_bad_fields_are_named(changes: dict[str, Any], error: str) -> None:
    assert refused(frame(**changes)).startswith(error)


def test_counts_travel_once_and_are_optional() -> None:
    msg = KvEvents("r", 3, False, (), (), counts=(("gaps", 2), ("replay_gap_ok", 1)))
    assert FrameDecoder().feed(encode(msg, 1)) == [msg]
    assert "counts" not in KV.to_dict()  # an older router never sees the field unless there is one
    newer = FrameDecoder().feed(frame(counts={"gaps": 1, "some_new_counter": 4}))[0]
    assert newer.counts == (("gaps", 1), ("some_new_counter", 4))  # the router ignores names it does not know


def test_missing_field() -> None:
    d = {"v": 1, "t": KV.TYPE, "seq": 1, **KV.to_dict()}
    del d["removed"]
    body = msgpack.packb(d, use_bin_type=True)
    assert refused(len(body).to_bytes(4, "big") + body) == "kv_events.removed: missing"


def test_bounds_at_the_edge_pass() -> None:
    msg = KvEvents("r", 1, False, tuple((None, i) for i in range(MAX_KV_BLOCKS - 1)), ((None, b"y" * 64),))
    assert FrameDecoder().feed(encode(msg, 1)) == [msg]


def test_welcome_lists_router_features_and_older_welcomes_have_none() -> None:
    w = Welcome("n", "r", 1, 5.0, features=ROUTER_FEATURES)
    assert FrameDecoder().feed(encode(w, 1)) == [w] and w.has(FEATURE_KV_EVENTS)
    d = {"v": 1, "t": "welcome", "seq": 1, "node": "n", "router_id": "r", "version": 1, "heartbeat_s": 5.0}
    body = msgpack.packb(d, use_bin_type=True)
    old = FrameDecoder().feed(len(body).to_bytes(4, "big") + body)[0]
    assert isinstance(old, Welcome) and not old.has(FEATURE_KV_EVENTS)
