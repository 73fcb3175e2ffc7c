"""The peers on this machine: qemu-ga on a unix socket, OpenSSH on loopback with a warm master."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from .procs import Placement, Processes, wait_for_path

# qemu-ga's limits per call (QGA_READ_COUNT_MAX is 48 MiB; a write's JSON must stay under
# the parser's 64 MiB token limit once base64-encoded).
QGA_READ_CHUNK = 48 << 20
QGA_WRITE_CHUNK = 32 << 20


class QgaError(RuntimeError):
    """qemu-ga answered with an error."""


class QemuGa:
    """One qemu-ga listening on a unix socket, and a blocking JSON client on it."""

    def __init__(self, binary: str, workdir: Path, procs: Processes, placement: Placement):
        self.binary = binary
        self.workdir = workdir
        self.procs = procs
        self.placement = placement
        self.socket_path = workdir / "qga.sock"
        self.proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._reader: Any = None

    def start(self) -> float:
        """Start it and wait for its first answer; returns the seconds that took."""
        self.workdir.mkdir(exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        argv = [
            *self.placement.server_prefix(),
            self.binary,
            "-m",
            "unix-listen",
            "-p",
            str(self.socket_path),
            "-t",
            str(self.workdir),
            "-f",
            str(self.workdir / "qga.pid"),
        ]
        started = time.perf_counter()
        with open(self.workdir / "qga.log", "ab") as log:
            self.proc = self.procs.start(argv, log=log)
        wait_for_path(self.socket_path, self.proc)
        deadline = time.monotonic() + 10
        while True:  # the socket file exists a moment before qemu-ga listens on it
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._sock.connect(str(self.socket_path))
                break
            except ConnectionRefusedError:
                self._sock.close()
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.0005)
        self._reader = self._sock.makefile("rb")
        self.call("guest-ping")
        return time.perf_counter() - started

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._reader = None
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None

    @property
    def process(self) -> psutil.Process:
        assert self.proc is not None
        return psutil.Process(self.proc.pid)

    def call(self, command: str, **arguments: Any) -> Any:
        """One command, one answer (qemu-ga answers line by line, in order)."""
        assert self._sock is not None
        message: dict[str, Any] = {"execute": command}
        if arguments:
            message["arguments"] = arguments
        self._sock.sendall(json.dumps(message).encode() + b"\n")
        line = self._reader.readline()
        if not line:
            raise QgaError(f"{command}: qemu-ga closed the connection")
        reply = json.loads(line)
        if "error" in reply:
            raise QgaError(f"{command}: {reply['error']}")
        return reply.get("return")

    def exec_wait(self, path: str) -> int:
        """guest-exec, then guest-exec-status polled without pause until it has exited."""
        pid = self.call("guest-exec", path=path, **{"capture-output": False})["pid"]
        while True:
            status = self.call("guest-exec-status", pid=pid)
            if status["exited"]:
                return int(status.get("exitcode", -1))

    def read_file(self, path: str) -> int:
        """Read a whole file through guest-file-read; returns the bytes received."""
        handle = self.call("guest-file-open", path=path, mode="r")
        total = 0
        try:
            while True:
                reply = self.call("guest-file-read", handle=handle, count=QGA_READ_CHUNK)
                total += len(base64.b64decode(reply["buf-b64"]))
                if reply["eof"] or reply["count"] == 0:
                    return total
        finally:
            self.call("guest-file-close", handle=handle)

    def write_file(self, path: str, size: int, block: bytes) -> int:
        """Write ``size`` bytes (``block`` repeated) through guest-file-write."""
        handle = self.call("guest-file-open", path=path, mode="w")
        total = 0
        try:
            while total < size:
                chunk = _repeat(block, min(QGA_WRITE_CHUNK, size - total))
                reply = self.call(
                    "guest-file-write",
                    handle=handle,
                    **{"buf-b64": base64.b64encode(chunk).decode()},
                )
                total += int(reply["count"])
        finally:
            self.call("guest-file-close", handle=handle)
        return total


def _repeat(block: bytes, size: int) -> bytes:
    whole, rest = divmod(size, len(block))
    return block * whole + block[:rest]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Ssh:
    """sshd on 127.0.0.1 with throwaway keys, and a warm ControlMaster to it."""

    CIPHER = "aes128-gcm@openssh.com"

    def __init__(
        self, sshd: str, ssh: str, workdir: Path, procs: Processes, placement: Placement
    ) -> None:
        self.sshd = sshd
        self.ssh = ssh
        self.workdir = workdir
        self.procs = procs
        self.placement = placement
        self.port = 0
        self.daemon: subprocess.Popen[bytes] | None = None
        self.master: subprocess.Popen[bytes] | None = None
        self._server_procs: list[psutil.Process] = []

    def _keygen(self, path: Path) -> str:
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
            check=True,
            capture_output=True,
        )
        return path.with_suffix(".pub").read_text().strip()

    def start(self) -> None:
        w = self.workdir
        w.mkdir(exist_ok=True)
        home = w / "home"  # no .bashrc: root's would cost ~90 ms per command
        home.mkdir(exist_ok=True)
        self._keygen(w / "host_key")
        client_pub = self._keygen(w / "client_key")
        (w / "authorized_keys").write_text(f'environment="HOME={home}" {client_pub}\n')
        self.port = _free_port()
        config = w / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {w / 'host_key'}",
                    f"AuthorizedKeysFile {w / 'authorized_keys'}",
                    "PidFile none",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitUserEnvironment yes",
                    "PrintMotd no",
                    "PrintLastLog no",
                    f"Ciphers {self.CIPHER}",
                    "LogLevel ERROR",
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation dir
        with open(w / "sshd.log", "ab") as log:
            self.daemon = self.procs.start(
                [*self.placement.server_prefix(), self.sshd, "-D", "-e", "-f", str(config)],
                log=log,
            )
        self._wait_listening()
        with open(w / "master.log", "ab") as log:
            self.master = self.procs.start(
                [*self.base_argv(), "-M", "-N", "-o", "ControlMaster=yes", self.target], log=log
            )
        deadline = time.monotonic() + 20
        while self._control("check") != 0:
            if self.master.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ssh master did not come up: {(w / 'master.log').read_text()}")
            time.sleep(0.02)
        # The per-connection sshd processes that relay the master's channels.
        self._server_procs = psutil.Process(self.daemon.pid).children(recursive=True)

    def _wait_listening(self) -> None:
        assert self.daemon is not None
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not start: {(self.workdir / 'sshd.log').read_text()}")
            time.sleep(0.01)

    @property
    def target(self) -> str:
        return "root@127.0.0.1"

    def base_argv(self) -> list[str]:
        w = self.workdir
        return [
            self.ssh,
            "-F",
            "/dev/null",
            "-i",
            str(w / "client_key"),
            "-p",
            str(self.port),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            f"ControlPath={w / 'cm'}",
            "-o",
            f"Ciphers={self.CIPHER}",
        ]

    def command(self, remote: str) -> list[str]:
        """argv of one command through the warm master."""
        return [*self.base_argv(), "-T", "-o", "ControlMaster=no", self.target, remote]

    def _control(self, op: str) -> int:
        proc = subprocess.run(
            [*self.base_argv(), "-O", op, self.target], capture_output=True, check=False
        )
        return proc.returncode

    def server_processes(self) -> list[psutil.Process]:
        """The sshd processes that move the data (for CPU accounting)."""
        return list(self._server_procs)

    def client_processes(self) -> list[psutil.Process]:
        assert self.master is not None
        return [psutil.Process(self.master.pid)]

    def stop(self) -> None:
        if self.master is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self._control("exit")
            self.procs.stop(self.master)
            self.master = None
        if self.daemon is not None:
            self.procs.stop(self.daemon)
            self.daemon = None
        for proc in self._server_procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def read_all(fd: int, bufsize: int = 1 << 20) -> int:
    """Read an fd to its end into one reused buffer, counting (and dropping) the bytes."""
    buffer = bytearray(bufsize)
    total = 0
    while size := os.readv(fd, [buffer]):
        total += size
    return total
