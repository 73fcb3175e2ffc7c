"""Property tests of the sans-IO protocol: round trips, arbitrary splits, and garbage."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import msgpack
from hypothesis import example, given
from hypothesis import strategies as st

from guest_agent.protocol import (
    HEADER_SIZE,
    MAX_FRAME_SIZE,
    PROTOCOL_VERSION,
    Cancel,
    Connection,
    Credit,
    Data,
    Eof,
    Error,
    Event,
    FrameDecoder,
    Hello,
    Message,
    ProtocolError,
    RemoteProtocolError,
    Request,
    Result,
    Role,
    decode_payload,
    encode_frame,
)
from guest_agent.protocol._messages import MAX_CREDIT, MAX_ID, MAX_NAME_LEN, MESSAGE_TYPES

# ---- strategies --------------------------------------------------------------------------

ids = st.integers(0, MAX_ID)
names = st.text(min_size=1, max_size=MAX_NAME_LEN)
byte_counts = st.integers(0, MAX_CREDIT)
# Anything msgpack carries and gives back equal (lists, not tuples; no NaN).
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
maps = st.dictionaries(st.text(max_size=10), values, max_size=5)

hellos = st.builds(
    Hello,
    protocol=st.tuples(st.integers(0, 1000), st.integers(0, 1000)),
    software=st.text(max_size=30),
    capabilities=st.lists(st.text(max_size=10), max_size=5).map(tuple),
    token=st.none() | st.text(max_size=40),
)
requests = st.builds(Request, id=ids, method=names, params=maps, window=byte_counts)
results = st.builds(Result, id=ids, result=maps)
errors = st.builds(
    Error,
    id=st.none() | ids,
    code=names,
    message=st.text(max_size=50),
    errno=st.none() | st.sampled_from(["ENOENT", "EACCES", "EIO"]),
)
datas = st.builds(Data, id=ids, stream=names, data=st.binary(max_size=300))
eofs = st.builds(Eof, id=ids, stream=names)
events = st.builds(Event, id=ids, event=names, body=maps)
credits = st.builds(Credit, id=ids, bytes=byte_counts)
cancels = st.builds(Cancel, id=ids)
messages = st.one_of(hellos, requests, results, errors, datas, eofs, events, credits, cancels)


def parse(wire: dict[str, Any]) -> Message:
    message: Message = MESSAGE_TYPES[wire["type"]].from_wire(wire)
    return message


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


# ---- round trips -------------------------------------------------------------------------


def test_every_message_type_is_covered() -> None:
    assert set(MESSAGE_TYPES) == {
        "hello", "request", "result", "error", "data", "eof", "event", "credit", "cancel",
    }  # fmt: skip


@given(messages)
def test_message_round_trip(message: Message) -> None:
    data = encode_frame(message.to_wire())
    assert int.from_bytes(data[:HEADER_SIZE], "big") == len(data) - HEADER_SIZE
    assert parse(decode_payload(data[HEADER_SIZE:])) == message


@given(st.lists(messages, max_size=8), st.lists(st.integers(0, 1 << 16), max_size=12))
def test_stream_split_anywhere_gives_the_same_messages(
    batch: list[Message], cuts: list[int]
) -> None:
    stream = b"".join(encode_frame(m.to_wire()) for m in batch)
    decoder = FrameDecoder()
    received = [parse(w) for piece in split(stream, cuts) for w in decoder.feed(piece)]
    assert received == batch
    assert decoder.pending == 0


@given(st.lists(messages, min_size=1, max_size=4))
def test_stream_split_at_every_byte_boundary(batch: list[Message]) -> None:
    stream = b"".join(encode_frame(m.to_wire()) for m in batch)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        maps = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert [parse(w) for w in maps] == batch
    decoder = FrameDecoder()
    assert [parse(w) for byte in stream for w in decoder.feed(bytes([byte]))] == batch


def conversation(draw: Callable[[st.SearchStrategy[Any]], Any]) -> list[tuple[Role, Message]]:
    """A valid exchange, in order: (the sender's role, the message)."""
    steps: list[tuple[Role, Message]] = [
        (Role.CLIENT, Hello(PROTOCOL_VERSION, draw(st.text(max_size=10)), token=draw(names))),
        (Role.AGENT, Hello(software="agent", capabilities=("system",))),
    ]
    for request_id in range(draw(st.integers(0, 4))):
        window = draw(st.integers(0, 500))
        chunk = draw(st.binary(max_size=window))
        final: Message = draw(st.sampled_from([Result(request_id), Error(request_id, "x", "y")]))
        steps += [
            (Role.CLIENT, Request(request_id, draw(names), draw(maps), window)),
            (Role.AGENT, Event(request_id, "started", draw(maps))),
            (Role.AGENT, Data(request_id, "stdout", chunk)),
            (Role.CLIENT, Credit(request_id, len(chunk))),
            (Role.AGENT, Credit(request_id, 10)),
            (Role.CLIENT, Data(request_id, "stdin", draw(st.binary(max_size=10)))),
            (Role.CLIENT, Eof(request_id, "stdin")),
            (Role.AGENT, final),
        ]
    return steps


@given(st.data(), st.lists(st.integers(0, 1 << 16), max_size=20))
def test_connection_split_anywhere_gives_the_same_messages(
    data: st.DataObject, cuts: list[int]
) -> None:
    steps = conversation(data.draw)
    sides = {Role.CLIENT: Connection(Role.CLIENT), Role.AGENT: Connection(Role.AGENT)}
    received: list[tuple[Role, Message]] = []
    for sender, message in steps:
        receiver = sides[Role.AGENT if sender is Role.CLIENT else Role.CLIENT]
        for piece in split(sides[sender].send(message), cuts):
            received += [(sender, m) for m in receiver.receive_data(piece)]
    assert received == steps
    assert sides[Role.AGENT].open_requests == sides[Role.CLIENT].open_requests == 0


# ---- garbage -----------------------------------------------------------------------------

FIELD_NAMES = [
    "type", "id", "method", "params", "window", "protocol", "token", "code", "message",
    "errno", "stream", "data", "event", "body", "bytes", "result", "capabilities",
]  # fmt: skip
framed_garbage = st.binary(max_size=200).map(
    lambda payload: len(payload).to_bytes(HEADER_SIZE, "big") + payload
)
random_maps = st.dictionaries(
    st.sampled_from(FIELD_NAMES),
    values,
    max_size=8,
)
typed_maps = st.tuples(st.sampled_from([*MESSAGE_TYPES, "unknown"]), random_maps).map(
    lambda pair: {**pair[1], "type": pair[0]}
)
msgpack_garbage = (random_maps | typed_maps | values).map(
    lambda value: encode_frame(value) if isinstance(value, dict) else _frame_any(value)
)


def _frame_any(value: Any) -> bytes:
    payload = msgpack.packb(value, use_bin_type=True)
    return len(payload).to_bytes(HEADER_SIZE, "big") + payload


garbage = st.binary(max_size=400) | framed_garbage | msgpack_garbage
streams = st.lists(garbage, min_size=1, max_size=6).map(b"".join)
HELLO_FRAME = encode_frame(Hello().to_wire())
AGENT_HELLO_FRAME = encode_frame(Hello(software="a").to_wire())


def feed_until_error(feed: Any, data: bytes, cuts: list[int]) -> ProtocolError | None:
    """Feed pieces; only the protocol's own error may come out."""
    for piece in split(data, cuts):
        try:
            feed(piece)
        except ProtocolError as exc:
            return exc
    return None


@given(streams, st.lists(st.integers(0, 1 << 12), max_size=6))
@example(b"\xff\xff\xff\xff", [])
@example(b"\x00\x00\x00\x01\xc1", [])
@example(b"\x00\x00\x00\x05\xdd\xff\xff\xff\xff", [])
def test_decoder_garbage_raises_only_protocol_errors(data: bytes, cuts: list[int]) -> None:
    decoder = FrameDecoder()
    error = feed_until_error(decoder.feed, data, cuts)
    if error is not None:
        assert isinstance(error, RemoteProtocolError)
        # Poisoned for good: even a valid frame is refused with the same error.
        for _ in range(2):
            try:
                decoder.feed(HELLO_FRAME)
            except RemoteProtocolError as again:
                assert again is error
            else:
                raise AssertionError("the decoder accepted data after an error")
    else:
        assert decoder.pending <= HEADER_SIZE + MAX_FRAME_SIZE


@given(
    st.sampled_from(list(Role)),
    st.booleans(),
    streams,
    st.lists(st.integers(0, 1 << 12), max_size=6),
)
def test_connection_garbage_raises_only_protocol_errors(
    role: Role, after_hello: bool, data: bytes, cuts: list[int]
) -> None:
    conn = Connection(role)
    if after_hello:
        # Past the handshake, so that garbage reaches the per-message rules too.
        conn.send(Hello())
        conn.receive_data(HELLO_FRAME if role is Role.AGENT else AGENT_HELLO_FRAME)
    error = feed_until_error(conn.receive_data, data, cuts)
    if error is not None:
        assert isinstance(error, RemoteProtocolError)
        try:
            conn.receive_data(b"")
        except RemoteProtocolError as again:
            assert again is error
        else:
            raise AssertionError("the connection accepted data after an error")
