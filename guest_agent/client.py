"""The trio client (``Client``); sync_client.py runs it on a thread for blocking code.

It speaks through the same sans-IO core as the agent. Errors from the agent arrive as
``AgentError`` subclasses (``RemoteOSError`` carries the errno name); a dropped connection
is ``ConnectionLost``.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import trio

from . import __version__
from .protocol import (
    MAX_CHUNK_SIZE,
    PROTOCOL_VERSION,
    AgentError,
    Cancel,
    Connection,
    ConnectionRefusedByAgent,
    Credit,
    Data,
    Eof,
    Error,
    Event,
    Hello,
    LocalProtocolError,
    Message,
    ProtocolError,
    Request,
    Result,
    Role,
    VersionMismatch,
)
from .transport import Address, Reader, connect, parse_address, send_parts

DEFAULT_WINDOW = 4 << 20
T = TypeVar("T")


class ConnectionLost(ConnectionError):
    """The connection to the agent ended while a call was in flight."""


class ConnectTimeout(TimeoutError):
    """The agent did not accept the connection or finish the handshake in time."""


class CallStream:
    """A call in progress: receive its data and events, send it data, cancel it."""

    def __init__(self, client: Client, request_id: int, method: str, window: int = 0) -> None:
        self.client = client
        self.id = request_id
        self.method = method
        self.result: dict[str, Any] | None = None
        # Credit goes back in batches of a quarter window: a quarter of the frames a
        # per-chunk grant would cost, and the agent never runs dry of credit meanwhile.
        self._credit_batch = max(window // 4, 1)
        self._consumed = 0
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

        Receiving Data frames gives their bytes back to the agent as credit.
        """
        while not self._inbox:
            if self._done:
                raise RuntimeError("the call has already ended")
            if self._consumed:
                await self._return_credit()  # caught up: give back everything consumed
                continue
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
            self._consumed += len(item.data)
            if self._consumed >= self._credit_batch:
                await self._return_credit()
        assert isinstance(item, (Data, Event, Eof, Result))
        return item

    async def _return_credit(self) -> None:
        consumed, self._consumed = self._consumed, 0
        if self.client._conn.is_open(self.id):
            await self.client._send(Credit(self.id, consumed))

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
        view = memoryview(data).cast("B")
        conn = self.client._conn
        while view:
            while (credit := conn.send_credit(self.id)) == 0:
                if self.client._lost is not None:
                    raise ConnectionLost(f"connection to the agent lost: {self.client._lost}")
                if not conn.is_open(self.id):
                    raise ConnectionLost(f"call {self.id} ended before its input was sent")
                await self._credit_changed.wait()
            size = min(credit, MAX_CHUNK_SIZE, len(view))
            # A slice, not a copy: _send writes the frame out before it returns.
            await self.client._send(Data(self.id, stream, cast(bytes, view[:size])))
            view = view[size:]

    async def send_eof(self, stream: str) -> None:
        """Tell the agent the named input stream has ended."""
        if self.client._conn.is_open(self.id):
            await self.client._send(Eof(self.id, stream))

    async def cancel(self) -> None:
        """Ask the agent to stop the call; it still ends with a final frame."""
        if self.client._conn.is_open(self.id):
            await self.client._send(Cancel(self.id))


def exec_params(
    argv: Sequence[str] | None = None,
    *,
    command: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | int | None = None,
    stdin: bool = False,
    pty: tuple[int, int] | None = None,
    timeout: float | None = None,
    kill_grace: float | None = None,
    detach: bool = False,
    memory_bytes: int | None = None,
    pids: int | None = None,
) -> dict[str, Any]:
    """The params of exec.start (see docs/protocol.md); ``pty`` is (rows, cols)."""
    params: dict[str, Any] = {"argv": list(argv)} if argv is not None else {"command": command}
    optional: dict[str, Any] = {"env": dict(env) if env else None, "cwd": cwd, "user": user}
    optional.update(timeout=timeout, kill_grace=kill_grace)
    params.update({key: value for key, value in optional.items() if value is not None})
    if stdin:
        params["stdin"] = True
    if pty is not None:
        params["pty"] = {"rows": pty[0], "cols": pty[1]}
    if detach:
        params["detach"] = True
    limits = {"memory_bytes": memory_bytes, "pids": pids}
    if any(value is not None for value in limits.values()):
        params["limits"] = {key: value for key, value in limits.items() if value is not None}
    return params


@dataclass
class ExecResult:
    """A finished exec with its collected output."""

    status: dict[str, Any]
    stdout: bytes
    stderr: bytes

    @property
    def exit_code(self) -> int | None:
        """The exit code, or None when a signal ended it."""
        code: int | None = self.status.get("exit_code")
        return code

    @property
    def signal(self) -> str | None:
        """The name of the signal that ended it (SIGKILL, ...), if any."""
        name: str | None = self.status.get("signal")
        return name

    @property
    def timed_out(self) -> bool:
        return bool(self.status.get("timed_out"))


class ExecStream:
    """A running exec's attached stream: its output as it comes, its stdin, its controls."""

    def __init__(self, client: Client, call: CallStream) -> None:
        self.client = client
        self.call = call
        self.exec_id: str = ""
        self.pid: int = 0
        self.announcement: dict[str, Any] = {}
        # Bytes received per stream: what a reattach passes as offsets.
        self.offsets: dict[str, int] = {}

    async def _read_announcement(self) -> None:
        first = await self.call.receive()
        if isinstance(first, Result):  # started detached: no stream follows
            self.announcement = first.result
        elif isinstance(first, Event):
            self.announcement = first.body
        else:
            raise ConnectionRefusedByAgent(f"unexpected first frame of an exec: {first!r}")
        self.exec_id = str(self.announcement.get("exec_id", ""))
        self.pid = int(self.announcement.get("pid", 0))
        self.offsets.update(self.announcement.get("offsets", {}))

    @property
    def result(self) -> dict[str, Any] | None:
        """The end frame (exit status, or detached), once received."""
        return self.call.result

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        return self._output()

    async def _output(self) -> AsyncIterator[tuple[str, bytes]]:
        async for item in self.call:
            if isinstance(item, Data):
                self.offsets[item.stream] = self.offsets.get(item.stream, 0) + len(item.data)
                yield item.stream, item.data

    async def wait(self) -> dict[str, Any]:
        """Drain the output and return the end frame."""
        async for _ in self:
            pass
        assert self.call.result is not None
        return self.call.result

    async def write(self, data: bytes) -> None:
        """Send bytes to the command's stdin (or terminal)."""
        await self.call.send_data("stdin", data)

    async def close_stdin(self) -> None:
        """EOF on the command's stdin (^D on a terminal)."""
        await self.call.send_eof("stdin")

    async def detach(self) -> None:
        """End this stream; the command runs on with its output kept in a ring."""
        await self.client.call("exec.detach", {"exec_id": self.exec_id})

    async def signal(self, signal: str | int, *, tree: bool = True) -> None:
        """Signal the command's whole tree (or only its main process)."""
        await self.client.exec_signal(self.exec_id, signal, tree=tree)

    async def resize(self, rows: int, cols: int) -> None:
        """Set the terminal size (PTY execs)."""
        await self.client.call("exec.resize", {"exec_id": self.exec_id, "rows": rows, "cols": cols})


class Client:
    """A connection to an agent, on trio. Use ``async with Client.connect(addr) as c``."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._reader = Reader(stream)
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
            # The caller's exception is re-raised outside the reader's nursery, so that it
            # arrives as itself (UnknownMethod, ...) and not wrapped in an ExceptionGroup.
            body_error: BaseException | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._read_loop)
                try:
                    yield client
                except BaseException as exc:
                    body_error = exc
                finally:
                    nursery.cancel_scope.cancel()
            if body_error is not None:
                raise body_error
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    async def _handshake(self, token: str | None, software: str) -> None:
        await self._send(Hello(software=software, token=token))
        while self._conn.peer_hello is None:
            data = await self._reader.read()
            if not data:
                raise ConnectionLost("the agent closed the connection during the handshake")
            for message in self._conn.receive_data(data):
                if isinstance(message, Error):
                    raise AgentError.from_wire(message.code, message.message, message.errno)
        self.agent_hello = self._conn.peer_hello
        major, minor = self.agent_hello.protocol
        if major != PROTOCOL_VERSION[0]:
            raise VersionMismatch(
                f"the agent speaks protocol {major}.{minor}; this client speaks "
                f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}"
            )

    async def _send(self, message: Message) -> None:
        if self._lost is not None:
            raise ConnectionLost(f"connection to the agent lost: {self._lost}")
        async with self._send_lock:
            try:
                await send_parts(self._stream, self._conn.send_parts(message))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ConnectionLost(f"connection to the agent lost: {exc}") from exc

    async def _read_loop(self) -> None:
        error: BaseException
        try:
            while True:
                data = await self._reader.read()
                if not data:
                    error = ConnectionLost("the agent closed the connection")
                    break
                for message in self._conn.receive_data(data):
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
        call = CallStream(self, request_id, method, window)
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

    # ---- exec ------------------------------------------------------------------------

    @asynccontextmanager
    async def open_exec(
        self, argv: Sequence[str] | None = None, **options: Any
    ) -> AsyncIterator[ExecStream]:
        """Start a command and stream it: ``async for stream, data in ex``; see exec_params."""
        async with self.open_call("exec.start", exec_params(argv, **options)) as call:
            stream = ExecStream(self, call)
            await stream._read_announcement()
            yield stream

    @asynccontextmanager
    async def attach_exec(
        self, exec_id: str, offsets: Mapping[str, int] | None = None
    ) -> AsyncIterator[ExecStream]:
        """Attach to a running or finished exec, replaying its output from ``offsets``."""
        params = {"exec_id": exec_id, "offsets": dict(offsets or {})}
        async with self.open_call("exec.attach", params) as call:
            stream = ExecStream(self, call)
            await stream._read_announcement()
            yield stream

    async def exec(
        self, argv: Sequence[str] | None = None, *, input: bytes | None = None, **options: Any
    ) -> ExecResult:
        """Run a command to its end and collect its output (``input`` goes to its stdin)."""
        chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": [], "pty": []}
        async with self.open_exec(argv, stdin=input is not None, **options) as ex:
            if input is None:
                async for name, data in ex:
                    chunks[name].append(data)
            else:

                async def feed() -> None:
                    await ex.write(input)
                    await ex.close_stdin()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(feed)
                    async for name, data in ex:
                        chunks[name].append(data)
        assert ex.result is not None
        stdout = b"".join(chunks["stdout"] or chunks["pty"])
        return ExecResult(ex.result, stdout, b"".join(chunks["stderr"]))

    async def start_detached(self, argv: Sequence[str] | None = None, **options: Any) -> str:
        """Start a command that runs on its own; returns its exec id."""
        result = await self.call("exec.start", exec_params(argv, detach=True, **options))
        return str(result["exec_id"])

    async def exec_wait(self, exec_id: str, timeout: float | None = None) -> dict[str, Any]:
        """The end status of an exec (its current state if ``timeout`` passes first)."""
        params: dict[str, Any] = {"exec_id": exec_id}
        if timeout is not None:
            params["timeout"] = timeout
        return await self.call("exec.wait", params)

    async def exec_kill(self, exec_id: str, grace: float | None = None) -> dict[str, Any]:
        """SIGTERM the exec's tree, then SIGKILL after the grace; returns its end status."""
        params: dict[str, Any] = {"exec_id": exec_id}
        if grace is not None:
            params["grace"] = grace
        return await self.call("exec.kill", params)

    async def exec_signal(self, exec_id: str, signal: str | int, *, tree: bool = True) -> None:
        """Send a signal to the exec's tree, or only its main process."""
        await self.call("exec.signal", {"exec_id": exec_id, "signal": signal, "tree": tree})

    async def exec_list(self) -> list[dict[str, Any]]:
        """Running and recently finished execs."""
        result = await self.call("exec.list")
        execs: list[dict[str, Any]] = result["execs"]
        return execs

    # ---- files -----------------------------------------------------------------------

    @asynccontextmanager
    async def open_read(
        self,
        path: str,
        *,
        offset: int = 0,
        length: int | None = None,
        user: str | int | None = None,
        window: int = DEFAULT_WINDOW,
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Stream a file: ``async with c.open_read(p) as chunks: async for b in chunks``."""
        params = _drop_none(path=path, offset=offset or None, length=length, user=user)
        async with self.open_call("file.read", params, window=window) as call:
            yield _data_chunks(call)

    async def read_file_into(
        self,
        path: str,
        sink: Callable[[bytes], object],
        *,
        offset: int = 0,
        length: int | None = None,
        user: str | int | None = None,
    ) -> dict[str, Any]:
        """Stream a file into ``sink(chunk)`` (which may be async); returns {size, bytes}."""
        params = _drop_none(path=path, offset=offset or None, length=length, user=user)
        return await self._download("file.read", params, sink)

    async def read_file(
        self,
        path: str,
        *,
        offset: int = 0,
        length: int | None = None,
        user: str | int | None = None,
    ) -> bytes:
        """A whole file (or ``length`` bytes from ``offset``) in memory."""
        parts: list[bytes] = []
        await self.read_file_into(path, parts.append, offset=offset, length=length, user=user)
        return b"".join(parts)

    async def write_file(
        self,
        path: str,
        data: bytes | bytearray | memoryview | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        owner: str | int | None = None,
        parents: bool = False,
        append: bool = False,
        exclusive: bool = False,
        user: str | int | None = None,
    ) -> dict[str, Any]:
        """Write a file atomically (unless ``append``) from bytes or an async iterable."""
        params = _drop_none(
            path=path,
            mode=mode,
            owner=owner,
            parents=parents or None,
            append=append or None,
            exclusive=exclusive or None,
            user=user,
        )

        async def feed(call: CallStream) -> None:
            if isinstance(data, (bytes, bytearray, memoryview)):
                await call.send_data("file", data)
            else:
                async for chunk in data:
                    await call.send_data("file", chunk)

        return await self._upload("file.write", params, "file", feed)

    async def stat(
        self, path: str, *, follow: bool = False, user: str | int | None = None
    ) -> dict[str, Any]:
        """name, type, size, mode, uid, gid, owner, group, mtime, target of one path."""
        return await self.call("file.stat", _drop_none(path=path, follow=follow, user=user))

    async def list_dir(
        self, path: str, *, depth: int = 1, user: str | int | None = None
    ) -> dict[str, Any]:
        """{entries: [stat entries plus "path"], truncated, errors} of a directory."""
        return await self.call("file.list", _drop_none(path=path, depth=depth, user=user))

    async def mkdir(
        self,
        path: str,
        *,
        parents: bool = False,
        mode: int | None = None,
        user: str | int | None = None,
    ) -> dict[str, Any]:
        """Create a directory (with its parents when ``parents``)."""
        params = _drop_none(path=path, parents=parents, mode=mode, user=user)
        return await self.call("file.mkdir", params)

    async def remove(
        self, path: str, *, recursive: bool = False, user: str | int | None = None
    ) -> dict[str, Any]:
        """Remove a file, symlink or empty directory; a whole tree with ``recursive``."""
        params = _drop_none(path=path, recursive=recursive, user=user)
        return await self.call("file.remove", params)

    async def rename(self, src: str, dst: str, *, user: str | int | None = None) -> dict[str, Any]:
        """Rename or move."""
        return await self.call("file.rename", _drop_none(src=src, dst=dst, user=user))

    async def chmod(self, path: str, mode: int, *, user: str | int | None = None) -> dict[str, Any]:
        """Set permission bits."""
        return await self.call("file.chmod", _drop_none(path=path, mode=mode, user=user))

    async def chown(
        self, path: str, owner: str | int, *, user: str | int | None = None
    ) -> dict[str, Any]:
        """Set owner and group: ``USER[:GROUP]``, ``:GROUP`` or a uid."""
        return await self.call("file.chown", _drop_none(path=path, owner=owner, user=user))

    async def download_tar(
        self, path: str, sink: Callable[[bytes], object], *, user: str | int | None = None
    ) -> dict[str, Any]:
        """Stream a tar archive of a guest directory (or file) into ``sink(chunk)``."""
        return await self._download("file.read_tar", _drop_none(path=path, user=user), sink)

    async def upload_tar(
        self,
        path: str,
        data: bytes | bytearray | memoryview | AsyncIterable[bytes],
        *,
        user: str | int | None = None,
    ) -> dict[str, Any]:
        """Extract a tar archive (bytes or an async iterable) into a guest directory."""

        async def feed(call: CallStream) -> None:
            if isinstance(data, (bytes, bytearray, memoryview)):
                await call.send_data("tar", data)
            else:
                async for chunk in data:
                    await call.send_data("tar", chunk)

        return await self._upload("file.write_tar", _drop_none(path=path, user=user), "tar", feed)

    async def download_dir(
        self,
        path: str,
        local_dir: str,
        *,
        user: str | int | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> dict[str, Any]:
        """Copy a guest directory's contents into ``local_dir`` (created if needed).

        The guest is not trusted: members that would land outside ``local_dir`` are refused.
        """
        from .filesystem.tar import extract_tar

        send, receive = trio.open_memory_channel[bytes](4)

        async def next_chunk() -> bytes:
            try:
                return await receive.receive()
            except trio.EndOfChannel:
                return b""

        async def produce() -> None:
            async with send:

                async def sink(chunk: bytes) -> None:
                    await send.send(chunk)
                    if progress is not None:
                        progress(len(chunk))

                await self.download_tar(path, sink, user=user)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            return await trio.to_thread.run_sync(
                extract_tar, local_dir, lambda _: trio.from_thread.run(next_chunk)
            )

    async def upload_dir(
        self,
        local_path: str,
        path: str,
        *,
        user: str | int | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> dict[str, Any]:
        """Copy a local directory's contents (or one file) into guest directory ``path``."""
        from .filesystem.tar import archive_tree

        async def feed(call: CallStream) -> None:
            def send(chunk: bytes) -> None:
                trio.from_thread.run(call.send_data, "tar", chunk)
                if progress is not None:
                    progress(len(chunk))

            await trio.to_thread.run_sync(archive_tree, local_path, send)

        return await self._upload("file.write_tar", _drop_none(path=path, user=user), "tar", feed)

    async def _download(
        self, method: str, params: dict[str, Any], sink: Callable[[bytes], object]
    ) -> dict[str, Any]:
        async with self.open_call(method, params) as call:
            async for chunk in _data_chunks(call):
                if inspect.isawaitable(pending := sink(chunk)):
                    await pending
        assert call.result is not None
        return call.result

    async def _upload(
        self,
        method: str,
        params: dict[str, Any],
        stream: str,
        feed: Callable[[CallStream], Awaitable[None]],
    ) -> dict[str, Any]:
        async with self.open_call(method, params, window=0) as call:
            try:
                await feed(call)
                await call.send_eof(stream)
            except (ConnectionLost, LocalProtocolError):
                if self._conn.is_open(call.id):
                    raise
                # The agent ended the call before taking all the data: its reply says why.
            return await call.wait_result()


# ---- files helpers -------------------------------------------------------------------


def _drop_none(**params: Any) -> dict[str, Any]:
    """Request params without the unset (None) ones."""
    return {key: value for key, value in params.items() if value is not None}


async def _data_chunks(call: CallStream) -> AsyncIterator[bytes]:
    """The data of a call, chunk by chunk, until its result."""
    async for item in call:
        if isinstance(item, Data) and item.data:
            yield item.data
