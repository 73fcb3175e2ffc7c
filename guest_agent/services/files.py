"""The files service: streamed, atomic, permission-correct file operations.

Every blocking filesystem call runs in a worker thread (bounded by ``config.file_workers``)
with the requesting user's filesystem credentials (see ``_fsuser``), so the kernel applies
that user's permissions and new files belong to them. Writes go to a temp file in the target
directory and are renamed into place after an fsync, so a writer that fails, cancels or
disconnects leaves the old file as it was and no temp file behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import grp
import os
import posixpath
import pwd
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any, TypeVar, cast

import msgpack
import trio

from ..protocol import MAX_CHUNK_SIZE, MAX_FRAME_SIZE, InvalidParams
from . import Call, Handler, Runtime, param
from ._fsuser import Credentials, parse_owner, resolve_user, run_as

if TYPE_CHECKING:
    import tarfile

T = TypeVar("T")

# Bytes read from disk per worker-thread hop; also the agent's memory per read stream.
READ_CHUNK = 1 << 20
# Credit granted to an uploader: the most inbound data queued per write stream.
WRITE_WINDOW = 2 << 20
# Inbound data gathered before one worker-thread write.
WRITE_BATCH = 1 << 20
# A list result must fit in one frame: entries stop (truncated=True) past this many bytes.
LIST_BUDGET = MAX_FRAME_SIZE * 3 // 4
LIST_MAX_ENTRIES = 100_000
_TMP_MARK = ".ga-tmp-"
_RENAME_NOREPLACE = 1
_TAR_BLOCK = 512
_TAR_RECORD = 20 * _TAR_BLOCK

_TYPES = {
    stat.S_IFREG: "file",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "symlink",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "char",
    stat.S_IFBLK: "block",
}


# ---- small helpers -----------------------------------------------------------------------


@contextlib.contextmanager
def _naming(path: str, *, replace: bool = False) -> Iterator[None]:
    """Give an OSError the path it was about (when it has none, or only a relative one)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None or replace:
            exc.filename = path
            exc.filename2 = None
        raise


def _path_param(call: Call, name: str = "path") -> str:
    path: str = param(call, name, str)
    if not path.startswith("/"):
        raise InvalidParams(f"{call.method}: {name} must be an absolute path, got {path!r}")
    if "\0" in path:
        raise InvalidParams(f"{call.method}: {name} contains a NUL byte")
    return path


def _mode_param(call: Call, default: int | None) -> int | None:
    mode: int | None = param(call, "mode", int, default)
    if mode is not None and not 0 <= mode <= 0o7777:
        raise InvalidParams(f"{call.method}: mode {mode:#o} is not a permission mode")
    return mode


def _count_param(call: Call, name: str, default: int | None) -> int | None:
    value: int | None = param(call, name, int, default)
    if value is not None and value < 0:
        raise InvalidParams(f"{call.method}: {name} must not be negative")
    return value


class _Names:
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
    path: str, st: os.stat_result, names: _Names, dir_fd: int | None = None
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


# ---- blocking operations (run in worker threads as the requesting user) ---------------------


def _stat(path: str, follow: bool) -> dict[str, Any]:
    with _naming(path):
        st = os.stat(path, follow_symlinks=follow)
    return _describe(path, st, _Names())


def _list(path: str, depth: int) -> dict[str, Any]:
    """Entries under ``path`` down to ``depth`` levels, bounded to fit in one frame."""
    names = _Names()
    entries: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    budget = LIST_BUDGET
    truncated = False
    # (directory path, its path relative to the listed one, its depth)
    pending: list[tuple[str, str, int]] = [(path, "", 1)]
    while pending and not truncated:
        directory, relative, level = pending.pop()
        try:
            with _naming(directory), os.scandir(directory) as it:
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


def _mkdir(path: str, parents: bool, mode: int) -> dict[str, Any]:
    with _naming(path):
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


def _remove(path: str, recursive: bool) -> dict[str, Any]:
    if posixpath.normpath(path) == "/":
        raise InvalidParams("refusing to remove /")
    with _naming(path):
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
        elif recursive:
            # rmtree works through directory fds and never follows a symlink out of the tree.
            shutil.rmtree(path)
        else:
            os.rmdir(path)
    return {"path": path}


def _rename(src: str, dst: str) -> dict[str, Any]:
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV or os.path.isdir(dst):
            raise
        # /tmp and /workspace are separate tmpfs mounts: copy then delete, like mv(1).
        shutil.move(src, dst)
    return {"src": src, "dst": dst}


def _chmod(path: str, mode: int) -> dict[str, Any]:
    with _naming(path):
        os.chmod(path, mode)
    return {"path": path}


def _chown(path: str, owner: str | int) -> dict[str, Any]:
    uid, gid = parse_owner(owner)
    with _naming(path):
        os.chown(path, uid, gid)
    return {"path": path, "uid": uid, "gid": gid}


def _open_for_read(path: str) -> tuple[int, int]:
    """An fd on a regular file, and its size."""
    with _naming(path):
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


def _write_all(fd: int, data: bytes | bytearray | memoryview, path: str) -> None:
    view = memoryview(data)
    with _naming(path):
        while view:
            view = view[os.write(fd, view) :]


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


def _resolve_and_run(spec: str | int | None, fn: Callable[..., T], *args: Any) -> T:
    return run_as(None if spec is None else resolve_user(spec), fn, *args)


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
        with _naming(directory):
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
        with _naming(self.display, replace=True):
            if self.append:
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
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
            # NAME_MAX is 255 bytes: keep the temp name inside it whatever the target's length.
            stem = self.name.encode()[:200].decode(errors="ignore")
            for _ in range(100):
                tmp = f".{stem}{_TMP_MARK}{secrets.token_hex(4)}"
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
        _write_all(self.fd, data, self.display)
        self.written += len(data)

    def _final_mode(self) -> int | None:
        if self.mode is not None:
            return self.mode
        if self._old is None or (self.tmp is not None and stat.S_ISLNK(self._old.st_mode)):
            return 0o644  # a new file
        if self.tmp is not None:
            return stat.S_IMODE(self._old.st_mode)  # replacing a file keeps its mode
        return None  # appending to an existing file leaves its mode alone

    def commit(self) -> None:
        with _naming(self.display, replace=True):
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


# ---- tar archives ------------------------------------------------------------------------


class UnsafeArchive(InvalidParams):
    """An archive member would land outside the target directory."""


def member_parts(name: str) -> list[str]:
    """The path components of an archive member name; refuses absolute names and ``..``."""
    if name.startswith("/") or "\0" in name:
        raise UnsafeArchive(f"archive member {name!r} has an absolute path")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"archive member {name!r} has a '..' component")
    return parts


def _check_symlink(parts: list[str], target: str) -> None:
    """Refuse a symlink whose target leaves the tree (judged from where the link sits)."""
    if target.startswith("/"):
        raise UnsafeArchive(f"symlink {'/'.join(parts)!r} points to an absolute path {target!r}")
    resolved = posixpath.normpath(posixpath.join("/".join(parts[:-1]), target))
    if resolved == ".." or resolved.startswith("../"):
        raise UnsafeArchive(f"symlink {'/'.join(parts)!r} points outside the tree ({target!r})")


def _walk(root_fd: int, parts: list[str], *, create: bool) -> int:
    """A new fd on root/parts, refusing to pass through any symlink (so nothing lands outside)."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                child = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISLNK(st.st_mode):
                        raise UnsafeArchive(
                            f"archive path {'/'.join(parts)!r} passes through a symlink"
                        ) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _replace_with(dir_fd: int, name: str, make: Callable[[str], None]) -> None:
    """Create a non-regular entry under a temp name with ``make``, then rename it into place."""
    tmp = f".{name.encode()[:200].decode(errors='ignore')}{_TMP_MARK}{secrets.token_hex(4)}"
    make(tmp)
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def extract_tar(root: str, read: Callable[[int], bytes]) -> dict[str, Any]:
    """Extract a tar stream into directory ``root`` (created if missing); blocking.

    ``read(n)`` returns up to n bytes of the archive, b"" at its end. Regular files are
    written atomically; ownership is the caller's (not the archive's); a member that would
    land outside ``root`` (absolute, ``..``, through or as a symlink leaving the tree) stops
    the extraction with UnsafeArchive before anything is written for it.
    """
    import tarfile

    with _naming(root):
        created_root = not os.path.isdir(root)
        if created_root:
            os.makedirs(root, exist_ok=True)
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    stream = _ReadStream(read)
    files = 0
    total = 0
    # Directory modes and mtimes are applied last, deepest first, so that a read-only
    # directory in the archive does not stop its own contents from being extracted.
    dir_attrs: list[tuple[list[str], int, int]] = []
    try:
        with tarfile.open(fileobj=cast("IO[bytes]", stream), mode="r|") as tar:
            while (member := tar.next()) is not None:
                # tarfile remembers every member (a private list): keep memory flat instead.
                cast(Any, tar).members.clear()
                parts = member_parts(member.name)
                mtime_ns = int(member.mtime * 1e9)
                if not parts:
                    if member.isdir() and created_root:
                        dir_attrs.append(([], member.mode, mtime_ns))
                    continue
                display = posixpath.join(root, *parts)
                parent_fd = _walk(root_fd, parts[:-1], create=True)
                try:
                    with _naming(display, replace=True):
                        total += _extract_member(
                            tar, member, parts, parent_fd, root_fd=root_fd, display=display
                        )
                    if member.isdir():
                        dir_attrs.append((parts, member.mode, mtime_ns))
                    files += 1
                finally:
                    os.close(parent_fd)
        for parts, mode, mtime_ns in reversed(dir_attrs):
            fd = _walk(root_fd, parts, create=False)
            try:
                os.fchmod(fd, mode & 0o7777)
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            finally:
                os.close(fd)
        os.fsync(root_fd)
        stream.drain()
    except tarfile.TarError as exc:
        raise InvalidParams(f"not a valid tar archive: {exc}") from None
    finally:
        os.close(root_fd)
    return {"path": root, "members": files, "bytes": total}


def _extract_member(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    parts: list[str],
    parent_fd: int,
    *,
    root_fd: int,
    display: str,
) -> int:
    """Create one member under ``parent_fd``; returns the file bytes written."""
    name = parts[-1]
    if member.isreg():
        source = tar.extractfile(member)
        assert source is not None
        writer = FileWriter(
            parent_fd, name, display, mode=member.mode & 0o7777, mtime_ns=int(member.mtime * 1e9)
        )
        try:
            writer.open()
            while chunk := source.read(READ_CHUNK):
                writer.write(chunk)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        return writer.written
    if member.isdir():
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory") from None
    elif member.issym():
        _check_symlink(parts, member.linkname)
        _replace_with(
            parent_fd, name, lambda tmp: os.symlink(member.linkname, tmp, dir_fd=parent_fd)
        )
    elif member.islnk():
        link_parts = member_parts(member.linkname)
        if not link_parts:
            raise UnsafeArchive(f"hard link {member.name!r} to the archive root")
        source_fd = _walk(root_fd, link_parts[:-1], create=False)
        try:
            # Only regular files: a hard link to a symlink would move where it points from.
            linked = os.stat(link_parts[-1], dir_fd=source_fd, follow_symlinks=False)
            if not stat.S_ISREG(linked.st_mode):
                raise UnsafeArchive(f"hard link {member.name!r} to a non-regular file")
            _replace_with(
                parent_fd,
                name,
                lambda tmp: os.link(
                    link_parts[-1],
                    tmp,
                    src_dir_fd=source_fd,
                    dst_dir_fd=parent_fd,
                    follow_symlinks=False,
                ),
            )
        finally:
            os.close(source_fd)
    elif member.isfifo():
        _replace_with(
            parent_fd, name, lambda tmp: os.mkfifo(tmp, member.mode & 0o777, dir_fd=parent_fd)
        )
    else:
        raise InvalidParams(f"archive member {member.name!r}: devices are not extracted")
    return 0


class _ReadStream:
    """A minimal readable file over ``read(n)`` calls, for tarfile's streaming mode."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read
        self._buffer = b""
        self._pos = 0  # slicing from an offset: tarfile reads 10 KiB at a time
        self._eof = False

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = 1 << 62
        if len(self._buffer) - self._pos >= size:
            self._pos += size
            return self._buffer[self._pos - size : self._pos]
        parts = [self._buffer[self._pos :]]
        have = len(parts[0])
        self._buffer, self._pos = b"", 0
        while have < size and not self._eof:
            chunk = self._read(MAX_CHUNK_SIZE)
            if not chunk:
                self._eof = True
            elif len(chunk) > size - have:
                self._buffer, self._pos = chunk, size - have
                parts.append(chunk[: self._pos])
                have = size
            else:
                parts.append(chunk)
                have += len(chunk)
        return b"".join(parts)

    def drain(self) -> None:
        """Consume what follows the archive (record padding) up to the stream's end."""
        self._buffer, self._pos = b"", 0
        while not self._eof:
            if not self._read(MAX_CHUNK_SIZE):
                self._eof = True


def archive_tree(path: str, send: Callable[[bytes], None]) -> dict[str, Any]:
    """Send a tar archive of ``path`` through ``send(bytes)``; blocking, bounded memory.

    A directory's archive holds its contents (member names relative to it, "." first);
    a file's holds that file under its own name. Symlinks are stored, not followed; files
    with several links are stored once and then as hard links; sockets are skipped.
    """
    out = _TarOut(send)
    with _naming(path):
        top = os.lstat(path)
    if not stat.S_ISDIR(top.st_mode):
        out.entry(path, posixpath.basename(path), top)
    else:
        out.entry(path, ".", top)
        # Depth first, names sorted: the archive is reproducible and a directory's entry
        # comes before its contents. Each level holds one directory's names, no more.
        pending: list[tuple[str, str]] = [(path, "")]
        while pending:
            directory, prefix = pending.pop()
            with _naming(directory):
                children = sorted(os.listdir(directory))
            subdirs = []
            for child in children:
                full = posixpath.join(directory, child)
                arcname = posixpath.join(prefix, child) if prefix else child
                try:
                    st = os.lstat(full)
                except FileNotFoundError:
                    continue  # removed while we walked
                if out.entry(full, arcname, st) and stat.S_ISDIR(st.st_mode):
                    subdirs.append((full, arcname))
            pending.extend(reversed(subdirs))
    out.finish()
    return {"path": path, "members": out.members, "bytes": out.file_bytes}


class _TarOut:
    """Writes tar members; small blocks are gathered into larger sends, file data is not."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send = send
        self._buffer = bytearray()
        self.offset = 0
        self.members = 0
        self.file_bytes = 0
        self._names = _Names()
        # (device, inode) of files with several links, to the name first archived.
        self._links: dict[tuple[int, int], str] = {}

    def entry(self, full: str, arcname: str, st: os.stat_result) -> bool:
        """Emit one member; False when its type is not archived (sockets)."""
        import tarfile

        info = tarfile.TarInfo(arcname)
        info.mode = stat.S_IMODE(st.st_mode)
        info.uid, info.gid = st.st_uid, st.st_gid
        info.uname = self._names.user(st.st_uid) or ""
        info.gname = self._names.group(st.st_gid) or ""
        info.mtime = int(st.st_mtime)
        kind = stat.S_IFMT(st.st_mode)
        key = (st.st_dev, st.st_ino)
        if kind == stat.S_IFREG and st.st_nlink > 1 and key in self._links:
            info.type = tarfile.LNKTYPE
            info.linkname = self._links[key]
        elif kind == stat.S_IFREG:
            info.type = tarfile.REGTYPE
            info.size = st.st_size
            if st.st_nlink > 1:
                self._links[key] = arcname
        elif kind == stat.S_IFDIR:
            info.type = tarfile.DIRTYPE
        elif kind == stat.S_IFLNK:
            info.type = tarfile.SYMTYPE
            with _naming(full):
                info.linkname = os.readlink(full)
        elif kind == stat.S_IFIFO:
            info.type = tarfile.FIFOTYPE
        elif kind in (stat.S_IFCHR, stat.S_IFBLK):
            info.type = tarfile.CHRTYPE if kind == stat.S_IFCHR else tarfile.BLKTYPE
            info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        else:
            return False
        if info.type != tarfile.REGTYPE:
            self.header(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
            return True
        with _naming(full):
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self.header(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
            remaining = info.size
            with _naming(full):
                while remaining > 0:
                    chunk = os.read(fd, min(READ_CHUNK, remaining))
                    if not chunk:
                        break
                    self.data(chunk)
                    remaining -= len(chunk)
            # The header promised this size: a file that shrank meanwhile is padded with zeros.
            while remaining > 0:
                self.data(bytes(min(READ_CHUNK, remaining)))
                remaining -= min(READ_CHUNK, remaining)
            self.pad()
        finally:
            os.close(fd)
        return True

    def header(self, block: bytes) -> None:
        self.members += 1
        self._emit(block)

    def data(self, chunk: bytes) -> None:
        self.file_bytes += len(chunk)
        self._emit(chunk)

    def pad(self) -> None:
        if remainder := self.offset % _TAR_BLOCK:
            self._emit(bytes(_TAR_BLOCK - remainder))

    def _emit(self, data: bytes) -> None:
        self.offset += len(data)
        if len(data) >= MAX_CHUNK_SIZE:
            self.flush()
            self._send(data)
            return
        self._buffer += data
        if len(self._buffer) >= MAX_CHUNK_SIZE:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            self._send(bytes(self._buffer))
            self._buffer.clear()

    def finish(self) -> None:
        """End-of-archive blocks and padding to a whole record, as tar(1) writes them."""
        self._emit(bytes(2 * _TAR_BLOCK))
        if remainder := self.offset % _TAR_RECORD:
            self._emit(bytes(_TAR_RECORD - remainder))
        self.flush()


# ---- the service -------------------------------------------------------------------------


class FilesService:
    """``file.*``: read, write, stat, list, mkdir, remove, rename, chmod, chown, tar both ways."""

    name = "file"

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        workers = max(1, runtime.config.file_workers)
        # Short blocking calls (a stat, one chunk of a read or write).
        self.limiter = trio.CapacityLimiter(workers)
        # Tar transfers hold a thread for their whole run, mostly waiting on the peer: they
        # get their own bound so that slow peers never starve the short calls.
        self.transfer_limiter = trio.CapacityLimiter(workers)

    def methods(self) -> dict[str, Handler]:
        return {
            "file.read": self.read,
            "file.write": self.write,
            "file.stat": self.stat,
            "file.list": self.list,
            "file.mkdir": self.mkdir,
            "file.remove": self.remove,
            "file.rename": self.rename,
            "file.chmod": self.chmod,
            "file.chown": self.chown,
            "file.read_tar": self.read_tar,
            "file.write_tar": self.write_tar,
        }

    # ---- plumbing --------------------------------------------------------------------

    def _user(self, call: Call) -> str | int | None:
        spec: str | int | None = param(call, "user", (str, int), self.runtime.config.default_user)
        return spec

    async def _credentials(self, call: Call) -> Credentials | None:
        spec = self._user(call)
        if spec is None:
            return None
        # pwd lookups may read files (or ask NSS): not on the event loop.
        return await trio.to_thread.run_sync(resolve_user, spec, limiter=self.limiter)

    async def _as_caller(self, call: Call, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking ``fn(*args)`` as the call's user: one thread hop, lookup included."""
        return await trio.to_thread.run_sync(
            functools.partial(_resolve_and_run, self._user(call), fn, *args),
            limiter=self.limiter,
        )

    async def _run(self, creds: Credentials | None, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking ``fn(*args)`` in a worker thread as ``creds``."""
        return await trio.to_thread.run_sync(
            functools.partial(run_as, creds, fn, *args), limiter=self.limiter
        )

    async def _cleanup(self, creds: Credentials | None, fn: Callable[[], None]) -> None:
        """Run cleanup to the end even when the call is being cancelled."""
        with trio.CancelScope(shield=True):
            # Not self.limiter: cleanup must not queue behind the very work it follows.
            await trio.to_thread.run_sync(functools.partial(run_as, creds, fn))

    # ---- unary calls -----------------------------------------------------------------

    async def stat(self, call: Call) -> dict[str, Any]:
        """Facts about one path; symlinks are described, not followed, unless ``follow``."""
        path = _path_param(call)
        follow: bool = param(call, "follow", bool, False)
        return await self._as_caller(call, _stat, path, follow)

    async def list(self, call: Call) -> dict[str, Any]:
        """Entries of a directory, ``depth`` levels deep, bounded to one frame."""
        path = _path_param(call)
        depth = _count_param(call, "depth", 1)
        if not depth:
            raise InvalidParams("file.list: depth must be at least 1")
        return await self._as_caller(call, _list, path, depth)

    async def mkdir(self, call: Call) -> dict[str, Any]:
        """Create a directory (and its parents with ``parents``)."""
        path = _path_param(call)
        parents: bool = param(call, "parents", bool, False)
        mode = _mode_param(call, 0o755)
        return await self._as_caller(call, _mkdir, path, parents, mode)

    async def remove(self, call: Call) -> dict[str, Any]:
        """Remove a file, symlink or empty directory; a whole tree with ``recursive``."""
        path = _path_param(call)
        recursive: bool = param(call, "recursive", bool, False)
        return await self._as_caller(call, _remove, path, recursive)

    async def rename(self, call: Call) -> dict[str, Any]:
        """Rename (atomically on one filesystem; copy and delete across filesystems)."""
        src, dst = _path_param(call, "src"), _path_param(call, "dst")
        return await self._as_caller(call, _rename, src, dst)

    async def chmod(self, call: Call) -> dict[str, Any]:
        """Set permission bits."""
        path = _path_param(call)
        param(call, "mode", int)  # required here, unlike for write and mkdir
        mode = _mode_param(call, None)
        return await self._as_caller(call, _chmod, path, mode)

    async def chown(self, call: Call) -> dict[str, Any]:
        """Set owner and/or group: ``USER[:GROUP]``, ``:GROUP``, names or numbers."""
        path = _path_param(call)
        owner: str | int = param(call, "owner", (str, int))
        return await self._as_caller(call, _chown, path, owner)

    # ---- streams ---------------------------------------------------------------------

    async def read(self, call: Call) -> dict[str, Any]:
        """Stream a file (from ``offset``, at most ``length`` bytes) as it gets credit."""
        path = _path_param(call)
        offset = _count_param(call, "offset", 0) or 0
        length = _count_param(call, "length", None)
        creds = await self._credentials(call)
        fd, size = await self._run(creds, _open_for_read, path)
        sent = 0
        try:
            while length is None or sent < length:
                # Read no more than the client will take now: memory stays at one chunk.
                want = min(await call.wait_for_credit(), READ_CHUNK)
                if length is not None:
                    want = min(want, length - sent)
                with _naming(path):
                    chunk = await trio.to_thread.run_sync(
                        os.pread, fd, want, offset + sent, limiter=self.limiter
                    )
                if not chunk:
                    break
                await call.send_data("file", chunk)
                sent += len(chunk)
        finally:
            os.close(fd)
        await call.send_eof("file")
        return {"size": size, "bytes": sent}

    async def write(self, call: Call) -> dict[str, Any]:
        """Receive a file's content; atomic unless ``append``. See FileWriter."""
        path = _path_param(call)
        mode = _mode_param(call, None)
        owner_spec: str | int | None = param(call, "owner", (str, int), None)
        parents: bool = param(call, "parents", bool, False)
        append: bool = param(call, "append", bool, False)
        exclusive: bool = param(call, "exclusive", bool, False)
        creds = await self._credentials(call)
        owner = None
        if owner_spec is not None:
            owner = await trio.to_thread.run_sync(parse_owner, owner_spec, limiter=self.limiter)
        writer = await self._run(
            creds,
            functools.partial(
                FileWriter.for_path,
                path,
                parents=parents,
                mode=mode,
                owner=owner,
                append=append,
                exclusive=exclusive,
            ),
        )
        done = False
        try:
            await call.grant(WRITE_WINDOW)
            while True:
                batch = bytearray()
                while len(batch) < WRITE_BATCH and (chunk := await call.receive()):
                    batch += chunk
                if not batch:
                    break
                # Granting before the disk write lets the client send the next batch meanwhile.
                await call.grant(len(batch))
                await self._run(creds, writer.write, batch)
            await self._run(creds, writer.commit)
            done = True
        finally:
            if not done:
                await self._cleanup(creds, writer.abort)
        return {"path": path, "bytes": writer.written}

    async def read_tar(self, call: Call) -> dict[str, Any]:
        """Stream a tar archive of a directory (or one file) on stream "tar"."""
        path = _path_param(call)
        creds = await self._credentials(call)

        def send(data: bytes) -> None:
            trio.from_thread.run(call.send_data, "tar", data)

        result = await trio.to_thread.run_sync(
            functools.partial(run_as, creds, archive_tree, path, send),
            limiter=self.transfer_limiter,
        )
        await call.send_eof("tar")
        return result

    async def write_tar(self, call: Call) -> dict[str, Any]:
        """Extract an uploaded tar stream into a directory, refusing unsafe members."""
        path = _path_param(call)
        creds = await self._credentials(call)

        async def receive(size: int) -> bytes:
            chunk = await call.receive()
            if chunk:
                await call.grant(len(chunk))
            return bytes(chunk)

        def read(size: int) -> bytes:
            return trio.from_thread.run(receive, size)

        await call.grant(WRITE_WINDOW)
        return await trio.to_thread.run_sync(
            functools.partial(run_as, creds, extract_tar, path, read),
            limiter=self.transfer_limiter,
        )
