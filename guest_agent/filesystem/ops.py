"""Blocking filesystem operations: stat, list, mkdir, remove, rename, chmod, chown, open to read.

Each runs in a worker thread as the requesting user (see ``credentials``), and an OSError it
raises names the path it was about.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import posixpath
import pwd
import shutil
import stat
from collections.abc import Iterator
from typing import Any

import msgpack

from ..protocol import MAX_FRAME_SIZE, InvalidParams
from .credentials import parse_owner

# Bytes read from disk per worker-thread hop; also the agent's memory per read stream.
READ_CHUNK = 1 << 20
# A list result must fit in one frame: entries stop (truncated=True) past this many bytes.
LIST_BUDGET = MAX_FRAME_SIZE * 3 // 4
LIST_MAX_ENTRIES = 100_000

_TYPES = {
    stat.S_IFREG: "file",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "symlink",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "char",
    stat.S_IFBLK: "block",
}


@contextlib.contextmanager
def naming(path: str, *, replace: bool = False) -> Iterator[None]:
    """Give an OSError the path it was about (when it has none, or only a relative one)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None or replace:
            exc.filename = path
            exc.filename2 = None
        raise


class Names:
    """uid/gid to name lookups, cached for one request (a listing repeats the same few)."""

    def __init__(self) -> None:
        self._users: dict[int, str | None] = {}
        self._groups: dict[int, str | None] = {}

    def user(self, uid: int) -> str | None:
        if uid not in self._users:
            try:
                self._users[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                self._users[uid] = None
        return self._users[uid]

    def group(self, gid: int) -> str | None:
        if gid not in self._groups:
            try:
                self._groups[gid] = grp.getgrgid(gid).gr_name
            except KeyError:
                self._groups[gid] = None
        return self._groups[gid]


def file_type(st: os.stat_result) -> str:
    """The wire name of a file's type."""
    return _TYPES.get(stat.S_IFMT(st.st_mode), "unknown")


def _describe(
    path: str, st: os.stat_result, names: Names, dir_fd: int | None = None
) -> dict[str, Any]:
    """The stat/list entry for ``path`` (a name relative to ``dir_fd`` when given)."""
    target = None
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            target = os.readlink(path, dir_fd=dir_fd)
    return {
        "name": posixpath.basename(path.rstrip("/")) or "/",
        "type": file_type(st),
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "uid": st.st_uid,
        "gid": st.st_gid,
        "owner": names.user(st.st_uid),
        "group": names.group(st.st_gid),
        "mtime": st.st_mtime,
        "target": target,
    }


def stat_path(path: str, follow: bool) -> dict[str, Any]:
    """The stat entry for one path (its target's, with ``follow``)."""
    with naming(path):
        st = os.stat(path, follow_symlinks=follow)
    return _describe(path, st, Names())


def list_dir(path: str, depth: int) -> dict[str, Any]:
    """Entries under ``path`` down to ``depth`` levels, bounded to fit in one frame."""
    names = Names()
    entries: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    budget = LIST_BUDGET
    truncated = False
    # (directory path, its path relative to the listed one, its depth)
    pending: list[tuple[str, str, int]] = [(path, "", 1)]
    while pending and not truncated:
        directory, relative, level = pending.pop()
        try:
            with naming(directory), os.scandir(directory) as it:
                children = sorted(it, key=lambda e: e.name, reverse=True)
        except OSError as exc:
            if not relative:
                raise  # the listed directory itself: that is the answer
            # An unreadable subdirectory does not spoil the listing; say which one.
            errors.append({"path": relative, "errno": errno.errorcode.get(exc.errno or 0, "")})
            continue
        subdirs = []
        for child in reversed(children):
            try:
                st = child.stat(follow_symlinks=False)
            except OSError:
                continue  # removed while we listed: not an entry any more
            entry = _describe(child.path, st, names)
            entry["path"] = posixpath.join(relative, child.name)
            budget -= len(msgpack.packb(entry, use_bin_type=True))
            if budget < 0 or len(entries) >= LIST_MAX_ENTRIES:
                truncated = True
                break
            entries.append(entry)
            if stat.S_ISDIR(st.st_mode) and level < depth:
                subdirs.append((child.path, entry["path"], level + 1))
        pending.extend(reversed(subdirs))
    entries.sort(key=lambda entry: str(entry["path"]))
    return {"entries": entries, "truncated": truncated, "errors": errors[:100]}


def mkdir(path: str, parents: bool, mode: int) -> dict[str, Any]:
    """Create a directory with exactly ``mode``, and its missing parents with ``parents``."""
    with naming(path):
        if parents:
            try:
                os.makedirs(path, mode=0o755)
            except FileExistsError:
                if not os.path.isdir(path):
                    raise
                return {"path": path, "created": False}
        else:
            os.mkdir(path, mode)
        # mkdir(2) applies the umask; the caller asked for this exact mode.
        os.chmod(path, mode)
    return {"path": path, "created": True}


def remove(path: str, recursive: bool) -> dict[str, Any]:
    """Remove a file, symlink or empty directory; a whole tree with ``recursive``."""
    if posixpath.normpath(path) == "/":
        raise InvalidParams("refusing to remove /")
    with naming(path):
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
        elif recursive:
            # rmtree works through directory fds and never follows a symlink out of the tree.
            shutil.rmtree(path)
        else:
            os.rmdir(path)
    return {"path": path}


def rename(src: str, dst: str) -> dict[str, Any]:
    """Rename ``src`` to ``dst``, moving it across filesystems if need be."""
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV or os.path.isdir(dst):
            raise
        # /tmp and /workspace are separate tmpfs mounts: copy then delete, like mv(1).
        shutil.move(src, dst)
    return {"src": src, "dst": dst}


def chmod(path: str, mode: int) -> dict[str, Any]:
    """Set the permission bits of ``path``."""
    with naming(path):
        os.chmod(path, mode)
    return {"path": path}


def chown(path: str, owner: str | int) -> dict[str, Any]:
    """Set the owner and/or group of ``path`` from an ``owner`` spec (see parse_owner)."""
    uid, gid = parse_owner(owner)
    with naming(path):
        os.chown(path, uid, gid)
    return {"path": path, "uid": uid, "gid": gid}


def open_for_read(path: str) -> tuple[int, int]:
    """An fd on a regular file, and its size."""
    with naming(path):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            if not stat.S_ISREG(st.st_mode):
                # A FIFO or a device could block a worker thread for ever.
                raise OSError(errno.EINVAL, f"not a regular file ({file_type(st)})", path)
        except BaseException:
            os.close(fd)
            raise
    return fd, st.st_size
