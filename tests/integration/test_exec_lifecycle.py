"""Stateful test of the exec stream lifecycle: attach, detach, cancel, disconnect and exit in
any order, through the blocking client against a real agent subprocess."""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

from guest_agent.client import ExecStream
from guest_agent.sync_client import SyncClient

from ..conftest import AgentProcess


@dataclass
class Stream:
    """An attached exec stream held open by one client."""

    client: SyncClient
    exec_id: str
    manager: Any
    stream: ExecStream
    received: bytearray = field(default_factory=bytearray)


@dataclass
class Model:
    """What the test knows of one exec."""

    exec_id: str
    stop_file: Path
    finished: bool = False


def _command(stop_file: Path) -> str:
    # Ticks until told to stop, then says bye and exits 3: output length varies, its shape not.
    return f"while [ ! -e {stop_file} ]; do echo tick; sleep 0.02; done; echo bye; exit 3"


def make_machine(
    address: str, workdir: Path, ran: collections.Counter[str]
) -> type[RuleBasedStateMachine]:
    counter = iter(range(1_000_000))

    class ExecLifecycle(RuleBasedStateMachine):
        streams = Bundle("streams")
        execs = Bundle("execs")

        def __init__(self) -> None:
            super().__init__()
            self.clients: list[SyncClient] = [SyncClient(address)]
            self.models: dict[str, Model] = {}
            self.open_streams: list[Stream] = []

        def _open(self, client: SyncClient, manager: Any) -> Stream:
            stream: ExecStream = client.run(manager.__aenter__)
            held = Stream(client, stream.exec_id, manager, stream)
            self.open_streams.append(held)
            return held

        def _close(self, held: Stream, *exc: Any) -> None:
            with contextlib.suppress(Exception):
                held.client.run(functools.partial(held.manager.__aexit__, *exc))
            if held in self.open_streams:
                self.open_streams.remove(held)

        @rule(target=streams, client_index=st.integers(0, 3))
        def start_attached(self, client_index: int) -> Stream:
            ran["start_attached"] += 1
            client = self.clients[client_index % len(self.clients)]
            stop = workdir / f"stop{next(counter)}"
            held = self._open(client, client.client.open_exec(command=_command(stop)))
            self.models[held.exec_id] = Model(held.exec_id, stop)
            return held

        @rule(target=execs)
        def start_detached(self) -> str:
            ran["start_detached"] += 1
            stop = workdir / f"stop{next(counter)}"
            exec_id = self.clients[0].start_detached(command=_command(stop))
            self.models[exec_id] = Model(exec_id, stop)
            return exec_id

        @rule(held=streams, frames=st.integers(1, 5))
        def read_some(self, held: Stream, frames: int) -> None:
            ran["read_some"] += 1
            if held not in self.open_streams or held.stream.call.done:
                return
            for _ in range(frames):
                item = held.client.run(held.stream.call.receive)
                data = getattr(item, "data", None)
                if data:
                    held.received += data
                if held.stream.call.done:
                    return

        @rule(held=consumes(streams))
        def detach(self, held: Stream) -> None:
            ran["detach"] += 1
            if held in self.open_streams and not held.stream.call.done:
                held.client.run(held.stream.detach)
            self._close(held, None, None, None)

        @rule(held=consumes(streams))
        def walk_away(self, held: Stream) -> None:
            """Leave the stream without detaching: the exec waits for a reattach."""
            ran["walk_away"] += 1
            self._close(held, None, None, None)

        @rule(target=streams, exec_id=execs)
        def attach(self, exec_id: str) -> Stream:
            ran["attach"] += 1
            client = self.clients[-1]
            return self._open(client, client.client.attach_exec(exec_id))

        @rule()
        def reconnect(self) -> None:
            """Drop a connection with whatever it had open; start a fresh one."""
            ran["reconnect"] += 1
            old = self.clients.pop(0)
            for held in [s for s in self.open_streams if s.client is old]:
                self.open_streams.remove(held)
            old.close()
            self.clients.append(SyncClient(address))

        @rule(exec_id=execs)
        def finish(self, exec_id: str) -> None:
            ran["finish"] += 1
            model = self.models[exec_id]
            model.stop_file.touch()
            model.finished = True

        @rule(held=streams)
        def finish_attached(self, held: Stream) -> None:
            ran["finish_attached"] += 1
            self.finish(held.exec_id)

        @invariant()
        def agent_answers_and_remembers(self) -> None:
            listed = {e["exec_id"] for e in self.clients[-1].exec_list()}
            assert set(self.models) <= listed

        def teardown(self) -> None:
            client = self.clients[-1]
            for model in self.models.values():
                model.stop_file.touch()
            for model in self.models.values():
                status = client.exec_wait(model.exec_id, timeout=30)
                assert status["state"] == "exited", status
                assert status["exit_code"] == 3 and not status["killed_by_agent"], status
                with client.open_call("exec.attach", {"exec_id": model.exec_id}) as call:
                    output = b"".join(getattr(item, "data", b"") for item in call)
                    assert call.result is not None
                assert output.endswith(b"bye\n")
                assert set(output[:-4].split()) <= {b"tick"}
            for held in list(self.open_streams):
                self._close(held, None, None, None)
            for c in self.clients:
                c.close()

    return ExecLifecycle


@pytest.mark.slow
def test_exec_stream_lifecycle(agent_process: Callable[..., AgentProcess], short_tmp: Path) -> None:
    agent = agent_process("--reattach-grace", "60")
    ran: collections.Counter[str] = collections.Counter()
    machine = make_machine(agent.address, short_tmp, ran)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=30,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert "Traceback" not in agent.log()
    assert sum(ran.values()) > 50 and len(ran) >= 6, ran  # the machine really explored
