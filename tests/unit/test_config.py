"""Config: defaults, the JSON file, the kernel command line, flags, and bad values."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from guest_agent.config import Config, ConfigError, config_from_settings, load_config
from guest_agent.transport import TcpAddress, UnixAddress, VsockAddress


def load(tmp_path: Path, *flags: str, cmdline: str = "", file: Any = None) -> Config:
    cmdline_path = tmp_path / "cmdline"
    cmdline_path.write_text(cmdline + "\n")
    argv = ["--cmdline-file", str(cmdline_path), *flags]
    if file is not None:
        config_path = tmp_path / "agent.json"
        config_path.write_text(file if isinstance(file, str) else json.dumps(file))
        argv += ["--config", str(config_path)]
    return load_config(argv)


def test_defaults(tmp_path: Path) -> None:
    config = load(tmp_path)
    assert config == Config(listen=(VsockAddress(None, 1024),))
    assert config.token is None
    assert config.allowed_cids == frozenset({2})
    assert config.handshake_timeout > 0
    assert config.max_requests_per_connection > 0
    assert config.log_level == "info"
    assert config == config_from_settings({})


def test_missing_cmdline_file_is_fine(tmp_path: Path) -> None:
    assert load_config(["--cmdline-file", str(tmp_path / "absent")]) == config_from_settings({})
    assert load_config(["--cmdline-file", ""]) == config_from_settings({})


def test_json_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    config = load(
        tmp_path,
        file={
            "listen": ["unix:/run/a.sock", "vsock:any:52"],
            "kill-grace": 2,
            "reattach_grace": 1.5,
            "allow-cid": ["any"],
            "default_env": {"LANG": "C.UTF-8"},
            "token-file": str(tmp_path / "token"),
            "log_level": "debug",
            "max_requests_per_connection": 8,
            "handshake_timeout": 0.5,
        },
    )
    assert config.listen == (UnixAddress("/run/a.sock"), VsockAddress(None, 52))
    assert config.kill_grace == 2.0
    assert config.reattach_grace == 1.5
    assert config.allowed_cids is None
    assert config.default_env == {"LANG": "C.UTF-8"}
    assert config.token == "s3cret"
    assert config.log_level == "debug"
    assert config.max_requests_per_connection == 8
    assert config.handshake_timeout == 0.5


def test_single_listen_string_in_json(tmp_path: Path) -> None:
    assert load(tmp_path, file={"listen": "unix:/a"}).listen == (UnixAddress("/a"),)


def test_kernel_cmdline(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        cmdline="console=ttyS0 reboot=k guest_agent.listen=vsock:any:5000 "
        "guest_agent.listen=unix:/run/ga.sock guest_agent.kill-grace=3 "
        "guest_agent.allow_cid=2 guest_agent.allow_cid=7 guest_agent.default_env=A=B=C "
        "guest_agent.default_env=EMPTY= guest_agent.log_level=warning "
        "guest_agentX.kill_grace=9 guest_agent.noequals quiet",
    )
    assert config.listen == (VsockAddress(None, 5000), UnixAddress("/run/ga.sock"))
    assert config.kill_grace == 3.0
    assert config.allowed_cids == frozenset({2, 7})
    assert config.default_env == {"A": "B=C", "EMPTY": ""}
    assert config.log_level == "warning"


def test_precedence_file_then_cmdline_then_flags(tmp_path: Path) -> None:
    file = {"kill_grace": 1, "reattach_grace": 1, "finished_retention": 1}
    cmdline = "guest_agent.reattach_grace=2 guest_agent.finished_retention=2"
    config = load(tmp_path, "--finished-retention", "3", cmdline=cmdline, file=file)
    assert (config.kill_grace, config.reattach_grace, config.finished_retention) == (1, 2, 3)
    flags_listen = load(
        tmp_path, "--listen", "unix:/flag", cmdline="guest_agent.listen=unix:/cmdline"
    )
    assert flags_listen.listen == (UnixAddress("/flag"),)


def test_flags(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "--listen", "unix:/a", "--listen", "vsock:any:9",
        "--allow-cid", "5", "--default-env", "X=1", "--log-level", "error",
    )  # fmt: skip
    assert config.listen == (UnixAddress("/a"), VsockAddress(None, 9))
    assert config.allowed_cids == frozenset({5})
    assert config.default_env == {"X": "1"}
    assert config.log_level == "error"


def test_tcp_needs_a_token(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token"):
        config_from_settings({"listen": ["tcp:127.0.0.1:9000"]})
    config = config_from_settings({"listen": ["tcp:127.0.0.1:9000"], "token": "t"})
    assert config.listen == (TcpAddress("127.0.0.1", 9000),)
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    config = load(tmp_path, "--listen", "tcp:127.0.0.1:9000", "--token-file", str(token_file))
    assert config.token == "from-file"


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"kill_grace": "soon"}, "kill_grace"),
        ({"kill_grace": -1}, "kill_grace"),
        ({"reattach_grace": math.nan}, "reattach_grace"),
        ({"handshake_timeout": "nan"}, "handshake_timeout"),
        ({"max_requests_per_connection": "1.5"}, "max_requests_per_connection"),
        ({"output_ring_bytes": [1]}, "output_ring_bytes"),
        ({"listen": ["nowhere"]}, "accepted forms"),
        ({"listen": ["hybrid:/run/v.sock:5"]}, "dial-only"),
        ({"allow_cid": ["host"]}, "allow_cid"),
        ({"log_level": "loud"}, "log_level"),
        ({"default_env": ["NOEQUALS"]}, "KEY=VALUE"),
        ({"default_env": ["=value"]}, "KEY=VALUE"),
        ({"token": 1234}, "token"),
        ({"colour": "blue"}, "unknown setting"),
    ],
)
def test_bad_values(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_settings(settings)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file"):
        load_config(["--cmdline-file", "", "--config", str(tmp_path / "absent.json")])
    with pytest.raises(ConfigError, match="config file"):
        load(tmp_path, file="{not json")
    with pytest.raises(ConfigError, match="object"):
        load(tmp_path, file=["unix:/a"])
    with pytest.raises(ConfigError, match="token file"):
        load(tmp_path, "--token-file", str(tmp_path / "absent"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        load(tmp_path, "--token-file", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="unknown setting"):
        load(tmp_path, cmdline="guest_agent.colour=blue")
    with pytest.raises(ConfigError, match="kill_grace"):
        load(tmp_path, cmdline="guest_agent.kill_grace=soon")


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
