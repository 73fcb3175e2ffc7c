"""Checking on processes the tests' commands started (by pid files they wrote)."""

from __future__ import annotations

import time


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_until_dead(pids: list[int], timeout: float = 15.0) -> bool:
    """True once none of ``pids`` is alive; False if some still are after ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
