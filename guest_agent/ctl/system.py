"""``ping`` and ``info``."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..client import Client
from ._output import emit


def register(sub: Any) -> None:
    """Add this module's subcommands."""
    ping = sub.add_parser("ping", help="check that the agent answers")
    ping.set_defaults(func=cmd_ping)
    info = sub.add_parser("info", help="agent versions, capabilities, uptime")
    info.set_defaults(func=cmd_info)


async def cmd_ping(client: Client, args: argparse.Namespace) -> int:
    started = time.perf_counter()
    await client.ping()
    elapsed_ms = (time.perf_counter() - started) * 1000
    emit(args, {"ok": True, "rtt_ms": round(elapsed_ms, 3)}, f"pong in {elapsed_ms:.2f} ms")
    return 0


async def cmd_info(client: Client, args: argparse.Namespace) -> int:
    info = await client.info()
    lines = [f"{key}: {value}" for key, value in sorted(info.items())]
    emit(args, info, "\n".join(lines))
    return 0
