"""Exec lifecycle: spawn, pump output, time out, kill the tree, reap, forget.

Each exec is supervised by one task in the agent-lifetime nursery, so it outlives the
connection that started it. The protocol side (services/exec.py) attaches to an exec to
stream its output; this module knows nothing of the wire.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from ..protocol import MAX_CHUNK_SIZE, NotFound
from ..signals import signal_name
from ..wakeup import Wakeup
from .cgroup import CgroupManager, ExecCgroup
from .output import OutputBuffer
from .spawn import Spawned, SpawnSpec, set_window_size, spawn
from .tree import signal_tree

log = logging.getLogger(__name__)

# After the main process exits, output still arriving is collected until the pipes have
# been quiet this long: a background grandchild holding stdout must not keep the exec open.
DRAIN_IDLE = 0.1
# How long shutdown waits for a SIGKILLed tree to be reaped.
_REAP_TIMEOUT = 5.0


@dataclass(frozen=True)
class ExecOptions:
    """How an exec runs, besides what it runs (SpawnSpec)."""

    user: str
    timeout: float | None = None
    kill_grace: float = 5.0
    ring_bytes: int = 1 << 20
    memory_max: int | None = None
    pids_max: int | None = None


class OutputSink(Protocol):
    """Where an attachment's output goes (the exec service's call): credit, then frames."""

    def reserve_credit(self, nbytes: int) -> int:
        """Set aside up to ``nbytes`` of the client's credit now; returns how many."""

    async def send_reserved(self, stream: str, data: bytes) -> None:
        """Send ``data`` (already reserved) as the next bytes of ``stream``."""


@dataclass(slots=True)
class Attachment:
    """One client stream attached to an exec's output."""

    sink: OutputSink
    sent: dict[str, int]
    acked: dict[str, int]
    lost: dict[str, int]
    # (stream, bytes) of every data frame sent and not yet acknowledged by returned credit:
    # a window's worth of frames at most, so a list (a deque costs 600 bytes empty).
    unacked: list[tuple[str, int]] = field(default_factory=list)
    detach_requested: bool = False
    superseded: bool = False
    # Sends in progress; cancelled when the attachment ends, so that a pump blocked on a
    # dead connection (half-open after a snapshot restore, say) lets go at once.
    sends: set[trio.CancelScope] = field(default_factory=set)

    def end_sends(self) -> None:
        for scope in self.sends:
            scope.cancel()


class Exec:
    """One command: its process, output buffers, state and end status."""

    # Slots: an exec costs memory in every VM for as long as it runs.
    __slots__ = (
        "_changed",
        "_room",
        "abandon_generation",
        "attachment",
        "buffers",
        "cgroup",
        "detached",
        "ended",
        "ended_mono",
        "exit_code",
        "exited",
        "id",
        "kill_done",
        "kill_grace",
        "kill_reason",
        "killed_by_agent",
        "killing",
        "lossless",
        "main_exited",
        "output_progress",
        "pumps_sending",
        "signal",
        "spawned",
        "spec",
        "started_at",
        "started_mono",
        "stdin",
        "stdin_closed",
        "stdin_lock",
        "stream_names",
        "swept_pids",
        "timed_out",
        "timeout",
        "user",
    )

    def __init__(self, exec_id: str, spec: SpawnSpec, options: ExecOptions) -> None:
        self.id = exec_id
        self.spec = spec
        self.user = options.user
        self.timeout = options.timeout
        self.kill_grace = options.kill_grace
        self.stream_names = ("pty",) if spec.pty_size else ("stdout", "stderr")
        self.buffers = {name: OutputBuffer(options.ring_bytes) for name in self.stream_names}
        self.spawned: Spawned | None = None
        self.cgroup: ExecCgroup | None = None
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        self.ended = trio.Event()
        self.ended_mono: float | None = None
        self.main_exited = False
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.timed_out = False
        self.killed_by_agent = False
        self.kill_reason: str | None = None
        # Lossless while a client is, or may come back, attached; a ring once detached.
        self.lossless = True
        # Detached once: runs until exit, timeout or kill, whoever attaches later.
        self.detached = False
        self.attachment: Attachment | None = None
        self.abandon_generation = 0
        self.stdin: trio.lowlevel.FdStream | None = None
        self.stdin_lock = trio.Lock() if spec.stdin or spec.pty_size else None
        self.stdin_closed = False
        self._changed = Wakeup()
        self._room = Wakeup()
        self.output_progress = 0  # chunks read so far: the drain's sign of life
        self.pumps_sending = 0
        self.killing = False
        self.kill_done = Wakeup()
        self.swept_pids: dict[int, int] = {}  # without a cgroup: the tree as last seen

    @property
    def pid(self) -> int:
        return self.spawned.pid if self.spawned else 0

    def notify(self) -> None:
        """Wake the streamer and the drain: output, credit, the end or a detach happened."""
        self._changed.notify()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def _room_changed(self) -> None:
        """Wake pumps waiting for buffer room (acknowledged output, or lossy mode)."""
        self._room.notify()

    async def wait_room(self) -> None:
        await self._room.wait()

    def state(self) -> str:
        if self.ended.is_set():
            return "exited"
        if self.main_exited:
            return "draining"
        return "running"

    def end_status(self) -> dict[str, Any]:
        """The exec's outcome, as end frames and wait report it."""
        return {
            "exec_id": self.id,
            "pid": self.pid,
            "state": self.state(),
            "exit_code": self.exit_code,
            "signal": signal_name(self.signal) if self.signal else None,
            "timed_out": self.timed_out,
            "killed_by_agent": self.killed_by_agent,
            "kill_reason": self.kill_reason,
            "bytes": {name: buf.end for name, buf in self.buffers.items()},
            "duration": round((self.ended_mono or time.monotonic()) - self.started_mono, 6),
        }

    def summary(self) -> dict[str, Any]:
        """One row of exec.list."""
        status = self.end_status()
        status.update(
            argv=list(self.spec.argv),
            user=self.user,
            started_at=self.started_at,
            attached=self.attachment is not None,
            detached=self.detached,
        )
        return status

    # ---- attachments (driven by the exec service) -------------------------------------

    def attach(self, offsets: dict[str, int], sink: OutputSink) -> Attachment:
        """Attach a stream from ``offsets``; supersedes any current attachment."""
        if self.attachment is not None:
            self.attachment.superseded = True
            self.attachment.end_sends()
        sent: dict[str, int] = {}
        lost: dict[str, int] = {}
        for name, buf in self.buffers.items():
            offset = min(max(int(offsets.get(name, 0)), 0), buf.end)
            lost[name] = max(buf.start - offset, 0)
            sent[name] = max(offset, buf.start)
        self.attachment = Attachment(sink, sent=sent, acked=dict(sent), lost=lost)
        self.abandon_generation += 1  # cancels a pending abandonment kill
        self.lossless = True
        for name, buf in self.buffers.items():
            buf.floor = max(buf.floor, min(sent[name], buf.end))
        self.notify()
        self._room_changed()
        return self.attachment

    def take_for_sending(self, att: Attachment, name: str, max_bytes: int) -> bytes:
        """The next bytes of ``name`` for ``att``, with credit reserved for them (or b"").

        Taking and recording happen with no checkpoint in between, and sends are queued in
        the order taken, so whichever task sends (pump or streamer), frames stay in order.
        """
        buffer = self.buffers[name]
        if att.sent[name] < buffer.start:  # the ring overwrote it while detached
            att.lost[name] += buffer.start - att.sent[name]
            att.sent[name] = buffer.start
        chunk = buffer.read(att.sent[name], max_bytes)
        if not chunk:
            return b""
        granted = att.sink.reserve_credit(len(chunk))
        if granted < len(chunk):
            chunk = chunk[:granted]  # a window smaller than a chunk: send what it allows
        if chunk:
            att.sent[name] += len(chunk)
            att.unacked.append((name, len(chunk)))
        return chunk

    async def send_taken(self, att: Attachment, name: str, chunk: bytes) -> None:
        """Send what take_for_sending gave; a dead connection only ends this attachment."""
        # Shielded: only end_sends() stops it. A chunk taken is counted as sent, so a send
        # cancelled from outside (the supervisor ending the pumps) would lose it silently.
        with trio.CancelScope(shield=True) as scope:
            att.sends.add(scope)
            try:
                await att.sink.send_reserved(name, chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client is gone; a reattach replays from what it received
            finally:
                att.sends.discard(scope)

    def acknowledge(self, attachment: Attachment, nbytes: int) -> None:
        """The client returned ``nbytes`` of credit: it consumed that much, in send order."""
        while nbytes > 0 and attachment.unacked:
            name, size = attachment.unacked[0]
            take = min(size, nbytes)
            attachment.acked[name] += take
            nbytes -= take
            if take == size:
                del attachment.unacked[0]
            else:
                attachment.unacked[0] = (name, size - take)
            if attachment is self.attachment:
                self.buffers[name].acknowledge(attachment.acked[name], self.lossless)
        self.notify()
        self._room_changed()

    def detach(self) -> None:
        """Stop the current stream; the exec runs on its own, its output into the ring."""
        if self.attachment is not None:
            self.attachment.detach_requested = True
        self.detached = True
        self.abandon_generation += 1  # a detach during the reattach grace saves the exec
        self.go_lossy()

    def go_lossy(self) -> None:
        """Output goes to the ring from now on, the oldest bytes making way."""
        self.lossless = False
        self.notify()
        self._room_changed()

    def release(self, attachment: Attachment) -> bool:
        """An attachment ended; True if it was the current one (its stream is abandoned)."""
        attachment.end_sends()
        if self.attachment is not attachment:
            return False
        self.attachment = None
        return True

    async def write_stdin(self, data: bytes | bytearray) -> None:
        """Write to the command's stdin; dropped once it has closed it (as a pipe would)."""
        assert self.stdin_lock is not None
        async with self.stdin_lock:
            if self.stdin is None or self.stdin_closed:
                return
            try:
                await self.stdin.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self.stdin_closed = True

    async def close_stdin(self) -> None:
        """EOF for the command: close the pipe, or type ^D on a terminal."""
        if self.spawned is not None and self.spawned.pty_fd is not None:
            await self.write_stdin(b"\x04")
            return
        assert self.stdin_lock is not None
        async with self.stdin_lock:
            if self.stdin is not None and not self.stdin_closed:
                self.stdin_closed = True
                await self.stdin.aclose()

    def resize(self, rows: int, cols: int) -> None:
        """Set the PTY size through the exec's own dup of the master (the pump owns the other)."""
        if self.spawned is None or self.spawned.pty_fd is None:
            raise NotFound(f"exec {self.id} has no terminal")
        if self.stdin is None or self.ended.is_set():
            raise NotFound(f"exec {self.id} has ended")
        set_window_size(self.stdin.fileno(), rows, cols)

    # ---- signals -------------------------------------------------------------------

    def send_signal(self, signum: int, tree: bool = True) -> None:
        """Signal the main process, or the whole tree (cgroup, else process group)."""
        if self.spawned is None or self.ended.is_set():
            return
        if not tree:
            if not self.main_exited:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.spawned.pid, signum)
            return
        if self.cgroup is not None:
            self.cgroup.signal_all(signum)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.spawned.pid, signum)
        else:
            # Process group, session and descendants, plus what earlier sweeps found.
            signal_tree(self.spawned.pid, signum, self.swept_pids)


class ExecManager:
    """All execs of the agent; spawns them and supervises each in ``nursery``."""

    def __init__(
        self,
        nursery: trio.Nursery,
        cgroups: CgroupManager | None,
        *,
        reattach_grace: float,
        finished_retention: float,
        max_finished: int,
    ) -> None:
        self.nursery = nursery
        self.cgroups = cgroups
        self.reattach_grace = reattach_grace
        self.finished_retention = finished_retention
        self.max_finished = max_finished
        self.execs: dict[str, Exec] = {}
        # Finished execs in end order, with when to forget each.
        self._finished: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._forgetting = False
        self._leftover_cgroups: list[ExecCgroup] = []

    def get(self, exec_id: str) -> Exec:
        try:
            return self.execs[exec_id]
        except KeyError:
            raise NotFound(f"no exec {exec_id!r} (never started, or forgotten)") from None

    def start(self, spec: SpawnSpec, options: ExecOptions) -> Exec:
        """Spawn at once (start failures raise here) and supervise in the background."""
        exec_ = Exec(secrets.token_hex(6), spec, options)
        cgroup = None
        if self.cgroups is not None:
            cgroup = self.cgroups.create(f"exec-{exec_.id}", options.memory_max, options.pids_max)
        try:
            exec_.spawned = spawn(spec, self.cgroups, cgroup)
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        exec_.cgroup = cgroup
        # The environment served its purpose; a long-running exec need not carry it.
        exec_.spec = dataclasses.replace(spec, env={})
        if exec_.spawned.stdin_fd is not None:
            exec_.stdin = trio.lowlevel.FdStream(exec_.spawned.stdin_fd)
        elif exec_.spawned.pty_fd is not None:
            exec_.stdin = trio.lowlevel.FdStream(os.dup(exec_.spawned.pty_fd))
        self.execs[exec_.id] = exec_
        # Constant task names: trio would otherwise build a string per task (0.4 KiB/exec).
        self.nursery.start_soon(self._supervise, exec_, name="exec-supervise")
        log.debug(
            "event=exec_started exec=%s pid=%d argv0=%r user=%s",
            exec_.id,
            exec_.pid,
            spec.argv[0],
            options.user,
        )
        return exec_

    # ---- supervision ----------------------------------------------------------------

    async def _supervise(self, exec_: Exec) -> None:
        spawned = exec_.spawned
        assert spawned is not None
        outputs = (
            {"pty": spawned.pty_fd}
            if spawned.pty_fd is not None
            else {"stdout": spawned.stdout_fd, "stderr": spawned.stderr_fd}
        )
        try:
            async with trio.open_nursery() as tasks:
                for name, fd in outputs.items():
                    assert fd is not None
                    tasks.start_soon(self._pump, exec_, name, fd, name="exec-pump")
                if exec_.timeout is not None:
                    tasks.start_soon(self._enforce_timeout, exec_, exec_.timeout)
                # This task is the only one that waits on the pidfd (trio allows one).
                await trio.lowlevel.wait_readable(spawned.pidfd)
                self._reap(exec_)
                await self._drain(exec_)
                while exec_.killing:
                    await exec_.kill_done.wait()  # the end frame comes after the tree is gone
                tasks.cancel_scope.cancel()
        except Exception:
            # One exec's failure must never take the agent (and every other exec) down.
            log.exception("event=exec_supervision_failed exec=%s", exec_.id)
        finally:
            with trio.CancelScope(shield=True):
                await self._finish(exec_)

    async def _enforce_timeout(self, exec_: Exec, timeout: float) -> None:
        await trio.sleep(timeout)
        if not exec_.main_exited:
            exec_.timed_out = True
            await self.terminate(exec_, "timeout")

    def _reap(self, exec_: Exec, *, block: bool = True) -> None:
        """Collect the main process's status through its pidfd (never waitpid(-1))."""
        spawned = exec_.spawned
        assert spawned is not None
        info = os.waitid(os.P_PIDFD, spawned.pidfd, os.WEXITED | (0 if block else os.WNOHANG))
        if info is None:
            # Not even SIGKILL ended it in time (uninterruptible sleep): init reaps it later.
            log.warning("event=exec_unreaped exec=%s pid=%d", exec_.id, exec_.pid)
            return
        if info.si_code == os.CLD_EXITED:
            exec_.exit_code = info.si_status
        else:
            exec_.signal = info.si_status
        exec_.main_exited = True
        exec_.notify()

    async def _pump(self, exec_: Exec, name: str, fd: int) -> None:
        """Read one output fd into its buffer, only as fast as the buffer has room."""
        buffer = exec_.buffers[name]
        stream = trio.lowlevel.FdStream(fd)
        try:
            while True:
                while not buffer.has_room(exec_.lossless):
                    await exec_.wait_room()
                try:
                    data = await stream.receive_some(MAX_CHUNK_SIZE)
                except (trio.BrokenResourceError, OSError):
                    data = b""  # EIO: the PTY's last holder closed it
                if not data:
                    break
                buffer.append(data, exec_.lossless)
                exec_.output_progress += 1
                att = exec_.attachment
                if att is not None and att.sent[name] == buffer.end - len(data):
                    # The client is caught up: send the chunk from here, without waking
                    # the streamer (one task switch per chunk instead of three).
                    chunk = exec_.take_for_sending(att, name, len(data))
                    if chunk:
                        exec_.pumps_sending += 1
                        try:
                            await exec_.send_taken(att, name, chunk)
                        finally:
                            exec_.pumps_sending -= 1
                    if att.sent[name] == buffer.end:
                        continue
                exec_.notify()
        finally:
            buffer.eof = True
            exec_.notify()
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _drain(self, exec_: Exec) -> None:
        """Collect output after the main exit until EOF or DRAIN_IDLE of silence."""
        while not all(buf.eof for buf in exec_.buffers.values()):
            progress = exec_.output_progress
            with trio.move_on_after(DRAIN_IDLE) as idle:
                await exec_.wait_changed()
            quiet = idle.cancelled_caught and exec_.output_progress == progress
            # Not quiet if a pump is mid-send or a slow client holds the pipe back.
            if (
                quiet
                and not exec_.pumps_sending
                and all(buf.eof or buf.has_room(exec_.lossless) for buf in exec_.buffers.values())
            ):
                return

    async def _finish(self, exec_: Exec) -> None:
        """Shielded: make sure the main process is gone and reaped, then record the end."""
        spawned = exec_.spawned
        assert spawned is not None
        if not exec_.main_exited:
            # The agent is shutting down: nothing may outlive it unsupervised.
            exec_.killed_by_agent = True
            exec_.kill_reason = exec_.kill_reason or "agent_shutdown"
            exec_.send_signal(signal.SIGKILL)
            with trio.move_on_after(_REAP_TIMEOUT):
                await trio.lowlevel.wait_readable(spawned.pidfd)
            with contextlib.suppress(ChildProcessError):
                self._reap(exec_, block=False)
        elif self.nursery.cancel_scope.cancel_called and exec_.cgroup is not None:
            exec_.cgroup.signal_all(signal.SIGKILL)  # shutdown: background leftovers too
        if exec_.stdin is not None:
            await exec_.stdin.aclose()
        # The pumps own and close the output fds (the PTY master included).
        os.close(spawned.pidfd)
        exec_.ended_mono = time.monotonic()
        exec_.ended.set()
        exec_.notify()
        # Let the streams send their end frames before the bookkeeping below.
        await trio.lowlevel.checkpoint()
        # Execs the agent had to kill are worth a line at info; the rest cost 0.1 ms each.
        log.log(
            logging.INFO if exec_.killed_by_agent else logging.DEBUG,
            "event=exec_ended exec=%s argv0=%r user=%s pid=%d exit_code=%s signal=%s "
            "timed_out=%s killed=%s seconds=%.3f",
            exec_.id,
            exec_.spec.argv[0],
            exec_.user,
            exec_.pid,
            exec_.exit_code,
            exec_.signal,
            exec_.timed_out,
            exec_.kill_reason,
            exec_.ended_mono - exec_.started_mono,
        )
        if exec_.cgroup is not None and not exec_.cgroup.remove():
            # Background processes it started are still running (a server, say).
            self._leftover_cgroups.append(exec_.cgroup)
        self._remember_finished(exec_)

    def _remember_finished(self, exec_: Exec) -> None:
        """Keep the end status for ``finished_retention`` (and at most ``max_finished``)."""
        self._finished[exec_.id] = trio.current_time() + self.finished_retention
        while len(self._finished) > self.max_finished:
            oldest, _ = self._finished.popitem(last=False)
            self.execs.pop(oldest, None)
        if not self._forgetting and not self.nursery.cancel_scope.cancel_called:
            self._forgetting = True
            self.nursery.start_soon(self._forget_loop)

    async def _forget_loop(self) -> None:
        """One task forgets finished execs in end order (not a sleeping task per exec)."""
        try:
            while self._finished:
                exec_id, deadline = next(iter(self._finished.items()))
                await trio.sleep_until(deadline)
                if self._finished.get(exec_id) == deadline:
                    del self._finished[exec_id]
                    self.execs.pop(exec_id, None)
                self._leftover_cgroups = [cg for cg in self._leftover_cgroups if not cg.remove()]
        finally:
            self._forgetting = False

    # ---- killing -------------------------------------------------------------------

    async def terminate(self, exec_: Exec, reason: str, grace: float | None = None) -> None:
        """SIGTERM the tree, wait the kill grace, then SIGKILL whatever is left."""
        if exec_.killed_by_agent or exec_.ended.is_set():
            return  # one kill sequence per exec
        exec_.killing = True
        exec_.killed_by_agent = True
        exec_.kill_reason = reason
        try:
            exec_.send_signal(signal.SIGTERM)
            with trio.move_on_after(exec_.kill_grace if grace is None else grace):
                while not exec_.main_exited:
                    await exec_.wait_changed()
                if exec_.cgroup is not None:
                    # cgroup.events has no trio-friendly notification; poll during the grace.
                    while exec_.cgroup.populated():  # noqa: ASYNC110
                        await trio.sleep(0.02)
            exec_.send_signal(signal.SIGKILL)
        finally:
            exec_.killing = False
            exec_.kill_done.notify()

    def kill(self, exec_: Exec, reason: str, grace: float | None = None) -> None:
        """Start ``terminate`` where a cancelled caller cannot interrupt it halfway."""
        self.nursery.start_soon(self.terminate, exec_, reason, grace)

    def abandon(self, exec_: Exec) -> None:
        """The attached stream went away without detaching: kill after the reattach grace.

        An exec that was detached before only goes back to its ring: watching it must not
        put it at risk.
        """
        if exec_.ended.is_set():
            return
        if exec_.detached:
            exec_.go_lossy()
            return
        exec_.abandon_generation += 1
        self.nursery.start_soon(self._abandon_timer, exec_, exec_.abandon_generation)

    async def _abandon_timer(self, exec_: Exec, generation: int) -> None:
        with trio.move_on_after(self.reattach_grace):
            await exec_.ended.wait()
        if exec_.ended.is_set() or exec_.abandon_generation != generation:
            return
        log.info("event=exec_abandoned exec=%s grace=%s", exec_.id, self.reattach_grace)
        exec_.go_lossy()  # nobody is coming back for the output
        await self.terminate(exec_, "abandoned")

    async def shutdown(self) -> None:
        """Remove the leftover cgroups once their processes are gone (agent exit)."""
        for cgroup in self._leftover_cgroups:
            cgroup.signal_all(signal.SIGKILL)
        with trio.move_on_after(_REAP_TIMEOUT):
            while self._leftover_cgroups:
                self._leftover_cgroups = [cg for cg in self._leftover_cgroups if not cg.remove()]
                if self._leftover_cgroups:
                    await trio.sleep(0.02)
        if self.cgroups is not None:
            self.cgroups.cleanup_root()
