"""One frozen, typed configuration, built from defaults < config file < kernel cmdline < flags.

The config file is JSON with the long flag names as keys (dashes or underscores). On the
kernel command line, ``guest_agent.KEY=VALUE`` sets KEY
(e.g. ``guest_agent.listen=vsock:any:1024``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from . import __version__
from .transport import HOST_CID, Address, AddressError, HybridAddress, TcpAddress, parse_address

DEFAULT_LISTEN = "vsock:any:1024"
CMDLINE_PREFIX = "guest_agent."


class ConfigError(ValueError):
    """The configuration is invalid; the message says which setting and why."""


@dataclass(frozen=True)
class Config:
    """Everything the agent reads from its environment, passed explicitly to whoever needs it."""

    listen: tuple[Address, ...] = ()
    token: str | None = None
    # vsock peers that may connect; None means any CID.
    allowed_cids: frozenset[int] | None = frozenset({HOST_CID})
    handshake_timeout: float = 10.0
    max_requests_per_connection: int = 1024
    log_level: str = "info"
    # exec: how long an abandoned stream's process tree waits for a reattach before it is killed.
    reattach_grace: float = 30.0
    kill_grace: float = 5.0
    output_ring_bytes: int = 1 << 20
    finished_retention: float = 300.0
    max_finished_execs: int = 1000
    default_env: Mapping[str, str] = field(default_factory=dict)
    cgroup_root: str | None = None
    # files: the user that file operations run as when a request names none.
    default_user: str | None = None
    file_workers: int = 8


def build_parser() -> argparse.ArgumentParser:
    """The daemon's command-line flags."""
    p = argparse.ArgumentParser(
        prog="guest-agent", description="The guest agent daemon (one per VM)."
    )
    p.add_argument("--version", action="version", version=f"guest-agent {__version__}")
    p.add_argument(
        "--listen",
        action="append",
        metavar="ADDR",
        help=f"address to listen on, repeatable (default {DEFAULT_LISTEN}); "
        "vsock:any:PORT, serial:/dev/vportNpM, serial:name=NAME, unix:/path, tcp:HOST:PORT",
    )
    p.add_argument("--config", metavar="FILE", help="JSON config file")
    p.add_argument("--token-file", metavar="FILE", help="require this token in every hello")
    p.add_argument(
        "--allow-cid",
        action="append",
        metavar="CID",
        help="vsock peer CID allowed to connect, repeatable, or 'any' (default 2, the host)",
    )
    p.add_argument("--reattach-grace", type=float, metavar="SECONDS")
    p.add_argument("--kill-grace", type=float, metavar="SECONDS")
    p.add_argument("--output-ring-bytes", type=int, metavar="BYTES")
    p.add_argument("--finished-retention", type=float, metavar="SECONDS")
    p.add_argument("--default-env", action="append", metavar="KEY=VALUE")
    p.add_argument("--cgroup-root", metavar="DIR", help="cgroup2 directory for exec cgroups")
    p.add_argument("--default-user", metavar="USER", help="user for file operations")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--cmdline-file",
        default="/proc/cmdline",
        metavar="FILE",
        help="kernel command line to read guest_agent.* settings from",
    )
    return p


def _parse_cmdline(text: str) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for word in text.split():
        if word.startswith(CMDLINE_PREFIX) and "=" in word:
            key, _, value = word[len(CMDLINE_PREFIX) :].partition("=")
            key = key.replace("-", "_")
            if key in ("listen", "allow_cid", "default_env"):
                settings.setdefault(key, []).append(value)
            else:
                settings[key] = value
    return settings


def _from_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        key: value
        for key, value in vars(args).items()
        if value is not None and key not in ("config", "cmdline_file")
    }


def load_config(argv: Sequence[str] | None = None) -> Config:
    """Build the Config from flags, the config file and the kernel command line."""
    args = build_parser().parse_args(argv)
    settings: dict[str, Any] = {}
    if args.config:
        import json  # only here: most VMs are configured by flags and the kernel cmdline

        try:
            loaded = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"config file {args.config}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {args.config}: top level must be an object")
        settings.update({key.replace("-", "_"): value for key, value in loaded.items()})
    if args.cmdline_file:
        # No /proc in a development chroot, say: then there is nothing to read.
        with contextlib.suppress(OSError):
            settings.update(_parse_cmdline(Path(args.cmdline_file).read_text()))
    settings.update(_from_flags(args))
    return config_from_settings(settings)


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def config_from_settings(settings: Mapping[str, Any]) -> Config:
    """Validate loose settings (strings from a cmdline, JSON values, flags) into a Config."""
    known = {f.name for f in fields(Config)} | {"token_file", "allow_cid"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
    values: dict[str, Any] = {}
    try:
        values["listen"] = tuple(
            parse_address(str(a)) for a in _as_list(settings.get("listen", [DEFAULT_LISTEN]))
        )
    except AddressError as exc:
        raise ConfigError(str(exc)) from None
    if dial_only := [str(a) for a in values["listen"] if isinstance(a, HybridAddress)]:
        raise ConfigError(f"listen: {', '.join(dial_only)} is dial-only (the host side)")
    token = settings.get("token")
    if token is not None and not isinstance(token, str):
        raise ConfigError("token must be a string")
    if settings.get("token_file"):
        try:
            token = Path(settings["token_file"]).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"token file: {exc}") from None
        if not token:
            raise ConfigError(f"token file {settings['token_file']} is empty")
    values["token"] = token or None
    if "allow_cid" in settings:
        cids = [str(c) for c in _as_list(settings["allow_cid"])]
        if "any" in cids:
            values["allowed_cids"] = None
        elif not all(c.isascii() and c.isdigit() for c in cids):
            raise ConfigError(f"allow_cid: {cids} must be numbers or 'any'")
        else:
            values["allowed_cids"] = frozenset(int(c) for c in cids)
    for name, kind in (
        ("reattach_grace", float),
        ("kill_grace", float),
        ("finished_retention", float),
        ("handshake_timeout", float),
        ("output_ring_bytes", int),
        ("max_finished_execs", int),
        ("max_requests_per_connection", int),
        ("file_workers", int),
    ):
        if name in settings:
            try:
                values[name] = kind(settings[name])
            except (TypeError, ValueError):
                raise ConfigError(f"{name}: {settings[name]!r} is not a {kind.__name__}") from None
            if not values[name] >= 0:  # also refuses NaN, which trio's timeouts reject
                raise ConfigError(f"{name}: {settings[name]!r} must be a number >= 0")
    for name in ("cgroup_root", "default_user", "log_level"):
        if settings.get(name) is not None:
            values[name] = str(settings[name])
    if "log_level" in values and values["log_level"] not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log_level: {values['log_level']!r} is not debug/info/warning/error")
    env = settings.get("default_env", {})
    if not isinstance(env, Mapping):
        pairs = [str(item).partition("=") for item in _as_list(env)]
        if not all(sep and key for key, sep, _ in pairs):
            raise ConfigError("default_env entries must be KEY=VALUE")
        env = {key: value for key, _, value in pairs}
    values["default_env"] = {str(k): str(v) for k, v in env.items()}
    config = Config(**values)
    if any(isinstance(a, TcpAddress) for a in config.listen) and not config.token:
        raise ConfigError("tcp listeners are for development and need a token (--token-file)")
    return config


def log_level_number(config: Config) -> int:
    """The logging module's level for the configured name."""
    return int(getattr(logging, config.log_level.upper()))
