"""Transports for real: hybrid vsock through a test muxer, vsock binding, unix and serial."""

from __future__ import annotations

import errno
import os
import random
import socket
import stat
import tty
from pathlib import Path
from typing import Any

import pytest
import trio

from guest_agent.client import Client, ConnectTimeout
from guest_agent.config import config_from_settings
from guest_agent.server import Session, serve
from guest_agent.services import Call
from guest_agent.transport import (
    TransportError,
    VsockListener,
    open_listener,
    parse_address,
)
from tests.conftest import StartAgent
from tests.muxer import HybridMuxer

HANG = 30
AGENT_PORT = 1024


async def start_muxer(nursery: trio.Nursery, short_tmp: Path, **options: object) -> HybridMuxer:
    muxer = HybridMuxer(str(short_tmp / f"fc{random.randrange(1 << 30)}.vsock"), **options)  # type: ignore[arg-type]
    await nursery.start(muxer.serve)
    return muxer


# ---- hybrid ------------------------------------------------------------------------------


@pytest.mark.parametrize("pipeline_hello", [False, True], ids=["plain", "hello_after_ok"])
async def test_hybrid_ping_and_info(
    start_agent: StartAgent, nursery: trio.Nursery, short_tmp: Path, pipeline_hello: bool
) -> None:
    agent = await start_agent()
    agent_path = agent.removeprefix("unix:")
    muxer = await start_muxer(
        nursery, short_tmp, ports={AGENT_PORT: agent_path}, pipeline_hello=pipeline_hello
    )
    with trio.fail_after(HANG):
        async with Client.connect(f"hybrid:{muxer.path}:{AGENT_PORT}") as client:
            await client.ping()
            info = await client.info()
            assert client.agent_hello is not None
    assert "system" in info["capabilities"]
    assert muxer.requests == [f"CONNECT {AGENT_PORT}\n".encode()]


async def test_hybrid_many_calls_through_the_muxer(
    agent: str, nursery: trio.Nursery, short_tmp: Path
) -> None:
    muxer = await start_muxer(nursery, short_tmp, ports={7: agent.removeprefix("unix:")})
    with trio.fail_after(HANG):
        async with Client.connect(f"hybrid:{muxer.path}:7") as client:
            async with trio.open_nursery() as calls:
                for _ in range(100):
                    calls.start_soon(client.ping)


async def test_hybrid_refused_port(agent: str, nursery: trio.Nursery, short_tmp: Path) -> None:
    muxer = await start_muxer(nursery, short_tmp, ports={AGENT_PORT: agent.removeprefix("unix:")})
    with trio.fail_after(HANG), pytest.raises(TransportError) as info:
        async with Client.connect(f"hybrid:{muxer.path}:5555"):
            pass
    assert info.value.errno == errno.ECONNREFUSED
    assert "5555" in str(info.value)


@pytest.mark.parametrize(
    "reply",
    [b"NOPE\n", b"ERR no listener\n", b"OK", b"x" * 200, b"\n", b"ok 12\n"],
    ids=["nope", "err", "no_newline", "overlong", "empty_line", "lowercase"],
)
async def test_hybrid_garbage_reply(nursery: trio.Nursery, short_tmp: Path, reply: bytes) -> None:
    muxer = await start_muxer(nursery, short_tmp, ports={}, reply=reply)
    with trio.fail_after(HANG), pytest.raises(TransportError) as info:
        async with Client.connect(f"hybrid:{muxer.path}:{AGENT_PORT}"):
            pass
    assert info.value.errno in (errno.EPROTO, errno.ECONNREFUSED)


async def test_hybrid_muxer_that_never_answers_times_out(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    path = short_tmp / "mute.vsock"
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(path))
    mute.listen()  # accepts (in the kernel backlog) and never says a word
    try:
        with trio.fail_after(HANG), pytest.raises(ConnectTimeout):
            async with Client.connect(f"hybrid:{path}:{AGENT_PORT}", timeout=0.5):
                pass
    finally:
        mute.close()


async def test_hybrid_no_muxer(short_tmp: Path) -> None:
    with pytest.raises(FileNotFoundError):
        async with Client.connect(f"hybrid:{short_tmp}/absent.vsock:{AGENT_PORT}"):
            pass


# ---- vsock -------------------------------------------------------------------------------


async def test_vsock_listener_binds_and_closes() -> None:
    if not hasattr(socket, "AF_VSOCK"):
        pytest.skip("no AF_VSOCK in this Python")
    for _ in range(20):
        port = random.randrange(20_000, 60_000)
        try:
            listener = await open_listener(parse_address(f"vsock:any:{port}"))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                continue
            if exc.errno in (errno.EAFNOSUPPORT, errno.ENODEV):
                pytest.skip(f"no vsock here: {exc}")
            raise
        break
    else:
        pytest.fail("no free vsock port found")
    assert isinstance(listener, VsockListener)
    assert listener.allowed_cids == frozenset({2})
    sock = listener.inner.socket
    assert sock.getsockname()[1] == port
    await listener.aclose()
    assert sock.fileno() == -1
    # Closed means the port is free again.
    again = await open_listener(parse_address(f"vsock:any:{port}"), allowed_cids=None)
    assert isinstance(again, VsockListener) and again.allowed_cids is None
    await again.aclose()


# ---- unix --------------------------------------------------------------------------------


async def test_unix_socket_is_private_and_removed_on_stop(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    path = short_tmp / "private.sock"
    config = config_from_settings({"listen": [f"unix:{path}"]})
    scope, stopped = trio.CancelScope(), trio.Event()

    async def run(task_status: trio.TaskStatus[list[trio.abc.Listener[Any]]]) -> None:
        try:
            with scope:
                await serve(config, task_status=task_status)
        finally:
            stopped.set()

    await nursery.start(run)
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode)
    assert mode & 0o077 == 0  # only the owner (root, the host side) may connect
    async with Client.connect(f"unix:{path}") as client:
        await client.ping()
    scope.cancel()
    with trio.fail_after(HANG):
        await stopped.wait()
    assert not path.exists()


async def test_stale_unix_socket_is_replaced(start_agent: StartAgent, short_tmp: Path) -> None:
    path = short_tmp / "stale.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(path))
    leftover.close()  # the file stays, nobody listens: a previous run's leftover
    address = await start_agent(listen=[f"unix:{path}"])
    async with Client.connect(address) as client:
        await client.ping()


async def test_live_unix_socket_is_not_stolen(start_agent: StartAgent) -> None:
    address = await start_agent()
    with pytest.raises(OSError) as info:
        await open_listener(parse_address(address))
    assert info.value.errno == errno.EADDRINUSE
    async with Client.connect(address) as client:
        await client.ping()


async def test_unix_path_that_is_not_a_socket_is_left_alone(short_tmp: Path) -> None:
    path = short_tmp / "regular-file"
    path.write_text("keep me")
    with pytest.raises(OSError):
        await open_listener(parse_address(f"unix:{path}"))
    assert path.read_text() == "keep me"


# ---- serial ------------------------------------------------------------------------------


async def test_serial_port_served_through_a_pty(nursery: trio.Nursery) -> None:
    # A pty in raw mode stands in for a virtio-serial port: the agent opens the "port"
    # (the pty's slave side) and the test speaks to it from the master side.
    master, slave = os.openpty()
    tty.setraw(slave)
    port = os.ttyname(slave)
    try:
        config = config_from_settings({"listen": [f"serial:{port}"]})

        async def ping(call: Call) -> dict[str, object]:
            return {"over": "serial"}

        listener = await open_listener(parse_address(f"serial:{port}"))

        async def accept_one() -> None:
            async with listener:
                stream = await listener.accept()
                await Session(stream, "serial", {"t.ping": ping}, config).run()

        nursery.start_soon(accept_one)
        stream = trio.lowlevel.FdStream(os.dup(master))
        client = Client(stream)
        with trio.fail_after(HANG):
            await client._handshake(None, "test")
            async with trio.open_nursery() as inner:
                inner.start_soon(client._read_loop)
                assert await client.call("t.ping") == {"over": "serial"}
                inner.cancel_scope.cancel()
        await stream.aclose()
    finally:
        os.close(slave)
        os.close(master)


@pytest.mark.parametrize("text", ["serial:/nonexistent/vport9p9", "serial:name=no.such.port"])
async def test_serial_port_missing(text: str) -> None:
    listener = await open_listener(parse_address(text))
    with pytest.raises(FileNotFoundError):
        await listener.accept()
    await listener.aclose()
