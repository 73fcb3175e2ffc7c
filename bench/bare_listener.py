"""The idle-RSS floor: a bare trio unix-socket listener with the agent's third-party imports.

``python -m bench.bare_listener SOCKET``: answers every line received with b"pong\\n".
"""

from __future__ import annotations

import socket
import sys

import msgpack  # noqa: F401  (imported only to weigh the same as the agent)
import trio


async def _answer(stream: trio.SocketStream) -> None:
    async with stream:
        while await stream.receive_some(4096):
            await stream.send_all(b"pong\n")


async def main(path: str) -> None:
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(128)
    await trio.serve_listeners(_answer, [trio.SocketListener(sock)])


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
