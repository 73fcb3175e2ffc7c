"""Generate the hex examples of docs/protocol.md with the real encoder and state machine.

Every frame is produced by ``guest_agent.protocol.Connection.send`` on the sending side and
fed to a second ``Connection`` of the other role, so an example that the protocol would
refuse cannot be generated. Field values (exec ids, pids, times) are fixed, so the output is
stable; they were taken from a real session.

    .venv/bin/python docs/examples.py                          # print every example block
    .venv/bin/python docs/examples.py --update docs/protocol.md  # rewrite the doc's blocks

``--update`` replaces, in order, each example (the line naming the frame and the ```hex
block after it) in the file; tests/unit/test_protocol_doc.py checks that they match.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guest_agent.protocol import (
    Cancel,
    Connection,
    Credit,
    Data,
    Eof,
    Error,
    ErrorCode,
    Event,
    Hello,
    Message,
    ProtocolError,
    Request,
    Result,
    Role,
)
from guest_agent.server import error_for_exception

AGENT_SOFTWARE = "guest-agent/0.1.0"
CLIENT_SOFTWARE = "example-client/1.0"
CAPABILITIES = ("exec", "file", "system")
ARROW = {Role.CLIENT: "client → agent", Role.AGENT: "agent → client"}

# The line naming a frame, then its hex block: what the test and --update look for.
EXAMPLE_RE = re.compile(
    r"^\*\*`(?P<type>[a-z_]+)`\*\* (?P<sender>client|agent) → (?:client|agent): "
    r"`(?P<decoded>[^`]*)`\n```hex\n(?P<hex>(?:[0-9a-f]{8}  [^\n]*\n)+)```$",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Example:
    """One frame as sent on the wire, and who sent it."""

    sender: Role
    message: Message
    frame: bytes

    def markdown(self) -> str:
        """The naming line and the hex block, as they appear in docs/protocol.md."""
        head = f"**`{self.message.TYPE}`** {ARROW[self.sender]}: `{render(self.message.to_wire())}`"
        return f"{head}\n```hex\n{hexdump(self.frame)}```"


def render(value: Any) -> str:
    """A one-line, JSON-like view of a decoded frame; bin values are shown as h'hex'."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{render(k)}: {render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render(v) for v in value) + "]"
    if isinstance(value, (bytes, bytearray)):
        return f"h'{bytes(value).hex()}'"
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def hexdump(frame: bytes) -> str:
    """``hexdump -C`` style: offset, 16 bytes in two groups of 8, printable ASCII."""
    lines = []
    for offset in range(0, len(frame), 16):
        row = frame[offset : offset + 16]
        left = " ".join(f"{b:02x}" for b in row[:8])
        right = " ".join(f"{b:02x}" for b in row[8:])
        text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in row)
        lines.append(f"{offset:08x}  {left:<23}  {right:<23}  |{text}|\n")
    return "".join(lines)


class Pair:
    """A client and an agent Connection wired together: every frame crosses both."""

    def __init__(self) -> None:
        self.ends = {Role.CLIENT: Connection(Role.CLIENT), Role.AGENT: Connection(Role.AGENT)}
        self.examples: list[Example] = []

    def send(self, sender: Role, message: Message) -> Example:
        frame = self.ends[sender].send(message)
        receiver = Role.AGENT if sender is Role.CLIENT else Role.CLIENT
        received = self.ends[receiver].receive_data(frame)
        assert received == [message], (received, message)
        example = Example(sender, message, frame)
        self.examples.append(example)
        return example

    def client(self, message: Message) -> Example:
        return self.send(Role.CLIENT, message)

    def agent(self, message: Message) -> Example:
        return self.send(Role.AGENT, message)

    def handshake(self, token: str | None = None) -> None:
        self.client(Hello(software=CLIENT_SOFTWARE, token=token))
        self.agent(Hello(software=AGENT_SOFTWARE, capabilities=CAPABILITIES))


def _end_status(exec_id: str, pid: int, out: int, duration: float) -> dict[str, Any]:
    return {
        "exec_id": exec_id,
        "pid": pid,
        "state": "exited",
        "exit_code": 0,
        "signal": None,
        "timed_out": False,
        "killed_by_agent": False,
        "kill_reason": None,
        "bytes": {"stdout": out, "stderr": 0},
        "duration": duration,
        "lost": {"stdout": 0, "stderr": 0},
        "offsets": {"stdout": out, "stderr": 0},
    }


def frame_types() -> list[Example]:
    """One example of each frame type (section 4 of the doc), cut from one consistent session."""
    s = Pair()
    s.handshake(token="s3cret")
    hello_client, hello_agent = s.examples
    request = s.client(Request(7, "exec.start", {"argv": ["cat"], "stdin": True}, 65536))
    exec_id, pid = "995bf0778fb8", 812
    body = {"exec_id": exec_id, "pid": pid, "cgroup": True, "limits": {}}
    event = s.agent(Event(7, "started", body))
    credit = s.agent(Credit(7, 262144))
    data_in = s.client(Data(7, "stdin", b"hi\n"))
    eof = s.client(Eof(7, "stdin"))
    data_out = s.agent(Data(7, "stdout", b"hi\n"))
    result = s.agent(Result(7, _end_status(exec_id, pid, 3, 0.009158)))
    s.client(Request(8, "file.stat", {"path": "/nonexistent"}))
    # The agent maps an OSError to os_error plus its errno name (server.error_for_exception).
    error = s.agent(
        error_for_exception(8, FileNotFoundError(2, "No such file or directory", "/nonexistent"))
    )
    s.client(Request(9, "exec.start", {"command": "sleep 60"}, 65536))
    cancel = s.client(Cancel(9))
    cancelled = s.agent(Error(9, ErrorCode.CANCELLED, "cancelled by the client"))
    return [
        hello_client,
        hello_agent,
        request,
        result,
        error,
        data_in,
        data_out,
        eof,
        event,
        credit,
        cancel,
        cancelled,
    ]


def refusals() -> list[Example]:
    """Handshakes the agent refuses: connection-level (id-less) error frames."""
    examples = []
    # A hello without the token the agent requires (server.Session._handshake).
    client, agent = Connection(Role.CLIENT), Connection(Role.AGENT)
    hello = Hello(software=CLIENT_SOFTWARE)
    examples.append(Example(Role.CLIENT, hello, frame := client.send(hello)))
    agent.receive_data(frame)
    refusal = Error(None, ErrorCode.AUTH_FAILED, "wrong or missing token")
    examples.append(Example(Role.AGENT, refusal, reply := agent.send(refusal)))
    assert client.receive_data(reply) == [refusal]
    # A hello of another major version: the agent's Connection refuses the frame itself.
    client, agent = Connection(Role.CLIENT), Connection(Role.AGENT)
    hello = Hello(protocol=(2, 0), software=CLIENT_SOFTWARE)
    examples.append(Example(Role.CLIENT, hello, frame := client.send(hello)))
    try:
        agent.receive_data(frame)
    except ProtocolError as exc:
        refusal = Error(None, exc.code, str(exc))  # as server.Session.run reports it
    assert refusal.code == ErrorCode.VERSION_MISMATCH
    examples.append(Example(Role.AGENT, refusal, reply := Connection(Role.AGENT).send(refusal)))
    assert client.receive_data(reply) == [refusal]
    return examples


def worked_session() -> list[Example]:
    """Section 11: a whole session, frame by frame."""
    s = Pair()
    s.handshake(token="s3cret")
    s.client(Request(1, "system.ping", {}))
    s.agent(Result(1, {}))
    # A command with stdin, both directions flow-controlled.
    s.client(Request(2, "exec.start", {"argv": ["cat"], "stdin": True}, 65536))
    exec_id, pid = "1ee155d52336", 6899
    s.agent(Event(2, "started", {"exec_id": exec_id, "pid": pid, "cgroup": True, "limits": {}}))
    s.agent(Credit(2, 262144))
    s.client(Data(2, "stdin", b"hello\n"))
    s.client(Eof(2, "stdin"))
    s.agent(Credit(2, 6))
    s.agent(Data(2, "stdout", b"hello\n"))
    s.client(Credit(2, 6))
    s.agent(Result(2, _end_status(exec_id, pid, 6, 0.011342)))
    # A file download, with an eof before the result.
    s.client(Request(3, "file.read", {"path": "/etc/hostname"}, 1 << 20))
    s.agent(Data(3, "file", b"vm\n"))
    s.agent(Eof(3, "file"))
    s.client(Credit(3, 3))
    s.agent(Result(3, {"size": 3, "bytes": 3}))
    # An unknown method: an error reply, the connection stays.
    s.client(Request(4, "network.status", {}))
    s.agent(Error(4, ErrorCode.UNKNOWN_METHOD, "unknown method 'network.status'"))
    return s.examples


def all_examples() -> list[Example]:
    """Every example of the doc, in the order it shows them."""
    return frame_types() + refusals() + worked_session()


def update(path: Path) -> None:
    """Rewrite the examples of ``path`` in order; their number must match."""
    text = path.read_text()
    found = list(EXAMPLE_RE.finditer(text))
    examples = all_examples()
    if len(found) != len(examples):
        sys.exit(f"{path}: {len(found)} examples in the file, {len(examples)} generated")
    blocks = iter(example.markdown() for example in examples)
    path.write_text(EXAMPLE_RE.sub(lambda _: next(blocks), text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", type=Path, metavar="FILE", help="rewrite FILE's examples")
    args = parser.parse_args()
    if args.update:
        update(args.update)
        return
    for example in all_examples():
        print(example.markdown(), end="\n\n")


if __name__ == "__main__":
    main()
