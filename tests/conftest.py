"""Shared fixtures: a real agent on a real unix socket, in-process or as a subprocess."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from guest_agent.config import config_from_settings
from guest_agent.server import serve

StartAgent = Callable[..., Awaitable[str]]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path (unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ga-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def start_agent(nursery: trio.Nursery, short_tmp: Path) -> AsyncIterator[StartAgent]:
    """Start an in-process agent with settings overrides; returns its address string."""
    counter = iter(range(1_000_000))

    async def start(**settings: Any) -> str:
        sock = short_tmp / f"agent{next(counter)}.sock"
        settings.setdefault("listen", [f"unix:{sock}"])
        config = config_from_settings(settings)
        await nursery.start(functools.partial(serve, config))
        return str(settings["listen"][0])

    yield start


@pytest.fixture
async def agent(start_agent: StartAgent) -> str:
    """The address of a default in-process agent."""
    return await start_agent()


class AgentProcess:
    """A real ``python -m guest_agent`` subprocess (for CLI, signal and crash tests)."""

    def __init__(self, address: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.address = address
        self.proc = proc
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def agent_process(short_tmp: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Factory for agent subprocesses; all are stopped (SIGTERM, then SIGKILL) at teardown."""
    started: list[AgentProcess] = []

    def start(*extra_args: str, env: dict[str, str] | None = None) -> AgentProcess:
        sock = short_tmp / f"proc{len(started)}.sock"
        log_path = short_tmp / f"proc{len(started)}.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "guest_agent",
                    "--listen",
                    f"unix:{sock}",
                    "--cmdline-file",
                    "",
                    *extra_args,
                ],
                stdout=log_file,
                stderr=log_file,
                env={**os.environ, **(env or {})},
            )
        handle = AgentProcess(f"unix:{sock}", proc, log_path)
        started.append(handle)
        deadline = time.monotonic() + 30
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent did not start: {handle.log()}")
            time.sleep(0.01)
        return handle

    yield start
    for handle in started:
        if handle.proc.poll() is None:
            handle.proc.send_signal(signal.SIGTERM)
            try:
                handle.proc.wait(10)
            except subprocess.TimeoutExpired:
                handle.proc.kill()
                handle.proc.wait()


def ctl_command(address: str, *args: str) -> list[str]:
    """The argv of guest-agent-ctl run with this venv's interpreter."""
    return [sys.executable, "-m", "guest_agent.ctl", "--connect", address, *args]


@pytest.fixture
def ctl() -> Callable[..., subprocess.CompletedProcess[bytes]]:
    """Run guest-agent-ctl as a real subprocess: ``ctl(address, "ping", input=b"")``."""

    def run(address: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(ctl_command(address, *args), check=False, **kwargs)

    return run


with contextlib.suppress(ImportError):
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "default", deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile("default")
