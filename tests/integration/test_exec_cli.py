"""guest-agent-ctl exec & co. as real subprocesses against a real agent subprocess."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from guest_agent.client import Client

from ..conftest import AgentProcess, ctl_command
from .proctools import wait_until_dead

Ctl = Callable[..., "subprocess.CompletedProcess[bytes]"]


@pytest.fixture
def agent_proc(agent_process: Callable[..., AgentProcess]) -> AgentProcess:
    return agent_process("--reattach-grace", "1")


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["true"], 0),
        (["sh", "-c", "exit 7"], 7),
        (["--timeout", "0.5", "--", "sleep", "30"], 124),
        (["no-such-command-xyz"], 127),
        (["/etc/passwd"], 126),
        (["sh", "-c", "kill -KILL $$"], 137),
    ],
)
def test_exec_exit_codes(agent_proc: AgentProcess, ctl: Ctl, argv: list[str], code: int) -> None:
    args = argv if argv[0].startswith("--") else ["--", *argv]
    result = ctl(agent_proc.address, "exec", *args)
    assert result.returncode == code, result.stderr
    if code in (126, 127):
        assert result.stderr.count(b"\n") == 1  # one clear line


def test_exec_streams_and_forwards_stdin(agent_proc: AgentProcess, ctl: Ctl) -> None:
    result = ctl(
        agent_proc.address, "exec", "-i", "--", "sh", "-c", "cat; echo e >&2", input=b"abc"
    )
    assert result.returncode == 0
    assert result.stdout == b"abc"
    assert result.stderr == b"e\n"


def test_exec_env_cwd_user(agent_proc: AgentProcess, ctl: Ctl) -> None:
    result = ctl(
        agent_proc.address, "exec", "-e", "A=1", "-w", "/tmp", "-u", "nobody", "--",
        "sh", "-c", "echo $A $(pwd) $(id -un)",
    )  # fmt: skip
    assert result.stdout == b"1 /tmp nobody\n"


def test_detach_ps_wait_attach_kill(agent_proc: AgentProcess, ctl: Ctl) -> None:
    address = agent_proc.address
    exec_id = (
        ctl(address, "exec", "-d", "--", "sh", "-c", "echo hi; exit 3").stdout.decode().strip()
    )
    assert ctl(address, "wait", exec_id).returncode == 3
    attached = ctl(address, "attach", exec_id)
    assert attached.stdout == b"hi\n" and attached.returncode == 3
    listed = json.loads(ctl(address, "--json", "ps").stdout)
    assert any(e["exec_id"] == exec_id and e["exit_code"] == 3 for e in listed)
    assert exec_id.encode() in ctl(address, "ps").stdout
    sleeper = ctl(address, "exec", "-d", "--", "sleep", "300").stdout.decode().strip()
    assert ctl(address, "kill", "--grace", "0.2", sleeper).returncode == 0
    assert ctl(address, "wait", sleeper).returncode == 128 + signal.SIGTERM
    assert ctl(address, "wait", "nope").returncode == 125


def test_ctrl_c_is_forwarded_then_kills(agent_proc: AgentProcess, short_tmp: Path) -> None:
    pidfile = short_tmp / "pid"
    script = f"echo $$ > {pidfile}; trap 'echo INT' INT; while :; do sleep 0.1; done"
    proc = subprocess.Popen(
        ctl_command(agent_proc.address, "exec", "--", "sh", "-c", script),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_for(pidfile.exists)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"INT\n"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 128 + signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    assert wait_until_dead([int(pidfile.read_text())])


def test_killed_client_leaves_no_process_after_the_grace(
    agent_proc: AgentProcess, short_tmp: Path
) -> None:
    pidfile = short_tmp / "pid"
    script = f"(sleep 300 & echo $! >> {pidfile}); echo $$ >> {pidfile}; yes"
    proc = subprocess.Popen(
        ctl_command(agent_proc.address, "exec", "--", "sh", "-c", script),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for(lambda: pidfile.exists() and len(pidfile.read_text().split()) == 2)
    time.sleep(0.2)
    proc.kill()  # mid-stream, no goodbye
    proc.wait()
    pids = [int(p) for p in pidfile.read_text().split()]
    assert wait_until_dead(pids, timeout=30)
    assert "event=exec_abandoned" in agent_proc.log()


async def test_slow_consumer_keeps_agent_memory_bounded(agent_proc: AgentProcess) -> None:
    agent = psutil.Process(agent_proc.proc.pid)
    async with Client.connect(agent_proc.address) as client:
        await client.ping()
        baseline = agent.memory_info().rss
        async with client.open_exec(["head", "-c", str(400 << 20), "/dev/zero"]) as ex:
            received = 0
            peak = baseline
            async for _, data in ex:
                received += len(data)
                await trio.sleep(0.01)  # a slow reader: about 25 MiB/s at most
                peak = max(peak, agent.memory_info().rss)
                if received > 40 << 20:
                    break
    assert received > 40 << 20
    assert peak - baseline < 48 << 20, (baseline, peak)


def _wait_for(predicate: Callable[[], Any], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
