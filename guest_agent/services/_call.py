"""The narrow interface a service handler sees: one request, its data both ways, no socket."""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

import trio

from ..protocol import MAX_CHUNK_SIZE, Credit, Data, Eof, Event, InvalidParams, Message
from ..wakeup import Wakeup


class CallTransport(Protocol):
    """What a connection offers its calls (implemented by server.Session)."""

    async def send(self, message: Message) -> None: ...

    def send_credit(self, request_id: int) -> int: ...


# Inbound chunks smaller than this are merged so that a flood of tiny frames costs bytes,
# not Python objects.
_COALESCE_BELOW = 4096
_COALESCE_LIMIT = 64 << 10


class Call:
    """One request being served: params in, data and events out, a final result returned."""

    def __init__(
        self, request_id: int, method: str, params: dict[str, Any], transport: CallTransport
    ):
        self.id = request_id
        self.method = method
        self.params = params
        self._transport = transport
        self._credit_changed = Wakeup()
        # Client data not yet taken by receive(); made on first use (most calls take none).
        self._inbound: collections.deque[bytes | bytearray] | None = None
        self._inbound_eof = False
        self._inbound_changed = Wakeup()
        self.cancel_scope = trio.CancelScope()
        # Credit returned by the client so far: the bytes it says it has consumed.
        self.credit_returned = 0
        # Called with each credit grant (exec uses it to wake its streamer and track acks).
        self.credit_callback: Callable[[int], None] | None = None
        self._reserved = 0  # credit set aside for sends in progress (send_reserved)

    # ---- agent to client -------------------------------------------------------------

    async def send_data(self, stream: str, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` on ``stream``, waiting for the client's credit as needed.

        The bytes are written out before this returns, so the caller may reuse ``data``.
        """
        view = memoryview(data).cast("B")
        while view:
            credit = await self.wait_for_credit()  # net of reserve_credit()'s reservations
            size = min(credit, MAX_CHUNK_SIZE, len(view))
            # Frames carry slices of ``data``, not copies: a Data frame's payload is only
            # read while it is sent (send_parts), never kept.
            chunk = cast(bytes, view[:size])
            await self._transport.send(Data(self.id, stream, chunk))
            view = view[size:]

    async def wait_for_credit(self) -> int:
        """Wait until the client allows at least one more byte; return how many."""
        while (credit := self.available_credit()) == 0:
            await self._credit_changed.wait()
        return credit

    def available_credit(self) -> int:
        """Bytes the client allows now, less what is reserved for sends in progress."""
        return max(self._transport.send_credit(self.id) - self._reserved, 0)

    def reserve_credit(self, nbytes: int) -> int:
        """Set aside up to ``nbytes`` of the client's credit for send_reserved; how many."""
        granted = max(min(nbytes, self._transport.send_credit(self.id) - self._reserved), 0)
        self._reserved += granted
        return granted

    async def send_reserved(self, stream: str, data: bytes) -> None:
        """Send bytes whose credit reserve_credit set aside: never waits for credit.

        Several tasks may send on one call this way (an exec's pumps and its streamer):
        as none of them waits for credit halfway through, their frames keep the order in
        which they reserved.
        """
        try:
            await self._transport.send(Data(self.id, stream, data))
        finally:
            self._reserved -= len(data)

    async def send_event(self, event: str, body: dict[str, Any]) -> None:
        """Send a stream event (not flow-controlled: keep them small and few)."""
        await self._transport.send(Event(self.id, event, body))

    async def send_eof(self, stream: str) -> None:
        """Tell the client ``stream`` has ended."""
        await self._transport.send(Eof(self.id, stream))

    # ---- client to agent -------------------------------------------------------------

    async def grant(self, nbytes: int) -> None:
        """Allow the client to send ``nbytes`` more bytes of data on this call."""
        await self._transport.send(Credit(self.id, nbytes))

    async def receive(self) -> bytes | bytearray:
        """The next chunk of data from the client; b"" once it has sent eof."""
        while not self._inbound:
            if self._inbound_eof:
                return b""
            await self._inbound_changed.wait()
        assert self._inbound is not None
        return self._inbound.popleft()

    # ---- fed by the connection --------------------------------------------------------

    def credit_arrived(self, nbytes: int) -> None:
        self.credit_returned += nbytes
        if self.credit_callback is not None:
            self.credit_callback(nbytes)
        self._credit_changed.notify()

    def data_arrived(self, data: bytes) -> None:
        if not data:
            return
        if self._inbound is None:
            self._inbound = collections.deque()
        last = self._inbound[-1] if self._inbound else None
        if len(data) < _COALESCE_BELOW:
            if isinstance(last, bytearray) and len(last) < _COALESCE_LIMIT:
                last += data
            else:
                self._inbound.append(bytearray(data))
        else:
            self._inbound.append(data)
        self._wake_receiver()

    def eof_arrived(self) -> None:
        self._inbound_eof = True
        self._wake_receiver()

    def _wake_receiver(self) -> None:
        self._inbound_changed.notify()


Handler = Callable[[Call], Awaitable[dict[str, Any]]]


def param(call: Call, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """A request parameter of the expected type, or an InvalidParams error naming it."""
    value = call.params.get(name)
    if value is None:
        if default is ...:
            raise InvalidParams(f"{call.method}: parameter {name!r} is required")
        return default
    bad_bool = isinstance(value, bool) and bool not in (
        kind if isinstance(kind, tuple) else (kind,)
    )
    if not isinstance(value, kind) or bad_bool:
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise InvalidParams(f"{call.method}: parameter {name!r} must be {names}")
    return value
