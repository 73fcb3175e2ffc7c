"""The import-time budget (conventions rule 8), checked by what start-up imports, not by a clock.

Timings on a shared machine are noise; the set of modules the agent has loaded once it is ready
to answer is not. The checks run in a fresh interpreter: this test process imported it all
long ago.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Runs the daemon's start-up (its imports, the config, serve() up to bound listeners) and
# prints the modules loaded at that point, one per line.
_READY = """
import sys
import trio
import guest_agent.__main__
from guest_agent.config import load_config
from guest_agent.server import serve

async def ready(path):
    config = load_config(["--listen", f"unix:{path}", "--cmdline-file", ""])
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve(config, task_status=task_status))
        print("\\n".join(sorted(sys.modules)))
        nursery.cancel_scope.cancel()

trio.run(ready, sys.argv[1])
"""
# The floor the benchmark compares start-up with.
_FLOOR = "import sys, trio, msgpack; print('\\n'.join(sorted(sys.modules)))"

# Never at start-up: heavyweights (rule 8), tar (only file transfers need it) and what only
# a config file needs.
NEVER = {"psutil", "pyroute2", "asyncio", "json", "tarfile"}
# All that start-up may add to `import trio, msgpack`, besides the agent's own modules. trio
# itself already loads logging, subprocess, ctypes, hmac and ssl, so keeping those out of the
# agent would gain nothing.
EXTRA_STDLIB = {"argparse", "gettext", "dataclasses", "glob", "grp", "pwd", "secrets", "termios"}


def _modules(*args: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", *args], capture_output=True, text=True, check=True, timeout=60
    )
    return set(out.stdout.split())


def _within(module: str, packages: set[str]) -> bool:
    return any(module == name or module.startswith(f"{name}.") for name in packages)


@pytest.fixture(scope="module")
def ready_modules() -> set[str]:
    path = Path(f"/tmp/ga-startup-{os.getpid()}.sock")  # unix socket paths are short
    try:
        return _modules(_READY, str(path))
    finally:
        path.unlink(missing_ok=True)


def test_start_up_imports_no_heavyweights(ready_modules: set[str]) -> None:
    assert "guest_agent.server" in ready_modules  # the script did get to ready
    assert sorted(m for m in ready_modules if _within(m, NEVER)) == []


def test_start_up_adds_little_to_trio_and_msgpack(ready_modules: set[str]) -> None:
    extra = ready_modules - _modules(_FLOOR)
    unexpected = sorted(m for m in extra if not _within(m, {"guest_agent"} | EXTRA_STDLIB))
    assert unexpected == [], "new start-up imports: import them where they are used"
