"""The clients refuse an agent that speaks another major protocol version."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from guest_agent.client import Client
from guest_agent.protocol import FrameDecoder, Hello, VersionMismatch, encode_frame


async def test_client_refuses_other_major_version(nursery: trio.Nursery, short_tmp: Path) -> None:
    path = str(short_tmp / "fake.sock")
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(1)

    async def fake_agent() -> None:
        stream = trio.SocketStream((await sock.accept())[0])
        decoder = FrameDecoder()
        while not decoder.feed(await stream.receive_some(4096)):
            pass
        await stream.send_all(encode_frame(Hello(protocol=(2, 0), software="future").to_wire()))
        await trio.sleep_forever()

    nursery.start_soon(fake_agent)
    with pytest.raises(VersionMismatch, match=r"2\.0"):
        async with Client.connect(f"unix:{path}", timeout=10):
            pass
    sock.close()
