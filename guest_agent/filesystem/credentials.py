"""Per-thread filesystem credentials: act as a user in one worker thread, never in the others.

Linux keeps credentials per thread; glibc's setgroups()/setresuid() wrappers broadcast a change
to every thread of the process (POSIX semantics), but the raw setfsuid, setfsgid and setgroups
system calls change only the calling thread. So a worker thread can take on a user's fsuid,
fsgid and supplementary groups, do its file operations with the kernel checking permissions
and stamping ownership as that user, and restore the agent's own before it returns. A fsuid
other than 0 also drops the filesystem capabilities (CAP_DAC_OVERRIDE, CAP_CHOWN, ...) from the
thread's effective set, so root's overrides do not leak into the user's operations.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import grp
import logging
import os
import pwd
from collections.abc import Callable
from typing import TypeVar

from ..protocol import InvalidParams
from ..users import Credentials

log = logging.getLogger(__name__)

T = TypeVar("T")

# (setfsuid, setfsgid, setgroups) system call numbers; the 32-bit-id variants everywhere.
_SYSCALLS = {
    "x86_64": (122, 123, 116),
    "aarch64": (151, 152, 159),
    "riscv64": (151, 152, 159),
}
_NGROUPS_MAX = 65536


class _Syscalls:
    """The three raw per-thread system calls, bound once."""

    def __init__(self) -> None:
        machine = os.uname().machine
        numbers = _SYSCALLS.get(machine)
        if numbers is None:
            raise OSError(errno.ENOSYS, f"per-thread credentials: unknown arch {machine}")
        self.setfsuid_nr, self.setfsgid_nr, self.setgroups_nr = numbers
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long

    def setfsuid(self, uid: int) -> int:
        """Set the thread's fsuid; returns the previous one (the kernel reports no errors)."""
        return int(self.libc.syscall(ctypes.c_long(self.setfsuid_nr), ctypes.c_long(uid)))

    def setfsgid(self, gid: int) -> int:
        return int(self.libc.syscall(ctypes.c_long(self.setfsgid_nr), ctypes.c_long(gid)))

    def setgroups(self, groups: tuple[int, ...]) -> None:
        array = (ctypes.c_uint * max(1, len(groups)))(*groups)
        result = self.libc.syscall(
            ctypes.c_long(self.setgroups_nr), ctypes.c_long(len(groups)), array
        )
        if result != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"setgroups: {os.strerror(code)}")


@functools.cache
def _calls() -> _Syscalls:
    """The syscall bindings, made on first use (most agents never switch users)."""
    return _Syscalls()


def _current_fsuid(calls: _Syscalls) -> int:
    # setfsuid(-1) is always refused and so just reports the current value.
    return calls.setfsuid(-1) & 0xFFFFFFFF


def _current_fsgid(calls: _Syscalls) -> int:
    return calls.setfsgid(-1) & 0xFFFFFFFF


def _group_id(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise InvalidParams(f"unknown group {text!r}") from None


def parse_owner(spec: str | int) -> tuple[int, int]:
    """``USER[:GROUP]``, ``:GROUP`` or a uid as (uid, gid); -1 leaves a side unchanged.

    A user name alone also sets that user's primary group, as chown(1) does for ``USER:``.
    """
    if isinstance(spec, int):
        return spec, -1
    user, sep, group = spec.partition(":")
    uid = gid = -1
    if user:
        if user.isdigit():
            uid = int(user)
        else:
            try:
                entry = pwd.getpwnam(user)
            except KeyError:
                raise InvalidParams(f"unknown user {user!r}") from None
            uid = entry.pw_uid
            if sep and not group:
                gid = entry.pw_gid
    if group:
        gid = _group_id(group)
    if uid == -1 and gid == -1:
        raise InvalidParams(f"owner {spec!r} names neither a user nor a group")
    return uid, gid


def run_as(creds: Credentials | None, fn: Callable[..., T], *args: object) -> T:
    """Call ``fn(*args)`` in this thread with ``creds`` as its filesystem identity.

    Must run in a worker thread (never the event loop's): the thread's identity is switched
    for the duration of the call and restored before returning, even on error.
    """
    if creds is None:
        return fn(*args)
    euid = os.geteuid()
    if euid != 0:
        if creds.uid == euid:
            return fn(*args)  # an unprivileged agent can only ever act as itself
        raise PermissionError(
            errno.EPERM, f"the agent (uid {euid}) cannot act as user {creds.name!r}"
        )
    calls = _calls()
    saved_groups = tuple(os.getgroups())  # this thread's own, read before we change them
    saved_gid = _current_fsgid(calls)
    saved_uid = _current_fsuid(calls)
    try:
        calls.setgroups(creds.groups[:_NGROUPS_MAX])
        calls.setfsgid(creds.gid)
        calls.setfsuid(creds.uid)
        if _current_fsuid(calls) != creds.uid or _current_fsgid(calls) != creds.gid:
            raise PermissionError(errno.EPERM, f"cannot take on the identity of {creds.name!r}")
        return fn(*args)
    finally:
        calls.setfsuid(saved_uid)
        calls.setfsgid(saved_gid)
        with contextlib.suppress(OSError):  # checked just below
            calls.setgroups(saved_groups)
        if (
            _current_fsuid(calls) != saved_uid
            or _current_fsgid(calls) != saved_gid
            or tuple(os.getgroups()) != saved_groups
        ):
            # A worker thread that cannot get its identity back would serve later requests as
            # someone else: stopping is the only safe answer (init restarts the agent).
            log.critical("event=credentials_restore_failed user=%s", creds.name)
            os._exit(70)
