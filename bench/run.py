"""The benchmark harness: the agent against the physical floor and its peers, in one run.

``python -m bench.run [--quick] [options]`` (``make bench`` runs the full set). It installs what
it needs, starts the agent and the peers on this machine, runs every comparison with the sides
interleaved, stops everything it started (also on failure or Ctrl-C) and writes
``OUT/latest.md`` and ``OUT/latest.json`` (plus timestamped copies). See docs/benchmarks.md.
"""

# The harness blocks its event loop on purpose: while it times a floor or a peer, nothing else
# may run, and every side is timed by the same clock in the same thread.
# ruff: noqa: ASYNC220, ASYNC221, ASYNC251

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import trio

from guest_agent.client import Client
from guest_agent.protocol import Data

from .agentproc import REPO, AgentUnderTest, RawClient
from .install import Installer, build_floor, compile_agent
from .peers import QemuGa, Ssh, read_all
from .procs import (
    CGROUP2_MOUNT,
    CpuMeter,
    Placement,
    Processes,
    remove_cgroup_tree,
    wait_for_path,
    wait_listening,
)
from .report import Comparison, Side, Target, fmt, markdown, ratio_text, to_json

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10
BENCHMARKS = ("spawn", "startup", "exec", "stream", "files", "concurrency")
PEERS = ("qemu-ga", "ssh")
# Parameter defaults: (full run, --quick).
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "exec_reps": (1000, 30),
    "warmup": (20, 3),
    "spawn_reps": (500, 30),
    "start_reps": (10, 2),
    "data_reps": (5, 2),
    "stream_size": (GiB, 16 * MiB),
    "file_size": (GiB, 16 * MiB),
    "qga_file_size": (256 * MiB, 4 * MiB),
    "concurrent": (1000, 50),
    "concurrent_streams": (20, 2),
    "concurrent_stream_size": (64 * MiB, 1 * MiB),
    "concurrent_sleep": (1.0, 1.0),
    "rss_sleep": (5.0, 2.0),
    "idle_settle": (0.5, 0.2),
    "install_timeout": (None, 30.0),
    "floor_chunk": (256 * KiB, 256 * KiB),
}
# A transfer is copied from this block, repeated (random: nothing on the way can compress it).
BLOCK_SIZE = 1 * MiB


def _size(text: str) -> int:
    """A byte count: 123, 64K, 16M, 1G."""
    units = {"K": KiB, "M": MiB, "G": GiB}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few reps (< 1 min)")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--peers", default=",".join(PEERS), help="peers to run (default: all)")
    parser.add_argument(
        "--placement",
        choices=["one", "split", "free"],
        default="one",
        help="one: all on one CPU (default); split: servers CPU0, clients CPU1; free: unpinned",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--file-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for files")
    parser.add_argument("--no-install", action="store_true", help="never run apt-get")
    ints = ("exec_reps", "warmup", "spawn_reps", "start_reps", "data_reps", "concurrent")
    for name in (*ints, "concurrent_streams"):
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    for name in ("stream_size", "file_size", "qga_file_size", "concurrent_stream_size"):
        parser.add_argument("--" + name.replace("_", "-"), type=_size, help="bytes, or 64M, 1G")
    parser.add_argument("--floor-chunk", type=_size)
    for name in ("concurrent_sleep", "rss_sleep", "idle_settle", "install_timeout"):
        parser.add_argument("--" + name.replace("_", "-"), type=float)
    args = parser.parse_args(argv)
    for name, (full, quick) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.only = set(args.only.split(",")) if args.only else set(BENCHMARKS)
    unknown = args.only - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmarks: {', '.join(sorted(unknown))}")
    args.peers = {p for p in args.peers.split(",") if p}
    return args


@dataclass
class Bench:
    """Everything a run shares: parameters, placement, started processes, peers."""

    args: argparse.Namespace
    placement: Placement
    procs: Processes
    workdir: Path
    filedir: Path
    tools: dict[str, str | None]
    floor: Path | None
    skipped: dict[str, str] = field(default_factory=dict)
    block: bytes = b""
    comparisons: list[Comparison] = field(default_factory=list)
    qga: QemuGa | None = None
    ssh: Ssh | None = None

    def log(self, text: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ---- helpers -----------------------------------------------------------------------------


def peer_side(bench: Bench, name: str, label: str) -> Side:
    side = Side(label, "peer")
    if name in bench.skipped:
        side.skipped = bench.skipped[name]
    return side


def ms(ns: int) -> float:
    return ns / 1e6


def gibps(nbytes: int, seconds: float) -> float:
    return nbytes / GiB / seconds


async def interleave(
    rounds: int, steps: Sequence[tuple[Side, Callable[[], Awaitable[float]]]], warmup: int
) -> None:
    """Run every side's step once per round, in turn (A, B, C, A, B, C, ...).

    The first ``warmup`` rounds are not recorded. A side whose step fails is marked skipped
    with the reason and dropped from the remaining rounds; the others go on.
    """
    live = [(side, step) for side, step in steps if side.skipped is None]
    for rep in range(warmup + rounds):
        for side, step in list(live):
            try:
                value = await step()
            except Exception as exc:
                side.skipped = f"failed: {type(exc).__name__}: {exc}"[:300]
                side.samples.clear()
                live = [(s, f) for s, f in live if s is not side]
                continue
            if rep >= warmup:
                side.samples.append(value)


def ratio_target(
    text: str, name: str, other: str, minimum: float | None = None, maximum: float | None = None
) -> Target:
    """Target on median(name)/median(other)."""

    def check(comparison: Comparison) -> tuple[str, bool] | None:
        value = comparison.ratio(name, other)
        if value is None:
            return None
        met = (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
        return f"{ratio_text(value)} ({name} / {other})", met

    return Target(text, check)


@contextlib.contextmanager
def relay(bench: Bench) -> Iterator[tuple[Path, psutil.Process]]:
    """The blocking-Python floor relay (bench/relay.py), pinned like a server."""
    path = bench.workdir / "relay.sock"
    argv = [
        *bench.placement.server_prefix(),
        sys.executable,
        "-m",
        "bench.relay",
        str(path),
        str(bench.args.floor_chunk),
    ]
    proc = bench.procs.start(argv, cwd=str(REPO))
    try:
        wait_for_path(path, proc)
        wait_listening(path, proc)
        yield path, psutil.Process(proc.pid)
    finally:
        bench.procs.stop(proc)


def relay_call(path: Path, command: dict[str, Any], send: Callable[[socket.socket], None]) -> int:
    """One relay transfer: send the command (and data), read back everything; bytes read."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        sock.sendall(json.dumps(command).encode() + b"\n")
        send(sock)
        sock.shutdown(socket.SHUT_WR)
        buffer = bytearray(MiB)
        total = 0
        while size := sock.recv_into(buffer):
            total += size
        return total


def send_repeated(write: Callable[[memoryview], int], block: bytes, size: int) -> None:
    """Write ``size`` bytes of ``block`` repeated through ``write`` (which may write less)."""
    view = memoryview(block)
    remaining = size
    while remaining:
        chunk = view[: min(len(view), remaining)]
        while chunk:
            written = write(chunk)
            chunk = chunk[written:]
            remaining -= written


def make_file(path: Path, block: bytes, size: int) -> None:
    with open(path, "wb") as f:
        send_repeated(f.write, block, size)


# ---- spawn primitives -----------------------------------------------------------------------


def bench_spawn(bench: Bench) -> None:
    """subprocess.Popen vfork path vs os.posix_spawn vs trio.run_process vs the C floor."""
    args = bench.args
    root = CGROUP2_MOUNT / f"ga-bench-{os.getpid()}-spawn"
    argv = [
        *bench.placement.server_prefix(),
        sys.executable,
        "-m",
        "bench.spawnprims",
        "--reps",
        str(args.spawn_reps),
        "--warmup",
        str(args.warmup),
        "--cgroup-root",
        str(root),
    ]
    if bench.floor is not None:
        argv += ["--floor", str(bench.floor)]
    try:
        proc = subprocess.run(argv, cwd=str(REPO), capture_output=True, check=True, timeout=600)
    finally:
        remove_cgroup_tree(root)
    result = json.loads(proc.stdout)
    comparison = Comparison(
        "spawn", "spawn+wait /bin/true, in one process", "ms", higher_is_better=False
    )
    comparison.params = {"reps": args.spawn_reps}
    for name, samples in result["samples"].items():
        role = (
            "floor" if "floor" in name else "agent" if name.startswith("agent spawn()") else "info"
        )
        if name.startswith("agent spawn() +"):
            role = "info"
        comparison.sides.append(Side(name, role, [ms(s) for s in samples]))
    if not result["cgroups"]:
        comparison.notes.append("cgroup2 not writable here: the cgroup variants were not run")
    comparison.notes.append(
        "all primitives interleaved in one process on the server CPU; the agent's spawn() adds "
        "two pipes with F_SETPIPE_SZ, the oom_score_adj write and pidfd_open to the Popen path"
    )
    bench.comparisons.append(comparison)


# ---- start-up and idle RSS ------------------------------------------------------------------


async def bench_startup(bench: Bench) -> None:
    """Start to first answered ping, and RSS when idle, against their floors and qemu-ga."""
    args = bench.args
    prefix = bench.placement.server_prefix()
    start = Comparison("startup", "start to first answered ping", "ms", higher_is_better=False)
    rss = Comparison("idle_rss", "idle RSS after start", "MiB", higher_is_better=False)
    start.params = rss.params = {"reps": args.start_reps, "settle_s": args.idle_settle}
    agent_start = Side("agent", "agent")
    import_floor = Side('python -c "import trio, msgpack"', "floor")
    bare_start = Side("bare trio unix listener", "info")
    qga_start = peer_side(bench, "qemu-ga", "qemu-ga (guest-ping)")
    agent_rss, bare_rss = Side("agent", "agent"), Side("bare trio unix listener", "floor")
    qga_rss = peer_side(bench, "qemu-ga", "qemu-ga")
    start.sides = [agent_start, import_floor, bare_start, qga_start]
    rss.sides = [agent_rss, bare_rss, qga_rss]

    def memory(proc: psutil.Process, side: Side) -> float:
        info = proc.memory_full_info()
        side.extra.setdefault("uss_mib", []).append(info.uss / MiB)
        side.extra.setdefault("pss_mib", []).append(info.pss / MiB)
        return float(info.rss / MiB)

    async def agent() -> float:
        under_test = AgentUnderTest(bench.workdir, bench.procs, bench.placement, name="startup")
        try:
            started = under_test.start()
            under_test.wait_socket()
            async with Client.connect(under_test.address) as client:
                await client.ping()
                elapsed = time.perf_counter() - started
                time.sleep(args.idle_settle)
                agent_rss.samples.append(memory(under_test.process, agent_rss))
            return elapsed * 1000
        finally:
            under_test.stop()

    async def python_import() -> float:
        started = time.perf_counter()
        subprocess.run([*prefix, sys.executable, "-c", "import trio, msgpack"], check=True)
        return (time.perf_counter() - started) * 1000

    async def bare() -> float:
        path = bench.workdir / "bare.sock"
        path.unlink(missing_ok=True)
        argv = [*prefix, sys.executable, "-m", "bench.bare_listener", str(path)]
        started = time.perf_counter()
        proc = bench.procs.start(argv, cwd=str(REPO))
        try:
            wait_for_path(path, proc)
            wait_listening(path, proc)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(path))
                sock.sendall(b"ping\n")
                sock.recv(16)
                elapsed = time.perf_counter() - started
                time.sleep(args.idle_settle)
                bare_rss.samples.append(memory(psutil.Process(proc.pid), bare_rss))
            return elapsed * 1000
        finally:
            bench.procs.stop(proc)

    async def qga() -> float:
        assert bench.tools["qemu-ga"] is not None
        peer = QemuGa(
            bench.tools["qemu-ga"], bench.workdir / "qga-start", bench.procs, bench.placement
        )
        try:
            elapsed = peer.start()
            time.sleep(args.idle_settle)
            qga_rss.samples.append(memory(peer.process, qga_rss))
            return elapsed * 1000
        finally:
            peer.stop()

    steps: list[tuple[Side, Callable[[], Awaitable[float]]]] = [
        (agent_start, agent),
        (import_floor, python_import),
        (bare_start, bare),
        (qga_start, qga),
    ]
    await interleave(args.start_reps, steps, 1)
    if qga_start.skipped and not qga_rss.skipped:
        qga_rss.skipped = qga_start.skipped
    start.targets.append(
        ratio_target(
            "start to first ping <= 1.2x `python -c 'import trio, msgpack'`",
            "agent",
            import_floor.name,
            maximum=1.2,
        )
    )
    rss.targets.append(
        ratio_target("idle RSS <= 1.1x the bare trio listener", "agent", bare_rss.name, maximum=1.1)
    )
    for side in rss.sides:
        if side.extra.get("uss_mib"):
            uss = sorted(side.extra["uss_mib"])[len(side.extra["uss_mib"]) // 2]
            rss.notes.append(f"{side.name}: USS {uss:.1f} MiB (median)")
    start.notes.append(
        "each rep starts a fresh process; the time runs from fork to the first answer, "
        "the harness polling for the socket every 0.5 ms"
    )
    bench.comparisons += [start, rss]


# ---- exec round trip ----------------------------------------------------------------------


async def bench_exec(bench: Bench, client: Client, agent: AgentUnderTest) -> None:
    """exec /bin/true: agent (Client and raw), C floor, qemu-ga, ssh; interleaved."""
    args = bench.args
    comparison = Comparison("exec", "exec /bin/true round trip", "ms", higher_is_better=False)
    comparison.params = {"reps": args.exec_reps, "warmup": args.warmup}
    agent_side = Side("agent (Client.exec)", "agent")
    raw_side = Side("agent (raw protocol client)", "info")
    floor_side = Side("C posix_spawn+waitpid", "floor")
    qga_side = peer_side(bench, "qemu-ga", "qemu-ga (guest-exec + busy-polled status)")
    ssh_side = peer_side(bench, "ssh", "ssh (warm ControlMaster)")
    comparison.sides = [agent_side, raw_side, floor_side, qga_side, ssh_side]
    raw = RawClient(agent.socket_path)
    floor_proc = None
    if bench.floor is None:
        floor_side.skipped = "no C compiler"
    else:
        floor_proc = bench.procs.start(
            [*bench.placement.server_prefix(), str(bench.floor), "serve", "/bin/true"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    async def via_client() -> float:
        start = time.perf_counter_ns()
        result = await client.exec(["/bin/true"])
        elapsed = time.perf_counter_ns() - start
        if result.exit_code != 0:
            raise RuntimeError(f"/bin/true exited {result.status}")
        return ms(elapsed)

    async def via_raw() -> float:
        start = time.perf_counter_ns()
        code = raw.exec(["/bin/true"])
        elapsed = time.perf_counter_ns() - start
        if code != 0:
            raise RuntimeError(f"/bin/true exited {code}")
        return ms(elapsed)

    async def via_floor() -> float:
        assert floor_proc is not None and floor_proc.stdin and floor_proc.stdout
        floor_proc.stdin.write(b"\n")
        floor_proc.stdin.flush()
        return ms(int(floor_proc.stdout.readline()))  # timed inside the C program

    async def via_qga() -> float:
        assert bench.qga is not None
        start = time.perf_counter_ns()
        code = bench.qga.exec_wait("/bin/true")
        elapsed = time.perf_counter_ns() - start
        if code != 0:
            raise RuntimeError(f"/bin/true exited {code}")
        return ms(elapsed)

    async def via_ssh() -> float:
        assert bench.ssh is not None
        argv = bench.ssh.command("true")
        start = time.perf_counter_ns()
        subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)
        return ms(time.perf_counter_ns() - start)

    try:
        await interleave(
            args.exec_reps,
            [
                (agent_side, via_client),
                (raw_side, via_raw),
                (floor_side, via_floor),
                (qga_side, via_qga),
                (ssh_side, via_ssh),
            ],
            args.warmup,
        )
    finally:
        raw.close()
        if floor_proc is not None:
            bench.procs.stop(floor_proc)

    def p50_vs_floor(c: Comparison) -> tuple[str, bool] | None:
        value = c.ratio(agent_side.name, floor_side.name)
        if value is None:
            return None
        return f"{ratio_text(value)} the floor", value <= 1.3

    comparison.targets.append(Target("exec p50 <= 1.3x the C floor", p50_vs_floor))
    comparison.targets.append(
        ratio_target("exec p50 below qemu-ga", agent_side.name, qga_side.name, maximum=0.9999)
    )
    comparison.notes.append(
        "the floor is timed inside the C program (no IPC); the agent and peers from the client"
    )
    bench.comparisons.append(comparison)


# ---- data paths -----------------------------------------------------------------------------


async def bench_stream(
    bench: Bench,
    client: Client,
    agent: AgentUnderTest,
    relay_path: Path,
    relay_proc: psutil.Process,
) -> None:
    """`head -c SIZE /dev/zero` streamed to the client: agent, floor relay, ssh."""
    args = bench.args
    size = args.stream_size
    title = f"stream {fmt(size / MiB)} MiB of stdout to the client"
    comparison = Comparison("stream", title, "GiB/s", higher_is_better=True)
    comparison.params = {"bytes": size, "reps": args.data_reps}
    agent_side = Side("agent (Client.open_exec)", "agent")
    floor_side = Side("blocking Python pipe -> unix socket -> reader", "floor")
    ssh_side = peer_side(bench, "ssh", "ssh warm master (head -c over ssh)")
    comparison.sides = [agent_side, floor_side, ssh_side]
    head = ["head", "-c", str(size), "/dev/zero"]

    def done(side: Side, meter: CpuMeter, nbytes: int, seconds: float) -> float:
        if nbytes != size:
            raise RuntimeError(f"{side.name}: received {nbytes} of {size} bytes")
        side.cpu_per_gib.append(meter.total / (nbytes / GiB))
        side.extra.setdefault("server_cpu_s", []).append(meter.server_s)
        side.extra.setdefault("client_cpu_s", []).append(meter.client_s)
        return gibps(nbytes, seconds)

    async def via_agent() -> float:
        total = 0
        with CpuMeter([agent.process]) as meter:
            start = time.perf_counter()
            async with client.open_exec(head) as ex:
                async for _stream, data in ex:
                    total += len(data)
            seconds = time.perf_counter() - start
        return done(agent_side, meter, total, seconds)

    async def via_floor() -> float:
        with CpuMeter([relay_proc]) as meter:
            start = time.perf_counter()
            total = relay_call(relay_path, {"mode": "pipe", "argv": head}, lambda _s: None)
            seconds = time.perf_counter() - start
        return done(floor_side, meter, total, seconds)

    async def via_ssh() -> float:
        assert bench.ssh is not None
        ssh = bench.ssh
        with CpuMeter(ssh.server_processes(), ssh.client_processes()) as meter:
            start = time.perf_counter()
            proc = subprocess.Popen(ssh.command(" ".join(head)), stdout=subprocess.PIPE)
            assert proc.stdout is not None
            total = read_all(proc.stdout.fileno())
            proc.wait()
            proc.stdout.close()
            seconds = time.perf_counter() - start
        return done(ssh_side, meter, total, seconds)

    await interleave(
        args.data_reps, [(agent_side, via_agent), (floor_side, via_floor), (ssh_side, via_ssh)], 0
    )
    comparison.targets.append(
        ratio_target("stream >= 1.0x ssh", agent_side.name, ssh_side.name, minimum=1.0)
    )
    comparison.targets.append(
        ratio_target("stream >= 0.7x the floor", agent_side.name, floor_side.name, minimum=0.7)
    )
    comparison.notes.append(
        "CPU s/GiB = server process (agent / relay / sshd) + client side (harness, ssh master "
        "and mux client); head itself is not counted"
    )
    bench.comparisons.append(comparison)


async def bench_files(
    bench: Bench,
    client: Client,
    agent: AgentUnderTest,
    relay_path: Path,
    relay_proc: psutil.Process,
) -> None:
    """Read and write a file: agent, floor relay, ssh cat, qemu-ga guest-file-*."""
    args = bench.args
    size, qga_size = args.file_size, min(args.qga_file_size, args.file_size)
    source = bench.filedir / "source.bin"
    qga_source = bench.filedir / "qga-source.bin"
    bench.log(f"files: creating {fmt(size / MiB)} MiB source in {bench.filedir}")
    make_file(source, bench.block, size)
    make_file(qga_source, bench.block, qga_size)
    read = Comparison("file_read", f"read a {fmt(size / MiB)} MiB file", "GiB/s", True)
    write = Comparison("file_write", f"write a {fmt(size / MiB)} MiB file", "GiB/s", True)
    for comparison in (read, write):
        comparison.params = {"bytes": size, "qemu_ga_bytes": qga_size, "reps": args.data_reps}
    sides: dict[str, dict[str, Side]] = {}
    for comparison in (read, write):
        sides[comparison.key] = {
            "agent": Side(
                "agent (file.read)" if comparison is read else "agent (file.write)", "agent"
            ),
            "floor": Side(
                "blocking Python file -> unix socket"
                if comparison is read
                else "blocking Python unix socket -> file (+fsync)",
                "floor",
            ),
            "ssh": peer_side(bench, "ssh", "ssh cat (warm master)"),
            "qga": peer_side(bench, "qemu-ga", f"qemu-ga ({fmt(qga_size / MiB)} MiB, base64 JSON)"),
        }
        comparison.sides = list(sides[comparison.key].values())

    def done(side: Side, meter: CpuMeter, nbytes: int, want: int, seconds: float) -> float:
        if nbytes != want:
            raise RuntimeError(f"{side.name}: moved {nbytes} of {want} bytes")
        side.cpu_per_gib.append(meter.total / (nbytes / GiB))
        side.extra.setdefault("server_cpu_s", []).append(meter.server_s)
        side.extra.setdefault("client_cpu_s", []).append(meter.client_s)
        return gibps(nbytes, seconds)

    def check_written(path: Path, want: int) -> int:
        got = path.stat().st_size
        path.unlink()
        return got if got == want else -got

    # ---- reads
    async def read_agent() -> float:
        total = 0
        with CpuMeter([agent.process]) as meter:
            start = time.perf_counter()
            async with client.open_call("file.read", {"path": str(source)}) as call:
                async for item in call:
                    if isinstance(item, Data):
                        total += len(item.data)
            seconds = time.perf_counter() - start
        return done(sides["file_read"]["agent"], meter, total, size, seconds)

    async def read_floor() -> float:
        with CpuMeter([relay_proc]) as meter:
            start = time.perf_counter()
            total = relay_call(relay_path, {"mode": "read", "path": str(source)}, lambda _s: None)
            seconds = time.perf_counter() - start
        return done(sides["file_read"]["floor"], meter, total, size, seconds)

    async def read_ssh() -> float:
        assert bench.ssh is not None
        ssh = bench.ssh
        with CpuMeter(ssh.server_processes(), ssh.client_processes()) as meter:
            start = time.perf_counter()
            proc = subprocess.Popen(ssh.command(f"cat {source}"), stdout=subprocess.PIPE)
            assert proc.stdout is not None
            total = read_all(proc.stdout.fileno())
            proc.wait()
            proc.stdout.close()
            seconds = time.perf_counter() - start
        return done(sides["file_read"]["ssh"], meter, total, size, seconds)

    async def read_qga() -> float:
        assert bench.qga is not None
        with CpuMeter([bench.qga.process]) as meter:
            start = time.perf_counter()
            total = bench.qga.read_file(str(qga_source))
            seconds = time.perf_counter() - start
        return done(sides["file_read"]["qga"], meter, total, qga_size, seconds)

    # ---- writes
    target = bench.filedir / "target.bin"

    async def write_agent() -> float:
        with CpuMeter([agent.process]) as meter:
            start = time.perf_counter()
            async with client.open_call("file.write", {"path": str(target)}) as call:
                remaining = size
                while remaining:
                    chunk = bench.block[: min(len(bench.block), remaining)]
                    await call.send_data("file", chunk)
                    remaining -= len(chunk)
                await call.send_eof("file")
                result = await call.wait_result()
            seconds = time.perf_counter() - start
        written = check_written(target, size)
        if result.get("bytes") != size:
            raise RuntimeError(f"file.write reported {result}")
        return done(sides["file_write"]["agent"], meter, written, size, seconds)

    async def write_floor() -> float:
        def send(sock: socket.socket) -> None:
            send_repeated(sock.send, bench.block, size)

        with CpuMeter([relay_proc]) as meter:
            start = time.perf_counter()
            answer = relay_call(relay_path, {"mode": "write", "path": str(target)}, send)
            seconds = time.perf_counter() - start
        if answer != 2:
            raise RuntimeError("the relay did not confirm the write")
        written = check_written(target, size)
        return done(sides["file_write"]["floor"], meter, written, size, seconds)

    async def write_ssh() -> float:
        assert bench.ssh is not None
        ssh = bench.ssh
        with CpuMeter(ssh.server_processes(), ssh.client_processes()) as meter:
            start = time.perf_counter()
            proc = subprocess.Popen(ssh.command(f"cat > {target}"), stdin=subprocess.PIPE)
            assert proc.stdin is not None
            fd = proc.stdin.fileno()
            send_repeated(lambda view: os.write(fd, view), bench.block, size)
            proc.stdin.close()
            if proc.wait() != 0:
                raise RuntimeError(f"ssh cat exited {proc.returncode}")
            seconds = time.perf_counter() - start
        written = check_written(target, size)
        return done(sides["file_write"]["ssh"], meter, written, size, seconds)

    async def write_qga() -> float:
        assert bench.qga is not None
        with CpuMeter([bench.qga.process]) as meter:
            start = time.perf_counter()
            bench.qga.write_file(str(target), qga_size, bench.block)
            seconds = time.perf_counter() - start
        written = check_written(target, qga_size)
        return done(sides["file_write"]["qga"], meter, written, qga_size, seconds)

    try:
        for comparison, steps in (
            (read, [read_agent, read_floor, read_ssh, read_qga]),
            (write, [write_agent, write_floor, write_ssh, write_qga]),
        ):
            pairs = list(zip(comparison.sides, steps, strict=True))
            await interleave(args.data_reps, pairs, 0)
    finally:
        for path in (source, qga_source, target):
            path.unlink(missing_ok=True)

    for comparison, qga_times, key in ((read, 15, "file_read"), (write, 30, "file_write")):
        agent_name = sides[key]["agent"].name
        comparison.targets.append(
            ratio_target(
                f"{comparison.key.replace('file_', '')} >= {qga_times}x qemu-ga",
                agent_name,
                sides[key]["qga"].name,
                minimum=qga_times,
            )
        )
        comparison.targets.append(
            ratio_target(
                f"{comparison.key.replace('file_', '')} >= 1.0x ssh",
                agent_name,
                sides[key]["ssh"].name,
                minimum=1.0,
            )
        )
        comparison.notes.append(
            f"files on {bench.filedir} (tmpfs, like /workspace); qemu-ga moves "
            f"{fmt(qga_size / MiB)} MiB per rep (its rate does not depend on the size)"
        )
    bench.comparisons += [read, write]


# ---- concurrency ----------------------------------------------------------------------------


async def bench_concurrency(bench: Bench, client: Client, agent: AgentUnderTest) -> None:
    """N concurrent sleeps plus streaming execs: all finish; RSS growth per live exec."""
    args = bench.args
    n, streams = args.concurrent, args.concurrent_streams
    proc = agent.process
    comparison = Comparison(
        "concurrency",
        f"{n} concurrent sleep execs (+{streams} streaming)",
        "KiB",
        higher_is_better=False,
    )
    comparison.params = {
        "execs": n,
        "streams": streams,
        "stream_bytes": args.concurrent_stream_size,
        "rss_sleep_s": args.rss_sleep,
        "sleep_s": args.concurrent_sleep,
    }
    per_exec = Side("agent RSS growth per live exec (sleeps only)", "agent")
    mixed = Side(f"agent RSS growth per live exec (with {streams} streaming)", "info")
    comparison.sides = [per_exec, mixed]

    async def phase(sleep: float, stream_count: int, side: Side) -> tuple[bool, dict[str, Any]]:
        live = 0
        peak_live = 0
        peak_rss = 0
        rss_at_full = 0
        exit_codes: list[int | None] = []
        streamed: list[int] = []
        baseline = proc.memory_info().rss
        all_started = trio.Event()

        async def one_sleep() -> None:
            nonlocal live, peak_live, rss_at_full
            async with client.open_exec(["sleep", str(sleep)]) as ex:
                live += 1
                peak_live = max(peak_live, live)
                if live == n:
                    rss_at_full = proc.memory_info().rss
                    all_started.set()
                result = await ex.wait()
                live -= 1
            exit_codes.append(result.get("exit_code"))

        async def one_stream() -> None:
            total = 0
            head = ["head", "-c", str(args.concurrent_stream_size), "/dev/zero"]
            async with client.open_exec(head) as ex:
                async for _stream, data in ex:
                    total += len(data)
            streamed.append(total)

        async def monitor() -> None:
            nonlocal peak_rss
            while True:
                peak_rss = max(peak_rss, proc.memory_info().rss)
                await trio.sleep(0.02)

        start = time.perf_counter()
        async with trio.open_nursery() as outer:
            outer.start_soon(monitor)
            async with trio.open_nursery() as nursery:
                for _ in range(stream_count):
                    nursery.start_soon(one_stream)
                for _ in range(n):
                    nursery.start_soon(one_sleep)
            outer.cancel_scope.cancel()
        wall = time.perf_counter() - start
        ok = (
            len(exit_codes) == n
            and all(code == 0 for code in exit_codes)
            and streamed == [args.concurrent_stream_size] * stream_count
        )
        growth = (rss_at_full or peak_rss) - baseline
        live_count = n if rss_at_full else peak_live
        side.samples.append(growth / max(live_count, 1) / KiB)
        details = {
            "all_finished": ok,
            "wall_s": round(wall, 3),
            "baseline_rss_mib": round(baseline / MiB, 2),
            "peak_rss_mib": round(peak_rss / MiB, 2),
            "peak_live_execs": peak_live,
            "all_live_at_once": bool(rss_at_full),
            "rss_after_mib": round(proc.memory_info().rss / MiB, 2),
        }
        side.extra.update(details)
        return ok, details

    # Long enough sleeps that all N are alive at once: a clean RSS-per-exec figure.
    ok_rss, rss_details = await phase(args.rss_sleep, 0, per_exec)
    await trio.sleep(0.5)
    ok_mixed, mixed_details = await phase(args.concurrent_sleep, streams, mixed)
    comparison.targets.append(
        Target(
            f"{n} concurrent `sleep {args.concurrent_sleep:g}` + {streams} streaming all finish",
            lambda _c: (
                f"{'all' if ok_mixed else 'NOT all'} finished in {mixed_details['wall_s']} s, "
                f"peak {mixed_details['peak_live_execs']} live",
                ok_mixed,
            ),
        )
    )
    comparison.targets.append(
        Target(
            "RSS growth per live exec <= 20 KiB",
            lambda c: (
                (f"{fmt(c.median(per_exec.name))} KiB", (c.median(per_exec.name) or 0) <= 20)
                if ok_rss
                else ("the sleep execs did not all finish", False)
            ),
        )
    )
    comparison.notes.append(
        f"sleeps only: RSS {rss_details['baseline_rss_mib']} -> "
        f"{rss_details['peak_rss_mib']} MiB peak with {rss_details['peak_live_execs']} live "
        f"(sleep {args.rss_sleep:g} s so that all are alive at once); "
        f"{rss_details['rss_after_mib']} MiB after they ended (finished execs are retained)"
    )
    comparison.notes.append(
        f"mixed: `sleep {args.concurrent_sleep:g}` x{n} + {streams} x "
        f"{fmt(args.concurrent_stream_size / MiB)} MiB streams; peak "
        f"{mixed_details['peak_live_execs']} sleeps live, RSS {mixed_details['peak_rss_mib']} MiB"
    )
    bench.comparisons.append(comparison)


# ---- orchestration --------------------------------------------------------------------------


async def run_all(bench: Bench) -> None:
    args = bench.args
    if "startup" in args.only:
        bench.log("startup and idle RSS")
        await bench_startup(bench)
    agent_needed = args.only & {"exec", "stream", "files", "concurrency"}
    if not agent_needed:
        return
    agent = AgentUnderTest(bench.workdir, bench.procs, bench.placement)
    agent.start()
    try:
        agent.wait_socket()
        async with Client.connect(agent.address) as client:
            await client.ping()
            if "exec" in args.only:
                bench.log(f"exec round trip x{args.exec_reps}")
                await bench_exec(bench, client, agent)
            if args.only & {"stream", "files"}:
                with relay(bench) as (relay_path, relay_proc):
                    if "stream" in args.only:
                        bench.log(f"stream {args.stream_size} bytes x{args.data_reps}")
                        await bench_stream(bench, client, agent, relay_path, relay_proc)
                    if "files" in args.only:
                        bench.log(f"files {args.file_size} bytes x{args.data_reps}")
                        await bench_files(bench, client, agent, relay_path, relay_proc)
            if "concurrency" in args.only:
                bench.log(f"concurrency {args.concurrent} + {args.concurrent_streams}")
                await bench_concurrency(bench, client, agent)
    finally:
        agent.stop()


def start_peers(bench: Bench) -> None:
    """Start the long-lived peers; a peer that cannot run is recorded as skipped."""
    wanted = {"exec", "stream", "files"} & bench.args.only
    if not wanted:
        return
    if "qemu-ga" in bench.args.peers and "qemu-ga" not in bench.skipped and wanted - {"stream"}:
        qga_bin = bench.tools["qemu-ga"]
        assert qga_bin is not None
        bench.qga = QemuGa(qga_bin, bench.workdir / "qga", bench.procs, bench.placement)
        try:
            bench.qga.start()
        except Exception as exc:
            bench.skipped["qemu-ga"] = f"did not start: {exc}"[:300]
            bench.qga.stop()
            bench.qga = None
    if "ssh" in bench.args.peers and "ssh" not in bench.skipped:
        sshd, ssh = bench.tools["sshd"], bench.tools["ssh"]
        assert sshd is not None and ssh is not None
        bench.ssh = Ssh(sshd, ssh, bench.workdir / "ssh", bench.procs, bench.placement)
        try:
            bench.ssh.start()
        except Exception as exc:
            bench.skipped["ssh"] = f"did not start: {exc}"[:300]
            bench.ssh.stop()
            bench.ssh = None


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = psutil.virtual_memory().total / GiB
    return (
        f"{os.cpu_count()} vCPU {model}, {memory:.0f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def agent_source() -> dict[str, Any]:
    """Which agent code was measured: the commit, and the files changed since."""

    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, check=False)
        return proc.stdout.decode(errors="replace").strip()

    dirty = [line[3:] for line in git("status", "--short", "guest_agent").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD") or None, "uncommitted": dirty}


def write_results(bench: Bench, started: float) -> tuple[Path, Path]:
    args = bench.args
    params = {name: getattr(args, name) for name in DEFAULTS if name not in ("install_timeout",)}
    params_text = ", ".join(f"{k}={v}" for k, v in params.items())
    header = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "machine": machine(),
        "placement": bench.placement.name,
        "agent_source": agent_source(),
        "quick": args.quick,
        "params": params,
        "params_text": params_text,
        "skipped": bench.skipped,
        "workdirs": [str(bench.workdir), str(bench.filedir)],
        "duration_s": round(time.monotonic() - bench_monotonic_start, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    text = markdown(bench.comparisons, header)
    data = json.dumps(to_json(bench.comparisons, header), indent=1)
    md_path, json_path = args.out / "latest.md", args.out / "latest.json"
    for path, content in ((md_path, text), (json_path, data)):
        path.write_text(content)
        shutil.copyfile(path, args.out / f"bench-{stamp}{path.suffix}")
    return md_path, json_path


bench_monotonic_start = time.monotonic()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    global bench_monotonic_start  # noqa: PLW0603
    bench_monotonic_start = time.monotonic()
    started = time.time()
    args = parse_args(argv)
    # Ctrl-C and SIGTERM raise at once wherever the harness is: trio's own SIGINT handling
    # would wait for a checkpoint, and the harness blocks between checkpoints by design.
    # The cleanup below runs outside trio.run, so an interrupted run still stops everything.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    placement = Placement.named(args.placement)
    procs = Processes()
    with contextlib.ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="gab-", dir="/tmp"))
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        args.file_dir.mkdir(parents=True, exist_ok=True)
        filedir = Path(tempfile.mkdtemp(prefix="gab-", dir=args.file_dir))
        cleanup.callback(shutil.rmtree, filedir, ignore_errors=True)
        cleanup.callback(procs.stop_all)

        budget = 0.0 if args.no_install else args.install_timeout
        installer = Installer(budget=budget)
        tools = installer.ensure(["qemu-ga", "sshd", "ssh", "gcc"])
        compile_agent()
        floor = None
        try:
            floor = build_floor(tools["gcc"], workdir)
        except subprocess.CalledProcessError as exc:
            installer.log.append(f"floor.c did not compile: {exc.stderr.decode(errors='replace')}")
        bench = Bench(args, placement, procs, workdir, filedir, tools, floor)
        bench.block = os.urandom(BLOCK_SIZE)
        for line in installer.log:
            bench.log(line)
        if tools["qemu-ga"] is None:
            bench.skipped["qemu-ga"] = "qemu-ga not installed"
        if tools["sshd"] is None or tools["ssh"] is None:
            bench.skipped["ssh"] = "openssh-server/client not installed"
        for peer in set(PEERS) - args.peers:
            bench.skipped[peer] = "not requested (--peers)"
        if floor is None and not args.quick:
            raise SystemExit("the C floor could not be built (gcc missing?)")
        placement.pin_client()
        if "spawn" in args.only:
            bench.log(f"spawn primitives x{args.spawn_reps}")
            bench_spawn(bench)
        start_peers(bench)
        for name, reason in bench.skipped.items():
            bench.log(f"{name}: skipped: {reason}")
        try:
            trio.run(run_all, bench)
        finally:
            if bench.qga is not None:
                bench.qga.stop()
            if bench.ssh is not None:
                bench.ssh.stop()
        md_path, json_path = write_results(bench, started)
    print(md_path.read_text())
    print(f"written: {md_path} {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, trio.TrioInternalError):
        print("bench: interrupted; everything it started has been stopped", file=sys.stderr)
        sys.exit(130)
