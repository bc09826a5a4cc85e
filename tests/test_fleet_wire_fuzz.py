"""Fuzzing the agent stream's decoder (llmgw.fleet.wire.FrameDecoder), the router's first line
against whatever a connection sends: arbitrary bytes, well-framed maps of arbitrary content, and
every message type with each field replaced by a value of the wrong type. The decoder either
decodes or raises its own WireProtocolError — never another exception — and every message it can
encode comes back equal."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llmgw.fleet.types import ENGINE_STATES, EngineReport, EngineSpec, GpuInfo, NodeFacts
from llmgw.fleet.wire import (
    AGENT_FEATURES,
    FROM_AGENT,
    MAX_HELLO,
    MESSAGE_TYPES,
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

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_all(data: bytes, **kw: Any) -> list[Message] | WireProtocolError:
    """Feed `data` in two pieces (framing must not care); only WireProtocolError may escape."""
    d = FrameDecoder(**kw)
    cut = len(data) // 2
    try:
        return d.feed(data[:cut]) + d.feed(data[cut:])
    except WireProtocolError as e:
        return e


def frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


# -- arbitrary values: what msgpack can carry ---------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=20) | st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), inner, max_size=4),
                      max_leaves=20)


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes(data: bytes) -> None:
    decode_all(data)
    decode_all(data, max_frame=64, accept=FROM_AGENT)


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bodies_in_a_frame(body: bytes) -> None:
    decode_all(len(body).to_bytes(4, "big") + body)


@FUZZ
@given(st.sampled_from(sorted(MESSAGE_TYPES)), st.dictionaries(st.text(max_size=12), values, max_size=8))
def test_well_framed_maps_of_anything(t: str, fields: dict[str, Any]) -> None:
    decode_all(frame({**fields, "v": 1, "t": t, "seq": 1}))


# -- valid messages, to round-trip and then to break field by field -----------------------------------
names = st.text(min_size=1, max_size=30)
texts = st.text(max_size=40)
ints = st.integers(-(2**63), 2**63 - 1)
positive = st.floats(min_value=1e-6, max_value=1e9, allow_nan=False, allow_infinity=False)
specs = st.builds(EngineSpec, replica=names, model=names, engine=st.sampled_from(["vllm", "llamacpp"]),
                  model_path=texts, simulate=st.booleans(), binary=st.none() | texts,
                  args=st.lists(texts, max_size=3).map(tuple),
                  env=st.lists(st.tuples(texts, texts), max_size=3).map(tuple),
                  gpu_indices=st.lists(st.integers(0, 16), max_size=3).map(tuple), health_timeout_s=positive,
                  generation=ints)
reports = st.builds(EngineReport, replica=names, model=names, state=st.sampled_from(ENGINE_STATES),
                    spec_hash=texts, generation=ints, url=st.none() | texts, pid=st.none() | ints, restarts=ints,
                    detail=texts, log_tail=st.lists(st.text(max_size=50), max_size=5).map(tuple),
                    adopted=st.booleans())
facts = st.builds(NodeFacts, cpus=ints, memory_mb=ints, hostname=texts, agent_version=texts,
                  gpus=st.lists(st.builds(GpuInfo, index=ints, name=texts, memory_mb=ints), max_size=3).map(tuple))
node_names = st.text(min_size=1, max_size=253)
epochs = st.integers(0, 2**63 - 1)
routers = st.lists(st.builds(RouterAddr, id=st.text(min_size=1, max_size=20),
                             control=st.from_regex(r"\A[a-z0-9.\[\]:-]{1,40}:[1-9][0-9]{0,3}\Z"),
                             ca_pem=st.just("") | st.just("-----BEGIN CERTIFICATE-----\nx\n"),
                             server_name=texts), max_size=3, unique_by=lambda r: r.id).map(tuple)
labels = st.dictionaries(st.text(max_size=40), st.text(max_size=60), max_size=5)
messages = st.one_of(
    st.builds(Hello, token=texts, node=node_names, agent_id=texts, versions=st.lists(ints, max_size=3).map(tuple),
              labels=labels, facts=facts, engines=st.lists(reports, max_size=3).map(tuple), credential=texts,
              features=st.lists(st.sampled_from(AGENT_FEATURES) | texts, max_size=3).map(tuple)),
    st.just(Heartbeat()),
    st.builds(EngineUpdate, report=reports),
    st.builds(Bye, reason=texts),
    st.builds(Welcome, node=node_names, router_id=texts, version=ints, heartbeat_s=positive, credential=texts,
              epoch=epochs, leading=st.booleans(), routers=routers),
    st.builds(Routers, epoch=epochs, leading=st.booleans(), routers=routers),
    st.builds(Refused, reason=texts, retry=st.booleans()),
    st.builds(Desired, rev=ints, engines=st.lists(specs, max_size=3).map(tuple), epoch=epochs),
    st.builds(ReportRejected, replica=texts, reason=texts),
)


@FUZZ
@given(st.lists(messages, min_size=1, max_size=4))
def test_encoded_messages_round_trip(msgs: list[Message]) -> None:
    data = b"".join(encode(m, i) for i, m in enumerate(msgs, 1))
    assert decode_all(data) == msgs
    for m in msgs:
        assert type(m).from_dict(m.to_dict()) == m


# A value of every kind: whichever type a field wants, most of these are the wrong one.
wrong = st.sampled_from([None, True, 0, -1, 2**64 - 1, 1.5, float("nan"), "", "x", b"\x00", [], [1, "a"], {},
                         {"k": 1}, {"replica": None}, [[1, 2]], [{"index": "0"}]])


@FUZZ
@given(messages, st.data())
def test_each_field_of_the_wrong_type(msg: Message, data: st.DataObject) -> None:
    d = {"v": 1, "t": msg.TYPE, "seq": 1, **msg.to_dict()}
    # One field of the message, or of a nested report, spec, facts or GPU, gets a wrong value.
    targets: list[dict[str, Any]] = [d]
    for r in d.get("routers", []):
        targets.append(r)
    for key in ("report", "facts"):
        if isinstance(d.get(key), dict):
            targets.append(d[key])
    for e in d.get("engines", []):
        targets.append(e)
    for g in d.get("facts", {}).get("gpus", []):
        targets.append(g)
    target = data.draw(st.sampled_from(targets))
    keys = sorted(k for k in target if target is not d or k not in ("v", "t", "seq"))
    assume(keys)
    target[data.draw(st.sampled_from(keys))] = data.draw(wrong | values)
    decode_all(frame(d))


def test_a_hello_with_trimmed_reports_fits_the_pre_authentication_cap() -> None:
    """What an agent sends when its full hello is too big (agent.py trims log tails): a node
    with 100 crashed engines still fits the router's default pre-auth cap."""
    reports = tuple(EngineReport(replica=f"model-name/{i:06x}", model="model-name", state="crashed",
                                 spec_hash="0123456789abcdef", url="http://10.0.0.1:40000", pid=123456,
                                 restarts=3, detail="exit status 1"[:200]) for i in range(100))
    hello = Hello(token="t" * 43, node="gpu-node-001", agent_id="a" * 12, versions=(1,), labels={"a": "b"},
                  facts=NodeFacts(), engines=reports, credential="c" * 43, features=AGENT_FEATURES)
    assert len(encode(hello, 1)) < MAX_HELLO
    assert decode_all(encode(hello, 1), max_frame=MAX_HELLO) == [hello]


@pytest.mark.parametrize("depth", [100, 10_000])
def test_deeply_nested_frames_are_refused_not_crashed(depth: int) -> None:
    body = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
    assert isinstance(decode_all(len(body).to_bytes(4, "big") + body), WireProtocolError)
