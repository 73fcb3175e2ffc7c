"""Length-prefixed msgpack frames: a 4-byte big-endian length, then one msgpack map."""

from __future__ import annotations

from typing import Any

import msgpack

from ._errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from ._messages import MAX_FRAME_SIZE

HEADER_SIZE = 4
# Refuse to buffer more than one frame's worth of an incomplete frame.
_MAX_BUFFERED = HEADER_SIZE + MAX_FRAME_SIZE


def encode_frame(wire: dict[str, Any]) -> bytes:
    """Pack one map into a frame."""
    try:
        payload = msgpack.packb(wire, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. a set, or an int over 2**64
        raise LocalProtocolError(f"unencodable frame: {type(exc).__name__}: {exc}") from None
    if len(payload) > MAX_FRAME_SIZE:
        raise LocalProtocolError(
            f"frame of {len(payload)} bytes exceeds {MAX_FRAME_SIZE}", ErrorCode.FRAME_TOO_LARGE
        )
    return len(payload).to_bytes(HEADER_SIZE, "big") + payload


def _bin_header(size: int) -> bytes:
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def encode_data_frame(
    request_id: int, stream: str, data: bytes | bytearray | memoryview
) -> tuple[bytes, bytes | bytearray | memoryview]:
    """A data frame as (envelope, payload), the same bytes encode_frame would make.

    Sent with one gathered write, the payload is never copied in user space: bulk output
    and file transfers move through the agent at the cost of the kernel's copies only.
    """
    head = bytearray(msgpack.packb({"type": "data", "id": request_id, "stream": stream}))
    head[0] = 0x84  # the map has a fourth entry: "data"
    head += b"\xa4data" + _bin_header(len(data))
    size = len(head) + len(data)
    if size > MAX_FRAME_SIZE:
        raise LocalProtocolError(
            f"frame of {size} bytes exceeds {MAX_FRAME_SIZE}", ErrorCode.FRAME_TOO_LARGE
        )
    return size.to_bytes(HEADER_SIZE, "big") + head, data


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"ext type {code} is not allowed")


# Deeper than any message of ours; msgpack itself would go to 1024.
MAX_DEPTH = 32
# More elements than any message of ours (a full file.list result has about 150k); it also
# bounds the pre-scan's time: a frame of a million one-byte objects is refused after this.
MAX_ELEMENTS = 1 << 18
# Bytes after the header byte that each fixed-size type occupies.
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
# Width of the length field of str, bin and container types.
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def check_structure(payload: bytes | memoryview) -> None:
    """Walk the msgpack headers, refusing what would make the decoder over-allocate.

    msgpack preallocates a list for every array header before reading its elements, so
    nested headers each claiming many elements cost far more memory than the frame's bytes.
    Every element takes at least one byte, so in an honest frame all containers together
    claim at most as many elements as there are bytes; deeper nesting than MAX_DEPTH is
    refused too. Map keys must be strings (msgpack's strict_map_key also lets bin through).
    Strings and bin payloads are skipped by their length, so this is cheap.
    """
    size = len(payload)
    position = 0
    claimed = 0
    limit = min(size, MAX_ELEMENTS)
    pending = [1]  # objects still to read at each open nesting level
    in_map = [False]  # whether that level is a map (its keys come at even counts)
    while pending:
        if pending[-1] == 0:
            pending.pop()
            in_map.pop()
            continue
        is_key = in_map[-1] and pending[-1] % 2 == 0
        pending[-1] -= 1
        if position >= size:
            raise RemoteProtocolError("truncated msgpack in frame")
        byte = payload[position]
        position += 1
        if is_key and not (0xA0 <= byte <= 0xBF or 0xD9 <= byte <= 0xDB):
            raise RemoteProtocolError("msgpack map keys must be strings")
        count = 0
        if byte <= 0x7F or byte >= 0xE0 or byte in (0xC0, 0xC2, 0xC3):
            continue
        if byte <= 0x8F:
            count = 2 * (byte & 0x0F)
        elif byte <= 0x9F:
            count = byte & 0x0F
        elif byte <= 0xBF:
            position += byte & 0x1F
        elif byte in _FIXED:
            position += _FIXED[byte]
        elif byte in _SIZED:
            width = _SIZED[byte]
            position += width + int.from_bytes(payload[position : position + width], "big")
        elif byte in _CONTAINERS:
            width, per_element = _CONTAINERS[byte]
            count = per_element * int.from_bytes(payload[position : position + width], "big")
            position += width
        else:
            raise RemoteProtocolError(f"msgpack type byte {byte:#x} is not allowed (ext types)")
        if count:
            claimed += count
            if claimed > limit:
                raise RemoteProtocolError(
                    f"msgpack containers claim {claimed} elements in a {size}-byte frame"
                    f" (at most {limit})"
                )
            pending.append(count)
            in_map.append(0x80 <= byte <= 0x8F or byte in (0xDE, 0xDF))
            if len(pending) > MAX_DEPTH:
                raise RemoteProtocolError(f"msgpack nesting deeper than {MAX_DEPTH}")


def decode_payload(payload: bytes | memoryview) -> dict[str, Any]:
    """Unpack one frame's payload with every msgpack limit bound to its actual size."""
    size = len(payload)
    check_structure(payload)
    try:
        # No container can hold more elements than there are bytes left, so bounding the
        # lengths by the payload size refuses a huge array header before it allocates.
        wire = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=size,
            max_str_len=size,
            max_array_len=size,
            max_map_len=size // 2,
            max_ext_len=0,
            # max_ext_len=0 still lets a zero-length ext through as an ExtType.
            ext_hook=_refuse_ext,
        )
    except Exception as exc:  # msgpack raises many kinds; all mean the same to us
        raise RemoteProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(wire, dict):
        raise RemoteProtocolError(f"frame is a msgpack {type(wire).__name__}, not a map")
    return wire


class FrameDecoder:
    """Splits a byte stream into frame payloads; an error poisons it for good."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._error: RemoteProtocolError | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> list[dict[str, Any]]:
        """Add received bytes; return the maps of every frame now complete."""
        if self._error is not None:
            raise self._error
        # Frames wholly inside ``data`` are decoded from it in place; only an incomplete
        # frame's bytes are copied into the buffer.
        if self._buffer:
            self._buffer += data
            source: bytes | bytearray | memoryview = self._buffer
        else:
            source = data
        maps: list[dict[str, Any]] = []
        offset = 0
        view = memoryview(source)
        try:
            while len(view) - offset >= HEADER_SIZE:
                size = int.from_bytes(view[offset : offset + HEADER_SIZE], "big")
                if size > MAX_FRAME_SIZE:
                    raise RemoteProtocolError(
                        f"frame length {size} exceeds the maximum {MAX_FRAME_SIZE}",
                        ErrorCode.FRAME_TOO_LARGE,
                    )
                end = offset + HEADER_SIZE + size
                if len(view) < end:
                    break
                with view[offset + HEADER_SIZE : end] as payload:
                    maps.append(decode_payload(payload))
                offset = end
            if source is not self._buffer:
                self._buffer += view[offset:]
        except RemoteProtocolError as exc:
            self._error = exc
            raise
        finally:
            view.release()
        if source is self._buffer:
            del self._buffer[:offset]
        assert len(self._buffer) <= _MAX_BUFFERED
        return maps

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buffer)
