"""``guest-agent-ctl``: the operator's CLI, one module per command group.

Exit codes follow ssh / docker exec / timeout(1): the remote command's code; 128+N when it
was killed by signal N; 124 when it timed out; 125 for agent or transport errors; 126 not
executable; 127 not found; 2 for usage errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable, Sequence

import trio

from ..client import Client, ConnectionLost, ConnectTimeout
from ..protocol import (
    AgentError,
    AuthenticationFailed,
    ConnectionRefusedByAgent,
    ProtocolError,
    VersionMismatch,
)
from ..transport import AddressError, TransportError
from ._output import fail

DEFAULT_ADDRESS = "vsock:3:1024"

Command = Callable[[Client, argparse.Namespace], Awaitable[int]]


def build_parser() -> argparse.ArgumentParser:
    """The CLI's flags and subcommands."""
    from . import exec as exec_commands
    from . import files, system

    p = argparse.ArgumentParser(prog="guest-agent-ctl", description="Talk to a guest agent.")
    p.add_argument(
        "--connect",
        "-c",
        metavar="ADDR",
        default=os.environ.get("GUEST_AGENT_ADDR", DEFAULT_ADDRESS),
        help="agent address (default $GUEST_AGENT_ADDR or %(default)s): vsock:CID:PORT, "
        "hybrid:/path/uds:PORT, unix:/path, tcp:HOST:PORT",
    )
    p.add_argument("--token", metavar="T", default=os.environ.get("GUEST_AGENT_TOKEN"))
    p.add_argument("--token-file", metavar="F")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--connect-timeout", type=float, default=10.0, metavar="S", help="default %(default)s s"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    system.register(sub)
    exec_commands.register(sub)
    files.register(sub)
    return p


async def _run(command: Command, args: argparse.Namespace, token: str | None) -> int:
    async with Client.connect(args.connect, token=token, timeout=args.connect_timeout) as client:
        return await command(client, args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of guest-agent-ctl."""
    args = build_parser().parse_args(argv)
    token = args.token
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            return fail(f"cannot read token file: {exc}")
    try:
        return trio.run(_run, args.func, args, token)
    except AddressError as exc:
        return fail(str(exc), 2)
    except ConnectTimeout as exc:
        return fail(str(exc))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        return fail(f"agent not listening at {args.connect}: {exc.strerror or exc}")
    except VersionMismatch as exc:
        return fail(f"protocol version mismatch: {exc}")
    except AuthenticationFailed as exc:
        return fail(f"handshake refused: {exc} (check --token / --token-file)")
    except ConnectionRefusedByAgent as exc:
        return fail(f"the agent refused the connection: {exc}")
    except AgentError as exc:
        return fail(f"{exc.code}: {exc}")
    except (ConnectionLost, TransportError, ProtocolError) as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"cannot reach the agent at {args.connect}: {exc}")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
