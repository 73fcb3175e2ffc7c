"""Finding an exec's processes without a cgroup: its process group, session and descendants.

The fallback where cgroup2 is not writable. A process that left the session and was
orphaned (double fork plus setsid) before any sweep saw it cannot be told apart from
anyone else's here: only a cgroup contains those, which is why the agent uses one
wherever it can.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple


class _Stat(NamedTuple):
    ppid: int
    pgrp: int
    session: int
    start: int  # clock ticks after boot: tells a process from a later one with its pid


def _read_stat(pid: int) -> _Stat | None:
    """The fields we need from /proc/PID/stat, or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return _Stat(int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


def tree_pids(leader: int) -> dict[int, int]:
    """pid -> start time of the processes in ``leader``'s group or session, or below it."""
    stats: dict[int, _Stat] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _read_stat(int(entry.name))) is not None:
            stats[int(entry.name)] = stat
    members = {pid for pid, stat in stats.items() if leader in (stat.pgrp, stat.session)}
    for pid, stat in stats.items():
        ancestor, depth = stat.ppid, 0
        while ancestor in stats and depth < 64:  # bounded: pid reuse could make a cycle
            if ancestor == leader or ancestor in members:
                members.add(pid)
                break
            ancestor, depth = stats[ancestor].ppid, depth + 1
    members.discard(os.getpid())
    return {pid: stats[pid].start for pid in members}


def signal_tree(leader: int, signum: int, known: dict[int, int]) -> None:
    """Send ``signum`` to every process ``tree_pids`` finds (the sweep), and to ``known``.

    The tree is read before anything is signalled: once the leader dies its children are
    reparented and no longer look like descendants. ``known`` remembers what earlier sweeps
    found, so SIGKILL after the grace still reaches a child orphaned by the SIGTERM; a pid
    whose start time changed belongs to someone else now and is left alone.
    """
    known.update(tree_pids(leader))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signum)
    for pid, start in list(known.items()):
        stat = _read_stat(pid)
        if stat is None or stat.start != start:
            del known[pid]
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
