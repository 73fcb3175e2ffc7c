"""Install what the harness needs (Debian packages, the C floor) on a fresh machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# What each tool is called on PATH, and the Debian package that brings it.
PACKAGES = {
    "qemu-ga": "qemu-guest-agent",
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "gcc": "gcc",
}
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FLOOR_SOURCE = Path(__file__).with_name("floor.c")


def which(tool: str) -> str | None:
    """The tool's path, looking in the sbin directories too (sshd, qemu-ga live there)."""
    return shutil.which(tool, path=_SBIN_PATH)


@dataclass
class Installer:
    """Runs apt-get at most once per harness run, within a time budget."""

    budget: float | None  # seconds for all apt work; None: no limit
    log: list[str] = field(default_factory=list)
    _updated: bool = False
    _spent: float = 0.0

    def _remaining(self) -> float | None:
        return None if self.budget is None else max(self.budget - self._spent, 0.0)

    def _apt(self, *args: str, limited: bool = True) -> bool:
        """apt-get, killed when the budget runs out if ``limited`` (only safe before dpkg runs)."""
        remaining = self._remaining() if limited else None
        if remaining is not None and remaining <= 0:
            self.log.append(f"apt-get {' '.join(args)}: skipped, install budget spent")
            return False
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PATH": _SBIN_PATH}
        start = time.monotonic()
        try:
            proc = subprocess.run(
                ["apt-get", "-y", "-q", *args],
                env=env,
                capture_output=True,
                timeout=remaining,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.log.append(f"apt-get {' '.join(args)}: {exc}")
            return False
        finally:
            self._spent += time.monotonic() - start
        if proc.returncode != 0:
            tail = proc.stderr.decode(errors="replace").strip().splitlines()[-3:]
            self.log.append(f"apt-get {' '.join(args)} failed: {' | '.join(tail)}")
            return False
        return True

    def ensure(self, tools: list[str]) -> dict[str, str | None]:
        """Path of each tool, installing the missing ones; None where that failed."""
        missing = [tool for tool in tools if which(tool) is None]
        if missing:
            if os.geteuid() != 0:
                self.log.append(f"not root: cannot install {', '.join(missing)}")
            else:
                if not self._updated:
                    self._updated = self._apt("update")
                packages = sorted({PACKAGES[tool] for tool in missing})
                install = ("install", "--no-install-recommends", *packages)
                # Only the download may be cut short by the budget: killing dpkg halfway
                # would leave the package database broken for the next run.
                if self._apt(*install, "--download-only"):
                    # Debian's postinst scripts would start the services; policy-rc.d says no.
                    with _no_service_starts():
                        self._apt(*install, limited=False)
        return {tool: which(tool) for tool in tools}


class _no_service_starts:
    """Make invoke-rc.d refuse to start services while packages install (if not already)."""

    path = Path("/usr/sbin/policy-rc.d")

    def __enter__(self) -> None:
        self.created = False
        if not self.path.exists():
            self.path.write_text("#!/bin/sh\nexit 101\n")
            self.path.chmod(0o755)
            self.created = True

    def __exit__(self, *exc_info: object) -> None:
        if self.created:
            self.path.unlink(missing_ok=True)


def compile_agent() -> None:
    """Compile the agent's .pyc, as a VM image ships it (and as `make` does).

    Without them every agent start compiles guest_agent from source (this environment sets
    PYTHONDONTWRITEBYTECODE), which is not what start-up or idle RSS measure in production.
    """
    package = Path(__file__).resolve().parent.parent / "guest_agent"
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True)


def build_floor(gcc: str | None, out_dir: Path) -> Path | None:
    """Compile floor.c into ``out_dir``; None without a compiler."""
    if gcc is None:
        return None
    binary = out_dir / "floor"
    subprocess.run(
        [gcc, "-O2", "-Wall", "-Werror", "-o", str(binary), str(FLOOR_SOURCE)],
        check=True,
        capture_output=True,
    )
    return binary
