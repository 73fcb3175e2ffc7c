"""Spawn primitives compared, interleaved: what the agent's one spawn module should use.

``python -m bench.spawnprims --reps N [--floor BIN] [--cgroup-root DIR]`` prints JSON:
{primitive: [nanoseconds per spawn+wait of /bin/true, ...]}.
"""

# Blocking spawns inside async functions on purpose: each primitive is timed alone.
# ruff: noqa: ASYNC220, ASYNC221, ASYNC222, ASYNC251

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import trio

from guest_agent.process.cgroup import CgroupManager
from guest_agent.process.spawn import Spawned, SpawnSpec, spawn

PROGRAM = "/bin/true"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _reap(spawned: Spawned) -> None:
    os.waitid(os.P_PIDFD, spawned.pidfd, os.WEXITED)
    for fd in (spawned.pidfd, spawned.stdin_fd, spawned.stdout_fd, spawned.stderr_fd):
        if fd is not None:
            os.close(fd)


def make_primitives(
    floor: str | None, cgroups: CgroupManager | None
) -> dict[str, Callable[[], Awaitable[int]]]:
    """Each primitive: spawn /bin/true, wait for it, return the nanoseconds it took."""
    spec = SpawnSpec(argv=(PROGRAM,), env=ENV, cwd="/")
    prims: dict[str, Callable[[], Awaitable[int]]] = {}

    if floor is not None:
        server = subprocess.Popen(
            [floor, "serve", PROGRAM], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert server.stdin is not None and server.stdout is not None
        to_floor, from_floor = server.stdin, server.stdout

        async def c_floor() -> int:
            to_floor.write(b"\n")
            to_floor.flush()
            return int(from_floor.readline())  # timed inside the C program

        prims["C posix_spawn+waitpid (floor)"] = c_floor

    async def posix_spawn() -> int:
        start = time.perf_counter_ns()
        pid = os.posix_spawn(PROGRAM, [PROGRAM], ENV)
        os.waitpid(pid, 0)
        return time.perf_counter_ns() - start

    async def popen() -> int:
        start = time.perf_counter_ns()
        proc = subprocess.Popen(
            [PROGRAM],
            stdin=subprocess.DEVNULL,
            env=ENV,
            cwd="/",
            close_fds=True,
            start_new_session=True,
            restore_signals=True,
        )
        proc.wait()
        return time.perf_counter_ns() - start

    async def run_process() -> int:
        start = time.perf_counter_ns()
        await trio.run_process([PROGRAM], env=ENV)
        return time.perf_counter_ns() - start

    async def agent_spawn() -> int:
        start = time.perf_counter_ns()
        _reap(spawn(spec, None, None))
        return time.perf_counter_ns() - start

    prims["os.posix_spawn+waitpid"] = posix_spawn
    prims["subprocess.Popen vfork path (spawn.py flags)"] = popen
    prims["trio.run_process"] = run_process
    prims["agent spawn(): pipes, oom_score_adj, pidfd"] = agent_spawn

    if cgroups is not None:
        counter = iter(range(1 << 30))

        async def agent_spawn_cgroup() -> int:
            start = time.perf_counter_ns()
            cgroup = cgroups.create(f"exec-{next(counter)}", None, None)
            _reap(spawn(spec, cgroups, cgroup))
            while not cgroup.remove():  # the reaped child may leave the cgroup a moment later
                time.sleep(0.0001)
            return time.perf_counter_ns() - start

        async def cgroup_only() -> int:
            start = time.perf_counter_ns()
            cgroup = cgroups.create(f"exec-{next(counter)}", None, None)
            with cgroups.joined(cgroup):
                pass
            cgroup.remove()
            return time.perf_counter_ns() - start

        prims["agent spawn() + own cgroup (mkdir, join, rmdir)"] = agent_spawn_cgroup
        prims["cgroup mkdir+join+rmdir alone"] = cgroup_only
    return prims


async def measure(reps: int, warmup: int, floor: str | None, cgroup_root: str | None) -> None:
    cgroups = CgroupManager.detect(cgroup_root) if cgroup_root else None
    try:
        prims = make_primitives(floor, cgroups)
        samples: dict[str, list[int]] = {name: [] for name in prims}
        for rep in range(warmup + reps):
            for name, prim in prims.items():
                elapsed = await prim()
                if rep >= warmup:
                    samples[name].append(elapsed)
        json.dump({"cgroups": cgroups is not None, "samples": samples}, sys.stdout)
    finally:
        if cgroups is not None:
            with contextlib.suppress(OSError):
                cgroups.cleanup_root()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--floor", help="the compiled bench/floor.c")
    parser.add_argument("--cgroup-root", help="a cgroup2 directory to create exec cgroups in")
    args = parser.parse_args()
    trio.run(measure, args.reps, args.warmup, args.floor, args.cgroup_root)


if __name__ == "__main__":
    main()
