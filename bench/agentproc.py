"""The agent under test as a real subprocess, and a minimal raw-protocol client for it."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from guest_agent.protocol import Connection, Credit, Data, Error, Hello, Request, Result, Role

from .procs import (
    CGROUP2_MOUNT,
    Placement,
    Processes,
    remove_cgroup_tree,
    wait_for_path,
    wait_listening,
)

REPO = Path(__file__).resolve().parent.parent


def cgroup_root() -> Path:
    """The exec cgroup root of the agents this harness starts (removed after each)."""
    return CGROUP2_MOUNT / f"ga-bench-{os.getpid()}"


class AgentUnderTest:
    """``python -m guest_agent`` on a unix socket, with its own cgroup root."""

    def __init__(
        self,
        workdir: Path,
        procs: Processes,
        placement: Placement,
        name: str = "agent",
        python: str = sys.executable,
    ) -> None:
        self.workdir = workdir
        self.procs = procs
        self.placement = placement
        self.python = python
        self.socket_path = workdir / f"{name}.sock"
        self.log_path = workdir / f"{name}.log"
        self.cgroup = cgroup_root()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"unix:{self.socket_path}"

    def argv(self) -> list[str]:
        return [
            *self.placement.server_prefix(),
            self.python,
            "-m",
            "guest_agent",
            "--listen",
            self.address,
            "--cmdline-file",
            "",
            "--cgroup-root",
            str(self.cgroup),
        ]

    def start(self) -> float:
        """Start the process; returns time.perf_counter() at the moment of starting it."""
        self.socket_path.unlink(missing_ok=True)
        started = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = self.procs.start(self.argv(), log=log, cwd=str(REPO))
        return started

    def wait_socket(self, timeout: float = 30.0) -> None:
        """Until the agent accepts connections (the socket file exists before listen())."""
        assert self.proc is not None
        try:
            wait_for_path(self.socket_path, self.proc, timeout)
            wait_listening(self.socket_path, self.proc, timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; agent log:\n{self.log()}") from None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    @property
    def process(self) -> psutil.Process:
        assert self.proc is not None
        return psutil.Process(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc, grace=10.0)
            self.proc = None
        remove_cgroup_tree(self.cgroup)


class RawClient:
    """The least a client can do: blocking socket, sans-IO core, no tasks, no locks.

    Shows how much of a round trip is the trio Client's own overhead.
    """

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.conn = Connection(Role.CLIENT)
        self.ids = itertools.count(1)
        self.sock.sendall(self.conn.send(Hello(software="bench-raw")))
        while self.conn.peer_hello is None:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the agent closed the connection during the hello")
            self.conn.receive_data(data)

    def exec(self, argv: list[str]) -> int:
        """Run a command on the agent; its exit code (output is read and dropped)."""
        request_id = next(self.ids)
        request = Request(request_id, "exec.start", {"argv": argv}, 1 << 20)
        self.sock.sendall(self.conn.send(request))
        while True:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the agent closed the connection")
            for message in self.conn.receive_data(data):
                if isinstance(message, Data) and message.id == request_id:
                    self.sock.sendall(self.conn.send(Credit(request_id, len(message.data))))
                elif isinstance(message, Result) and message.id == request_id:
                    return int(message.result.get("exit_code", -1))
                elif isinstance(message, Error) and message.id == request_id:
                    raise RuntimeError(f"exec failed: {message.code} {message.message}")

    def close(self) -> None:
        self.sock.close()
