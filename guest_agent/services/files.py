"""The files service: streamed, atomic, permission-correct file operations.

Every blocking filesystem call (``guest_agent.filesystem``) runs in a worker thread (bounded
by ``config.file_workers``) with the requesting user's filesystem credentials (see
``filesystem.credentials``), so the kernel applies that user's permissions and new files belong
to them. Writes go to a temp file in the target directory and are renamed into place after an
fsync, so a writer that fails, cancels or disconnects leaves the old file as it was and no temp
file behind.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from ..filesystem import ops
from ..filesystem.atomic import FileWriter
from ..filesystem.credentials import parse_owner, run_as
from ..filesystem.tar import archive_tree, extract_tar
from ..protocol import InvalidParams
from ..users import Credentials, resolve_user
from . import Call, Handler, Runtime, param

T = TypeVar("T")

# Credit granted to an uploader: the most inbound data queued per write stream. Twice the
# batch, so that the client sends the next batch while the worker writes this one; a 2 MiB
# window with 1 MiB batches cost ~0.2 s/GiB more CPU (the client waited for credit often).
WRITE_WINDOW = 4 << 20
# Inbound data gathered before one worker-thread write (one writev of the chunks).
WRITE_BATCH = 2 << 20


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


def _resolve_and_run(spec: str | int | None, fn: Callable[..., T], *args: Any) -> T:
    return run_as(None if spec is None else resolve_user(spec), fn, *args)


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
        return await self._as_caller(call, ops.stat_path, path, follow)

    async def list(self, call: Call) -> dict[str, Any]:
        """Entries of a directory, ``depth`` levels deep, bounded to one frame."""
        path = _path_param(call)
        depth = _count_param(call, "depth", 1)
        if not depth:
            raise InvalidParams("file.list: depth must be at least 1")
        return await self._as_caller(call, ops.list_dir, path, depth)

    async def mkdir(self, call: Call) -> dict[str, Any]:
        """Create a directory (and its parents with ``parents``)."""
        path = _path_param(call)
        parents: bool = param(call, "parents", bool, False)
        mode = _mode_param(call, 0o755)
        return await self._as_caller(call, ops.mkdir, path, parents, mode)

    async def remove(self, call: Call) -> dict[str, Any]:
        """Remove a file, symlink or empty directory; a whole tree with ``recursive``."""
        path = _path_param(call)
        recursive: bool = param(call, "recursive", bool, False)
        return await self._as_caller(call, ops.remove, path, recursive)

    async def rename(self, call: Call) -> dict[str, Any]:
        """Rename (atomically on one filesystem; copy and delete across filesystems)."""
        src, dst = _path_param(call, "src"), _path_param(call, "dst")
        return await self._as_caller(call, ops.rename, src, dst)

    async def chmod(self, call: Call) -> dict[str, Any]:
        """Set permission bits."""
        path = _path_param(call)
        param(call, "mode", int)  # required here, unlike for write and mkdir
        mode = _mode_param(call, None)
        return await self._as_caller(call, ops.chmod, path, mode)

    async def chown(self, call: Call) -> dict[str, Any]:
        """Set owner and/or group: ``USER[:GROUP]``, ``:GROUP``, names or numbers."""
        path = _path_param(call)
        owner: str | int = param(call, "owner", (str, int))
        return await self._as_caller(call, ops.chown, path, owner)

    # ---- streams ---------------------------------------------------------------------

    async def read(self, call: Call) -> dict[str, Any]:
        """Stream a file (from ``offset``, at most ``length`` bytes) as it gets credit."""
        path = _path_param(call)
        offset = _count_param(call, "offset", 0) or 0
        length = _count_param(call, "length", None)
        creds = await self._credentials(call)
        fd, size = await self._run(creds, ops.open_for_read, path)
        sent = 0
        try:
            # One buffer, read into and sent from (send_data sends slices of it, not copies,
            # and returns once they are written out): memory stays at one chunk. Small files
            # get a small one (but /proc files say size 0, so never tiny).
            buffer = memoryview(bytearray(min(ops.READ_CHUNK, max(size, 64 << 10))))
            while length is None or sent < length:
                # Read no more than the client will take now.
                want = min(await call.wait_for_credit(), len(buffer))
                if length is not None:
                    want = min(want, length - sent)
                with ops.naming(path):
                    count = await trio.to_thread.run_sync(
                        os.preadv, fd, [buffer[:want]], offset + sent, limiter=self.limiter
                    )
                if not count:
                    break
                await call.send_data("file", buffer[:count])
                sent += count
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
                # The chunks as received, written with one writev: no joining copy.
                batch: list[bytes | bytearray] = []
                size = 0
                while size < WRITE_BATCH and (chunk := await call.receive()):
                    batch.append(chunk)
                    size += len(chunk)
                if not batch:
                    break
                # Granting before the disk write lets the client send the next batch meanwhile.
                await call.grant(size)
                await self._run(creds, writer.write_chunks, batch)
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
