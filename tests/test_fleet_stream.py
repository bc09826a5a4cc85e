"""The trio shell of the control stream (llmgw.daemon.net.message_stream): messages over memory and loopback TCP."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.daemon.net.message_stream import MessageStream, StreamClosed, WireProtocolError, open_client
from llmgw.fleet.types import EngineReport, NodeFacts
from llmgw.fleet.wire import FROM_AGENT, FROM_ROUTER, Bye, EngineUpdate, Heartbeat, Hello, Welcome, encode

pytestmark = pytest.mark.anyio

HELLO = Hello(token="t", node="gpu-7", agent_id="a1", versions=(1,), labels={"zone": "eu"},
              facts=NodeFacts(cpus=8), engines=(EngineReport(replica="r", model="m", state="ready"),))
WELCOME = Welcome(node="gpu-7", router_id="router-1", version=1, heartbeat_s=5.0)


def pair() -> tuple[MessageStream, MessageStream]:
    a, b = trio.testing.memory_stream_pair()
    return MessageStream(a), MessageStream(b)


class Trickle(trio.abc.Stream):
    """Sends a few bytes at a time with a checkpoint between: frames of unserialised senders
    would interleave (or trip trio's conflict detection)."""

    def __init__(self, inner: trio.abc.Stream, piece: int = 3) -> None:
        self.inner, self.piece = inner, piece

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        for i in range(0, len(data), self.piece):
            await self.inner.send_all(data[i:i + self.piece])
            await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_send_receive_both_ways() -> None:
    agent, router = pair()
    await agent.send(HELLO)
    await agent.send(Heartbeat())
    assert await router.receive() == HELLO
    assert await router.receive() == Heartbeat()
    await router.send(WELCOME)
    assert await agent.receive() == WELCOME
    assert (agent.sent_seq, router.received_seq, router.sent_seq, agent.received_seq) == (2, 2, 1, 1)


async def test_concurrent_senders_do_not_interleave() -> None:
    a, b = trio.testing.memory_stream_pair()
    sender, receiver = MessageStream(Trickle(a)), MessageStream(b)

    async def burst(task: int) -> None:
        for i in range(10):
            await sender.send(EngineUpdate(EngineReport(replica=f"{task}/{i}", model="m", state="ready",
                                                        detail="x" * (task * 7))))

    async with trio.open_nursery() as nursery:
        for task in range(8):
            nursery.start_soon(burst, task)
    got = [(await receiver.receive()).report.replica for _ in range(80)]  # type: ignore[union-attr]
    assert receiver.received_seq == 80  # the decoder checked every seq: none lost, repeated or reordered
    for task in range(8):  # each sender's messages arrive whole and in its order
        assert [r for r in got if r.startswith(f"{task}/")] == [f"{task}/{i}" for i in range(10)]


async def test_eof_is_stream_closed() -> None:
    agent, router = pair()
    await agent.send(Bye("leaving"))
    await agent.aclose()
    assert await router.receive() == Bye("leaving")
    with pytest.raises(StreamClosed, match="peer closed the connection$"):
        await router.receive()


async def test_eof_mid_frame() -> None:
    a, b = trio.testing.memory_stream_pair()
    router = MessageStream(b)
    await a.send_all(encode(HELLO, 1)[:10])
    await a.aclose()
    with pytest.raises(StreamClosed, match="10 bytes into a frame"):
        await router.receive()


async def test_garbage_is_protocol_error() -> None:
    a, b = trio.testing.memory_stream_pair()
    router = MessageStream(b)
    await a.send_all(b"\x00\x00\x00\x01\xc1")
    with pytest.raises(WireProtocolError, match="not a msgpack document"):
        await router.receive()


async def test_oversize_is_refused_before_the_body() -> None:
    a, b = trio.testing.memory_stream_pair()
    router = MessageStream(b, max_frame=1024)
    await a.send_all(b"\x00\x01\x00\x00")  # 64 KiB announced, none sent
    with pytest.raises(WireProtocolError, match="exceeds the 1024 byte limit"):
        await router.receive()


async def test_accept_filters_direction() -> None:
    a, b = trio.testing.memory_stream_pair()
    agent, router = MessageStream(a), MessageStream(b, accept=FROM_AGENT)
    await agent.send(WELCOME)  # a router's message, from the agent's side
    with pytest.raises(WireProtocolError, match="unexpected welcome"):
        await router.receive()


async def test_too_large_message_costs_no_seq() -> None:
    agent, router = pair()
    with pytest.raises(ValueError, match="exceeds"):
        await agent.send(Bye("x" * (5 << 20)))
    await agent.send(Heartbeat())
    assert await router.receive() == Heartbeat()  # seq 1: the refused one never got a number


async def test_send_cancelled_mid_frame_breaks_the_stream() -> None:
    a, _b = trio.testing.memory_stream_pair()
    scope = trio.CancelScope()

    class HalfThenCancel(Trickle):
        async def send_all(self, data: bytes | bytearray | memoryview) -> None:
            await self.inner.send_all(data[:2])
            scope.cancel()
            await trio.lowlevel.checkpoint()
            await self.inner.send_all(data[2:])

    agent = MessageStream(HalfThenCancel(a))
    with scope:
        await agent.send(Heartbeat())
    assert scope.cancelled_caught
    with pytest.raises(StreamClosed, match="interrupted mid-frame"):
        await agent.send(Heartbeat())


async def test_send_cancelled_before_any_byte_keeps_the_stream() -> None:
    agent, router = pair()
    with trio.CancelScope() as scope:
        scope.cancel()
        await agent.send(Bye("never"))
    await agent.send(Heartbeat())
    assert await router.receive() == Heartbeat()


async def test_broken_connection_is_stream_closed() -> None:
    class Broken(Trickle):
        async def send_all(self, data: bytes | bytearray | memoryview) -> None:
            raise trio.BrokenResourceError("connection reset")

        async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
            raise trio.BrokenResourceError("connection reset")

    a, _b = trio.testing.memory_stream_pair()
    stream = MessageStream(Broken(a))
    with pytest.raises(StreamClosed, match="connection reset"):
        await stream.send(Heartbeat())
    with pytest.raises(StreamClosed, match="connection reset"):
        await stream.receive()


async def test_loopback_tcp() -> None:
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    async with listener:
        agent = await open_client("127.0.0.1", port, accept=FROM_ROUTER)
        router = MessageStream(await listener.accept(), accept=FROM_AGENT)
        async with agent, router:
            await agent.send(HELLO)
            assert await router.receive() == HELLO
            await router.send(WELCOME)
            assert await agent.receive() == WELCOME
            big = EngineUpdate(EngineReport(replica="r", model="m", state="failed", detail="d" * (1 << 20)))
            async with trio.open_nursery() as nursery:  # a 1 MiB frame needs the reader while it's written
                nursery.start_soon(agent.send, big)
                assert await router.receive() == big
            await agent.aclose()
            with pytest.raises(StreamClosed):
                await router.receive()


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not on PATH")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=router", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


async def tls_exchange(cert: Path, key: Path, client_ctx: ssl.SSLContext) -> list[object]:
    """Serve one TLS connection on loopback: receive a message, answer WELCOME, close."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    got: list[object] = []

    async def serve() -> None:
        router = MessageStream(trio.SSLStream(await listener.accept(), server_ctx, server_side=True),
                               accept=FROM_AGENT)
        async with router:
            try:
                got.append(await router.receive())  # the handshake happens in here
            except StreamClosed:
                return
            await router.send(WELCOME)

    async with listener, trio.open_nursery() as nursery:
        nursery.start_soon(serve)  # the handshake needs both sides at once
        agent = await open_client("127.0.0.1", port, ssl_context=client_ctx, accept=FROM_ROUTER)
        async with agent:
            await agent.send(HELLO)
            got.append(await agent.receive())
            with pytest.raises(StreamClosed):  # the router closed (close_notify, then EOF)
                await agent.receive()
    return got


async def test_loopback_tls(self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    assert await tls_exchange(cert, key, ssl.create_default_context(cafile=str(cert))) == [HELLO, WELCOME]


async def test_tls_untrusted_certificate_fails_the_connect(self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    with pytest.raises(ExceptionGroup) as e:  # out of tls_exchange's nursery
        await tls_exchange(cert, key, ssl.create_default_context())  # system CAs: not ours
    (err,) = e.value.exceptions
    assert isinstance(err, trio.BrokenResourceError) and isinstance(err.__cause__, ssl.SSLCertVerificationError)
