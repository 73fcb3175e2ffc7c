"""``guest-agent`` / ``python -m guest_agent``: run the daemon until SIGTERM or SIGINT."""

from __future__ import annotations

import time

# Taken before the heavy imports so that "info" can report what they cost.
_IMPORT_START = time.clock_gettime(time.CLOCK_BOOTTIME)

import ctypes  # noqa: E402  (trio has loaded it already)
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import trio  # noqa: E402

from .config import Config, ConfigError, load_config, log_level_number  # noqa: E402
from .logs import setup_logging  # noqa: E402
from .server import boottime, serve  # noqa: E402

log = logging.getLogger("guest_agent")

# glibc's mallopt parameter (malloc.h).
_M_ARENA_MAX = -8


def _process_start() -> float:
    """Seconds since boot at which this process started (from /proc/self/stat)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORT_START


def _protect_from_oom() -> None:
    """The agent must survive a user's memory hog; children reset this to 0."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError as exc:
        log.info("event=oom_protect_skipped error=%r", exc)


def _one_malloc_arena() -> None:
    """Curb the RSS creep after large transfers (27 MiB idle -> 33-37 after 1 GiB each way).

    The file workers' threads each got a malloc arena that kept freed 256 KiB-1 MiB buffers;
    with one arena the agent idles at ~32 MiB after them, at no CPU cost measured. Not
    M_MMAP_THRESHOLD=128 KiB: it ends at 29 MiB, but mapping and faulting in every buffer
    afresh cost +25-80% agent CPU per GiB streamed, read or written.
    """
    try:
        if not ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 1):
            log.info("event=mallopt_refused param=M_ARENA_MAX")
    except (OSError, AttributeError):  # not glibc: its allocator has its own habits
        log.info("event=mallopt_unavailable")


async def _run(config: Config, timings: dict[str, float]) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await nursery.start(
                lambda task_status: serve(config, timings=timings, task_status=task_status)
            )
            async for signum in signals:
                log.info("event=stopping signal=%s", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the daemon."""
    timings = {"process_start": _process_start(), "imports_start": _IMPORT_START}
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"guest-agent: {exc}", file=sys.stderr)
        return 2
    setup_logging(log_level_number(config))
    timings["imports_done"] = boottime()
    _one_malloc_arena()
    _protect_from_oom()
    try:
        trio.run(_run, config, timings)
    except OSError as exc:
        log.error("event=fatal error=%r", exc)
        return 1
    log.info("event=stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
