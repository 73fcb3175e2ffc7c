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
from guest_agent.process.cgroup import find_cgroup2_mount
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


CGROUP2 = find_cgroup2_mount()


@pytest.fixture
def cgroup_root() -> Iterator[str | None]:
    """A per-test cgroup directory for exec cgroups (None without cgroup2); removed after."""
    if CGROUP2 is None:
        yield None
        return
    path = os.path.join(CGROUP2, f"ga-test-{os.getpid()}-{next(_cgroup_numbers)}")
    try:
        yield path
    finally:
        _remove_cgroup_tree(path)


_cgroup_numbers = iter(range(1_000_000))


def _remove_cgroup_tree(path: str) -> None:
    """Kill whatever a test left in its cgroups and remove them, leaves first."""
    if not os.path.isdir(path):
        return
    with contextlib.suppress(OSError):
        Path(path, "cgroup.kill").write_text("1")
    for directory, _, _ in sorted(os.walk(path), key=lambda entry: -len(entry[0])):
        for _ in range(200):  # a killed process leaves its cgroup a moment later
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


@pytest.fixture
async def start_agent(
    nursery: trio.Nursery, short_tmp: Path, cgroup_root: str | None
) -> AsyncIterator[StartAgent]:
    """Start an in-process agent with settings overrides; returns its address string."""
    counter = iter(range(1_000_000))

    async def start(**settings: Any) -> str:
        sock = short_tmp / f"agent{next(counter)}.sock"
        settings.setdefault("listen", [f"unix:{sock}"])
        if cgroup_root is not None:
            settings.setdefault("cgroup_root", f"{cgroup_root}/{next(counter)}")
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
def agent_process(
    short_tmp: Path, cgroup_root: str | None
) -> Iterator[Callable[..., AgentProcess]]:
    """Factory for agent subprocesses; all are stopped (SIGTERM, then SIGKILL) at teardown."""
    started: list[AgentProcess] = []

    def start(*extra_args: str, env: dict[str, str] | None = None) -> AgentProcess:
        sock = short_tmp / f"proc{len(started)}.sock"
        if cgroup_root is not None and "--cgroup-root" not in extra_args:
            extra_args = (*extra_args, "--cgroup-root", f"{cgroup_root}/p{len(started)}")
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
