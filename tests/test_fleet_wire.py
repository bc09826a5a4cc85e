"""The agent ↔ router wire codec (llmgw.fleet.wire): framing, sequencing and strict validation."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from llmgw.fleet.types import EngineReport, EngineSpec, GpuInfo, NodeFacts
from llmgw.fleet.wire import (
    FROM_AGENT,
    MAX_FRAME,
    Bye,
    Desired,
    EngineUpdate,
    FrameDecoder,
    Heartbeat,
    Hello,
    Message,
    Refused,
    ReportRejected,
    RouterAddr,
    Routers,
    Welcome,
    WireProtocolError,
    encode,
)

SPEC = EngineSpec(replica="llama-8b/3f9a1c", model="llama-8b", engine="vllm", model_path="meta/llama-8b",
                  simulate=True, binary="/opt/vllm", args=("--max-model-len", "8192"), env=(("HF_HOME", "/hf"),),
                  gpu_indices=(0, 1), health_timeout_s=120.0, generation=3)
REPORT = EngineReport(replica="llama-8b/3f9a1c", model="llama-8b", state="crashed", spec_hash="ab12",
                      generation=3, url="http://10.0.0.7:8000", pid=4242, restarts=2, detail="exit 1",
                      log_tail=("CUDA out of memory", "bye"), adopted=True)
FACTS = NodeFacts(cpus=32, memory_mb=256000, gpus=(GpuInfo(0, "H100", 81559), GpuInfo(1, "H100", 81559)),
                  hostname="gpu-7", agent_version="0.1.0")

MESSAGES: list[Message] = [
    Hello(token="s3cret", node="gpu-7", agent_id="a1b2c3", versions=(1,), labels={"zone": "eu-1", "gpu": "h100"},
          facts=FACTS, engines=(REPORT, EngineReport(replica="r2", model="m", state="ready"))),
    Heartbeat(),
    EngineUpdate(report=REPORT),
    Bye(reason="shutting down"),
    Welcome(node="gpu-7", router_id="router-1", version=1, heartbeat_s=5.0),
    Refused(reason="bad token"),
    Desired(rev=17, engines=(SPEC, EngineSpec(replica="r2", model="m", engine="llamacpp", model_path="/m.gguf"))),
    Desired(rev=18, engines=()),
    Hello(token="", node="gpu-8", agent_id="a2", versions=(1,), labels={}, facts=FACTS, engines=(),
          credential="cred-Secret", features=("credential", "report_rejected")),
    Welcome(node="gpu-8", router_id="router-1", version=1, heartbeat_s=1.0, credential="new-Secret"),
    Refused(reason="node gpu-8 is connected", retry=True),
    ReportRejected(replica="llama-8b/3f9a1c", reason="url: the port is missing"),
]
CA = "-----BEGIN CERTIFICATE-----\nMIIB...\n-----END CERTIFICATE-----\n"
ROUTERS = (RouterAddr("r1", "10.0.0.1:7070", CA, "llmgw-control"), RouterAddr("r2", "[::1]:7071"))
MESSAGES += [
    Welcome(node="gpu-8", router_id="r2", version=1, heartbeat_s=1.0, epoch=7, leading=False, routers=ROUTERS),
    Routers(epoch=8, leading=True, routers=ROUTERS),
    Routers(epoch=0, leading=False, routers=()),
    Desired(rev=19, engines=(), epoch=8),
]


def stream_of(msgs: list[Message]) -> bytes:
    return b"".join(encode(m, i) for i, m in enumerate(msgs, 1))


def raw_frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def wire(msg: Message, seq: int = 1, **changes: Any) -> dict[str, Any]:
    """A message's map as encode writes it, with `changes` applied (None deletes a key)."""
    d = {"v": 1, "t": msg.TYPE, "seq": seq, **msg.to_dict()}
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def refused(*frames: bytes, **kw: Any) -> str:
    """The WireProtocolError message for feeding `frames` to a fresh decoder."""
    with pytest.raises(WireProtocolError) as e:
        FrameDecoder(**kw).feed(b"".join(frames))
    return str(e.value)


# --------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_each_type(msg: Message) -> None:
    d = FrameDecoder()
    assert d.feed(encode(msg, 1)) == [msg]
    assert d.last_seq == 1
    assert type(msg).from_dict(msg.to_dict()) == msg


def test_stream_split_at_every_byte() -> None:
    data = stream_of(MESSAGES)
    for cut in range(len(data) + 1):
        d = FrameDecoder()
        assert d.feed(data[:cut]) + d.feed(data[cut:]) == MESSAGES, cut
        assert d.buffered == 0 and d.last_seq == len(MESSAGES)


def test_byte_by_byte() -> None:
    d = FrameDecoder()
    out: list[Message] = []
    for i in range(len(data := stream_of(MESSAGES))):
        out += d.feed(data[i:i + 1])
    assert out == MESSAGES


def test_two_frames_in_one_feed() -> None:
    d = FrameDecoder()
    assert d.feed(encode(Heartbeat(), 1) + encode(Bye("done"), 2)) == [Heartbeat(), Bye("done")]
    assert d.last_seq == 2


def test_partial_frame_is_held() -> None:
    d = FrameDecoder()
    frame = encode(Refused("no"), 1)
    assert d.feed(frame[:3]) == [] and d.feed(frame[3:-1]) == []
    assert d.buffered == len(frame) - 1
    assert d.feed(frame[-1:]) == [Refused("no")]


# --------------------------------------------------------------------------- framing errors

def test_oversize_rejected_from_the_header_alone() -> None:
    assert "exceeds" in refused((MAX_FRAME + 1).to_bytes(4, "big"))
    assert "4294967295 bytes" in refused(b"\xff\xff\xff\xff")
    assert "exceeds the 10 byte limit" in refused(b"\x00\x00\x00\x0b", max_frame=10)
    FrameDecoder(max_frame=10).feed(b"\x00\x00\x00\x0a")  # at the limit: waits for the body


def test_decoder_stays_failed() -> None:
    d = FrameDecoder()
    with pytest.raises(WireProtocolError):
        d.feed(b"\xff\xff\xff\xff")
    with pytest.raises(WireProtocolError):
        d.feed(encode(Heartbeat(), 1))


@pytest.mark.parametrize("body", [b"\xc1", b"\x92\x01", msgpack.packb({"v": 1}) + b"\x00", b"",
                                  b"\x81\x01\x02"],  # an int map key (strict_map_key)
                         ids=["reserved-byte", "truncated", "extra-data", "empty", "int-key"])
def test_garbage_msgpack(body: bytes) -> None:
    assert "not a msgpack document" in refused(len(body).to_bytes(4, "big") + body)


@pytest.mark.parametrize("obj", [[1, 2], "hello", 7, None])
def test_not_a_map(obj: Any) -> None:
    assert "expected a map" in refused(raw_frame(obj))


def test_unknown_type() -> None:
    assert refused(raw_frame({"v": 1, "t": "reboot", "seq": 1})) == "unknown message type 'reboot'"
    assert "unknown message type" in refused(raw_frame({"v": 1, "t": 3, "seq": 1}))
    assert "unknown message type" in refused(raw_frame({"v": 1, "seq": 1}))


@pytest.mark.parametrize("v", [2, 0, "1", None, True])
def test_bad_version(v: Any) -> None:
    assert "unsupported protocol version" in refused(raw_frame(wire(Heartbeat(), v=v)))  # None: absent


def test_unaccepted_type() -> None:
    assert "unexpected welcome" in refused(encode(MESSAGES[4], 1), accept=FROM_AGENT)
    assert FrameDecoder(accept=FROM_AGENT).feed(encode(Heartbeat(), 1)) == [Heartbeat()]


# --------------------------------------------------------------------------- sequence numbers

@pytest.mark.parametrize("seqs", [[0], [2], [1, 3], [1, 1], [1, 2, 1]], ids=str)
def test_bad_seq(seqs: list[int]) -> None:
    d = FrameDecoder()
    for s in seqs[:-1]:
        d.feed(raw_frame(wire(Heartbeat(), s)))
    with pytest.raises(WireProtocolError, match=r"heartbeat\.seq: .* expected \d+"):
        d.feed(raw_frame(wire(Heartbeat(), seqs[-1])))
    assert d.last_seq == len(seqs) - 1


def test_seq_type() -> None:
    assert refused(raw_frame({"v": 1, "t": "heartbeat"})) == "heartbeat.seq: missing"
    assert refused(raw_frame(wire(Heartbeat(), seq="1"))) == "heartbeat.seq: expected int, got str"


def test_encode_refuses_bad_seq_and_oversize() -> None:
    with pytest.raises(ValueError, match="seq"):
        encode(Heartbeat(), 0)
    with pytest.raises(ValueError, match="exceeds"):
        encode(Bye("x" * 100), 1, max_frame=50)


# --------------------------------------------------------------------------- field validation

HELLO = MESSAGES[0]


def test_missing_field_names_it() -> None:
    assert refused(raw_frame(wire(HELLO, node=None))) == "hello.node: missing"
    assert refused(raw_frame(wire(Bye("x"), reason=None))) == "bye.reason: missing"
    engines = [{"replica": "r", "model": "m"}]
    assert refused(raw_frame(wire(HELLO, engines=engines))) == "hello.engines[0].state: missing"


@pytest.mark.parametrize(("msg", "changes", "error"), [
    (HELLO, {"node": 5}, "hello.node: expected str, got int"),
    (HELLO, {"versions": [1, "2"]}, "hello.versions[1]: expected int, got str"),
    (HELLO, {"versions": 1}, "hello.versions: expected list, got int"),
    (HELLO, {"labels": {"zone": 1}}, "hello.labels['zone']: expected str, got int"),
    (HELLO, {"labels": [["zone", "eu"]]}, "hello.labels: expected dict, got list"),
    (HELLO, {"facts": {"gpus": [{"index": "0"}]}}, "hello.facts.gpus[0].index: expected int, got str"),
    (HELLO, {"engines": [REPORT.to_wire() | {"pid": 1.5}]}, "hello.engines[0].pid: expected int, got float"),
    (HELLO, {"engines": [REPORT.to_wire() | {"adopted": 1}]}, "hello.engines[0].adopted: expected bool, got int"),
    (EngineUpdate(REPORT), {"report": REPORT.to_wire() | {"state": 3}},
     "engine_update.report.state: expected str, got int"),
    (Desired(1, ()), {"rev": True}, "desired.rev: expected int, got bool"),
    (Desired(1, ()), {"engines": [SPEC.to_wire() | {"env": [["A"]]}]}, "desired.engines[0].env[0]: expected"),
    (Desired(1, ()), {"engines": [SPEC.to_wire() | {"args": ["--x", b"y"]}]},
     "desired.engines[0].args[1]: expected str, got bytes"),
    (Welcome("n", "r", 1, 5.0), {"heartbeat_s": "5"}, "welcome.heartbeat_s: expected float, got str"),
])
def test_wrong_type_names_the_field(msg: Message, changes: dict[str, Any], error: str) -> None:
    assert refused(raw_frame(wire(msg, **changes))).startswith(error)


def test_int_is_a_float() -> None:
    msg = FrameDecoder().feed(raw_frame(wire(Welcome("n", "r", 1, 5.0), heartbeat_s=5)))[0]
    assert msg == Welcome("n", "r", 1, 5.0) and type(msg.heartbeat_s) is float  # type: ignore[union-attr]


@pytest.mark.parametrize(("msg", "changes", "error"), [
    (HELLO, {"node": "n" * 254}, "hello.node: 254 chars, at most 253"),
    (HELLO, {"node": ""}, "hello.node: empty"),
    (HELLO, {"labels": {"k" * 254: "v"}}, "hello.labels key 'kkk"),  # reprlib shortens it
    (HELLO, {"labels": {"k": "v" * 1025}}, "hello.labels['k']: 1025 chars, at most 1024"),
    (HELLO, {"labels": {f"k{i}": "v" for i in range(257)}}, "hello.labels: 257 labels, at most 256"),
    (HELLO, {"labels": {b"zone": "eu"}}, "hello.labels key b'zone': expected str, got bytes"),
    (HELLO, {"engines": [{"replica": "r", "model": "m", "state": "dancing"}]},
     "hello.engines[0].state: unknown engine state 'dancing'"),
    (Desired(1, ()), {"engines": [{"replica": "r"}] * 4097}, "desired.engines: 4097 items, at most 4096"),
    (Welcome("n", "r", 1, 5.0), {"heartbeat_s": 0}, "welcome.heartbeat_s: 0.0 is not > 0"),
    (Welcome("n", "r", 1, 5.0), {"heartbeat_s": float("nan")}, "welcome.heartbeat_s: nan is not > 0"),
])
def test_limits(msg: Message, changes: dict[str, Any], error: str) -> None:
    assert refused(raw_frame(wire(msg, **changes))).startswith(error)


def test_long_label_key_says_how_long() -> None:
    assert refused(raw_frame(wire(HELLO, labels={"k" * 254: "v"}))).endswith(": 254 chars, at most 253")


def test_limits_at_the_edge_pass() -> None:
    labels = {f"{i:0>253}": "v" * 1024 for i in range(256)}
    hello = Hello(token="t", node="n" * 253, agent_id="a", versions=(1,), labels=labels, facts=NodeFacts(),
                  engines=tuple(EngineReport(replica=f"r{i}", model="m", state="ready") for i in range(4096)))
    assert FrameDecoder().feed(encode(hello, 1)) == [hello]


def test_long_log_tail_truncated() -> None:
    lines = [f"{i:03d}" + "x" * 600 for i in range(80)]
    report = REPORT.to_wire() | {"log_tail": lines}
    (msg,) = FrameDecoder().feed(raw_frame(wire(EngineUpdate(REPORT), report=report)))
    tail = msg.report.log_tail  # type: ignore[union-attr]
    assert len(tail) == 50 and tail[0].startswith("030") and tail[-1].startswith("079")
    assert all(len(line) == 500 for line in tail)


def test_log_tail_lines_checked() -> None:
    report = REPORT.to_wire() | {"log_tail": ["ok", 5]}
    assert refused(raw_frame(wire(EngineUpdate(REPORT), report=report))) == \
        "engine_update.report.log_tail[1]: expected str, got int"


def test_unknown_extra_keys_ignored() -> None:
    d = wire(HELLO, future="field", another={"nested": [1, 2]})
    d["facts"] = d["facts"] | {"numa": 2}
    d["engines"] = [e | {"new_thing": True} for e in d["engines"]]
    assert FrameDecoder().feed(raw_frame(d)) == [HELLO]


def test_optional_nested_fields_default() -> None:
    spec = {"replica": "r", "model": "m", "engine": "vllm", "model_path": "p"}
    (msg,) = FrameDecoder().feed(raw_frame(wire(Desired(1, ()), engines=[spec])))
    assert msg == Desired(1, (EngineSpec(replica="r", model="m", engine="vllm", model_path="p"),))
    (msg,) = FrameDecoder().feed(raw_frame(wire(HELLO, facts={})))
    assert msg.facts == NodeFacts()  # type: ignore[union-attr]


# --------------------------------------------------------------------------- fields added since the first release

def test_fields_older_peers_leave_out_default() -> None:
    """An older agent's hello (no credential, no features), an older router's welcome (no
    credential) and refusal (no retry) still decode."""
    hello = MESSAGES[0]
    (msg,) = FrameDecoder().feed(raw_frame(wire(hello, credential=None, features=None)))
    assert msg == hello and msg.credential == "" and msg.features == ()  # type: ignore[union-attr]
    (msg,) = FrameDecoder().feed(raw_frame({"v": 1, "t": "welcome", "seq": 1, "node": "n", "router_id": "r",
                                            "version": 1, "heartbeat_s": 1.0}))
    assert msg == Welcome("n", "r", 1, 1.0, credential="")
    (msg,) = FrameDecoder().feed(raw_frame({"v": 1, "t": "refused", "seq": 1, "reason": "no"}))
    assert msg == Refused("no", retry=False)


@pytest.mark.parametrize(("msg", "changes", "error"), [
    (HELLO, {"credential": 5}, "hello.credential: expected str, got int"),
    (HELLO, {"credential": "c" * 1025}, "hello.credential: 1025 chars, at most 1024"),
    (HELLO, {"token": "t" * 1025}, "hello.token: 1025 chars, at most 1024"),
    (HELLO, {"features": "credential"}, "hello.features: expected list, got str"),
    (HELLO, {"features": ["f"] * 33}, "hello.features: 33 items, at most 32"),
    (HELLO, {"versions": list(range(33))}, "hello.versions: 33 items, at most 32"),
    (Refused("x"), {"retry": 1}, "refused.retry: expected bool, got int"),
    (ReportRejected("r", "x"), {"replica": None}, "report_rejected.replica: missing"),
])
def test_new_fields_are_checked(msg: Message, changes: dict[str, Any], error: str) -> None:
    assert refused(raw_frame(wire(msg, **changes))).startswith(error)


def test_long_reasons_are_cut_not_refused() -> None:
    (msg,) = FrameDecoder().feed(raw_frame(wire(Bye("x"), reason="y" * 10_000)))
    assert msg == Bye("y" * 4096)


def test_the_frame_cap_can_be_raised_after_the_hello() -> None:
    d = FrameDecoder(max_frame=1024, accept=FROM_AGENT)
    assert d.feed(encode(Heartbeat(), 1)) == [Heartbeat()]
    big = EngineUpdate(REPORT.__class__(replica="r", model="m", state="failed", detail="d" * 5000))
    with pytest.raises(WireProtocolError, match="exceeds the 1024 byte limit"):
        FrameDecoder(max_frame=1024).feed(encode(big, 1))
    d.max_frame = 1 << 20
    assert d.feed(encode(big, 2)) == [big]


def test_report_rejected_goes_to_agents_only() -> None:
    assert "unexpected report_rejected" in refused(encode(ReportRejected("r", "x"), 1), accept=FROM_AGENT)


# --------------------------------------------------------------------------- several routers (docs/ha.md)

def test_an_older_routers_welcome_and_desired_read_as_one_leading_router() -> None:
    (w,) = FrameDecoder().feed(raw_frame({"v": 1, "t": "welcome", "seq": 1, "node": "n", "router_id": "r",
                                          "version": 1, "heartbeat_s": 1.0}))
    assert (w.epoch, w.leading, w.routers) == (0, True, ())  # type: ignore[union-attr]
    (d,) = FrameDecoder().feed(raw_frame({"v": 1, "t": "desired", "seq": 1, "rev": 3, "engines": []}))
    assert d == Desired(3, (), epoch=0)


def test_routers_goes_to_agents_only() -> None:
    assert "unexpected routers" in refused(encode(Routers(1, True, ()), 1), accept=FROM_AGENT)


ADDR = ROUTERS[0].to_wire()


@pytest.mark.parametrize(("msg", "changes", "error"), [
    (Desired(1, ()), {"epoch": -1}, "desired.epoch: -1 is not in 0.."),
    (Desired(1, ()), {"epoch": True}, "desired.epoch: expected int, got bool"),
    (Desired(1, ()), {"epoch": 1 << 63}, "desired.epoch: 9223372036854775808 is not in 0.."),
    (Welcome("n", "r", 1, 5.0), {"leading": 1}, "welcome.leading: expected bool, got int"),
    (Welcome("n", "r", 1, 5.0), {"epoch": "1"}, "welcome.epoch: expected int, got str"),
    (Welcome("n", "r", 1, 5.0), {"routers": {"r1": ADDR}}, "welcome.routers: expected list, got dict"),
    (Welcome("n", "r", 1, 5.0), {"routers": [ADDR] * 65}, "welcome.routers: 65 items, at most 64"),
    (Routers(1, True, ()), {"epoch": None}, "routers.epoch: missing"),
    (Routers(1, True, ()), {"leading": None}, "routers.leading: missing"),
    (Routers(1, True, ()), {"routers": None}, "routers.routers: missing"),
    (Routers(1, True, ()), {"routers": [ADDR, ADDR]}, "routers.routers[1].id: 'r1' is listed twice"),
    (Routers(1, True, ()), {"routers": [ADDR | {"id": ""}]}, "routers.routers[0].id: empty"),
    (Routers(1, True, ()), {"routers": [ADDR | {"id": "i" * 257}]},
     "routers.routers[0].id: 257 chars, at most 256"),
    (Routers(1, True, ()), {"routers": [{"id": "r1"}]}, "routers.routers[0].control: missing"),
    (Routers(1, True, ()), {"routers": [ADDR | {"control": "10.0.0.1"}]},
     "routers.routers[0].control: expected host:port, got '10.0.0.1'"),
    (Routers(1, True, ()), {"routers": [ADDR | {"control": "h:99999"}]},
     "routers.routers[0].control: expected host:port"),
    (Routers(1, True, ()), {"routers": [ADDR | {"control": "a@b:1"}]},
     "routers.routers[0].control: expected host:port"),
    (Routers(1, True, ()), {"routers": [ADDR | {"ca_pem": "not a pem"}]},
     "routers.routers[0].ca_pem: not a PEM certificate"),
    (Routers(1, True, ()), {"routers": [ADDR | {"ca_pem": CA + "x" * (16 << 10)}]},
     "routers.routers[0].ca_pem: 16446 chars, at most 16384"),
    (Routers(1, True, ()), {"routers": [ADDR | {"server_name": 7}]},
     "routers.routers[0].server_name: expected str, got int"),
    (Routers(1, True, ()), {"routers": [ADDR | {"server_name": "s" * 254}]},
     "routers.routers[0].server_name: 254 chars, at most 253"),
    (Routers(1, True, ()), {"routers": ["r1"]}, "routers.routers[0]: expected dict, got str"),
])
def test_router_fields_are_checked(msg: Message, changes: dict[str, Any], error: str) -> None:
    assert refused(raw_frame(wire(msg, **changes))).startswith(error)


def test_a_routers_list_at_its_limits_passes() -> None:
    big = tuple(RouterAddr(f"{i:0>256}", f"{'h' * 250}:{1000 + i}", CA + "x" * ((16 << 10) - len(CA)), "s" * 253)
                for i in range(64))
    msg = Routers(epoch=(1 << 63) - 1, leading=True, routers=big)
    frame = encode(msg, 1)
    assert len(frame) < MAX_FRAME and FrameDecoder().feed(frame) == [msg]
    (ra,) = FrameDecoder().feed(raw_frame(wire(Routers(1, False, ()), routers=[{"id": "x", "control": "h:1"}])))
    assert ra.routers == (RouterAddr("x", "h:1", "", ""),)  # type: ignore[union-attr]
