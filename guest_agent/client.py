"""Clients: ``Client`` on trio, and ``SyncClient``, a blocking facade running it in a thread.

Both speak through the same sans-IO core as the agent. Errors from the agent arrive as
``AgentError`` subclasses (``RemoteOSError`` carries the errno name); a dropped connection
is ``ConnectionLost``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import trio

from . import __version__
from .protocol import (
    MAX_CHUNK_SIZE,
    AgentError,
    Cancel,
    Connection,
    Credit,
    Data,
    Eof,
    Error,
    Event,
    Hello,
    Message,
    ProtocolError,
    Request,
    Result,
    Role,
)
from .transport import Address, connect, parse_address

DEFAULT_WINDOW = 4 << 20
RECEIVE_SIZE = 256 << 10
T = TypeVar("T")


class ConnectionLost(ConnectionError):
    """The connection to the agent ended while a call was in flight."""


class ConnectTimeout(TimeoutError):
    """The agent did not accept the connection or finish the handshake in time."""


class CallStream:
    """A call in progress: receive its data and events, send it data, cancel it."""

    def __init__(self, client: Client, request_id: int, method: str) -> None:
        self.client = client
        self.id = request_id
        self.method = method
        self.result: dict[str, Any] | None = None
        self._inbox: collections.deque[Message | BaseException] = collections.deque()
        self._changed = trio.Event()
        self._credit_changed = trio.Event()
        self._done = False

    # ---- fed by the client's reader --------------------------------------------------

    def _deliver(self, item: Message | BaseException) -> None:
        self._inbox.append(item)
        self._changed.set()
        self._changed = trio.Event()

    def _credit_arrived(self) -> None:
        self._credit_changed.set()
        self._credit_changed = trio.Event()

    # ---- for the caller --------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether the final frame (result or error) has been received."""
        return self._done

    async def receive(self) -> Data | Event | Eof | Result:
        """The next frame of this call; a final Error is raised as an AgentError.

        Receiving a Data frame gives its bytes back to the agent as credit.
        """
        while not self._inbox:
            if self._done:
                raise RuntimeError("the call has already ended")
            await self._changed.wait()
        item = self._inbox.popleft()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if isinstance(item, Error):
            self._done = True
            raise AgentError.from_wire(item.code, item.message, item.errno)
        if isinstance(item, Result):
            self._done = True
            self.result = item.result
        elif isinstance(item, Data) and item.data:
            await self.client._send(Credit(self.id, len(item.data)))
        assert isinstance(item, (Data, Event, Eof, Result))
        return item

    def __aiter__(self) -> AsyncIterator[Data | Event | Eof]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Data | Event | Eof]:
        while not self._done:
            item = await self.receive()
            if not isinstance(item, Result):
                yield item

    async def wait_result(self) -> dict[str, Any]:
        """Drain the call (discarding data) and return its result."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def send_data(self, stream: str, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` on the named stream, waiting for the agent's credit."""
        view = memoryview(data)
        conn = self.client._conn
        while view:
            while (credit := conn.send_credit(self.id)) == 0:
                if not conn.is_open(self.id):
                    raise ConnectionLost(f"call {self.id} ended before its input was sent")
                await self._credit_changed.wait()
            size = min(credit, MAX_CHUNK_SIZE, len(view))
            await self.client._send(Data(self.id, stream, bytes(view[:size])))
            view = view[size:]

    async def send_eof(self, stream: str) -> None:
        """Tell the agent the named input stream has ended."""
        if self.client._conn.is_open(self.id):
            await self.client._send(Eof(self.id, stream))

    async def cancel(self) -> None:
        """Ask the agent to stop the call; it still ends with a final frame."""
        if self.client._conn.is_open(self.id):
            await self.client._send(Cancel(self.id))


class Client:
    """A connection to an agent, on trio. Use ``async with Client.connect(addr) as c``."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._conn = Connection(Role.CLIENT)
        self._send_lock = trio.Lock()
        self._calls: dict[int, CallStream] = {}
        self._ids = itertools.count(1)
        self._lost: BaseException | None = None
        self.agent_hello: Hello | None = None

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        address: str | Address,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        software: str = f"guest-agent-client/{__version__}",
    ) -> AsyncIterator[Client]:
        """Connect and handshake; raises ConnectTimeout, OSError or an AgentError."""
        if isinstance(address, str):
            address = parse_address(address)
        with trio.move_on_after(timeout) as scope:
            stream = await connect(address)
        if scope.cancelled_caught:
            raise ConnectTimeout(f"connecting to {address} timed out after {timeout} s")
        client = cls(stream)
        try:
            with trio.move_on_after(timeout) as scope:
                await client._handshake(token, software)
            if scope.cancelled_caught:
                raise ConnectTimeout(f"{address}: no hello from the agent within {timeout} s")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._read_loop)
                try:
                    yield client
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    async def _handshake(self, token: str | None, software: str) -> None:
        await self._send(Hello(software=software, token=token))
        while self._conn.peer_hello is None:
            data = await self._stream.receive_some(RECEIVE_SIZE)
            if not data:
                raise ConnectionLost("the agent closed the connection during the handshake")
            for message in self._conn.receive_data(bytes(data)):
                if isinstance(message, Error):
                    raise AgentError.from_wire(message.code, message.message, message.errno)
        self.agent_hello = self._conn.peer_hello

    async def _send(self, message: Message) -> None:
        if self._lost is not None:
            raise ConnectionLost(f"connection to the agent lost: {self._lost}")
        async with self._send_lock:
            try:
                await self._stream.send_all(self._conn.send(message))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ConnectionLost(f"connection to the agent lost: {exc}") from exc

    async def _read_loop(self) -> None:
        error: BaseException
        try:
            while True:
                data = await self._stream.receive_some(RECEIVE_SIZE)
                if not data:
                    error = ConnectionLost("the agent closed the connection")
                    break
                for message in self._conn.receive_data(bytes(data)):
                    if isinstance(message, Error) and message.id is None:
                        raise AgentError.from_wire(message.code, message.message, message.errno)
                    if isinstance(message, Credit):
                        if (call := self._calls.get(message.id)) is not None:
                            call._credit_arrived()
                        continue
                    call = self._calls.get(getattr(message, "id", -1))
                    if call is None:
                        continue
                    call._deliver(message)
                    if isinstance(message, (Result, Error)) and message.id is not None:
                        self._calls.pop(message.id, None)
                        call._credit_arrived()  # wake senders: the call is over
        except (AgentError, ProtocolError) as exc:
            error = exc
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            error = ConnectionLost(f"connection to the agent lost: {exc!r}")
        self._lost = error
        for call in self._calls.values():
            call._deliver(error)
            call._credit_arrived()
        self._calls.clear()

    # ---- calls -----------------------------------------------------------------------

    @asynccontextmanager
    async def open_call(
        self, method: str, params: dict[str, Any] | None = None, *, window: int = DEFAULT_WINDOW
    ) -> AsyncIterator[CallStream]:
        """Start a streaming call; leaving the block early cancels it on the agent."""
        request_id = next(self._ids)
        call = CallStream(self, request_id, method)
        self._calls[request_id] = call
        try:
            await self._send(Request(request_id, method, params or {}, window))
        except BaseException:
            self._calls.pop(request_id, None)
            raise
        try:
            yield call
        finally:
            if not call.done and self._conn.is_open(request_id):
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(5),
                    contextlib.suppress(ConnectionLost),
                ):
                    await call.cancel()

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """A unary call: send the request, return the result (or raise its error)."""
        async with self.open_call(method, params, window=0) as call:
            return await call.wait_result()

    async def ping(self) -> None:
        """Round trip to the agent."""
        await self.call("system.ping")

    async def info(self) -> dict[str, Any]:
        """Agent and protocol versions, capabilities, hostname, uptimes, boot timing."""
        return await self.call("system.info")


class SyncClient:
    """A blocking client: the trio ``Client`` on a private thread, driven from yours.

    ``with SyncClient(addr) as c: c.ping()``. Safe to use from one thread at a time per
    call; several threads may run calls concurrently.
    """

    def __init__(
        self, address: str | Address, *, token: str | None = None, timeout: float = 10.0
    ) -> None:
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._client: Client | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(
            target=trio.run,
            args=(self._main, address, token, timeout),
            name="guest-agent-client",
            daemon=True,
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    async def _main(self, address: str | Address, token: str | None, timeout: float) -> None:
        try:
            async with Client.connect(address, token=token, timeout=timeout) as client:
                self._client = client
                self._trio_token = trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # handed to the caller's thread
            self._error = exc
        finally:
            self._ready.set()

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` (a coroutine function using the trio client) and return its value."""
        if self._client is None or self._trio_token is None:
            raise ConnectionLost("the client is closed")
        return trio.from_thread.run(fn, *args, trio_token=self._trio_token)

    @property
    def client(self) -> Client:
        """The trio client behind this facade (for use inside ``run``)."""
        if self._client is None:
            raise ConnectionLost("the client is closed")
        return self._client

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """A unary call."""
        return self.run(self.client.call, method, params)

    def ping(self) -> None:
        """Round trip to the agent."""
        self.run(self.client.ping)

    def info(self) -> dict[str, Any]:
        """Agent facts, as Client.info."""
        return self.run(self.client.info)

    @contextmanager
    def open_call(
        self, method: str, params: dict[str, Any] | None = None, *, window: int = DEFAULT_WINDOW
    ) -> Iterator[SyncCallStream]:
        """A streaming call driven from this thread; leaving the block early cancels it."""
        manager = self.client.open_call(method, params, window=window)
        call = self.run(manager.__aenter__)
        try:
            yield SyncCallStream(self, call)
        except BaseException as exc:
            if not self.run(
                functools.partial(manager.__aexit__, type(exc), exc, exc.__traceback__)
            ):
                raise
        else:
            self.run(functools.partial(manager.__aexit__, None, None, None))

    def close(self) -> None:
        """Close the connection and stop the thread."""
        if self._stop is not None and self._trio_token is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._trio_token)
        self._thread.join()
        self._client = None

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SyncCallStream:
    """The blocking view of a CallStream."""

    def __init__(self, owner: SyncClient, call: CallStream) -> None:
        self._owner = owner
        self.call = call

    @property
    def result(self) -> dict[str, Any] | None:
        return self.call.result

    def receive(self) -> Data | Event | Eof | Result:
        return self._owner.run(self.call.receive)

    def __iter__(self) -> Iterator[Data | Event | Eof]:
        while not self.call.done:
            item = self.receive()
            if not isinstance(item, Result):
                yield item

    def wait_result(self) -> dict[str, Any]:
        return self._owner.run(self.call.wait_result)

    def send_data(self, stream: str, data: bytes) -> None:
        self._owner.run(self.call.send_data, stream, data)

    def send_eof(self, stream: str) -> None:
        self._owner.run(self.call.send_eof, stream)

    def cancel(self) -> None:
        self._owner.run(self.call.cancel)
