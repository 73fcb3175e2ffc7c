"""The daemon over real unix sockets: handshake, auth, multiplexing, limits, hostile peers."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from guest_agent import __version__
from guest_agent.client import Client
from guest_agent.protocol import (
    HEADER_SIZE,
    PROTOCOL_VERSION,
    AuthenticationFailed,
    Error,
    ErrorCode,
    Hello,
    LimitExceeded,
    Message,
    Request,
    Result,
    UnknownMethod,
    encode_frame,
)
from tests.conftest import StartAgent
from tests.rawclient import RawClient

# Only to turn a hang into a failure; never a timing assertion.
HANG = 30


def refusal(messages: Sequence[object]) -> Error:
    """The single connection-level error frame an agent sends before hanging up."""
    assert len(messages) == 1, messages
    error = messages[0]
    assert isinstance(error, Error) and error.id is None, error
    return error


async def assert_serving(address: str) -> None:
    """A fresh connection can do a round trip."""
    with trio.fail_after(HANG):
        async with Client.connect(address) as client:
            await client.ping()


# ---- basics ------------------------------------------------------------------------------


async def test_ping_and_info(agent: str) -> None:
    async with Client.connect(agent) as client:
        await client.ping()
        info = await client.info()
        hello = client.agent_hello
    assert hello is not None
    assert hello.software == f"guest-agent/{__version__}"
    assert hello.protocol == PROTOCOL_VERSION
    assert "system" in hello.capabilities
    assert info["agent_version"] == __version__
    assert info["protocol"] == list(PROTOCOL_VERSION)
    assert "system" in info["capabilities"]
    assert info["pid"] == os.getpid()  # the in-process agent
    assert info["hostname"] == socket.gethostname()
    assert info["system_uptime"] > 0
    assert info["agent_uptime"] >= 0
    assert isinstance(info["boot"], dict)
    assert isinstance(info["wall_clock"], float)


async def test_many_concurrent_requests_on_one_connection(agent: str) -> None:
    done = 0

    async def one(client: Client, n: int) -> None:
        nonlocal done
        if n % 10 == 0:
            assert (await client.info())["protocol"] == list(PROTOCOL_VERSION)
        else:
            await client.ping()
        done += 1

    with trio.fail_after(HANG):
        async with Client.connect(agent) as client, trio.open_nursery() as nursery:
            for n in range(500):
                nursery.start_soon(one, client, n)
    assert done == 500


async def test_several_clients_at_once(agent: str) -> None:
    async def pings(n: int) -> None:
        async with Client.connect(agent) as client:
            for _ in range(20):
                await client.ping()

    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            for n in range(20):
                nursery.start_soon(pings, n)


async def test_unknown_method_is_an_error_reply_not_a_disconnect(agent: str) -> None:
    async with Client.connect(agent) as client:
        with pytest.raises(UnknownMethod) as info:
            await client.call("system.teleport", {"to": "mars"})
        assert info.value.code == ErrorCode.UNKNOWN_METHOD
        assert "system.teleport" in str(info.value)
        await client.ping()
        with pytest.raises(UnknownMethod):
            await client.call("nothing")
        assert "agent_version" in await client.info()


async def test_unknown_method_raw(agent: str) -> None:
    raw = await RawClient.open(agent)
    await raw.hello()
    reply = await raw.call(1, "nope.nope")
    assert reply == Error(1, ErrorCode.UNKNOWN_METHOD, "unknown method 'nope.nope'")
    assert isinstance(await raw.call(1, "system.ping"), Result)  # the id is free again
    await raw.aclose()


async def test_unknown_frame_types_and_fields_are_ignored(agent: str) -> None:
    raw = await RawClient.open(agent)
    await raw.hello()
    await raw.send_raw(encode_frame({"type": "from_the_future", "id": 1, "x": [1, 2]}))
    wire = {**Request(2, "system.ping").to_wire(), "deadline_ms": 5, "trace": {"a": 1}}
    await raw.send_raw(encode_frame(wire))
    assert await raw.receive() == Result(2, {})
    await raw.aclose()


# ---- handshake and auth ------------------------------------------------------------------


@pytest.fixture
def token_file(short_tmp: Path) -> Path:
    path = short_tmp / "token"
    path.write_text("correct horse battery staple\n")
    return path


async def test_token_refusal(start_agent: StartAgent, token_file: Path) -> None:
    address = await start_agent(token_file=str(token_file))
    for token in (None, "wrong", "correct horse battery stapl", ""):
        with trio.fail_after(HANG), pytest.raises(AuthenticationFailed) as info:
            async with Client.connect(address, token=token):
                pass
        assert info.value.code == ErrorCode.AUTH_FAILED
    async with Client.connect(address, token="correct horse battery staple") as client:
        await client.ping()


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_token_refusal_closes_the_connection(
    start_agent: StartAgent, token_file: Path, token: str | None
) -> None:
    address = await start_agent(token_file=str(token_file))
    raw = await RawClient.open(address)
    await raw.send(Hello(token=token))
    await raw.send(Request(1, "system.ping"))  # must not be served
    assert refusal(await raw.wait_closed()).code == ErrorCode.AUTH_FAILED
    await raw.aclose()


async def test_frames_before_hello_rejected(agent: str) -> None:
    raw = await RawClient.open(agent)
    await raw.send_raw(encode_frame(Request(1, "system.ping").to_wire()))
    error = refusal(await raw.wait_closed())
    assert error.code == ErrorCode.PROTOCOL_ERROR
    assert "hello" in error.message
    await raw.aclose()


@pytest.mark.parametrize("version", [(PROTOCOL_VERSION[0] + 1, 0), (0, 1)])
async def test_version_mismatch(agent: str, version: tuple[int, int]) -> None:
    raw = await RawClient.open(agent)
    await raw.send(Hello(protocol=version))
    error = refusal(await raw.wait_closed())
    assert error.code == ErrorCode.VERSION_MISMATCH
    assert f"{version[0]}.{version[1]}" in error.message
    await raw.aclose()


async def test_handshake_timeout(start_agent: StartAgent) -> None:
    address = await start_agent(handshake_timeout=0.5)
    silent = await RawClient.open(address)
    partial = await RawClient.open(address)
    await partial.send_raw(encode_frame(Hello().to_wire())[:-1])  # a hello never finished
    greeted = await RawClient.open(address)
    await greeted.hello()
    for raw in (silent, partial):
        error = refusal(await raw.wait_closed())
        assert error.code == ErrorCode.PROTOCOL_ERROR
        assert "no hello within" in error.message
        await raw.aclose()
    # The timeout is for the handshake only: a greeted connection may idle past it.
    assert isinstance(await greeted.call(1, "system.ping"), Result)
    await greeted.aclose()
    await assert_serving(address)


# ---- hostile and broken peers ------------------------------------------------------------


async def test_garbage_on_one_connection_while_another_keeps_working(agent: str) -> None:
    rng = random.Random(1234)
    async with Client.connect(agent) as survivor:
        await survivor.ping()

        # Random bytes: refused with a connection-level error, then closed.
        for _ in range(5):
            raw = await RawClient.open(agent)
            await raw.send_raw(rng.randbytes(rng.randrange(1, 4096)))
            messages = await raw.wait_closed()
            assert len(messages) <= 1
            if messages:
                refusal(messages)
            await raw.aclose()
            await survivor.ping()

        # A 4 GiB length header.
        raw = await RawClient.open(agent)
        await raw.send_raw(b"\xff\xff\xff\xff")
        assert refusal(await raw.wait_closed()).code == ErrorCode.FRAME_TOO_LARGE
        await raw.aclose()

        # A msgpack bomb, after a proper handshake.
        raw = await RawClient.open(agent)
        await raw.hello()
        await raw.send_raw(b"\x00\x00\x00\x05\xdd\xff\xff\xff\xff")
        assert refusal(await raw.wait_closed()).code == ErrorCode.PROTOCOL_ERROR
        await raw.aclose()

        # Garbage after a handshake and a served request.
        raw = await RawClient.open(agent)
        await raw.hello()
        assert isinstance(await raw.call(1, "system.ping"), Result)
        await raw.send_raw(HEADER_SIZE.to_bytes(HEADER_SIZE, "big") + b"\xc1\xc1\xc1\xc1")
        assert refusal(await raw.wait_closed()).code == ErrorCode.PROTOCOL_ERROR
        await raw.aclose()

        # Abrupt closes: mid-header, mid-frame, mid-handshake, right after a request.
        hello = encode_frame(Hello().to_wire())
        ping = encode_frame(Request(1, "system.ping").to_wire())
        for data in (b"\x00\x00", hello[:7], hello + ping[:5], hello + ping):
            raw = await RawClient.open(agent)
            await raw.send_raw(data)
            await raw.aclose()

        # A duplicate request id in flight is a protocol error for that connection only.
        raw = await RawClient.open(agent)
        await raw.hello()
        await raw.send_raw(ping + ping)
        assert refusal(await raw.wait_closed()).code == ErrorCode.PROTOCOL_ERROR
        await raw.aclose()

        await survivor.ping()
        assert "agent_version" in await survivor.info()
    await assert_serving(agent)


async def test_request_limit_per_connection(start_agent: StartAgent) -> None:
    address = await start_agent(max_requests_per_connection=2)
    raw = await RawClient.open(address)
    await raw.hello()
    # Three requests in one write: the agent reads them all before any call can run.
    burst = b"".join(raw.conn.send(Request(n, "system.ping")) for n in (1, 2, 3))
    await raw.send_raw(burst)
    finals: dict[int, Message] = {}
    while len(finals) < 3:
        message = await raw.receive()
        assert isinstance(message, (Result, Error)) and message.id is not None, message
        finals[message.id] = message
    assert finals[1] == Result(1, {}) and finals[2] == Result(2, {})
    assert isinstance(finals[3], Error) and finals[3].code == ErrorCode.LIMIT_EXCEEDED
    # The connection is still usable once calls have ended.
    assert isinstance(await raw.call(3, "system.ping"), Result)
    await raw.aclose()


async def test_request_limit_error_type(start_agent: StartAgent) -> None:
    address = await start_agent(max_requests_per_connection=0)
    async with Client.connect(address) as client:
        with pytest.raises(LimitExceeded):
            await client.ping()
        with pytest.raises(LimitExceeded):
            await client.ping()


async def test_client_that_never_reads_does_not_block_other_connections(
    agent: str, nursery: trio.Nursery
) -> None:
    stalled = await RawClient.open(agent)
    stalled.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # type: ignore[attr-defined]
    await stalled.hello()

    flood_scope = trio.CancelScope()

    async def flood() -> None:
        # About 1.5 MB of info replies that nobody reads: the agent's writes to this
        # connection block for good (and past 1024 calls its reader blocks on refusals).
        with flood_scope:
            for n in range(4000):
                await stalled.send(Request(n, "system.info"))

    nursery.start_soon(flood)
    with trio.fail_after(HANG):
        async with Client.connect(agent) as other:
            for _ in range(20):
                await other.ping()
                await trio.sleep(0.02)  # let the flood get ahead; nothing is timed
            assert "agent_version" in await other.info()
    flood_scope.cancel()
    await stalled.aclose()
    await assert_serving(agent)


async def test_stalled_stream_does_not_block_other_stream(agent: str) -> None:
    """Two streams on one connection: one consumer never grants credit, the other goes on.

    The same property is checked at the core level with a test-only handler in
    test_core_session.py.
    """
    with trio.fail_after(HANG):
        async with Client.connect(agent) as client:
            async with client.open_call("exec.start", {"argv": ["yes"]}, window=1024) as stalled:
                # Never read: its 1 KiB window fills and the agent must wait for credit.
                result = await client.exec(["head", "-c", str(5 << 20), "/dev/zero"])
                assert result.exit_code == 0
                assert result.stdout == bytes(5 << 20)
                assert not stalled.done
