"""``cp``, ``cat``, ``ls``, ``stat``, ``rm``, ``mkdir``, ``mv``, ``chmod``, ``chown``.

Missing files, permission errors and the like print one line and exit 1; agent and transport
errors keep the CLI's usual 125.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import posixpath
import stat as stat_module
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

from ..client import Client, ConnectionLost
from ..protocol import AgentError, InvalidParams, RemoteOSError
from ._output import emit

EXIT_FILE_ERROR = 1
EXIT_BROKEN_PIPE = 128 + 13  # as a shell reports a command killed by SIGPIPE
GUEST_PREFIX = "guest:"
_LOCAL_CHUNK = 1 << 20

FileCommand = Callable[[Client, argparse.Namespace], Awaitable[int]]


def register(sub: Any) -> None:
    """Add this module's subcommands."""

    def add(name: str, help_text: str, func: FileCommand, subject: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
        p.add_argument("--user", "-u", metavar="USER", help="act as this guest user")
        p.set_defaults(func=_reporting_errors(name, subject, func))
        return p

    cp = add("cp", "copy files or directories between here and the guest", cmd_cp, "src")
    cp.add_argument("src", help="guest:PATH, a local path, or - for stdin")
    cp.add_argument("dst", help="guest:PATH, a local path, or - for stdout")

    cat = add("cat", "print a guest file", cmd_cat, "path")
    cat.add_argument("path")

    ls = add("ls", "list a guest directory", cmd_ls, "path")
    ls.add_argument("-l", dest="long", action="store_true", help="long format")
    ls.add_argument("--depth", type=int, default=1, metavar="N", help="levels (default 1)")
    ls.add_argument("path")
    _json_flag(ls)

    st = add("stat", "facts about a guest path", cmd_stat, "path")
    st.add_argument("-L", dest="follow", action="store_true", help="follow a symlink")
    st.add_argument("path")
    _json_flag(st)

    rm = add("rm", "remove a guest file or directory", cmd_rm, "path")
    rm.add_argument("-r", dest="recursive", action="store_true", help="a whole tree")
    rm.add_argument("path")

    mkdir = add("mkdir", "create a guest directory", cmd_mkdir, "path")
    mkdir.add_argument("-p", dest="parents", action="store_true", help="with parents; no error")
    mkdir.add_argument("-m", dest="mode", type=_octal, metavar="MODE", help="octal mode")
    mkdir.add_argument("path")

    mv = add("mv", "rename or move a guest path", cmd_mv, "src")
    mv.add_argument("src")
    mv.add_argument("dst")

    chmod = add("chmod", "set a guest path's mode", cmd_chmod, "path")
    chmod.add_argument("mode", type=_octal, help="octal, e.g. 644")
    chmod.add_argument("path")

    chown = add("chown", "set a guest path's owner", cmd_chown, "path")
    chown.add_argument("owner", metavar="USER[:GROUP]")
    chown.add_argument("path")


def _json_flag(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: when absent here, the global --json (before the command) still counts.
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="as JSON")


def _octal(text: str) -> int:
    try:
        mode = int(text.removeprefix("0o"), 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode") from None
    if not 0 <= mode <= 0o7777:
        raise argparse.ArgumentTypeError(f"{text!r} is not a permission mode")
    return mode


def _reporting_errors(name: str, subject: str, command: FileCommand) -> FileCommand:
    """Turn file errors (guest or local) into one line and exit code 1."""

    @functools.wraps(command)
    async def run(client: Client, args: argparse.Namespace) -> int:
        what = f"{name} {getattr(args, subject)}"
        try:
            return await command(client, args)
        except (RemoteOSError, InvalidParams) as exc:
            return _fail(f"{what}: {_reason(exc, getattr(args, subject))}")
        except ConnectionLost:
            raise  # a transport error: the CLI's 125
        except BrokenPipeError:
            # The reader of our stdout went away (``| head``): end quietly, as cat(1) does.
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_BROKEN_PIPE
        except OSError as exc:  # a local file in cp
            where = f": {exc.filename}" if exc.filename else ""
            return _fail(f"{what}: {exc.strerror or exc}{where}")

    return run


def _reason(exc: AgentError, subject: str) -> str:
    message = exc.message
    # The agent names the path; when it is the one we already named, once is enough.
    for path in (subject, _guest_path(subject)):
        if path and message.endswith(f": {path}"):
            message = message[: -len(path) - 2]
    return f"{exc.errno}: {message}" if exc.errno else message


def _fail(message: str) -> int:
    print(f"guest-agent-ctl: {message}", file=sys.stderr)
    return EXIT_FILE_ERROR


def _guest_path(spec: str) -> str | None:
    return spec[len(GUEST_PREFIX) :] if spec.startswith(GUEST_PREFIX) else None


class _Progress:
    """A one-line progress report on stderr, only when stderr is a terminal."""

    def __init__(self, label: str, total: int | None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.enabled = sys.stderr.isatty()
        self._started = time.monotonic()
        self._shown = 0.0

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and now - self._shown >= 0.1:
            self._shown = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.done / max(now - self._started, 1e-6)
        text = f"{self.label}: {_size(self.done)}"
        if self.total:
            width = 30
            filled = min(width, width * self.done // self.total)
            percent = min(100, 100 * self.done // self.total)
            text = f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {percent:3d}% "
            text += f"{_size(self.done)}/{_size(self.total)}"
        sys.stderr.write(f"\r{text}  {_size(int(rate))}/s\x1b[K")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            sys.stderr.write("\n")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


async def _local_chunks(fd: int, progress: _Progress) -> AsyncIterator[bytes]:
    """A local file or stdin, read in worker threads."""
    while chunk := await trio.to_thread.run_sync(os.read, fd, _LOCAL_CHUNK):
        progress(len(chunk))
        yield chunk


def _write_stdout(chunk: bytes) -> None:
    sys.stdout.buffer.write(chunk)


async def _is_guest_dir(client: Client, path: str, user: str | None) -> bool:
    try:
        info = await client.stat(path, follow=True, user=user)
    except RemoteOSError as exc:
        if exc.errno == "ENOENT":
            return False
        raise
    return bool(info["type"] == "dir")


# ---- commands ----------------------------------------------------------------------------


async def cmd_cp(client: Client, args: argparse.Namespace) -> int:
    src_guest, dst_guest = _guest_path(args.src), _guest_path(args.dst)
    if (src_guest is None) == (dst_guest is None):
        print("guest-agent-ctl: cp: exactly one side must be guest:PATH", file=sys.stderr)
        return 2
    if src_guest is not None:
        return await _copy_out(client, src_guest, args.dst, args.user)
    assert dst_guest is not None
    return await _copy_in(client, args.src, dst_guest, args.user)


async def _copy_out(client: Client, path: str, local: str, user: str | None) -> int:
    info = await client.stat(path, follow=True, user=user)
    name = posixpath.basename(path.rstrip("/")) or "root"
    if info["type"] == "dir":
        progress = _Progress(name, None)
        if local == "-":
            # A directory on stdout is a tar stream, as docker cp writes it.
            await client.download_tar(path, _counting(_write_stdout, progress), user=user)
        else:
            target = await trio.to_thread.run_sync(_local_target, local, name)
            await client.download_dir(path, target, user=user, progress=progress)
        progress.finish()
        return 0
    progress = _Progress(name, info["size"])
    if local == "-":
        await client.read_file_into(path, _counting(_write_stdout, progress), user=user)
        sys.stdout.buffer.flush()
        progress.finish()
        return 0
    from ..filesystem.atomic import FileWriter

    target = await trio.to_thread.run_sync(_local_target, local, name)
    # The local copy is atomic too: a failed download leaves what was there before.
    writer = await trio.to_thread.run_sync(
        functools.partial(FileWriter.for_path, target, mode=info["mode"])
    )
    try:

        async def sink(chunk: bytes) -> None:
            await trio.to_thread.run_sync(writer.write, chunk)
            progress(len(chunk))

        await client.read_file_into(path, sink, user=user)
        await trio.to_thread.run_sync(writer.commit)
    except BaseException:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(writer.abort)
        raise
    progress.finish()
    return 0


def _local_target(local: str, name: str) -> str:
    """Where a download lands: inside ``local`` if it is a directory (as cp does), else there."""
    target = os.path.join(local, name) if os.path.isdir(local) else local
    return os.path.abspath(target)


def _counting(sink: Callable[[bytes], object], progress: _Progress) -> Callable[[bytes], None]:
    def counted(chunk: bytes) -> None:
        sink(chunk)
        progress(len(chunk))

    return counted


async def _copy_in(client: Client, local: str, path: str, user: str | None) -> int:
    if local == "-":
        progress = _Progress("stdin", None)
        await client.write_file(path, _local_chunks(sys.stdin.fileno(), progress), user=user)
        progress.finish()
        return 0
    st = os.stat(local)
    name = await trio.to_thread.run_sync(lambda: os.path.basename(os.path.abspath(local)))
    target = posixpath.join(path, name) if await _is_guest_dir(client, path, user) else path
    if stat_module.S_ISDIR(st.st_mode):
        progress = _Progress(name, None)
        await client.upload_dir(local, target, user=user, progress=progress)
        progress.finish()
        return 0
    progress = _Progress(name, st.st_size)
    fd = os.open(local, os.O_RDONLY | os.O_CLOEXEC)
    try:
        mode = stat_module.S_IMODE(st.st_mode)
        chunks = _local_chunks(fd, progress)
        await client.write_file(target, chunks, mode=mode, user=user)
    finally:
        os.close(fd)
    progress.finish()
    return 0


async def cmd_cat(client: Client, args: argparse.Namespace) -> int:
    await client.read_file_into(args.path, _write_stdout, user=args.user)
    sys.stdout.buffer.flush()
    return 0


def _long_line(entry: dict[str, Any], path: str) -> str:
    kinds = {"dir": stat_module.S_IFDIR, "symlink": stat_module.S_IFLNK}
    kinds.update(fifo=stat_module.S_IFIFO, socket=stat_module.S_IFSOCK)
    kinds.update(char=stat_module.S_IFCHR, block=stat_module.S_IFBLK)
    mode = stat_module.filemode(kinds.get(entry["type"], stat_module.S_IFREG) | entry["mode"])
    owner = entry["owner"] or str(entry["uid"])
    group = entry["group"] or str(entry["gid"])
    mtime = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["mtime"]))
    line = f"{mode} {owner:<8} {group:<8} {entry['size']:>10} {mtime} {path}"
    if entry["target"] is not None:
        line += f" -> {entry['target']}"
    return line


async def cmd_ls(client: Client, args: argparse.Namespace) -> int:
    try:
        result = await client.list_dir(args.path, depth=args.depth, user=args.user)
    except RemoteOSError as exc:
        if exc.errno != "ENOTDIR":
            raise
        # Listing a file shows that file, as ls(1) does.
        entry = await client.stat(args.path, user=args.user)
        result = {"entries": [{**entry, "path": entry["name"]}], "truncated": False}
    entries = result["entries"]
    lines = [_long_line(e, e["path"]) if args.long else e["path"] for e in entries]
    if entries or args.json:
        emit(args, result, "\n".join(lines))
    if result.get("truncated"):
        print(f"guest-agent-ctl: ls {args.path}: listing truncated", file=sys.stderr)
    return 0


async def cmd_stat(client: Client, args: argparse.Namespace) -> int:
    info = await client.stat(args.path, follow=args.follow, user=args.user)
    shown = {**info, "mode": f"{info['mode']:04o}"}
    shown["mtime"] = time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(info["mtime"]))
    lines = [f"{key}: {value}" for key, value in shown.items() if value is not None]
    emit(args, info, "\n".join(lines))
    return 0


async def cmd_rm(client: Client, args: argparse.Namespace) -> int:
    await client.remove(args.path, recursive=args.recursive, user=args.user)
    return 0


async def cmd_mkdir(client: Client, args: argparse.Namespace) -> int:
    await client.mkdir(args.path, parents=args.parents, mode=args.mode, user=args.user)
    return 0


async def cmd_mv(client: Client, args: argparse.Namespace) -> int:
    await client.rename(args.src, args.dst, user=args.user)
    return 0


async def cmd_chmod(client: Client, args: argparse.Namespace) -> int:
    await client.chmod(args.path, args.mode, user=args.user)
    return 0


async def cmd_chown(client: Client, args: argparse.Namespace) -> int:
    await client.chown(args.path, args.owner, user=args.user)
    return 0
