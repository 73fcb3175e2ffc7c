"""``exec``, ``shell``, ``ps``, ``attach``, ``kill`` and ``wait``: commands like docker exec."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import sys
import termios
import tty
from collections.abc import Iterator
from typing import Any

import trio

from ..client import Client, ExecStream
from ..protocol import InvalidParams, RemoteOSError
from ..signals import signal_number
from ._output import emit, fail

EXIT_TIMED_OUT = 124
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
_STDIN_CHUNK = 64 << 10
LOGIN_SHELL = 'exec "${SHELL:-/bin/sh}" -l'


def register(sub: Any) -> None:
    """Add this module's subcommands."""
    p = sub.add_parser("exec", help="run a command in the guest (like docker exec)")
    _exec_flags(p)
    p.add_argument("--detach", "-d", action="store_true", help="print the exec id and return")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("shell", help="interactive login shell (exec -it of the user's shell)")
    _exec_flags(p, interactive=False)
    p.set_defaults(func=cmd_shell, interactive=True, tty=True, detach=False)

    p = sub.add_parser("ps", help="list running and recently finished execs")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("attach", help="attach to an exec's output (replays what is kept)")
    p.add_argument("-i", "--interactive", action="store_true", help="forward local stdin")
    p.add_argument("exec_id")
    p.set_defaults(func=cmd_attach, tty=False)

    p = sub.add_parser("kill", help="kill an exec's process tree (TERM, grace, KILL)")
    p.add_argument("--signal", "-s", metavar="SIG", help="send only this signal to the tree")
    p.add_argument("--grace", type=float, metavar="S", help="seconds between TERM and KILL")
    p.add_argument("exec_id")
    p.set_defaults(func=cmd_kill)

    p = sub.add_parser("wait", help="wait for an exec to end; exit with its exit code")
    p.add_argument("--timeout", type=float, metavar="S")
    p.add_argument("exec_id")
    p.set_defaults(func=cmd_wait)


def _exec_flags(p: argparse.ArgumentParser, interactive: bool = True) -> None:
    p.add_argument("--timeout", type=float, metavar="S", help="kill the tree after S seconds")
    p.add_argument("--kill-grace", type=float, metavar="S", help="seconds between TERM and KILL")
    p.add_argument("--env", "-e", action="append", default=[], metavar="K=V")
    p.add_argument("--cwd", "-w", metavar="DIR")
    p.add_argument("--user", "-u", metavar="USER", help="name, uid or uid:gid")
    if interactive:
        p.add_argument("-i", "--interactive", action="store_true", help="forward local stdin")
        p.add_argument("-t", "--tty", action="store_true", help="allocate a terminal")


def exit_code_for(status: dict[str, Any]) -> int:
    """The local exit code for an exec's end status (timeout(1) and shell conventions)."""
    if status.get("timed_out"):
        return EXIT_TIMED_OUT
    if status.get("signal"):
        return 128 + signal_number(status["signal"])
    code = status.get("exit_code")
    return int(code) if code is not None else 1


def _options(args: argparse.Namespace) -> dict[str, Any]:
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidParams(f"--env {item!r} is not K=V")
        env[key] = value
    options: dict[str, Any] = {
        "env": env,
        "cwd": args.cwd,
        "user": args.user,
        "timeout": args.timeout,
        "kill_grace": args.kill_grace,
    }
    if args.tty:
        size = os.get_terminal_size(0) if os.isatty(0) else os.terminal_size((80, 24))
        options["pty"] = (size.lines, size.columns)
    return options


async def cmd_exec(client: Client, args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        return fail("exec: no command given (exec [OPTIONS] -- CMD [ARG...])", 2)
    return await _run(client, args, argv=argv)


async def cmd_shell(client: Client, args: argparse.Namespace) -> int:
    return await _run(client, args, command=LOGIN_SHELL)


async def _run(
    client: Client, args: argparse.Namespace, argv: list[str] | None = None, **extra: Any
) -> int:
    options = {**_options(args), **extra}
    try:
        if args.detach:
            exec_id = await client.start_detached(argv, **options)
            emit(args, {"exec_id": exec_id}, exec_id)
            return 0
        async with client.open_exec(argv, stdin=args.interactive, **options) as ex:
            return await _attached(client, ex, args)
    except RemoteOSError as exc:
        what = argv[0] if argv else "shell"
        code = EXIT_NOT_FOUND if exc.errno == "ENOENT" else EXIT_NOT_EXECUTABLE
        if exc.errno not in ("ENOENT", "EACCES", "ENOEXEC", "EISDIR", "ENOTDIR", "EPERM"):
            code = 125
        return fail(f"exec {what}: {exc}", code)


async def cmd_attach(client: Client, args: argparse.Namespace) -> int:
    async with client.attach_exec(args.exec_id) as ex:
        lost = ex.announcement.get("lost", {})
        if any(lost.values()):
            print(f"guest-agent-ctl: {lost} bytes of output were lost", file=sys.stderr)
        return await _attached(client, ex, args)


async def _attached(client: Client, ex: ExecStream, args: argparse.Namespace) -> int:
    """Copy output out and stdin in until the exec ends; Ctrl-C goes to the command."""
    with _raw_terminal(args.tty), trio.open_signal_receiver(signal.SIGINT, signal.SIGWINCH) as sigs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_forward_signals, ex, sigs)
            if args.interactive:
                nursery.start_soon(_forward_stdin, ex)
            outputs = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
            async for name, data in ex:
                out = outputs.get(name, sys.stdout.buffer)
                out.write(data)
                out.flush()
            nursery.cancel_scope.cancel()
    result = ex.result or {}
    if result.get("detached"):
        emit(args, result, f"detached from {ex.exec_id}")
        return 0
    return exit_code_for(result)


async def _forward_signals(ex: ExecStream, signals: Any) -> None:
    interrupts = 0
    async for signum in signals:
        if signum == signal.SIGWINCH:
            with contextlib.suppress(OSError):
                size = os.get_terminal_size(0)
                await ex.resize(size.lines, size.columns)
            continue
        interrupts += 1
        # First Ctrl-C asks the command to stop; the second kills its tree.
        await ex.signal("SIGINT" if interrupts == 1 else "SIGKILL")


async def _forward_stdin(ex: ExecStream) -> None:
    while True:
        data = await trio.to_thread.run_sync(os.read, 0, _STDIN_CHUNK, abandon_on_cancel=True)
        if not data:
            await ex.close_stdin()
            return
        await ex.write(data)


@contextlib.contextmanager
def _raw_terminal(enabled: bool) -> Iterator[None]:
    """Raw mode on the local terminal for -t, restored however we leave."""
    if not enabled or not os.isatty(0):
        yield
        return
    saved = termios.tcgetattr(0)
    tty.setraw(0)
    try:
        yield
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)


async def cmd_ps(client: Client, args: argparse.Namespace) -> int:
    execs = await client.exec_list()
    rows = ["EXEC ID       PID      STATE     EXIT  USER      STARTED   COMMAND"]
    for e in execs:
        started = datetime.datetime.fromtimestamp(e["started_at"]).strftime("%H:%M:%S")
        exit_text = e["signal"] or ("" if e["exit_code"] is None else str(e["exit_code"]))
        command = " ".join(e["argv"])
        rows.append(
            f"{e['exec_id']:<13} {e['pid']:<8} {e['state']:<9} {exit_text:<5} "
            f"{e['user']:<9} {started:<9} {command[:60]}"
        )
    emit(args, execs, "\n".join(rows))
    return 0


async def cmd_kill(client: Client, args: argparse.Namespace) -> int:
    if args.signal:
        await client.exec_signal(args.exec_id, args.signal)
        return 0
    status = await client.exec_kill(args.exec_id, args.grace)
    emit(args, status, f"{args.exec_id}: {status['signal'] or status['exit_code']}")
    return 0


async def cmd_wait(client: Client, args: argparse.Namespace) -> int:
    status = await client.exec_wait(args.exec_id, args.timeout)
    if status["state"] != "exited":
        emit(args, status, f"{args.exec_id}: still {status['state']}")
        return EXIT_TIMED_OUT
    emit(args, status, f"{args.exec_id}: exit {status['exit_code']} signal {status['signal']}")
    return exit_code_for(status)
