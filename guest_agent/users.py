"""Who an exec or a file operation runs as: one resolution for both."""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass

from .protocol import InvalidParams


@dataclass(frozen=True)
class Credentials:
    """Who a process runs as, and the login variables that go with it."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    name: str
    home: str = "/"
    shell: str = "/bin/sh"

    def login_env(self) -> dict[str, str]:
        """HOME, USER, LOGNAME and SHELL for this user."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "SHELL": self.shell}


def resolve_user(spec: str | int) -> Credentials:
    """``NAME``, ``UID``, ``UID:GID`` or ``NAME:GROUP`` to credentials, or InvalidParams."""
    user_part, _, group_part = str(spec).partition(":")
    try:
        entry = pwd.getpwuid(int(user_part)) if user_part.isdigit() else pwd.getpwnam(user_part)
    except KeyError:
        if not user_part.isdigit():
            raise InvalidParams(f"unknown user {user_part!r}") from None
        entry = None  # a bare uid without a passwd entry is allowed, as in docker
    uid = entry.pw_uid if entry else int(user_part)
    gid = entry.pw_gid if entry else uid
    if group_part:
        try:
            gid = int(group_part) if group_part.isdigit() else grp.getgrnam(group_part).gr_gid
        except KeyError:
            raise InvalidParams(f"unknown group {group_part!r}") from None
    name = entry.pw_name if entry else str(uid)
    groups = tuple(sorted(set(os.getgrouplist(name, gid)))) if entry else (gid,)
    return Credentials(
        uid=uid,
        gid=gid,
        groups=groups,
        name=name,
        home=entry.pw_dir if entry else "/",
        shell=(entry.pw_shell if entry else "") or "/bin/sh",
    )


def current_user() -> Credentials:
    """The agent's own identity, with its login variables (the default for execs)."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return Credentials(uid, gid, (gid,), str(uid))
    return Credentials(
        uid, entry.pw_gid, (entry.pw_gid,), entry.pw_name, entry.pw_dir, entry.pw_shell
    )
