"""Address strings to trio listeners (daemon) and streams (clients).

vsock:CID:PORT        AF_VSOCK; listen with vsock:any:PORT
hybrid:/path:PORT     dial only: Firecracker / Cloud Hypervisor host socket
serial:/dev/vportNpM  listen only: a virtio-serial port (also serial:name=NAME)
unix:/path            unix socket (development, tests, virtio-serial chardevs)
tcp:HOST:PORT         development only; the daemon requires a token for it
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import socket
import stat
from dataclasses import dataclass

import trio

log = logging.getLogger(__name__)

HOST_CID = 2
ADDRESS_FORMS = (
    "vsock:CID:PORT (vsock:any:PORT to listen), hybrid:/path/to/uds:PORT, "
    "serial:/dev/vportNpM or serial:name=NAME, unix:/path, tcp:HOST:PORT"
)
_HYBRID_REPLY_MAX = 64  # "OK 1073741824\n" fits many times over
_SERIAL_RETRY_MAX = 1.0
# How long one frame may take to write before the connection is given up for dead.
FRAME_WRITE_TIMEOUT = 60.0
# Kernel send and receive buffers of a connected unix or vsock socket. The ~200 KiB default
# holds less than one 512 KiB data frame, so a transfer stalls and switches tasks at every
# frame; with a few MiB it moves in a few large reads. Capped by net.core.[wr]mem_max.
SOCKET_BUFFER = 4 << 20


class AddressError(ValueError):
    """A malformed or misused address string."""


class TransportError(OSError):
    """Connecting or handshaking with a transport failed."""


@dataclass(frozen=True)
class VsockAddress:
    cid: int | None  # None: any (listen only)
    port: int

    def __str__(self) -> str:
        return f"vsock:{'any' if self.cid is None else self.cid}:{self.port}"


@dataclass(frozen=True)
class HybridAddress:
    path: str
    port: int

    def __str__(self) -> str:
        return f"hybrid:{self.path}:{self.port}"


@dataclass(frozen=True)
class SerialAddress:
    path: str | None
    name: str | None

    def __str__(self) -> str:
        return f"serial:{self.path}" if self.path else f"serial:name={self.name}"


@dataclass(frozen=True)
class UnixAddress:
    path: str

    def __str__(self) -> str:
        return f"unix:{self.path}"


@dataclass(frozen=True)
class TcpAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"tcp:{self.host}:{self.port}"


Address = VsockAddress | HybridAddress | SerialAddress | UnixAddress | TcpAddress


def _number(text: str) -> bool:
    # ASCII only: str.isdigit() accepts "²", which int() then refuses with a bare ValueError.
    return text.isascii() and text.isdigit()


def _port(text: str, address: str, limit: int = 1 << 32) -> int:
    if not _number(text) or not 0 < int(text) < limit:
        raise AddressError(f"bad port {text!r} in address {address!r}")
    return int(text)


def parse_address(text: str) -> Address:
    """Parse an address string; AddressError names the accepted forms."""
    try:
        return _parse_address(text)
    except AddressError as exc:
        raise AddressError(f"{exc}; accepted forms: {ADDRESS_FORMS}") from None


def _parse_address(text: str) -> Address:
    scheme, sep, rest = text.partition(":")
    if not sep or not rest:
        raise AddressError(f"malformed address {text!r}")
    if scheme == "vsock":
        cid_text, sep, port_text = rest.partition(":")
        if not sep:
            raise AddressError(f"vsock address {text!r} needs CID:PORT")
        if cid_text == "any":
            cid = None
        elif _number(cid_text) and int(cid_text) < 1 << 32:
            cid = int(cid_text)
        else:
            raise AddressError(f"bad vsock CID {cid_text!r} in {text!r} (a number or 'any')")
        return VsockAddress(cid, _port(port_text, text))
    if scheme == "hybrid":
        path, sep, port_text = rest.rpartition(":")
        if not sep or not path:
            raise AddressError(f"hybrid address {text!r} needs /path/to/uds:PORT")
        return HybridAddress(path, _port(port_text, text))
    if scheme == "serial":
        if rest.startswith("name="):
            if rest == "name=":
                raise AddressError(f"serial address {text!r} needs a port name")
            return SerialAddress(None, rest[len("name=") :])
        return SerialAddress(rest, None)
    if scheme == "unix":
        return UnixAddress(rest)
    if scheme == "tcp":
        host, sep, port_text = rest.rpartition(":")
        if not sep or not host:
            raise AddressError(f"tcp address {text!r} needs HOST:PORT")
        return TcpAddress(host.strip("[]"), _port(port_text, text, 1 << 16))
    raise AddressError(f"unknown transport {scheme!r} in {text!r}")


# ---- writing ---------------------------------------------------------------------------


Parts = list[bytes | bytearray | memoryview]


async def send_parts(stream: trio.abc.Stream, parts: Parts) -> None:
    """Write one frame's ``parts`` in order, gathered into as few system calls as possible.

    A cancellation takes effect before the frame or after it, never inside: a frame cut
    short would garble every later frame of the connection (all its other requests). A
    frame that cannot be written within FRAME_WRITE_TIMEOUT (a peer that stopped reading,
    a half-open connection after a snapshot restore) closes the stream instead.
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    if isinstance(stream, trio.SocketStream):
        # Fast path: most frames fit in the socket buffer at once, and then need neither a
        # wait nor the scopes below (two per frame, a tenth of an exec's round trip).
        try:
            written = os.writev(stream.socket.fileno(), parts)
        except BlockingIOError:
            written = 0
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket send failed: {exc!r}") from exc
        parts = _after(parts, written)
        if not parts:
            await trio.lowlevel.cancel_shielded_checkpoint()  # still a scheduling point
            return
    with trio.CancelScope(shield=True), trio.move_on_after(FRAME_WRITE_TIMEOUT) as deadline:
        try:
            await _write_parts(stream, parts)
        except OSError as exc:
            # What SocketStream.send_all would raise, so callers handle one kind of failure.
            raise trio.BrokenResourceError(f"socket send failed: {exc!r}") from exc
    if deadline.cancelled_caught:
        abort_stream(stream)
        raise trio.BrokenResourceError(f"no frame written for {FRAME_WRITE_TIMEOUT} s: gave up")


def _after(parts: Parts, written: int) -> Parts:
    """What is left of ``parts`` once ``written`` bytes of them have gone out."""
    views = [memoryview(part).cast("B") for part in parts]
    while written and views:
        first = len(views[0])
        if written >= first:
            written -= first
            views.pop(0)
        else:
            views[0] = views[0][written:]
            written = 0
    return [view for view in views if len(view)]


async def _write_parts(stream: trio.abc.Stream, parts: Parts) -> None:
    if not isinstance(stream, trio.SocketStream):
        for part in parts:
            await stream.send_all(part)
        return
    while parts:
        parts = _after(parts, await stream.socket.sendmsg(parts))


class Reader:
    """Reads a stream into one reused buffer, which grows while reads come back full.

    A fresh object per read would have its pages faulted in again and again (transfers
    run at a GiB/s); an idle connection keeps only the small starting buffer. What a read
    returns is valid until the next read: decode it first (msgpack copies what it keeps).
    """

    START = 64 << 10
    LIMIT = 1 << 20

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._buffer = bytearray(self.START if self._socket is not None else 0)

    async def read(self) -> bytes | memoryview:
        """The next bytes; empty at the end of the stream."""
        if self._socket is None:
            return bytes(await self.stream.receive_some(self.LIMIT))
        received = await self._socket.recv_into(self._buffer)
        data = memoryview(self._buffer)[:received]
        if received == len(self._buffer) < self.LIMIT:
            self._buffer = bytearray(len(self._buffer) * 2)  # the old one lives on in `data`
        return data


def abort_stream(stream: trio.abc.Stream) -> None:
    """Close ``stream`` at once, without a checkpoint; a task reading it gets an error."""
    if isinstance(stream, trio.SocketStream):
        stream.socket.close()
    elif isinstance(stream, (trio.lowlevel.FdStream, _SerialStream)):
        stream.close()


def enlarge_buffers(stream: trio.SocketStream) -> trio.SocketStream:
    """Give a connected socket SOCKET_BUFFER-sized kernel buffers (best effort)."""
    sock = stream.socket
    options = [(socket.SOL_SOCKET, socket.SO_SNDBUF), (socket.SOL_SOCKET, socket.SO_RCVBUF)]
    if sock.family == socket.AF_VSOCK:
        # virtio-vsock has a buffer of its own (256 KiB by default), capped by its max.
        options = [
            (socket.AF_VSOCK, socket.SO_VM_SOCKETS_BUFFER_MAX_SIZE),
            (socket.AF_VSOCK, socket.SO_VM_SOCKETS_BUFFER_SIZE),
        ]
    for level, option in options:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, SOCKET_BUFFER)
    return stream


# ---- dialing ---------------------------------------------------------------------------


async def connect(address: Address) -> trio.abc.Stream:
    """Open a byte stream to an agent listening at ``address``."""
    if isinstance(address, UnixAddress):
        return enlarge_buffers(await trio.open_unix_socket(address.path))
    if isinstance(address, TcpAddress):
        return await trio.open_tcp_stream(address.host, address.port)
    if isinstance(address, VsockAddress):
        if address.cid is None:
            raise AddressError("vsock:any is for listening; dial a CID")
        sock = trio.socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        try:
            await sock.connect((address.cid, address.port))
        except BaseException:
            sock.close()
            raise
        return enlarge_buffers(trio.SocketStream(sock))
    if isinstance(address, HybridAddress):
        return await _connect_hybrid(address)
    raise AddressError(f"{address} is listen-only")


async def _connect_hybrid(address: HybridAddress) -> trio.abc.Stream:
    stream = enlarge_buffers(await trio.open_unix_socket(address.path))
    try:
        await stream.send_all(f"CONNECT {address.port}\n".encode())
        reply = bytearray()
        # One byte at a time: anything after the newline already belongs to the agent.
        while not reply.endswith(b"\n"):
            byte = await stream.receive_some(1)
            if not byte:
                raise TransportError(
                    errno.ECONNREFUSED,
                    f"hybrid vsock {address.path}: closed before OK (nothing on port "
                    f"{address.port}?)",
                )
            reply += byte
            if len(reply) > _HYBRID_REPLY_MAX:
                raise TransportError(errno.EPROTO, f"hybrid vsock: overlong reply {reply!r}")
        if not reply.startswith(b"OK "):
            raise TransportError(errno.EPROTO, f"hybrid vsock: unexpected reply {reply!r}")
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream


# ---- listening -------------------------------------------------------------------------


async def open_listener(
    address: Address, *, allowed_cids: frozenset[int] | None = frozenset({HOST_CID})
) -> trio.abc.Listener[trio.abc.Stream]:
    """Bind ``address``; ``allowed_cids`` (None: any) filters vsock peers."""
    if isinstance(address, UnixAddress):
        return _listen_unix(address.path)
    if isinstance(address, TcpAddress):
        listeners = await trio.open_tcp_listeners(address.port, host=address.host)
        if len(listeners) != 1:
            for extra in listeners[1:]:
                await extra.aclose()
        return listeners[0]
    if isinstance(address, VsockAddress):
        sock = trio.socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        try:
            cid = socket.VMADDR_CID_ANY if address.cid is None else address.cid
            await sock.bind((cid, address.port))
            sock.listen(socket.SOMAXCONN)
        except BaseException:
            sock.close()
            raise
        return VsockListener(trio.SocketListener(sock), allowed_cids)
    if isinstance(address, SerialAddress):
        return SerialListener(address)
    raise AddressError(f"{address} is dial-only")


def _listen_unix(path: str) -> UnixListener:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Bind under a tight umask: only root (the host side's operator) may connect.
        old_umask = os.umask(0o077)
        try:
            sock.bind(path)
        finally:
            os.umask(old_umask)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return UnixListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))


def _remove_stale_socket(path: str) -> None:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: a leftover of a previous run
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another process listens on {path}")


class UnixListener(trio.abc.Listener[trio.abc.Stream]):
    """A unix socket listener whose connections get big buffers (unix sockets do not
    inherit them from the listening socket)."""

    def __init__(self, inner: trio.SocketListener) -> None:
        self.inner = inner

    async def accept(self) -> trio.abc.Stream:
        return enlarge_buffers(await self.inner.accept())

    async def aclose(self) -> None:
        await self.inner.aclose()


class VsockListener(trio.abc.Listener[trio.abc.Stream]):
    """A vsock listener that drops peers whose CID is not allowed."""

    def __init__(self, inner: trio.SocketListener, allowed_cids: frozenset[int] | None) -> None:
        self.inner = inner
        self.allowed_cids = allowed_cids

    async def accept(self) -> trio.abc.Stream:
        while True:
            stream = await self.inner.accept()
            try:
                cid, port = stream.socket.getpeername()
            except OSError:  # the peer is already gone
                await trio.aclose_forcefully(stream)
                continue
            if self.allowed_cids is None or cid in self.allowed_cids:
                return enlarge_buffers(stream)
            log.warning("event=vsock_refused peer_cid=%s peer_port=%s", cid, port)
            await trio.aclose_forcefully(stream)

    async def aclose(self) -> None:
        await self.inner.aclose()


def resolve_serial_port(address: SerialAddress) -> str:
    """The device path of a serial address (looks named ports up in sysfs; no udev)."""
    if address.path:
        return address.path
    for name_file in sorted(glob.glob("/sys/class/virtio-ports/*/name")):
        with open(name_file) as f:
            if f.read().strip() == address.name:
                return "/dev/" + os.path.basename(os.path.dirname(name_file))
    raise FileNotFoundError(errno.ENOENT, f"no virtio-serial port named {address.name!r}")


class SerialListener(trio.abc.Listener[trio.abc.Stream]):
    """A virtio-serial port as a listener: one connection at a time, reopened after each.

    While the host side is disconnected, reads return EOF at once; a connection that ended
    without receiving a byte makes the next accept back off before reopening.
    """

    def __init__(self, address: SerialAddress) -> None:
        self.address = address
        self._current: _SerialStream | None = None
        self._retry_delay = 0.0

    async def accept(self) -> trio.abc.Stream:
        if self._current is not None:
            await self._current.closed.wait()
            if self._current.received_anything:
                self._retry_delay = 0.0
            else:
                self._retry_delay = min(max(self._retry_delay * 2, 0.05), _SERIAL_RETRY_MAX)
            self._current = None
        await trio.sleep(self._retry_delay)
        path = resolve_serial_port(self.address)
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        self._current = _SerialStream(fd)
        return self._current

    async def aclose(self) -> None:
        if self._current is not None:
            await self._current.aclose()
        await trio.lowlevel.checkpoint()


class _SerialStream(trio.abc.Stream):
    """An FdStream that remembers whether it got data and signals when it is closed."""

    def __init__(self, fd: int) -> None:
        self._inner = trio.lowlevel.FdStream(fd)
        self.closed = trio.Event()
        self.received_anything = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self._inner.receive_some(max_bytes)
        if data:
            self.received_anything = True
        return data

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self.closed.set()

    def close(self) -> None:
        self._inner.close()
        self.closed.set()
