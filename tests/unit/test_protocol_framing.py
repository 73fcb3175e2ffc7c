"""Framing: length prefix, size limits, msgpack limits, and what a frame may contain."""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgpack
import pytest

from guest_agent.protocol import (
    HEADER_SIZE,
    MAX_FRAME_SIZE,
    FrameDecoder,
    LocalProtocolError,
    RemoteProtocolError,
    decode_payload,
    encode_frame,
)
from guest_agent.protocol._errors import ErrorCode
from guest_agent.protocol._framing import MAX_ELEMENTS, encode_data_frame

ALLOCATION_BUDGET = 1 << 20


@contextmanager
def peak_allocation() -> Iterator[Callable[[], int]]:
    """Measure the peak of Python allocations inside the block (read it after the block)."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield lambda: peak[0]
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER_SIZE, "big") + payload


def test_frame_layout() -> None:
    data = encode_frame({"type": "cancel", "id": 1})
    assert data == bytes.fromhex("00000011") + msgpack.packb({"type": "cancel", "id": 1})
    assert FrameDecoder().feed(data) == [{"type": "cancel", "id": 1}]


def test_4gib_length_header_refused_at_once_without_allocating() -> None:
    decoder = FrameDecoder()
    with peak_allocation() as peak, pytest.raises(RemoteProtocolError) as info:
        decoder.feed(b"\xff\xff\xff\xff")  # no payload byte has arrived yet
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    assert peak() < ALLOCATION_BUDGET


def test_length_header_byte_by_byte_refused_on_its_last_byte() -> None:
    decoder = FrameDecoder()
    for _ in range(HEADER_SIZE - 1):
        assert decoder.feed(b"\xff") == []
    with pytest.raises(RemoteProtocolError) as info:
        decoder.feed(b"\xff")
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


def test_frame_size_limit_is_exact() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(MAX_FRAME_SIZE.to_bytes(HEADER_SIZE, "big")) == []
    assert decoder.pending == HEADER_SIZE
    with pytest.raises(RemoteProtocolError) as info:
        FrameDecoder().feed((MAX_FRAME_SIZE + 1).to_bytes(HEADER_SIZE, "big"))
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


def test_largest_frame_decodes() -> None:
    envelope = len(msgpack.packb({"type": "data", "data": b""}))
    # bin 32 header is 5 bytes, bin 8's is 2: grow the bin until the payload is exactly the max.
    wire = {"type": "data", "data": b"x" * (MAX_FRAME_SIZE - envelope - 3)}
    data = encode_frame(wire)
    assert len(data) == HEADER_SIZE + MAX_FRAME_SIZE
    assert FrameDecoder().feed(data) == [wire]


def test_oversize_frame_refused_when_sending() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame({"type": "data", "data": b"x" * MAX_FRAME_SIZE})
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


@pytest.mark.parametrize(
    "value", [{1, 2}, 1 << 64, object()], ids=["set", "int_over_64_bits", "object"]
)
def test_unencodable_frame_is_a_local_protocol_error(value: object) -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame({"type": "result", "id": 1, "result": {"x": value}})


# Headers that claim 2**32-1 elements or bytes, followed by almost nothing.
BOMBS = {
    "array32": b"\xdd\xff\xff\xff\xff",
    "map32": b"\xdf\xff\xff\xff\xff",
    "bin32": b"\xc6\xff\xff\xff\xff",
    "str32": b"\xdb\xff\xff\xff\xff",
    "array_in_map": b"\x81\xa4type\xdd\xff\xff\xff\xff",
    "map_in_array": b"\x91\xdf\xff\xff\xff\xff",
    "nested_arrays": b"\xdd\xff\xff\xff\xff" * 100,
}


@pytest.mark.parametrize("payload", BOMBS.values(), ids=BOMBS.keys())
def test_msgpack_bomb_refused_without_allocating(payload: bytes) -> None:
    with peak_allocation() as peak, pytest.raises(RemoteProtocolError):
        FrameDecoder().feed(frame(payload))
    assert peak() < ALLOCATION_BUDGET


def test_nested_array_bomb_stays_small() -> None:
    # 1000 nested arrays, each claiming 10000 elements: each claim alone fits the payload.
    payload = (b"\xdc" + (10000).to_bytes(2, "big")) * 1000
    payload += b"\xc0" * (10000 - len(payload))
    with peak_allocation() as peak, pytest.raises(RemoteProtocolError):
        FrameDecoder().feed(frame(payload))
    assert peak() < ALLOCATION_BUDGET


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb({"type": "x", "v": msgpack.ExtType(5, b"abc")}),
        b"\x81\xa4type\xd4\x05\x00",  # fixext 1
        b"\x81\xa4type\xc7\x00\x05",  # ext 8 of length 0: passes max_ext_len=0 on its own
        b"\x81\xa4type\xd6\xff\x00\x00\x00\x00",  # the timestamp extension
    ],
    ids=["ext_packed", "fixext1", "ext8_empty", "timestamp"],
)
def test_ext_types_rejected(payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_payload(payload)


@pytest.mark.parametrize(
    "value", [[1, 2], "hello", 7, None, b"bin", 1.5, True], ids=lambda v: type(v).__name__
)
def test_non_map_top_level_rejected(value: object) -> None:
    with pytest.raises(RemoteProtocolError, match="not a map"):
        FrameDecoder().feed(encode_frame_any(value))


def encode_frame_any(value: object) -> bytes:
    return frame(msgpack.packb(value, use_bin_type=True))


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x81", b"\xc1", b"\x81\xa4type", b"\x81\x01\x02", b"\x81\xc0\x01", b"\x80\x80"],
    ids=["empty", "truncated_map", "reserved_byte", "missing_value", "int_key", "nil_key", "two"],
)
def test_malformed_payload_rejected(payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        FrameDecoder().feed(frame(payload))


def test_invalid_utf8_rejected() -> None:
    with pytest.raises(RemoteProtocolError):
        decode_payload(b"\x81\xa4type\xa2\xff\xfe")


def test_decoder_stays_poisoned() -> None:
    decoder = FrameDecoder()
    with pytest.raises(RemoteProtocolError) as first:
        decoder.feed(frame(b"\xc1"))
    good = encode_frame({"type": "cancel", "id": 1})
    for _ in range(2):
        with pytest.raises(RemoteProtocolError) as again:
            decoder.feed(good)
        assert again.value is first.value


def test_frames_after_an_incomplete_one_wait_for_it() -> None:
    one, two = encode_frame({"n": 1}), encode_frame({"n": 2})
    decoder = FrameDecoder()
    assert decoder.feed(one + two[:3]) == [{"n": 1}]
    assert decoder.pending == 3
    assert decoder.feed(two[3:]) == [{"n": 2}]
    assert decoder.pending == 0


def test_too_many_elements_refused_before_decoding() -> None:
    count = MAX_ELEMENTS + 1
    payload = b"\x81\xa1a\xdd" + count.to_bytes(4, "big") + b"\x00" * count
    with pytest.raises(RemoteProtocolError, match="claim"):
        decode_payload(payload)
    fine = b"\x81\xa1a\xdd" + (1000).to_bytes(4, "big") + b"\x00" * 1000
    assert decode_payload(fine) == {"a": [0] * 1000}


@pytest.mark.parametrize("size", [0, 1, 255, 256, 65535, 65536, 256 << 10])
def test_data_frame_parts_are_the_same_bytes(size: int) -> None:
    data = os.urandom(size)
    envelope, payload = encode_data_frame(3, "stdout", data)
    assert payload is data  # the payload is not copied
    assert envelope + payload == encode_frame(
        {"type": "data", "id": 3, "stream": "stdout", "data": data}
    )


@pytest.mark.parametrize("wire", [{"a": {b"k": 1}}, {"type": "x", 1: 2}])
def test_map_keys_must_be_strings(wire: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(RemoteProtocolError, match="keys must be strings"):
        decode_payload(msgpack.packb(wire))
