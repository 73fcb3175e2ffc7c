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
    payload = msgpack.packb(wire, use_bin_type=True)
    if len(payload) > MAX_FRAME_SIZE:
        raise LocalProtocolError(
            f"frame of {len(payload)} bytes exceeds {MAX_FRAME_SIZE}", ErrorCode.FRAME_TOO_LARGE
        )
    return len(payload).to_bytes(HEADER_SIZE, "big") + payload


def decode_payload(payload: bytes) -> dict[str, Any]:
    """Unpack one frame's payload with every msgpack limit bound to its actual size."""
    size = len(payload)
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

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add received bytes; return the maps of every frame now complete."""
        if self._error is not None:
            raise self._error
        self._buffer += data
        maps: list[dict[str, Any]] = []
        view = memoryview(self._buffer)
        offset = 0
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
                maps.append(decode_payload(bytes(view[offset + HEADER_SIZE : end])))
                offset = end
        except RemoteProtocolError as exc:
            self._error = exc
            raise
        finally:
            view.release()
        del self._buffer[:offset]
        assert len(self._buffer) <= _MAX_BUFFERED
        return maps

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buffer)
