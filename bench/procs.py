"""Processes the harness starts: CPU placement, guaranteed cleanup, CPU-time accounting."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from guest_agent.process.cgroup import find_cgroup2_mount

# Where exec cgroups of the agents under test go (this machine: /sys/fs/cgroup/unified).
CGROUP2_MOUNT = Path(find_cgroup2_mount() or "/sys/fs/cgroup/unified")


@dataclass(frozen=True)
class Placement:
    """Which CPUs the server side (agent, peers, floors) and the client side (harness) use.

    ``one``: everything on one CPU (like with like, no cross-CPU copies);
    ``split``: servers on one CPU, clients on the other; ``free``: the scheduler decides.
    """

    name: str
    server: frozenset[int] | None
    client: frozenset[int] | None

    @classmethod
    def named(cls, name: str) -> Placement:
        cpus = sorted(os.sched_getaffinity(0))
        if name == "one":
            return cls(name, frozenset(cpus[:1]), frozenset(cpus[:1]))
        if name == "split":
            if len(cpus) < 2:
                raise ValueError("placement 'split' needs two CPUs")
            return cls(name, frozenset(cpus[:1]), frozenset(cpus[1:2]))
        if name == "free":
            return cls(name, None, None)
        raise ValueError(f"unknown placement {name!r}")

    def server_prefix(self) -> list[str]:
        """An argv prefix that starts a server-side program on the server CPUs."""
        if self.server is None:
            return []
        return ["taskset", "-c", ",".join(map(str, sorted(self.server)))]

    def pin_client(self) -> None:
        """Put the harness (and what it starts without a prefix) on the client CPUs."""
        if self.client is not None:
            os.sched_setaffinity(0, self.client)


class Processes:
    """Every long-lived process the harness starts; ``stop_all`` runs even on Ctrl-C."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, argv: Sequence[str], *, log: IO[bytes] | None = None, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(
            list(argv),
            stdout=kwargs.pop("stdout", log if log is not None else subprocess.DEVNULL),
            stderr=kwargs.pop("stderr", log if log is not None else subprocess.DEVNULL),
            **kwargs,
        )
        self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        """SIGTERM, the grace, SIGKILL; then SIGKILL descendants that outlived it."""
        try:
            descendants = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for child in descendants:
            with contextlib.suppress(psutil.Error):
                child.kill()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self._procs)):
            self.stop(proc)


def remove_cgroup_tree(path: Path, timeout: float = 5.0) -> None:
    """Kill everything left in a cgroup tree and remove its directories, deepest first."""
    if not path.is_dir():
        return
    dirs = sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    dirs.append(path)
    for directory in dirs:
        with contextlib.suppress(OSError):
            (directory / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + timeout
    for directory in dirs:
        while True:
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)


def process_cpu(proc: psutil.Process) -> float:
    """User + system seconds of one process (not its children); 0 once it is gone."""
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def own_cpu() -> float:
    """CPU seconds of the harness, plus of the children it has waited for (ssh clients)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


class CpuMeter:
    """CPU time spent by a transfer: server processes, then client processes + the harness."""

    def __init__(self, server: Sequence[psutil.Process], client: Sequence[psutil.Process] = ()):
        self.server = list(server)
        self.client = list(client)
        self._start: tuple[list[float], list[float], float] = ([], [], 0.0)

    def __enter__(self) -> CpuMeter:
        self._start = (
            [process_cpu(p) for p in self.server],
            [process_cpu(p) for p in self.client],
            own_cpu(),
        )
        self.server_s = 0.0
        self.client_s = 0.0
        return self

    def __exit__(self, *exc_info: object) -> None:
        server0, client0, own0 = self._start
        # A process that ended in between counts as zero rather than negative.
        self.server_s = sum(
            max(process_cpu(p) - s, 0.0) for p, s in zip(self.server, server0, strict=True)
        )
        self.client_s = sum(
            max(process_cpu(p) - s, 0.0) for p, s in zip(self.client, client0, strict=True)
        )
        self.client_s += own_cpu() - own0

    @property
    def total(self) -> float:
        return self.server_s + self.client_s


def wait_for_path(path: Path, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Until ``path`` exists; RuntimeError if ``proc`` exits or the timeout passes first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout} s")
        time.sleep(0.0005)


def wait_listening(path: Path, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Until a unix socket accepts connections (it exists a moment before it listens)."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
                return
            except (ConnectionRefusedError, FileNotFoundError):
                pass
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not accept connections within {timeout} s")
        time.sleep(0.0005)
