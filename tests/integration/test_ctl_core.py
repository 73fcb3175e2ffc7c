"""guest-agent-ctl and the daemon as real subprocesses: ping, info, errors, signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import AgentProcess

Ctl = Callable[..., subprocess.CompletedProcess[bytes]]
StartProcess = Callable[..., AgentProcess]

EXIT_AGENT_ERROR = 125
EXIT_USAGE = 2


def one_line_error(result: subprocess.CompletedProcess[bytes]) -> str:
    """The CLI's error: exactly one line on stderr, no traceback."""
    text = result.stderr.decode()
    assert text.endswith("\n") and text.count("\n") == 1, text
    assert text.startswith("guest-agent-ctl: "), text
    assert "Traceback" not in text
    return text


def test_ping(agent_process: StartProcess, ctl: Ctl) -> None:
    proc = agent_process()
    result = ctl(proc.address, "ping")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(b"pong in ")
    assert result.stderr == b""


def test_ping_json(agent_process: StartProcess, ctl: Ctl) -> None:
    proc = agent_process()
    result = ctl(proc.address, "--json", "ping")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["ok"] is True and out["rtt_ms"] >= 0


def test_info_text_and_json(agent_process: StartProcess, ctl: Ctl) -> None:
    proc = agent_process()
    text = ctl(proc.address, "info")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.decode().splitlines()
    assert any(line.startswith("agent_version: ") for line in lines)
    assert any(line.startswith("capabilities: ") for line in lines)
    result = ctl(proc.address, "--json", "info")
    assert result.returncode == 0, result.stderr
    info: dict[str, Any] = json.loads(result.stdout)
    assert info["pid"] == proc.proc.pid
    assert info["protocol"] == [1, 0]
    assert "system" in info["capabilities"]
    assert {"imports_done", "ready"} <= set(info["boot"])


def test_agent_not_listening(ctl: Ctl, short_tmp: Path) -> None:
    # No socket file at all.
    result = ctl(f"unix:{short_tmp}/absent.sock", "ping")
    assert result.returncode == EXIT_AGENT_ERROR
    assert "not listening" in one_line_error(result)
    # A socket file nobody listens on.
    path = short_tmp / "dead.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()
    result = ctl(f"unix:{path}", "info")
    assert result.returncode == EXIT_AGENT_ERROR
    assert "not listening" in one_line_error(result)


@pytest.fixture
def token_path(short_tmp: Path) -> Path:
    path = short_tmp / "agent.token"
    path.write_text("s3cret-token\n")
    return path


def test_token(agent_process: StartProcess, ctl: Ctl, token_path: Path, short_tmp: Path) -> None:
    proc = agent_process("--token-file", str(token_path))
    for flags in ([], ["--token", "wrong"]):
        result = ctl(proc.address, *flags, "ping")
        assert result.returncode == EXIT_AGENT_ERROR
        message = one_line_error(result)
        assert "handshake refused" in message and "token" in message
    assert ctl(proc.address, "--token", "s3cret-token", "ping").returncode == 0
    assert ctl(proc.address, "--token-file", str(token_path), "ping").returncode == 0
    env = {**os.environ, "GUEST_AGENT_TOKEN": "s3cret-token"}
    assert ctl(proc.address, "ping", env=env).returncode == 0
    result = ctl(proc.address, "--token-file", str(short_tmp / "absent"), "ping")
    assert result.returncode == EXIT_AGENT_ERROR
    assert "token file" in one_line_error(result)


@pytest.mark.parametrize("address", ["nowhere", "vsock:three:1024", "tcp:localhost:99999"])
def test_bad_address(ctl: Ctl, address: str) -> None:
    result = ctl(address, "ping")
    assert result.returncode == EXIT_USAGE
    message = one_line_error(result)
    assert "accepted forms" in message and "unix:/path" in message


def test_address_from_environment(agent_process: StartProcess) -> None:
    proc = agent_process()
    result = subprocess.run(
        [sys.executable, "-m", "guest_agent.ctl", "ping"],
        env={**os.environ, "GUEST_AGENT_ADDR": proc.address},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert b"pong" in result.stdout


def test_usage_errors(ctl: Ctl) -> None:
    assert ctl("unix:/x").returncode == EXIT_USAGE  # no command
    assert ctl("unix:/x", "teleport").returncode == EXIT_USAGE


def test_sigterm_stops_the_agent_and_removes_its_socket(agent_process: StartProcess) -> None:
    proc = agent_process()
    path = Path(proc.address.removeprefix("unix:"))
    assert path.exists()
    # A connected client must not keep the agent from stopping.
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(path))
    try:
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=30) == 0, proc.log()
    finally:
        client.close()
    assert not path.exists()
    log = proc.log()
    assert "event=stopping signal=SIGTERM" in log
    assert "event=stopped" in log
    assert "Traceback" not in log


def test_agent_refuses_bad_config(short_tmp: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "guest_agent", "--cmdline-file", "", "--listen", "tcp:127.0.0.1:1"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == EXIT_USAGE
    assert b"token" in result.stderr
    assert b"Traceback" not in result.stderr


def test_error_after_the_handshake_is_one_line(
    agent_process: StartProcess, ctl: Ctl, short_tmp: Path
) -> None:
    # An agent that refuses every request: the error arrives inside the client's session.
    config = short_tmp / "agent.json"
    config.write_text(json.dumps({"max_requests_per_connection": 0}))
    proc = agent_process("--config", str(config))
    result = ctl(proc.address, "ping")
    assert result.returncode == EXIT_AGENT_ERROR
    assert "limit_exceeded" in one_line_error(result)
