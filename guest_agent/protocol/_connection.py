"""The connection state machine: handshake, request ids and credit, with no I/O.

Bytes in through ``receive_data`` give messages out; messages in through ``send`` give
bytes out. Both sides use the same class with a different ``Role``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ._errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from ._framing import FrameDecoder, encode_data_frame, encode_frame
from ._messages import (
    MAX_CREDIT,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Cancel,
    Credit,
    Data,
    Eof,
    Error,
    Event,
    Hello,
    Message,
    Request,
    Result,
)


class Role(enum.Enum):
    CLIENT = "client"
    AGENT = "agent"


# Which messages each role may send (the other role may receive them).
_SENDS: dict[Role, frozenset[type]] = {
    Role.CLIENT: frozenset({Hello, Request, Data, Eof, Credit, Cancel}),
    Role.AGENT: frozenset({Hello, Result, Error, Data, Eof, Event, Credit}),
}


@dataclass(slots=True)
class _StreamState:
    send_credit: int  # payload bytes we may still send on this id
    receive_window: int  # payload bytes the peer may still send us


class Connection:
    """One side of a protocol connection."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self.peer_role = Role.AGENT if role is Role.CLIENT else Role.CLIENT
        self.peer_hello: Hello | None = None
        self._sent_hello = False
        self._decoder = FrameDecoder()
        self._streams: dict[int, _StreamState] = {}
        self._closed_error: ProtocolError | None = None

    # ---- receiving -------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Feed received bytes; return the messages they complete, in order."""
        if self._closed_error is not None:
            raise self._closed_error
        try:
            messages = []
            for wire in self._decoder.feed(data):
                message = self._parse(wire)
                if message is not None:
                    self._on_receive(message)
                    messages.append(message)
            return messages
        except RemoteProtocolError as exc:
            self._closed_error = exc
            raise

    def _parse(self, wire: dict[str, Any]) -> Message | None:
        kind = wire.get("type")
        if not isinstance(kind, str):
            raise RemoteProtocolError("frame without a string 'type'")
        cls = MESSAGE_TYPES.get(kind)
        if cls is None:
            return None  # a newer minor version's frame type: ignored by design
        if cls not in _SENDS[self.peer_role]:
            raise RemoteProtocolError(f"a {self.peer_role.value} may not send {kind!r} frames")
        message: Message = cls.from_wire(wire)
        return message

    def _on_receive(self, message: Message) -> None:
        if self.peer_hello is None:
            if isinstance(message, Hello):
                self.peer_hello = message
                if self.role is Role.AGENT:
                    self._check_version(message)
                return
            if self.role is Role.CLIENT and isinstance(message, Error) and message.id is None:
                return  # the agent refused the handshake
            raise RemoteProtocolError(f"expected a hello frame first, got {message.TYPE!r}")
        if isinstance(message, Hello):
            raise RemoteProtocolError("second hello frame")
        if isinstance(message, Request):
            if message.id in self._streams:
                raise RemoteProtocolError(f"request id {message.id} is already in use")
            self._streams[message.id] = _StreamState(message.window, 0)
        elif isinstance(message, Data):
            state = self._streams.get(message.id)
            if state is None:
                return  # raced with the stream's end; the caller drops it
            if len(message.data) > state.receive_window:
                raise RemoteProtocolError(
                    f"id {message.id}: {len(message.data)} data bytes exceed the "
                    f"{state.receive_window} granted"
                )
            state.receive_window -= len(message.data)
        elif isinstance(message, Credit):
            state = self._streams.get(message.id)
            if state is not None:
                state.send_credit = min(state.send_credit + message.bytes, MAX_CREDIT)
        elif isinstance(message, (Result, Error)) and message.id is not None:
            self._streams.pop(message.id, None)

    def _check_version(self, hello: Hello) -> None:
        if hello.protocol[0] != PROTOCOL_VERSION[0]:
            raise RemoteProtocolError(
                f"protocol version {hello.protocol[0]}.{hello.protocol[1]} is not supported; "
                f"this agent speaks {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}",
                ErrorCode.VERSION_MISMATCH,
            )

    # ---- sending ---------------------------------------------------------------------

    def send(self, message: Message) -> bytes:
        """Check that ``message`` may be sent now and return its frame."""
        if type(message) not in _SENDS[self.role]:
            raise LocalProtocolError(f"a {self.role.value} may not send {message.TYPE!r} frames")
        # Encode before touching any state: a frame that cannot be sent must change nothing.
        frame = encode_frame(message.to_wire())
        self._record_sent(message)
        return frame

    def send_parts(self, message: Message) -> list[bytes | bytearray | memoryview]:
        """As ``send``, but a data frame's payload comes back as its own, uncopied part."""
        if not isinstance(message, Data):
            return [self.send(message)]
        if Data not in _SENDS[self.role]:
            raise LocalProtocolError(f"a {self.role.value} may not send 'data' frames")
        envelope, payload = encode_data_frame(message.id, message.stream, message.data)
        self._record_sent(message)
        return [envelope, payload]

    def _record_sent(self, message: Message) -> None:
        """Check ``message`` against the connection's state and update it."""
        if not self._sent_hello:
            refusing = isinstance(message, Error) and message.id is None
            if not isinstance(message, Hello) and not refusing:
                raise LocalProtocolError("the hello frame must be sent first")
            self._sent_hello = True
        elif isinstance(message, Hello):
            raise LocalProtocolError("hello already sent")
        if isinstance(message, Request):
            if message.id in self._streams:
                raise LocalProtocolError(f"request id {message.id} is already in use")
            self._streams[message.id] = _StreamState(0, message.window)
        elif isinstance(message, Data):
            state = self._streams.get(message.id)
            if state is None:
                raise LocalProtocolError(f"id {message.id} is not an open request")
            if len(message.data) > state.send_credit:
                raise LocalProtocolError(
                    f"id {message.id}: {len(message.data)} bytes exceed credit {state.send_credit}"
                )
            state.send_credit -= len(message.data)
        elif isinstance(message, Credit):
            state = self._streams.get(message.id)
            if state is not None:
                state.receive_window = min(state.receive_window + message.bytes, MAX_CREDIT)
        elif isinstance(message, (Result, Error)) and message.id is not None:
            self._streams.pop(message.id, None)

    # ---- state -----------------------------------------------------------------------

    def send_credit(self, request_id: int) -> int:
        """Payload bytes we may send on ``request_id`` now (0 if it is not open)."""
        state = self._streams.get(request_id)
        return state.send_credit if state is not None else 0

    def is_open(self, request_id: int) -> bool:
        """Whether ``request_id`` is a request that has not ended yet."""
        return request_id in self._streams

    @property
    def open_requests(self) -> int:
        return len(self._streams)
