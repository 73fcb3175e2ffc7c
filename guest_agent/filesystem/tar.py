"""Safe tar archives: extract a stream into a directory, archive a tree into a stream.

Blocking, bounded memory. Used by the agent (file.read_tar, file.write_tar) and by the host
client (download_dir, upload_dir), which does not trust a guest's archive either.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import posixpath
import stat
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, cast

from ..protocol import MAX_CHUNK_SIZE, InvalidParams
from .atomic import FileWriter, temp_name
from .ops import READ_CHUNK, Names, naming

if TYPE_CHECKING:
    import tarfile

_TAR_BLOCK = 512
_TAR_RECORD = 20 * _TAR_BLOCK


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


# Permission bits an archive may set: never setuid or setgid (the archive is untrusted on
# either side: a guest's for the host, a client's for the guest).
_SAFE_MODE = 0o1777


def _check_symlink(parts: list[str], target: str) -> None:
    """Refuse a symlink whose target leaves the tree (judged from where the link sits)."""
    if target.startswith("/"):
        raise UnsafeArchive(f"symlink {'/'.join(parts)!r} points to an absolute path {target!r}")
    steps = [step for step in target.split("/") if step not in ("", ".")]
    ups = len(steps) - len(list(itertools.dropwhile(lambda step: step == "..", steps)))
    # ".." only at the start: after a name it could climb out through another symlink
    # ("d -> ." then "e -> d/../x"), which a lexical check cannot see.
    if ".." in steps[ups:] or ups > len(parts) - 1:
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
    tmp = temp_name(name)
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

    with naming(root):
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
                    with naming(display, replace=True):
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
                os.fchmod(fd, mode & _SAFE_MODE)
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
            parent_fd,
            name,
            display,
            mode=member.mode & _SAFE_MODE,
            mtime_ns=int(member.mtime * 1e9),
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
    with naming(path):
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
            with naming(directory):
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
        self._names = Names()
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
            with naming(full):
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
        with naming(full):
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self.header(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
            remaining = info.size
            with naming(full):
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
