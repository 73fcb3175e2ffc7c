"""The daemon: accept loops, handshake and auth, one nursery per connection, dispatch."""

from __future__ import annotations

import contextlib
import errno
import hmac
import itertools
import logging
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from . import __version__
from .config import Config
from .protocol import (
    AgentError,
    AuthenticationFailed,
    Cancel,
    Connection,
    Credit,
    Data,
    Eof,
    Error,
    ErrorCode,
    Hello,
    Message,
    ProtocolError,
    Request,
    Result,
    Role,
)
from .services import Call, Handler, Runtime, build_handlers
from .transport import Address, Reader, UnixAddress, open_listener, send_parts

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger(__name__)

# How long a refused peer gets to read our error frame before we hang up.
_FAREWELL_TIMEOUT = 1.0
_ACCEPT_RETRY = 0.1
_connection_numbers = itertools.count(1)


def boottime() -> float:
    """Seconds since boot; unlike the wall clock it does not jump at snapshot resume."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def error_for_exception(request_id: int | None, exc: BaseException) -> Error:
    """The typed error frame that reports ``exc`` to the client."""
    if isinstance(exc, AgentError):
        return Error(request_id, exc.code, exc.message, exc.errno)
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        what = exc.strerror or str(exc)
        if exc.filename is not None:
            what = f"{what}: {exc.filename}"
        return Error(request_id, ErrorCode.OS_ERROR, what, name)
    return Error(request_id, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _single(exc: BaseException) -> BaseException:
    """The one leaf exception of nested single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class Session:
    """One client connection: its protocol state, its calls and the nursery they run in."""

    def __init__(
        self, stream: trio.abc.Stream, name: str, handlers: dict[str, Handler], config: Config
    ) -> None:
        self.stream = stream
        self.name = name
        self.handlers = handlers
        self.config = config
        self.conn = Connection(Role.AGENT)
        self.calls: dict[int, Call] = {}
        self._send_lock = trio.Lock()
        self._handshake_done = False
        self._requests_served = 0

    # ---- CallTransport ---------------------------------------------------------------

    async def send(self, message: Message) -> None:
        async with self._send_lock:
            await send_parts(self.stream, self.conn.send_parts(message))

    def send_credit(self, request_id: int) -> int:
        return self.conn.send_credit(request_id)

    # ---- lifecycle -------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until the peer leaves or breaks the protocol."""
        started = time.monotonic()
        log.info("event=connection_opened conn=%s", self.name)
        reason = "closed by peer"
        try:
            async with trio.open_nursery() as nursery:
                try:
                    await self._read_loop(nursery)
                except ProtocolError as exc:
                    reason = f"protocol error: {exc}"
                    await self._farewell(Error(None, exc.code, str(exc)))
                except AgentError as exc:
                    reason = f"refused: {exc}"
                    await self._farewell(Error(None, exc.code, exc.message))
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    reason = f"transport error: {exc!r}"
                # Every call this connection started ends with it.
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)
            log.info(
                "event=connection_closed conn=%s requests=%d seconds=%.3f reason=%r",
                self.name,
                self._requests_served,
                time.monotonic() - started,
                reason,
            )

    async def _farewell(self, error: Error) -> None:
        with trio.move_on_after(_FAREWELL_TIMEOUT):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await self.send(error)

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        reader = Reader(self.stream)
        with trio.move_on_after(self.config.handshake_timeout) as handshake_scope:
            while True:
                data = await reader.read()
                if not data:
                    return
                for message in self.conn.receive_data(data):
                    await self._dispatch(message, nursery)
                if self._handshake_done:
                    handshake_scope.deadline = math.inf
        if handshake_scope.cancelled_caught:
            raise ProtocolError(f"no hello within {self.config.handshake_timeout} s")

    async def _dispatch(self, message: Message, nursery: trio.Nursery) -> None:
        if isinstance(message, Hello):
            await self._handshake(message)
        elif isinstance(message, Request):
            await self._start_call(message, nursery)
        elif isinstance(message, Data):
            if (call := self.calls.get(message.id)) is not None:
                call.data_arrived(message.data)
        elif isinstance(message, Credit):
            if (call := self.calls.get(message.id)) is not None:
                call.credit_arrived(message.bytes)
        elif isinstance(message, Eof):
            if (call := self.calls.get(message.id)) is not None:
                call.eof_arrived()
        elif isinstance(message, Cancel):
            if (call := self.calls.get(message.id)) is not None:
                call.cancel_scope.cancel()

    async def _handshake(self, hello: Hello) -> None:
        token = self.config.token
        if token is not None and not hmac.compare_digest(
            (hello.token or "").encode(), token.encode()
        ):
            raise AuthenticationFailed("wrong or missing token")
        await self.send(
            Hello(software=f"guest-agent/{__version__}", capabilities=tuple(self._capabilities()))
        )
        self._handshake_done = True
        log.info("event=handshake conn=%s client=%r", self.name, hello.software)

    def _capabilities(self) -> list[str]:
        return sorted({method.partition(".")[0] for method in self.handlers})

    async def _start_call(self, request: Request, nursery: trio.Nursery) -> None:
        handler = self.handlers.get(request.method)
        if handler is None:
            await self.send(
                Error(request.id, ErrorCode.UNKNOWN_METHOD, f"unknown method {request.method!r}")
            )
            return
        if len(self.calls) >= self.config.max_requests_per_connection:
            await self.send(
                Error(
                    request.id,
                    ErrorCode.LIMIT_EXCEEDED,
                    f"more than {self.config.max_requests_per_connection} requests in flight",
                )
            )
            return
        call = Call(request.id, request.method, request.params, self)
        self.calls[request.id] = call
        self._requests_served += 1
        nursery.start_soon(self._run_call, call, handler, name="call")

    async def _run_call(self, call: Call, handler: Handler) -> None:
        final: Message
        try:
            with call.cancel_scope:
                result: dict[str, Any] = await handler(call)
            if call.cancel_scope.cancelled_caught:
                final = Error(call.id, ErrorCode.CANCELLED, "cancelled by the client")
            else:
                final = Result(call.id, result)
        except Exception as exc:  # every failure becomes a typed error reply
            leaf = _single(exc)
            final = error_for_exception(call.id, leaf)
            if final.code == ErrorCode.INTERNAL:
                log.exception("event=handler_failed conn=%s method=%s", self.name, call.method)
        finally:
            del self.calls[call.id]
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            try:
                await self.send(final)
            except ProtocolError as exc:
                # An unencodable or oversized result is the handler's bug; it must not take
                # the connection (and with it the agent) down.
                log.error(
                    "event=unsendable_result conn=%s method=%s error=%r",
                    self.name,
                    call.method,
                    exc,
                )
                await self.send(Error(call.id, ErrorCode.INTERNAL, f"internal error: {exc}"))


async def serve(
    config: Config,
    *,
    timings: dict[str, float] | None = None,
    task_status: trio.TaskStatus[list[trio.abc.Listener[Any]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the agent until cancelled; ``task_status.started`` gets the bound listeners."""
    cleanups: list[Callable[[], Awaitable[None]]] = []
    try:
        async with trio.open_nursery() as nursery:
            await _start(config, nursery, timings, cleanups, task_status)
    finally:
        with trio.CancelScope(shield=True):
            for cleanup in cleanups:
                await cleanup()


async def _start(
    config: Config,
    nursery: trio.Nursery,
    timings: dict[str, float] | None,
    cleanups: list[Callable[[], Awaitable[None]]],
    task_status: trio.TaskStatus[list[trio.abc.Listener[Any]]],
) -> None:
    """Build the services, bind every listener and start accepting."""
    runtime = Runtime(config, nursery, timings if timings is not None else {})
    runtime.cleanups = cleanups
    handlers = build_handlers(runtime)
    listeners = []
    for address in config.listen:
        listener = await open_listener(address, allowed_cids=config.allowed_cids)
        listeners.append(listener)
        nursery.start_soon(_accept_loop, listener, address, handlers, config)
    runtime.timings["ready"] = boottime()
    log.info(
        "event=ready version=%s listen=%s",
        __version__,
        ",".join(str(a) for a in config.listen),
    )
    task_status.started(listeners)


async def _serve_connection(session: Session) -> None:
    """Run one session; whatever goes wrong in it ends that connection only."""
    try:
        await session.run()
    except Exception:
        log.exception("event=connection_failed conn=%s", session.name)


async def _accept_loop(
    listener: trio.abc.Listener[Any], address: Address, handlers: dict[str, Handler], config: Config
) -> None:
    try:
        async with listener, trio.open_nursery() as nursery:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    # EMFILE and friends, or a serial port not there yet: keep serving.
                    log.warning("event=accept_failed listen=%s error=%r", address, exc)
                    await trio.sleep(_ACCEPT_RETRY)
                    continue
                name = f"{next(_connection_numbers)}@{address}"
                nursery.start_soon(_serve_connection, Session(stream, name, handlers, config))
    finally:
        if isinstance(address, UnixAddress):
            with contextlib.suppress(OSError):
                os.unlink(address.path)
