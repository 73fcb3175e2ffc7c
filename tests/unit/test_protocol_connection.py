"""The connection state machine: handshake, versions, request ids, credit, message rules."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from guest_agent.protocol import (
    MAX_CHUNK_SIZE,
    PROTOCOL_VERSION,
    AgentError,
    AuthenticationFailed,
    Cancel,
    Connection,
    ConnectionRefusedByAgent,
    Credit,
    Data,
    Eof,
    Error,
    ErrorCode,
    Event,
    Hello,
    LocalProtocolError,
    Message,
    RemoteOSError,
    RemoteProtocolError,
    Request,
    Result,
    Role,
    UnknownMethod,
    VersionMismatch,
    encode_frame,
)


def raw(wire: dict[str, Any]) -> bytes:
    """A frame built by hand, bypassing every check of the sending side."""
    return encode_frame(wire)


def agent_after_hello() -> Connection:
    agent = Connection(Role.AGENT)
    assert agent.receive_data(raw(Hello().to_wire())) == [Hello()]
    agent.send(Hello(software="agent"))
    return agent


def pair() -> tuple[Connection, Connection]:
    """A client and an agent that have done the handshake with each other."""
    client, agent = Connection(Role.CLIENT), Connection(Role.AGENT)
    agent.receive_data(client.send(Hello(software="c")))
    client.receive_data(agent.send(Hello(software="a")))
    return client, agent


def relay(sender: Connection, receiver: Connection, message: Message) -> list[Message]:
    return receiver.receive_data(sender.send(message))


# ---- handshake ---------------------------------------------------------------------------


def test_handshake() -> None:
    client, agent = Connection(Role.CLIENT), Connection(Role.AGENT)
    assert relay(client, agent, Hello(software="c", token="t")) == [Hello(software="c", token="t")]
    assert agent.peer_hello == Hello(software="c", token="t")
    reply = Hello(software="a", capabilities=("system",))
    assert relay(agent, client, reply) == [reply]
    assert client.peer_hello == reply


@pytest.mark.parametrize(
    "first",
    [
        Request(1, "system.ping").to_wire(),
        Cancel(1).to_wire(),
        Credit(1, 10).to_wire(),
        Data(1, "stdin", b"x").to_wire(),
        Eof(1, "stdin").to_wire(),
    ],
    ids=lambda w: w["type"],
)
def test_frames_before_hello_rejected(first: dict[str, Any]) -> None:
    agent = Connection(Role.AGENT)
    with pytest.raises(RemoteProtocolError, match="hello"):
        agent.receive_data(raw(first))


def test_client_rejects_results_before_hello_but_accepts_a_refusal() -> None:
    with pytest.raises(RemoteProtocolError):
        Connection(Role.CLIENT).receive_data(raw(Result(1).to_wire()))
    refusal = Error(None, ErrorCode.AUTH_FAILED, "wrong or missing token")
    assert Connection(Role.CLIENT).receive_data(raw(refusal.to_wire())) == [refusal]


def test_second_hello_rejected() -> None:
    agent = agent_after_hello()
    with pytest.raises(RemoteProtocolError, match="second hello"):
        agent.receive_data(raw(Hello().to_wire()))


@pytest.mark.parametrize("version", [(PROTOCOL_VERSION[0] + 1, 0), (0, 9)])
def test_major_version_mismatch(version: tuple[int, int]) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        Connection(Role.AGENT).receive_data(raw(Hello(protocol=version).to_wire()))
    assert info.value.code == ErrorCode.VERSION_MISMATCH
    assert "not supported" in str(info.value)


def test_newer_minor_version_accepted() -> None:
    hello = Hello(protocol=(PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 7))
    assert Connection(Role.AGENT).receive_data(raw(hello.to_wire())) == [hello]


@pytest.mark.parametrize("protocol", [[1], [1, 0, 0], ["1", "0"], [1.0, 0], [True, 0], "1.0", None])
def test_malformed_hello_version_rejected(protocol: object) -> None:
    with pytest.raises(RemoteProtocolError):
        Connection(Role.AGENT).receive_data(raw({"type": "hello", "protocol": protocol}))


def test_sending_rules() -> None:
    client = Connection(Role.CLIENT)
    with pytest.raises(LocalProtocolError, match="hello"):
        client.send(Request(1, "system.ping"))
    client.send(Hello())
    with pytest.raises(LocalProtocolError, match="already sent"):
        client.send(Hello())
    with pytest.raises(LocalProtocolError, match="may not send"):
        client.send(Result(1))
    with pytest.raises(LocalProtocolError, match="may not send"):
        Connection(Role.AGENT).send(Request(1, "x"))
    # The agent may refuse a connection with an error before its own hello.
    Connection(Role.AGENT).send(Error(None, ErrorCode.PROTOCOL_ERROR, "no"))


# ---- message rules -----------------------------------------------------------------------


def test_unknown_frame_type_ignored() -> None:
    agent = agent_after_hello()
    assert agent.receive_data(raw({"type": "teleport", "id": 1, "where": "mars"})) == []
    assert agent.receive_data(raw(Request(1, "system.ping").to_wire())) == [
        Request(1, "system.ping")
    ]


def test_unknown_fields_ignored() -> None:
    agent = agent_after_hello()
    wire = {**Request(5, "m", {"a": 1}, 10).to_wire(), "priority": "high", "trace": [1, 2]}
    assert agent.receive_data(raw(wire)) == [Request(5, "m", {"a": 1}, 10)]
    hello = {**Hello().to_wire(), "compression": ["zstd"]}
    assert Connection(Role.AGENT).receive_data(raw(hello)) == [Hello()]


def test_optional_fields_default() -> None:
    agent = Connection(Role.AGENT)
    assert agent.receive_data(raw({"type": "hello", "protocol": [1, 0]})) == [Hello()]
    assert agent.receive_data(raw({"type": "request", "id": 1, "method": "m"})) == [
        Request(1, "m", {}, 0)
    ]


@pytest.mark.parametrize(
    "wire",
    [
        {"id": 1, "method": "m"},  # no type
        {"type": 7, "id": 1},  # type not a string
        {"type": "hello"},  # no protocol
        {"type": "request", "method": "m"},  # no id
        {"type": "request", "id": 1},  # no method
        {"type": "request", "id": 1, "method": ""},  # empty method
        {"type": "request", "id": 1, "method": "m" * 257},  # method too long
        {"type": "request", "id": -1, "method": "m"},  # negative id
        {"type": "request", "id": 1 << 63, "method": "m"},  # id beyond int64
        {"type": "request", "id": True, "method": "m"},  # a bool is not an id
        {"type": "request", "id": "1", "method": "m"},
        {"type": "request", "id": 1, "method": "m", "params": [1]},
        {"type": "request", "id": 1, "method": "m", "window": -1},
        {"type": "request", "id": 1, "method": "m", "window": 1 << 62},
        {"type": "cancel"},
        {"type": "credit", "id": 1},
        {"type": "credit", "id": 1, "bytes": 1.5},
        {"type": "data", "id": 1, "stream": "stdin"},
        {"type": "data", "id": 1, "stream": "stdin", "data": "text, not bin"},
        {"type": "data", "id": 1, "data": b"x"},
        {"type": "eof", "id": 1},
    ],
)
def test_missing_or_mistyped_fields_rejected(wire: dict[str, Any]) -> None:
    agent = agent_after_hello()
    with pytest.raises(RemoteProtocolError):
        agent.receive_data(raw(wire))


@pytest.mark.parametrize(
    "wire",
    [
        {"type": "result"},
        {"type": "error", "id": 1},  # no code
        {"type": "error", "id": 1, "code": "x", "message": 5},
        {"type": "event", "id": 1},
        {"type": "event", "id": 1, "event": "started", "body": []},
    ],
)
def test_client_rejects_malformed_agent_frames(wire: dict[str, Any]) -> None:
    client, _ = pair()
    with pytest.raises(RemoteProtocolError):
        client.receive_data(raw(wire))


@pytest.mark.parametrize(
    "wire",
    [Result(1).to_wire(), Event(1, "x").to_wire(), Hello().to_wire() | {"type": "hello"}],
    ids=["result", "event", "second_hello"],
)
def test_agent_rejects_agent_only_frames(wire: dict[str, Any]) -> None:
    agent = agent_after_hello()
    with pytest.raises(RemoteProtocolError):
        agent.receive_data(raw(wire))


def test_client_rejects_requests_and_cancels() -> None:
    for message in (Request(1, "m"), Cancel(1)):
        client, _ = pair()
        with pytest.raises(RemoteProtocolError, match="may not send"):
            client.receive_data(raw(message.to_wire()))


def test_a_received_error_poisons_the_connection() -> None:
    agent = Connection(Role.AGENT)
    with pytest.raises(RemoteProtocolError) as first:
        agent.receive_data(raw(Request(1, "m").to_wire()))
    with pytest.raises(RemoteProtocolError) as again:
        agent.receive_data(raw(Hello().to_wire()))
    assert again.value is first.value


def test_a_bad_frame_fails_the_whole_read() -> None:
    agent = agent_after_hello()
    data = raw(Request(1, "m").to_wire()) + raw({"type": "request"})
    with pytest.raises(RemoteProtocolError):
        agent.receive_data(data)


# ---- request ids -------------------------------------------------------------------------


def test_duplicate_request_id_rejected() -> None:
    agent = agent_after_hello()
    agent.receive_data(raw(Request(7, "m").to_wire()))
    with pytest.raises(RemoteProtocolError, match="already in use"):
        agent.receive_data(raw(Request(7, "m").to_wire()))


def test_duplicate_request_id_in_one_read_rejected() -> None:
    agent = agent_after_hello()
    with pytest.raises(RemoteProtocolError, match="already in use"):
        agent.receive_data(raw(Request(7, "m").to_wire()) * 2)


def test_request_id_reusable_after_its_final_frame() -> None:
    client, agent = pair()
    for final in (Result(3, {"ok": True}), Error(3, ErrorCode.NOT_FOUND, "gone")):
        relay(client, agent, Request(3, "m"))
        assert agent.is_open(3) and client.is_open(3)
        relay(agent, client, final)
        assert not agent.is_open(3) and not client.is_open(3)
    assert agent.open_requests == client.open_requests == 0


def test_client_refuses_to_reuse_an_open_id() -> None:
    client, _ = pair()
    client.send(Request(1, "m"))
    with pytest.raises(LocalProtocolError, match="already in use"):
        client.send(Request(1, "m"))


def test_frames_for_unknown_ids_are_tolerated() -> None:
    # A stream's end races with frames already in flight for it; they must not be fatal.
    client, agent = pair()
    assert relay(client, agent, Cancel(99)) == [Cancel(99)]
    assert relay(client, agent, Credit(99, 5)) == [Credit(99, 5)]
    assert agent.receive_data(raw(Data(99, "stdin", b"late").to_wire())) == [
        Data(99, "stdin", b"late")
    ]
    assert relay(agent, client, Result(99)) == [Result(99)]


# ---- credit ------------------------------------------------------------------------------


def test_agent_data_within_the_window() -> None:
    client, agent = pair()
    relay(client, agent, Request(1, "exec", window=10))
    assert agent.send_credit(1) == 10
    relay(agent, client, Data(1, "stdout", b"0123456789"))
    assert agent.send_credit(1) == 0
    with pytest.raises(LocalProtocolError, match="exceed credit"):
        agent.send(Data(1, "stdout", b"x"))
    relay(client, agent, Credit(1, 4))
    assert agent.send_credit(1) == 4
    relay(agent, client, Data(1, "stdout", b"abcd"))


def test_data_beyond_the_window_rejected_by_the_client() -> None:
    client, agent = pair()
    relay(client, agent, Request(1, "exec", window=4))
    with pytest.raises(RemoteProtocolError, match="exceed"):
        client.receive_data(raw(Data(1, "stdout", b"12345").to_wire()))


def test_data_beyond_the_window_rejected_by_the_agent() -> None:
    client, agent = pair()
    relay(client, agent, Request(1, "exec"))
    # The client may send nothing until the agent grants credit.
    with pytest.raises(RemoteProtocolError, match="exceed"):
        agent.receive_data(raw(Data(1, "stdin", b"x").to_wire()))

    client, agent = pair()
    relay(client, agent, Request(1, "exec"))
    relay(agent, client, Credit(1, 3))
    relay(client, agent, Data(1, "stdin", b"abc"))
    with pytest.raises(RemoteProtocolError, match="exceed"):
        agent.receive_data(raw(Data(1, "stdin", b"d").to_wire()))


def test_window_accumulates_over_several_frames() -> None:
    client, agent = pair()
    relay(client, agent, Request(1, "exec", window=6))
    client.receive_data(raw(Data(1, "stdout", b"abc").to_wire()))
    client.receive_data(raw(Data(1, "stderr", b"abc").to_wire()))
    with pytest.raises(RemoteProtocolError):
        client.receive_data(raw(Data(1, "stdout", b"!").to_wire()))


def test_empty_data_needs_no_credit() -> None:
    client, agent = pair()
    relay(client, agent, Request(1, "exec"))
    assert relay(agent, client, Data(1, "stdout", b"")) == [Data(1, "stdout", b"")]


def test_credit_is_capped() -> None:
    client, agent = pair()
    relay(client, agent, Request(1, "exec", window=(1 << 62) - 1))
    relay(client, agent, Credit(1, (1 << 62) - 1))
    assert agent.send_credit(1) == (1 << 62) - 1


def test_send_data_requires_an_open_request() -> None:
    _, agent = pair()
    with pytest.raises(LocalProtocolError, match="not an open request"):
        agent.send(Data(1, "stdout", b"x"))


def test_a_frame_that_cannot_be_encoded_changes_no_state() -> None:
    client, agent = pair()
    relay(client, agent, Request(1, "m", window=MAX_CHUNK_SIZE))
    with pytest.raises(LocalProtocolError):
        agent.send(Result(1, {"bad": {1, 2}}))
    assert agent.is_open(1)  # the request is still open: an error reply can follow
    relay(agent, client, Error(1, ErrorCode.INTERNAL, "internal error"))
    assert not agent.is_open(1)
    with pytest.raises(LocalProtocolError):
        client.send(Request(2, "m", {"bad": object()}))
    assert not client.is_open(2)


# ---- typed errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (ErrorCode.UNKNOWN_METHOD, UnknownMethod),
        (ErrorCode.VERSION_MISMATCH, VersionMismatch),
        (ErrorCode.AUTH_FAILED, AuthenticationFailed),
        (ErrorCode.PROTOCOL_ERROR, ConnectionRefusedByAgent),
        (ErrorCode.OS_ERROR, RemoteOSError),
        ("some_future_code", AgentError),
    ],
)
def test_error_codes_map_to_exceptions(code: str, cls: type[AgentError]) -> None:
    exc = AgentError.from_wire(code, "msg", "ENOENT" if cls is RemoteOSError else None)
    assert type(exc) is cls
    assert exc.code == code
    assert str(exc) == ("ENOENT: msg" if cls is RemoteOSError else "msg")


def test_wire_examples_are_plain_msgpack_maps() -> None:
    frame = encode_frame(Data(1, "stdout", b"\x00\xff").to_wire())
    assert msgpack.unpackb(frame[4:]) == {
        "type": "data",
        "id": 1,
        "stream": "stdout",
        "data": b"\x00\xff",
    }
