"""Server sessions with test-only handlers: streaming credit, cancellation, handler bugs.

These handlers live only here (the agent has no such methods); they are served by the
real ``server.Session`` over a real unix socket and reached through the real ``Client``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from guest_agent.client import Client, ConnectionLost
from guest_agent.config import config_from_settings
from guest_agent.protocol import (
    MAX_FRAME_SIZE,
    AgentError,
    Cancelled,
    Data,
    ErrorCode,
    InvalidParams,
    Result,
)
from guest_agent.server import Session
from guest_agent.services import Call, Handler, param
from guest_agent.transport import UnixAddress, open_listener

HANG = 30


async def serve_handlers(
    handlers: dict[str, Handler],
    path: Path,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    config = config_from_settings({"listen": [f"unix:{path}"]})
    listener = await open_listener(UnixAddress(str(path)))
    async with listener, trio.open_nursery() as nursery:
        task_status.started()
        while True:
            stream = await listener.accept()
            nursery.start_soon(Session(stream, "test", handlers, config).run)


@pytest.fixture
def serve(nursery: trio.Nursery, short_tmp: Path) -> Callable[[dict[str, Handler]], Awaitable[str]]:
    async def start(handlers: dict[str, Handler]) -> str:
        path = short_tmp / "session.sock"
        await nursery.start(functools.partial(serve_handlers, handlers, path))
        return f"unix:{path}"

    return start


Serve = Callable[[dict[str, Handler]], Awaitable[str]]


async def ping(call: Call) -> dict[str, Any]:
    return {}


async def stream_forever(call: Call) -> dict[str, Any]:
    """Writes as fast as the client's credit allows, until cancelled."""
    chunk = b"x" * 4096
    while True:
        await call.send_data("stdout", chunk)


async def stream_some(call: Call) -> dict[str, Any]:
    size = param(call, "size", int)
    await call.send_event("started", {"size": size})
    await call.send_data("stdout", b"y" * size)
    await call.send_eof("stdout")
    return {"sent": size}


async def echo_input(call: Call) -> dict[str, Any]:
    """Grants credit for its input and returns how many bytes it got."""
    await call.grant(param(call, "grant", int))
    total = 0
    while chunk := await call.receive():
        total += len(chunk)
        await call.grant(len(chunk))
    return {"received": total}


async def test_stalled_call_does_not_block_other_call_on_the_same_connection(
    serve: Serve,
) -> None:
    address = await serve({"t.forever": stream_forever, "t.some": stream_some, "t.ping": ping})
    with trio.fail_after(HANG):
        async with Client.connect(address) as client:
            # The consumer of this call never reads, so it never gives credit back.
            async with client.open_call("t.forever", window=64 << 10) as stalled:
                size = 3 << 20  # far more than the stalled window and any socket buffer
                async with client.open_call("t.some", {"size": size}, window=256 << 10) as call:
                    got = 0
                    async for item in call:
                        if isinstance(item, Data):
                            got += len(item.data)
                    assert call.result == {"sent": size}
                assert got == size
                assert await client.call("t.ping") == {}
                # The stalled call sent its window and then waited, holding nothing else up.
                assert not stalled.done


async def test_credit_bounds_what_the_agent_sends(serve: Serve) -> None:
    address = await serve({"t.forever": stream_forever})
    with trio.fail_after(HANG):
        async with Client.connect(address) as client:
            async with client.open_call("t.forever", window=10_000) as call:
                received = 0
                for _ in range(20):
                    item = await call.receive()  # each receive gives its bytes back as credit
                    assert isinstance(item, Data)
                    received += len(item.data)
                # The agent can never be more than one window ahead of the consumer.
                assert client._conn.send_credit(call.id) == 0
                assert received > 10_000


async def test_client_input_with_credit(serve: Serve) -> None:
    address = await serve({"t.echo": echo_input})
    payload = bytes(range(256)) * 4000  # 1 MB, more than one frame, in small grants
    with trio.fail_after(HANG):
        async with Client.connect(address) as client:
            async with client.open_call("t.echo", {"grant": 50_000}) as call:
                await call.send_data("stdin", payload)
                await call.send_eof("stdin")
                assert await call.wait_result() == {"received": len(payload)}


async def test_cancel_ends_the_call_with_cancelled(serve: Serve) -> None:
    cancelled = trio.Event()

    async def wait_forever(call: Call) -> dict[str, Any]:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
        return {}

    address = await serve({"t.wait": wait_forever, "t.ping": ping})
    with trio.fail_after(HANG):
        async with Client.connect(address) as client:
            async with client.open_call("t.wait") as call:
                await call.cancel()
                with pytest.raises(Cancelled) as info:
                    await call.wait_result()
                assert info.value.code == ErrorCode.CANCELLED
            await cancelled.wait()
            assert await client.call("t.ping") == {}


async def test_a_dropped_connection_cancels_its_calls(serve: Serve) -> None:
    started, cancelled = trio.Event(), trio.Event()

    async def wait_forever(call: Call) -> dict[str, Any]:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
        return {}

    address = await serve({"t.wait": wait_forever})
    with trio.fail_after(HANG):
        async with Client.connect(address) as client, client.open_call("t.wait"):
            await started.wait()
        await cancelled.wait()


async def test_handler_failures_become_typed_errors(serve: Serve) -> None:
    async def needs_param(call: Call) -> dict[str, Any]:
        return {"n": param(call, "n", int)}

    async def raises_oserror(call: Call) -> dict[str, Any]:
        open("/nonexistent/for/sure")  # noqa: ASYNC230, SIM115
        return {}

    async def crashes(call: Call) -> dict[str, Any]:
        raise RuntimeError("handler bug")

    async def unencodable(call: Call) -> dict[str, Any]:
        return {"oops": {1, 2, 3}}

    async def oversized(call: Call) -> dict[str, Any]:
        return {"blob": b"z" * MAX_FRAME_SIZE}

    address = await serve(
        {
            "t.param": needs_param,
            "t.oserror": raises_oserror,
            "t.crash": crashes,
            "t.unencodable": unencodable,
            "t.oversized": oversized,
            "t.ping": ping,
        }
    )
    with trio.fail_after(HANG):
        async with Client.connect(address) as client:
            with pytest.raises(InvalidParams, match="'n'"):
                await client.call("t.param")
            with pytest.raises(InvalidParams, match="must be int"):
                await client.call("t.param", {"n": True})
            assert await client.call("t.param", {"n": 3}) == {"n": 3}
            with pytest.raises(AgentError) as info:
                await client.call("t.oserror")
            assert (info.value.code, info.value.errno) == (ErrorCode.OS_ERROR, "ENOENT")
            with pytest.raises(AgentError, match="handler bug") as info:
                await client.call("t.crash")
            assert info.value.code == ErrorCode.INTERNAL
            # A result the wire cannot carry is the handler's bug: an error reply, and the
            # connection (and the agent) carry on.
            for method in ("t.unencodable", "t.oversized"):
                with pytest.raises(AgentError) as info:
                    await client.call(method)
                assert info.value.code == ErrorCode.INTERNAL
                assert await client.call("t.ping") == {}


async def test_calls_fail_with_connection_lost_when_the_agent_goes(
    nursery: trio.Nursery, short_tmp: Path
) -> None:
    started = trio.Event()

    async def wait_forever(call: Call) -> dict[str, Any]:
        started.set()
        await trio.sleep_forever()
        return {}

    path = short_tmp / "dying.sock"
    server_scope = trio.CancelScope()

    async def run_server(task_status: trio.TaskStatus[None]) -> None:
        with server_scope:
            await serve_handlers({"t.wait": wait_forever}, path, task_status=task_status)

    await nursery.start(run_server)
    with trio.fail_after(HANG):
        async with Client.connect(f"unix:{path}") as client:
            async with client.open_call("t.wait") as call:
                await started.wait()
                server_scope.cancel()
                with pytest.raises(ConnectionLost):
                    await call.wait_result()
            with pytest.raises(ConnectionLost):
                await client.call("t.wait")


async def test_result_frame_fields(serve: Serve) -> None:
    address = await serve({"t.some": stream_some})
    async with Client.connect(address) as client:
        async with client.open_call("t.some", {"size": 3}) as call:
            items = [await call.receive() for _ in range(4)]
    assert [type(i).__name__ for i in items] == ["Event", "Data", "Eof", "Result"]
    assert items[3] == Result(call.id, {"sent": 3})
