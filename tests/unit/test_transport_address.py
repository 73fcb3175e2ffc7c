"""Address strings: every accepted form, malformed ones, and listen-only / dial-only misuse."""

from __future__ import annotations

import pytest

from guest_agent import transport
from guest_agent.transport import (
    ADDRESS_FORMS,
    AddressError,
    HybridAddress,
    SerialAddress,
    TcpAddress,
    UnixAddress,
    VsockAddress,
    parse_address,
)

ACCEPTED = {
    "vsock:3:1024": VsockAddress(3, 1024),
    "vsock:any:1024": VsockAddress(None, 1024),
    "vsock:2:4294967295": VsockAddress(2, 4294967295),
    "vsock:4294967295:1": VsockAddress(4294967295, 1),
    "hybrid:/run/fc/v.sock:1024": HybridAddress("/run/fc/v.sock", 1024),
    "hybrid:relative.sock:52": HybridAddress("relative.sock", 52),
    "hybrid:/odd:dir/v.sock:7": HybridAddress("/odd:dir/v.sock", 7),
    "serial:/dev/vport0p1": SerialAddress("/dev/vport0p1", None),
    "serial:name=org.guest_agent.0": SerialAddress(None, "org.guest_agent.0"),
    "unix:/tmp/agent.sock": UnixAddress("/tmp/agent.sock"),
    "unix:relative/agent.sock": UnixAddress("relative/agent.sock"),
    "unix:/with:colon": UnixAddress("/with:colon"),
    "tcp:127.0.0.1:8080": TcpAddress("127.0.0.1", 8080),
    "tcp:localhost:65535": TcpAddress("localhost", 65535),
    "tcp:[::1]:1": TcpAddress("::1", 1),
}


@pytest.mark.parametrize(("text", "expected"), ACCEPTED.items(), ids=list(ACCEPTED))
def test_accepted_forms(text: str, expected: transport.Address) -> None:
    assert parse_address(text) == expected
    # str() gives an address string that parses back to the same address.
    assert parse_address(str(expected)) == expected


MALFORMED = [
    "",
    "unix",
    "unix:",
    "/tmp/agent.sock",
    "ftp:host:21",
    "VSOCK:3:1024",
    "vsock:",
    "vsock:3",
    "vsock:3:",
    "vsock:three:1024",
    "vsock:-1:1024",
    "vsock:4294967296:1024",
    "vsock:3:0",
    "vsock:3:-5",
    "vsock:3:4294967296",
    "vsock:3:10x",
    "vsock:3:\u00b2",  # a digit to str.isdigit(), not to int()
    "vsock:\u0663:1024",  # an Arabic-Indic digit three
    "hybrid:/run/v.sock",
    "hybrid::1024",
    "hybrid:/run/v.sock:port",
    "serial:",
    "serial:name=",
    "tcp:localhost",
    "tcp::8080",
    "tcp:localhost:0",
    "tcp:localhost:65536",
    "tcp:localhost:http",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_addresses_name_the_accepted_forms(text: str) -> None:
    with pytest.raises(AddressError) as info:
        parse_address(text)
    message = str(info.value)
    assert ADDRESS_FORMS in message
    assert repr(text) in message or text == ""
    assert "\n" not in message


def test_address_error_is_a_value_error() -> None:
    assert issubclass(AddressError, ValueError)


async def test_vsock_any_cannot_be_dialed() -> None:
    with pytest.raises(AddressError, match="listening"):
        await transport.connect(parse_address("vsock:any:1024"))


@pytest.mark.parametrize("text", ["serial:/dev/vport0p1", "serial:name=org.guest_agent.0"])
async def test_serial_is_listen_only(text: str) -> None:
    with pytest.raises(AddressError, match="listen-only"):
        await transport.connect(parse_address(text))


async def test_hybrid_is_dial_only() -> None:
    with pytest.raises(AddressError, match="dial-only"):
        await transport.open_listener(parse_address("hybrid:/run/v.sock:1024"))
