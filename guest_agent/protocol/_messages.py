"""The messages of the protocol: frozen dataclasses with explicit wire conversion.

Every frame carries one msgpack map with a "type" key. Unknown keys are ignored so
that a minor protocol version can add fields; missing or mistyped required keys are
a RemoteProtocolError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._errors import RemoteProtocolError

PROTOCOL_VERSION = (1, 0)
# The largest msgpack payload of one frame, header excluded; fixed by the protocol.
MAX_FRAME_SIZE = 1 << 20
# The largest data chunk a sender puts in one frame (leaves room for the envelope).
MAX_CHUNK_SIZE = 512 << 10
MAX_ID = (1 << 63) - 1
# Credit and windows are byte counts; capped so a peer cannot overflow a Go int64.
MAX_CREDIT = (1 << 62) - 1
MAX_NAME_LEN = 256


def _get(wire: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = wire.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise RemoteProtocolError(f"{what} frame: {key!r} missing or of the wrong type")
    return value


def _opt(wire: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if wire.get(key) is None:
        return None
    return _get(wire, key, kind, what)


def _stream_id(wire: dict[str, Any], what: str) -> int:
    value = _get(wire, "id", int, what)
    if not 0 <= value <= MAX_ID:
        raise RemoteProtocolError(f"{what} frame: id {value} out of range 0..2**63-1")
    return int(value)


def _name(wire: dict[str, Any], key: str, what: str) -> str:
    value = _get(wire, key, str, what)
    if not 0 < len(value) <= MAX_NAME_LEN:
        raise RemoteProtocolError(f"{what} frame: {key!r} must be 1..{MAX_NAME_LEN} characters")
    return str(value)


def _byte_count(wire: dict[str, Any], key: str, what: str) -> int:
    value = _get(wire, key, int, what)
    if not 0 <= value <= MAX_CREDIT:
        raise RemoteProtocolError(f"{what} frame: {key!r} out of range 0..2**62-1")
    return int(value)


@dataclass(frozen=True, slots=True)
class Hello:
    """First frame each way: versions, capabilities and (client to agent) the token."""

    TYPE: ClassVar[str] = "hello"
    protocol: tuple[int, int] = PROTOCOL_VERSION
    software: str = ""
    capabilities: tuple[str, ...] = ()
    token: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "type": self.TYPE,
            "protocol": list(self.protocol),
            "software": self.software,
            "capabilities": list(self.capabilities),
        }
        if self.token is not None:
            wire["token"] = self.token
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Hello:
        version = _get(wire, "protocol", list, "hello")
        if len(version) != 2 or not all(type(part) is int for part in version):
            raise RemoteProtocolError("hello frame: 'protocol' must be [major, minor]")
        caps = _opt(wire, "capabilities", list, "hello") or []
        if not all(isinstance(cap, str) for cap in caps):
            raise RemoteProtocolError("hello frame: 'capabilities' must be strings")
        return cls(
            protocol=(version[0], version[1]),
            software=_opt(wire, "software", str, "hello") or "",
            capabilities=tuple(caps),
            token=_opt(wire, "token", str, "hello"),
        )


@dataclass(frozen=True, slots=True)
class Request:
    """Client to agent: call ``method``; ``window`` is the initial credit for agent data."""

    TYPE: ClassVar[str] = "request"
    id: int
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    window: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "method": self.method,
            "params": self.params,
            "window": self.window,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Request:
        params = _opt(wire, "params", dict, "request")
        # nil means absent here as everywhere (a Go client's nil pointer, say).
        window = _byte_count(wire, "window", "request") if wire.get("window") is not None else 0
        return cls(
            id=_stream_id(wire, "request"),
            method=_name(wire, "method", "request"),
            params=params if params is not None else {},
            window=window,
        )


@dataclass(frozen=True, slots=True)
class Result:
    """Agent to client: the request succeeded; ends the request's stream."""

    TYPE: ClassVar[str] = "result"
    id: int
    result: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "result": self.result}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Result:
        result = _opt(wire, "result", dict, "result")
        return cls(id=_stream_id(wire, "result"), result=result if result is not None else {})


@dataclass(frozen=True, slots=True)
class Error:
    """Agent to client: the request failed (ends its stream); ``id`` None: the connection."""

    TYPE: ClassVar[str] = "error"
    id: int | None
    code: str
    message: str
    errno: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "type": self.TYPE,
            "id": self.id,
            "code": self.code,
            "message": self.message,
        }
        if self.errno is not None:
            wire["errno"] = self.errno
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Error:
        return cls(
            id=_stream_id(wire, "error") if wire.get("id") is not None else None,
            code=_name(wire, "code", "error"),
            message=_opt(wire, "message", str, "error") or "",
            errno=_opt(wire, "errno", str, "error"),
        )


@dataclass(frozen=True, slots=True)
class Data:
    """Bytes of one named stream of a request (stdout, stderr, stdin, file, ...); uses credit."""

    TYPE: ClassVar[str] = "data"
    id: int
    stream: str
    data: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "stream": self.stream, "data": self.data}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Data:
        return cls(
            id=_stream_id(wire, "data"),
            stream=_name(wire, "stream", "data"),
            data=_get(wire, "data", bytes, "data"),
        )


@dataclass(frozen=True, slots=True)
class Eof:
    """The named stream of a request has no more data (e.g. stdin closed)."""

    TYPE: ClassVar[str] = "eof"
    id: int
    stream: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "stream": self.stream}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Eof:
        return cls(id=_stream_id(wire, "eof"), stream=_name(wire, "stream", "eof"))


@dataclass(frozen=True, slots=True)
class Event:
    """Agent to client: something happened on a stream (e.g. "started"); not flow-controlled."""

    TYPE: ClassVar[str] = "event"
    id: int
    event: str
    body: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "event": self.event, "body": self.body}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Event:
        body = _opt(wire, "body", dict, "event")
        return cls(
            id=_stream_id(wire, "event"),
            event=_name(wire, "event", "event"),
            body=body if body is not None else {},
        )


@dataclass(frozen=True, slots=True)
class Credit:
    """The receiver of a request's data allows ``bytes`` more payload bytes on it."""

    TYPE: ClassVar[str] = "credit"
    id: int
    bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "bytes": self.bytes}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Credit:
        return cls(id=_stream_id(wire, "credit"), bytes=_byte_count(wire, "bytes", "credit"))


@dataclass(frozen=True, slots=True)
class Cancel:
    """Client to agent: stop the request; the agent still answers with a final frame."""

    TYPE: ClassVar[str] = "cancel"
    id: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Cancel:
        return cls(id=_stream_id(wire, "cancel"))


Message = Hello | Request | Result | Error | Data | Eof | Event | Credit | Cancel

MESSAGE_TYPES: dict[str, Any] = {
    cls.TYPE: cls for cls in (Hello, Request, Result, Error, Data, Eof, Event, Credit, Cancel)
}
