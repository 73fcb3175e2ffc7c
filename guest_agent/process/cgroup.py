"""cgroup v2 containment for exec trees: create, limit, join-before-exec, kill, remove.

A child must be in its exec's cgroup before it runs any code of its own. Python cannot
clone straight into a cgroup (CLONE_INTO_CGROUP), so the agent briefly moves itself into
the new cgroup, spawns (the child inherits it), and moves back: two writes to
cgroup.procs, about 0.1 ms, serialised because spawning runs on the event loop thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

ROOT_NAME = "guest-agent"
CONTROLLERS = ("memory", "pids")


def write_control(path: str, value: str) -> None:
    """Write a cgroup or /proc control file: three system calls, where open() makes seven."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def find_cgroup2_mount(mounts_file: str = "/proc/self/mounts") -> str | None:
    """The first cgroup2 mount point, or None."""
    try:
        with open(mounts_file) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "cgroup2":
                    return parts[1]
    except OSError:
        pass
    return None


def own_cgroup(mount: str) -> str:
    """The absolute directory of this process's cgroup v2."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return os.path.join(mount, line[3:].strip().lstrip("/"))
    raise OSError(errno.ENOENT, "this process has no cgroup v2 membership")


@dataclass
class ExecCgroup:
    """One exec's cgroup directory."""

    path: str
    limits_applied: dict[str, int]

    def pids(self) -> list[int]:
        """Processes currently in the cgroup."""
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def populated(self) -> bool:
        """Whether any process is left in the cgroup."""
        try:
            with open(os.path.join(self.path, "cgroup.events")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "populated":
                        return value.strip() == "1"
        except FileNotFoundError:
            return False
        return bool(self.pids())

    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to every process of the tree, setsid escapees included."""
        if signum == signal.SIGKILL:
            try:
                write_control(os.path.join(self.path, "cgroup.kill"), "1")
                return
            except FileNotFoundError:
                pass  # kernel before 5.14: signal each process below
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def remove(self) -> bool:
        """rmdir the cgroup; False while processes remain in it."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False
            raise
        return True


class CgroupManager:
    """Creates exec cgroups under one root directory, or reports that it cannot."""

    def __init__(self, root: str, home: str, controllers: frozenset[str]) -> None:
        self.root = root
        self.home = home  # where the agent itself lives, and returns after each spawn
        self.controllers = controllers

    @classmethod
    def detect(cls, configured_root: str | None) -> CgroupManager | None:
        """Set up the root (default: <cgroup2 mount>/guest-agent); None if not writable."""
        mount = find_cgroup2_mount()
        if mount is None:
            log.info("event=cgroups_unavailable reason=no_cgroup2_mount")
            return None
        root = configured_root or os.path.join(mount, ROOT_NAME)
        try:
            home = own_cgroup(mount)
            os.makedirs(root, exist_ok=True)
            controllers = cls._enable_controllers(mount, root)
        except OSError as exc:
            log.info("event=cgroups_unavailable root=%s error=%r", root, exc)
            return None
        log.info("event=cgroups root=%s controllers=%s", root, ",".join(sorted(controllers)))
        return cls(root, home, controllers)

    @staticmethod
    def _enable_controllers(mount: str, root: str) -> frozenset[str]:
        """Enable memory and pids from the mount down to ``root``'s children where possible."""
        with open(os.path.join(mount, "cgroup.controllers")) as f:
            available = set(f.read().split()) & set(CONTROLLERS)
        enabled: set[str] = set()
        for name in sorted(available):
            directory = mount
            try:
                for part in [*os.path.relpath(root, mount).split(os.sep)]:
                    with open(os.path.join(directory, "cgroup.subtree_control"), "w") as f:
                        f.write(f"+{name}")
                    directory = os.path.join(directory, part)
                with open(os.path.join(root, "cgroup.subtree_control"), "w") as f:
                    f.write(f"+{name}")
                enabled.add(name)
            except OSError as exc:  # e.g. EBUSY: processes in an intermediate cgroup
                log.info("event=cgroup_controller_unavailable controller=%s error=%r", name, exc)
        return frozenset(enabled)

    def create(self, name: str, memory_max: int | None, pids_max: int | None) -> ExecCgroup:
        """Make the exec's cgroup and apply the limits its controllers allow."""
        path = os.path.join(self.root, name)
        os.mkdir(path)
        applied: dict[str, int] = {}
        try:
            for controller, filename, value in (
                ("memory", "memory.max", memory_max),
                ("pids", "pids.max", pids_max),
            ):
                if value is not None and controller in self.controllers:
                    write_control(os.path.join(path, filename), str(value))
                    applied[controller] = value
                    if controller == "memory":
                        # No swap escape hatch: the limit is the limit.
                        with contextlib.suppress(OSError):
                            write_control(os.path.join(path, "memory.swap.max"), "0")
        except BaseException:
            os.rmdir(path)
            raise
        return ExecCgroup(path, applied)

    @contextlib.contextmanager
    def joined(self, cgroup: ExecCgroup) -> Iterator[None]:
        """Run the body (a spawn) with the agent inside ``cgroup``; children inherit it."""
        pids_max = cgroup.limits_applied.get("pids")
        pids_file = os.path.join(cgroup.path, "pids.max")
        if pids_max is not None:
            # The agent's own threads count while it sits in the cgroup to spawn: make room
            # for them, and set the real limit once it has left.
            threads = len(os.listdir("/proc/self/task"))
            write_control(pids_file, str(pids_max + threads))
        self._move_self(cgroup.path)
        try:
            yield
        finally:
            self._move_self(self.home)
            if pids_max is not None:
                write_control(pids_file, str(pids_max))

    @staticmethod
    def _move_self(directory: str) -> None:
        write_control(os.path.join(directory, "cgroup.procs"), str(os.getpid()))

    def cleanup_root(self) -> None:
        """Remove the root if it is empty (agent shutdown; tests)."""
        with contextlib.suppress(OSError):
            os.rmdir(self.root)
