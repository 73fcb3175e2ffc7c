"""The data-path floor: blocking Python moving bytes between a pipe or file and a unix socket.

``python -m bench.relay SOCKET CHUNK`` serves one connection at a time. The first line of a
connection is a JSON command:

- ``{"mode": "pipe", "argv": [...]}``: run argv, copy its stdout to the socket;
- ``{"mode": "read", "path": P}``: copy the file to the socket;
- ``{"mode": "write", "path": P}``: copy the socket to the file until EOF, fsync, answer "ok".

It stays up between transfers so that the harness can read its CPU time like the agent's.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys

# The agent's pipe size (process/spawn.py), so that both sides see the same pipe.
PIPE_SIZE = 1 << 20


def _read_line(conn: socket.socket) -> bytes:
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            break
        line += byte
    return bytes(line)


def _copy_fd_to_socket(fd: int, conn: socket.socket, chunk: int) -> None:
    while data := os.read(fd, chunk):
        conn.sendall(data)


def serve(path: str, chunk: int) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    buffer = bytearray(chunk)
    while True:
        conn, _ = server.accept()
        with conn:
            line = _read_line(conn)
            if not line.strip():
                continue  # a readiness probe
            command = json.loads(line)
            mode = command["mode"]
            if mode == "pipe":
                read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
                fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
                proc = subprocess.Popen(command["argv"], stdout=write_fd)
                os.close(write_fd)
                try:
                    _copy_fd_to_socket(read_fd, conn, chunk)
                finally:
                    os.close(read_fd)
                    proc.wait()
            elif mode == "read":
                fd = os.open(command["path"], os.O_RDONLY | os.O_CLOEXEC)
                try:
                    _copy_fd_to_socket(fd, conn, chunk)
                finally:
                    os.close(fd)
            elif mode == "write":
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                fd = os.open(command["path"], flags, 0o644)
                try:
                    view = memoryview(buffer)
                    while size := conn.recv_into(buffer):
                        written = 0
                        while written < size:
                            written += os.write(fd, view[written:size])
                    os.fsync(fd)  # the agent's writes are durable too
                finally:
                    os.close(fd)
                conn.sendall(b"ok")
            elif mode == "quit":
                return


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
