"""A stand-in for the Firecracker / Cloud Hypervisor host-side vsock socket ("hybrid vsock").

The real muxer accepts on a unix socket, reads ``CONNECT PORT\\n``, answers ``OK N\\n`` and
then joins the connection to the guest's vsock port; when nothing listens on that port it
closes the connection without a reply. Here the "guest ports" are unix socket paths.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import trio

from guest_agent.protocol import HEADER_SIZE, Hello, encode_frame

_LINE_MAX = 64
OK_REPLY = b"OK 1073741824\n"


async def receive_exactly(stream: trio.abc.Stream, size: int) -> bytes:
    """Read exactly ``size`` bytes; EOFError if the stream ends first."""
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        if not chunk:
            raise EOFError(f"stream ended after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


async def receive_frame(stream: trio.abc.Stream) -> bytes:
    """Read one whole protocol frame (header included) without reading past it."""
    header = await receive_exactly(stream, HEADER_SIZE)
    return header + await receive_exactly(stream, int.from_bytes(header, "big"))


@dataclass
class HybridMuxer:
    """Serve hybrid-vsock handshakes on ``path``, forwarding ``ports`` to unix socket paths.

    ``reply`` replaces the OK line (to test garbage replies). With ``pipeline_hello`` the
    muxer does the protocol handshake with the agent itself and sends the agent's hello in
    the same write as the OK line, so a client that reads past the newline would lose it;
    it then drops the client's own hello and joins the two streams.
    """

    path: str
    ports: dict[int, str]
    reply: bytes | None = None
    pipeline_hello: bool = False
    # Every CONNECT line received, for assertions.
    requests: list[bytes] = field(default_factory=list)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept and serve connections until cancelled."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(self.path)
        sock.listen()
        async with trio.SocketListener(sock) as listener, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                nursery.start_soon(self._handle, await listener.accept())

    async def _handle(self, client: trio.SocketStream) -> None:
        async with client:
            line = bytearray()
            # Byte by byte, like the real muxer: it cannot know where the line ends.
            while not line.endswith(b"\n") and len(line) < _LINE_MAX:
                byte = await client.receive_some(1)
                if not byte:
                    return
                line += byte
            self.requests.append(bytes(line))
            if self.reply is not None:
                await client.send_all(self.reply)
                return
            verb, _, port = line.decode("ascii", "replace").strip().partition(" ")
            target = self.ports.get(int(port)) if verb == "CONNECT" and port.isdigit() else None
            if target is None:
                return  # nothing listens on that port: hang up without a reply
            async with await trio.open_unix_socket(target) as agent:
                if self.pipeline_hello:
                    await agent.send_all(encode_frame(Hello(software="muxer").to_wire()))
                    await client.send_all(OK_REPLY + await receive_frame(agent))
                    await receive_frame(client)  # the client's hello: the agent has had one
                else:
                    await client.send_all(OK_REPLY)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, client, agent, nursery.cancel_scope)
                    nursery.start_soon(self._pump, agent, client, nursery.cancel_scope)

    @staticmethod
    async def _pump(
        source: trio.abc.Stream, sink: trio.abc.Stream, scope: trio.CancelScope
    ) -> None:
        try:
            while data := await source.receive_some(64 << 10):
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            scope.cancel()  # either side gone: tear the whole connection down
