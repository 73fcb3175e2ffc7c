"""The one place that starts processes.

subprocess.Popen without preexec_fn takes CPython's vfork path (close_fds, new session,
SIGPIPE restored to default, cwd), measured as fast as os.posix_spawn and faster than
trio.run_process, which forks from a worker thread (see bench/). Switching users makes
it fork instead of vfork, still without Python code in the child.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import signal
import struct
import subprocess
import termios
from dataclasses import dataclass, field

from ..users import Credentials
from .cgroup import CgroupManager, ExecCgroup, write_control

# Bigger pipes mean fewer wake-ups per MiB streamed (the kernel default is 64 KiB).
PIPE_SIZE = 1 << 20
# util-linux setsid: makes the PTY the controlling terminal (TIOCSCTTY) before exec,
# which Popen cannot do without preexec_fn.
_SETSID = shutil.which("setsid", path="/usr/bin:/bin")


@dataclass(frozen=True)
class SpawnSpec:
    """What to run and how."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None = None
    credentials: Credentials | None = None
    stdin: bool = False
    pty_size: tuple[int, int] | None = None  # (rows, cols); None: pipes


@dataclass
class Spawned:
    """A started process and the agent's ends of its stdio."""

    pid: int
    pidfd: int
    stdin_fd: int | None = None
    stdout_fd: int | None = None
    stderr_fd: int | None = None
    pty_fd: int | None = None  # the PTY master: output and input both
    notes: list[str] = field(default_factory=list)


def set_window_size(fd: int, rows: int, cols: int) -> None:
    """TIOCSWINSZ on a terminal; the kernel sends SIGWINCH to its foreground group."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


@functools.cache
def _devnull() -> int:
    """/dev/null for stdin, opened once (Popen's DEVNULL opens and closes it every spawn)."""
    return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)


def _pipe() -> tuple[int, int]:
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    return read_fd, write_fd


def switches_identity(creds: Credentials) -> bool:
    """Whether running as ``creds`` changes the agent's uid, gid or groups.

    Switching costs a fork instead of a vfork (about 1 ms per exec), so only when it changes
    something. Groups are compared with the primary group in: getgroups() may or may not
    list it.
    """
    wanted = (creds.uid, creds.gid, {creds.gid, *creds.groups})
    return wanted != (os.geteuid(), os.getegid(), {os.getegid(), *os.getgroups()})


def _check_executable(argv0: str, env: dict[str, str], cwd: str | None) -> None:
    """Raise ENOENT / EACCES now for a program the PTY trampoline would fail to exec."""
    if "/" in argv0:
        path = argv0 if os.path.isabs(argv0) or cwd is None else os.path.join(cwd, argv0)
        if not os.path.exists(path):
            raise FileNotFoundError(2, "No such file or directory", argv0)
        if not os.access(path, os.X_OK):
            raise PermissionError(13, "Permission denied", argv0)
    elif shutil.which(argv0, path=env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(2, "No such file or directory", argv0)


def spawn(spec: SpawnSpec, cgroups: CgroupManager | None, cgroup: ExecCgroup | None) -> Spawned:
    """Start ``spec`` in its own session (and ``cgroup``); raises OSError on start failure."""
    parent_fds: list[int] = []
    child_fds: list[int] = []
    argv = list(spec.argv)
    new_session = True
    try:
        if spec.pty_size is not None:
            master, slave = os.openpty()
            os.set_inheritable(master, False)
            parent_fds.append(master)
            child_fds.append(slave)
            set_window_size(slave, *spec.pty_size)
            stdin = stdout = stderr = slave
            _check_executable(argv[0], spec.env, spec.cwd)
            if _SETSID is not None:
                argv = [_SETSID, "--ctty", "--", *argv]
                new_session = False  # setsid(1) makes the session itself
        else:
            if spec.stdin:
                stdin_read, stdin_write = _pipe()
                parent_fds.append(stdin_write)
                child_fds.append(stdin_read)
                stdin = stdin_read
            else:
                stdin = _devnull()
            out_read, stdout = _pipe()
            err_read, stderr = _pipe()
            parent_fds += [out_read, err_read]
            child_fds += [stdout, stderr]
        creds = spec.credentials
        # The gid and groups count too: "root:staff" must not run with root's own group.
        as_other_user = creds is not None and switches_identity(creds)
        with cgroups.joined(cgroup) if cgroups and cgroup else contextlib.nullcontext():
            popen = subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                env=spec.env,
                cwd=spec.cwd,
                start_new_session=new_session,
                close_fds=True,
                restore_signals=True,
                user=creds.uid if creds and as_other_user else None,
                group=creds.gid if creds and as_other_user else None,
                extra_groups=list(creds.groups) if creds and as_other_user else None,
            )
    except BaseException:
        for fd in parent_fds:
            os.close(fd)
        raise
    finally:
        for fd in child_fds:
            os.close(fd)
    notes: list[str] = []
    # The agent protects itself from the OOM killer; its children must not inherit that.
    try:
        write_control(f"/proc/{popen.pid}/oom_score_adj", "0")
    except OSError as exc:
        notes.append(f"oom_score_adj not reset: {exc.strerror}")
    try:
        pidfd = os.pidfd_open(popen.pid)
    except OSError:
        # Out of fds, say: nothing could supervise this child, so it must not run on.
        os.kill(popen.pid, signal.SIGKILL)
        os.waitpid(popen.pid, 0)
        popen.returncode = -signal.SIGKILL
        for fd in parent_fds:
            os.close(fd)
        raise
    # The pidfd is how the agent waits for and reaps this child. Popen must never do it:
    # dropped while it thinks the child runs, it queues the pid for its own waitpid() in a
    # later Popen() call, which would steal the exit status. So it is told it is done.
    popen.returncode = 0
    spawned = Spawned(popen.pid, pidfd, notes=notes)
    if spec.pty_size is not None:
        spawned.pty_fd = parent_fds[0]
    else:
        if spec.stdin:
            spawned.stdin_fd = parent_fds.pop(0)
        spawned.stdout_fd, spawned.stderr_fd = parent_fds
    return spawned
