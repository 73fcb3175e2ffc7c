"""A raw protocol peer for tests: the sans-IO Connection over a real stream, no Client logic.

Unlike ``guest_agent.client.Client`` it never grants credit, never answers anything on its
own and can send arbitrary bytes, so tests can play a slow, broken or hostile client.
"""

from __future__ import annotations

import collections

import trio

from guest_agent.protocol import (
    Connection,
    Hello,
    Message,
    Request,
    Result,
    Role,
)
from guest_agent.transport import connect, parse_address

RECEIVE_SIZE = 64 << 10
# Only to turn a hang into a failure; never a timing assertion.
DEFAULT_TIMEOUT = 20.0


class RawClient:
    """One connection to an agent, driven frame by frame."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.conn = Connection(Role.CLIENT)
        self._pending: collections.deque[Message] = collections.deque()
        self._eof = False

    @classmethod
    async def open(cls, address: str) -> RawClient:
        """Connect to ``address`` (any dialable address string)."""
        return cls(await connect(parse_address(address)))

    async def send(self, message: Message) -> None:
        """Send one message through the client-side state machine."""
        await self.stream.send_all(self.conn.send(message))

    async def send_raw(self, data: bytes) -> None:
        """Send bytes as they are, bypassing the state machine."""
        await self.stream.send_all(data)

    async def hello(self, token: str | None = None) -> Hello:
        """Do the handshake; return the agent's hello."""
        await self.send(Hello(software="rawclient", token=token))
        reply = await self.receive()
        assert isinstance(reply, Hello), reply
        return reply

    async def _fill(self) -> bool:
        """Read once; False at end of stream (a reset counts as the end)."""
        if self._eof:
            return False
        try:
            data = await self.stream.receive_some(RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self._eof = True
            return False
        self._pending.extend(self.conn.receive_data(bytes(data)))
        return True

    async def receive(self, timeout: float = DEFAULT_TIMEOUT) -> Message:
        """The next message; EOFError if the agent closed the connection first."""
        with trio.fail_after(timeout):
            while not self._pending:
                if not await self._fill():
                    raise EOFError("the agent closed the connection")
        return self._pending.popleft()

    async def wait_closed(self, timeout: float = DEFAULT_TIMEOUT) -> list[Message]:
        """Read until the agent closes the connection; return the messages received."""
        with trio.fail_after(timeout):
            while await self._fill():
                pass
        messages = list(self._pending)
        self._pending.clear()
        return messages

    async def call(self, request_id: int, method: str, **params: object) -> Message:
        """Send a unary request and return its final frame (Result or Error)."""
        await self.send(Request(request_id, method, dict(params)))
        while True:
            message = await self.receive()
            if isinstance(message, Result) or getattr(message, "code", None) is not None:
                assert getattr(message, "id", None) == request_id, message
                return message

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)
