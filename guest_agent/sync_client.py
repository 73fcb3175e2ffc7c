"""The blocking client: the trio ``Client`` on a private thread, driven from yours.

``with SyncClient(addr) as agent: agent.exec([...])``: the same calls as ``Client``, over the
same protocol core, for code that does not run trio.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from contextlib import contextmanager
from typing import Any, BinaryIO, TypeVar, cast

import trio

from .client import DEFAULT_WINDOW, CallStream, Client, ConnectionLost, ExecResult
from .protocol import Data, Eof, Event, Result
from .transport import Address

T = TypeVar("T")


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

    # ---- exec ------------------------------------------------------------------------

    def exec(
        self, argv: Sequence[str] | None = None, *, input: bytes | None = None, **options: Any
    ) -> ExecResult:
        """Run a command to its end and collect its output, as Client.exec."""
        return self.run(functools.partial(self.client.exec, argv, input=input, **options))

    def start_detached(self, argv: Sequence[str] | None = None, **options: Any) -> str:
        """Start a detached command; returns its exec id."""
        return self.run(functools.partial(self.client.start_detached, argv, **options))

    def exec_wait(self, exec_id: str, timeout: float | None = None) -> dict[str, Any]:
        """As Client.exec_wait."""
        return self.run(self.client.exec_wait, exec_id, timeout)

    def exec_kill(self, exec_id: str, grace: float | None = None) -> dict[str, Any]:
        """As Client.exec_kill."""
        return self.run(self.client.exec_kill, exec_id, grace)

    def exec_signal(self, exec_id: str, signal: str | int, *, tree: bool = True) -> None:
        """As Client.exec_signal."""
        self.run(functools.partial(self.client.exec_signal, exec_id, signal, tree=tree))

    def exec_list(self) -> list[dict[str, Any]]:
        """As Client.exec_list."""
        return self.run(self.client.exec_list)

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

    # ---- files -----------------------------------------------------------------------

    def read_file(
        self,
        path: str,
        *,
        offset: int = 0,
        length: int | None = None,
        user: str | int | None = None,
    ) -> bytes:
        """As Client.read_file."""
        return self.run(
            functools.partial(self.client.read_file, path, offset=offset, length=length, user=user)
        )

    def read_file_into(
        self,
        path: str,
        sink: Callable[[bytes], object],
        *,
        offset: int = 0,
        length: int | None = None,
        user: str | int | None = None,
    ) -> dict[str, Any]:
        """As Client.read_file_into; ``sink`` runs on the client's thread."""
        return self.run(
            functools.partial(
                self.client.read_file_into, path, sink, offset=offset, length=length, user=user
            )
        )

    def write_file(
        self,
        path: str,
        data: bytes | bytearray | memoryview | BinaryIO | Iterable[bytes],
        **options: Any,
    ) -> dict[str, Any]:
        """As Client.write_file; ``data`` may also be a binary file or an iterable of bytes."""
        source = _as_source(data)
        return self.run(functools.partial(self.client.write_file, path, source, **options))

    def stat(
        self, path: str, *, follow: bool = False, user: str | int | None = None
    ) -> dict[str, Any]:
        """As Client.stat."""
        return self.run(functools.partial(self.client.stat, path, follow=follow, user=user))

    def list_dir(
        self, path: str, *, depth: int = 1, user: str | int | None = None
    ) -> dict[str, Any]:
        """As Client.list_dir."""
        return self.run(functools.partial(self.client.list_dir, path, depth=depth, user=user))

    def mkdir(self, path: str, **options: Any) -> dict[str, Any]:
        """As Client.mkdir."""
        return self.run(functools.partial(self.client.mkdir, path, **options))

    def remove(self, path: str, **options: Any) -> dict[str, Any]:
        """As Client.remove."""
        return self.run(functools.partial(self.client.remove, path, **options))

    def rename(self, src: str, dst: str, *, user: str | int | None = None) -> dict[str, Any]:
        """As Client.rename."""
        return self.run(functools.partial(self.client.rename, src, dst, user=user))

    def chmod(self, path: str, mode: int, *, user: str | int | None = None) -> dict[str, Any]:
        """As Client.chmod."""
        return self.run(functools.partial(self.client.chmod, path, mode, user=user))

    def chown(
        self, path: str, owner: str | int, *, user: str | int | None = None
    ) -> dict[str, Any]:
        """As Client.chown."""
        return self.run(functools.partial(self.client.chown, path, owner, user=user))

    def download_tar(
        self, path: str, sink: Callable[[bytes], object], *, user: str | int | None = None
    ) -> dict[str, Any]:
        """As Client.download_tar; ``sink`` runs on the client's thread."""
        return self.run(functools.partial(self.client.download_tar, path, sink, user=user))

    def upload_tar(
        self,
        path: str,
        data: bytes | bytearray | memoryview | BinaryIO | Iterable[bytes],
        *,
        user: str | int | None = None,
    ) -> dict[str, Any]:
        """As Client.upload_tar; ``data`` may also be a binary file or an iterable of bytes."""
        source = _as_source(data)
        return self.run(functools.partial(self.client.upload_tar, path, source, user=user))

    def download_dir(self, path: str, local_dir: str, **options: Any) -> dict[str, Any]:
        """As Client.download_dir."""
        return self.run(functools.partial(self.client.download_dir, path, local_dir, **options))

    def upload_dir(self, local_path: str, path: str, **options: Any) -> dict[str, Any]:
        """As Client.upload_dir."""
        return self.run(functools.partial(self.client.upload_dir, local_path, path, **options))


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


# ---- helpers --------------------------------------------------------------------------

_FILE_CHUNK = 1 << 20


def _as_source(
    data: bytes | bytearray | memoryview | BinaryIO | Iterable[bytes],
) -> bytes | bytearray | memoryview | AsyncIterable[bytes]:
    """Bytes as they are; a blocking file or iterable as chunks read in worker threads."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    return _chunks_from_thread(data)


async def _chunks_from_thread(data: BinaryIO | Iterable[bytes]) -> AsyncIterator[bytes]:
    """A blocking file or iterable as async chunks, read in worker threads."""
    if hasattr(data, "read"):
        reader = cast("BinaryIO", data)
        while chunk := await trio.to_thread.run_sync(reader.read, _FILE_CHUNK):
            yield chunk
        return
    iterator: Iterator[bytes] = iter(data)
    while (item := await trio.to_thread.run_sync(_next_or_none, iterator)) is not None:
        yield item


def _next_or_none(iterator: Iterator[bytes]) -> bytes | None:
    return next(iterator, None)
