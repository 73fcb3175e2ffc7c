"""docs/protocol.md shows real frames: each hex example decodes, validates and re-encodes.

An example is a line naming the frame type, its sender and its decoded form, followed by a
```hex block in ``hexdump -C`` layout (see docs/examples.py, which generates them).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from guest_agent.protocol import Connection, FrameDecoder, Role, encode_frame
from guest_agent.protocol._connection import _SENDS
from guest_agent.protocol._messages import MESSAGE_TYPES

DOCS = Path(__file__).resolve().parents[2] / "docs"
DOC = (DOCS / "protocol.md").read_text()
ROLES = {"client": Role.CLIENT, "agent": Role.AGENT}
_HEX_LINE = re.compile(r"^(?P<offset>[0-9a-f]{8})  (?P<hex>[0-9a-f ]{48})  \|(?P<text>.*)\|$")


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("protocol_doc_examples", DOCS / "examples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


GENERATOR = _load_generator()
EXAMPLES = list(GENERATOR.EXAMPLE_RE.finditer(DOC))


def _frame(dump: str) -> bytes:
    """The bytes of a hexdump block, checking its offsets and ASCII column on the way."""
    frame = bytearray()
    for line in dump.splitlines():
        match = _HEX_LINE.match(line)
        assert match, f"not a hexdump line: {line!r}"
        assert int(match["offset"], 16) == len(frame), f"offset out of step: {line!r}"
        row = bytes.fromhex(match["hex"])
        text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in row)
        assert match["text"] == text, f"ASCII column does not match the bytes: {line!r}"
        frame += row
    return bytes(frame)


def _section(title: str) -> str:
    start = re.search(rf"^## \d+\. {re.escape(title)}$", DOC, re.MULTILINE)
    assert start, f"no section {title!r}"
    end = re.search(r"^## ", DOC[start.end() :], re.MULTILINE)
    return DOC[start.start() : start.end() + end.start() if end else len(DOC)]


def test_every_hex_block_is_a_named_example() -> None:
    assert EXAMPLES
    assert len(EXAMPLES) == DOC.count("```hex"), "a ```hex block without its naming line"


@pytest.mark.parametrize(
    "example", EXAMPLES, ids=lambda m: f"line{DOC.count(chr(10), 0, m.start()) + 1}"
)
def test_example_is_a_valid_frame(example: re.Match[str]) -> None:
    frame = _frame(example["hex"])
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4, "length prefix"
    decoder = FrameDecoder()
    [wire] = decoder.feed(frame)
    assert decoder.pending == 0
    assert wire["type"] == example["type"]
    cls = MESSAGE_TYPES[wire["type"]]
    assert cls in _SENDS[ROLES[example["sender"]]], "this role may not send this frame"
    message = cls.from_wire(wire)
    assert message.to_wire() == wire, "the example carries fields the message does not know"
    assert GENERATOR.render(wire) == example["decoded"], "the decoded form shown is wrong"
    assert encode_frame(wire) == frame, "not what our encoder produces for this map"


def test_worked_session_replays_through_both_state_machines() -> None:
    section = _section("A worked session")
    examples = list(GENERATOR.EXAMPLE_RE.finditer(section))
    assert len(examples) > 10
    ends = {Role.CLIENT: Connection(Role.CLIENT), Role.AGENT: Connection(Role.AGENT)}
    for example in examples:
        frame = _frame(example["hex"])
        sender = ROLES[example["sender"]]
        receiver = Role.AGENT if sender is Role.CLIENT else Role.CLIENT
        [message] = ends[receiver].receive_data(frame)
        assert ends[sender].send(message) == frame
    assert ends[Role.CLIENT].open_requests == 0 and ends[Role.AGENT].open_requests == 0


def test_doc_examples_are_the_generated_ones() -> None:
    generated = [example.markdown() for example in GENERATOR.all_examples()]
    assert [m.group(0) for m in EXAMPLES] == generated, (
        "docs/protocol.md is out of date: run .venv/bin/python docs/examples.py "
        "--update docs/protocol.md"
    )
