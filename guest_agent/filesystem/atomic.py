"""Atomic file writes: a temp file in the target directory, fsynced, then renamed into place.

A writer that fails or is aborted leaves the old file as it was and no temp file behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import posixpath
import secrets
import stat
from collections.abc import Sequence
from typing import Any

from .ops import naming

_TMP_MARK = ".ga-tmp-"
_IOV_MAX = 1024  # Linux's limit on the buffers of one writev
_RENAME_NOREPLACE = 1


def temp_name(name: str) -> str:
    """A fresh hidden name for a temp entry beside ``name``, marked as the agent's."""
    # NAME_MAX is 255 bytes: keep the temp name inside it whatever the target's length.
    stem = name.encode()[:200].decode(errors="ignore")
    return f".{stem}{_TMP_MARK}{secrets.token_hex(4)}"


def _write_all(fd: int, chunks: Sequence[bytes | bytearray | memoryview], path: str) -> int:
    """Write ``chunks`` in order, gathered into as few system calls as the kernel allows."""
    views = [memoryview(chunk).cast("B") for chunk in chunks]
    written = 0
    first = 0  # views before this one are written out
    with naming(path):
        while first < len(views):
            sent = os.writev(fd, views[first : first + _IOV_MAX])
            written += sent
            while first < len(views) and sent >= len(views[first]):
                sent -= len(views[first])
                first += 1
            if sent:
                views[first] = views[first][sent:]
    return written


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _rename_noreplace(name: str, tmp: str, dir_fd: int) -> None:
    """Rename ``tmp`` to ``name`` unless ``name`` exists (EEXIST), atomically."""
    result = _libc().renameat2(dir_fd, tmp.encode(), dir_fd, name.encode(), _RENAME_NOREPLACE)
    if result == 0:
        return
    code = ctypes.get_errno()
    if code not in (errno.EINVAL, errno.ENOSYS):
        raise OSError(code, os.strerror(code))
    # A filesystem without RENAME_NOREPLACE: link(2) fails atomically on an existing name too.
    os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.unlink(tmp, dir_fd=dir_fd)


def _open_dir(path: str) -> tuple[int, bool]:
    """An fd on a directory for *at calls, and whether it can be fsynced."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), True
    except PermissionError:
        # Write and search permission without read: enough to create files, not to fsync.
        return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), False


class FileWriter:
    """One file being written: atomically (temp file, fsync, rename) or by appending.

    ``open``, ``write``, ``commit`` and ``abort`` are blocking and run in worker threads;
    ``commit`` makes the new content visible, ``abort`` leaves everything as it was.
    """

    def __init__(
        self,
        dir_fd: int,
        name: str,
        display: str,
        *,
        mode: int | None = None,
        owner: tuple[int, int] | None = None,
        append: bool = False,
        exclusive: bool = False,
        mtime_ns: int | None = None,
        owns_dir_fd: bool = False,
        dir_syncable: bool = True,
    ) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.display = display
        self.mode = mode
        self.owner = owner
        self.append = append
        self.exclusive = exclusive
        self.mtime_ns = mtime_ns
        self.owns_dir_fd = owns_dir_fd
        self.dir_syncable = dir_syncable
        self.fd = -1
        self.tmp: str | None = None
        self.created = False
        self.written = 0
        self._old: os.stat_result | None = None

    @classmethod
    def for_path(cls, path: str, *, parents: bool = False, **options: Any) -> FileWriter:
        """Open a writer for an absolute path, creating parent directories if asked."""
        directory, name = posixpath.split(path)
        if not name or name in (".", ".."):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        with naming(directory):
            if parents:
                os.makedirs(directory, exist_ok=True)
            dir_fd, syncable = _open_dir(directory)
        writer = cls(dir_fd, name, path, owns_dir_fd=True, dir_syncable=syncable, **options)
        try:
            writer.open()
        except BaseException:
            writer.abort()
            raise
        return writer

    def open(self) -> None:
        with naming(self.display, replace=True):
            if self.append:
                # O_NOFOLLOW: a link planted at the target must not redirect the append.
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                if self.exclusive:
                    flags |= os.O_EXCL
                with contextlib.suppress(FileNotFoundError):
                    self._old = os.stat(self.name, dir_fd=self.dir_fd)
                self.fd = os.open(self.name, flags, 0o644, dir_fd=self.dir_fd)
                self.created = self._old is None
                return
            with contextlib.suppress(FileNotFoundError):
                self._old = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
            if self._old is not None:
                if self.exclusive:
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), self.display)
                if stat.S_ISDIR(self._old.st_mode):
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self.display)
            for _ in range(100):
                tmp = temp_name(self.name)
                try:
                    self.fd = os.open(
                        tmp,
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                        0o600,
                        dir_fd=self.dir_fd,
                    )
                except FileExistsError:
                    continue
                self.tmp = tmp
                self.created = True
                return
            raise FileExistsError(errno.EEXIST, "no free temp file name", self.display)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += _write_all(self.fd, (data,), self.display)

    def write_chunks(self, chunks: Sequence[bytes | bytearray | memoryview]) -> None:
        """Write several buffers with one gathered write (no joining copy)."""
        self.written += _write_all(self.fd, chunks, self.display)

    def _final_mode(self) -> int | None:
        if self.mode is not None:
            return self.mode
        if self._old is None or (self.tmp is not None and stat.S_ISLNK(self._old.st_mode)):
            return 0o644  # a new file
        if self.tmp is not None:
            return stat.S_IMODE(self._old.st_mode)  # replacing a file keeps its mode
        return None  # appending to an existing file leaves its mode alone

    def commit(self) -> None:
        with naming(self.display, replace=True):
            os.fsync(self.fd)
            if self.owner is not None:
                os.fchown(self.fd, *self.owner)
            elif self._old is not None and self.tmp is not None:
                # Replacing someone's file keeps their ownership where we may (root may).
                with contextlib.suppress(PermissionError):
                    os.fchown(self.fd, self._old.st_uid, self._old.st_gid)
            mode = self._final_mode()
            if mode is not None:
                os.fchmod(self.fd, mode)  # after fchown, which may clear setuid bits
            if self.mtime_ns is not None:
                os.utime(self.fd, ns=(self.mtime_ns, self.mtime_ns))
            os.close(self.fd)
            self.fd = -1
            if self.tmp is not None:
                if self.exclusive:
                    _rename_noreplace(self.name, self.tmp, self.dir_fd)
                else:
                    os.rename(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                self.tmp = None
                if self.dir_syncable:
                    os.fsync(self.dir_fd)  # the rename itself must survive a crash
        self._close_dir()

    def abort(self) -> None:
        """Close and remove the temp file; never raises (it runs during error handling)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        if self.tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dir_fd)
            self.tmp = None
        self._close_dir()

    def _close_dir(self) -> None:
        if self.owns_dir_fd and self.dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.dir_fd)
            self.dir_fd = -1
