"""The exec service: start commands, stream their output, attach, detach, signal, wait.

The lifecycle lives in process/execs.py; this module turns requests into calls on it and
an exec's buffers into credit-respecting data frames.
"""

from __future__ import annotations

import os
from typing import Any

import trio

from ..process.cgroup import CgroupManager
from ..process.execs import Attachment, Exec, ExecManager, ExecOptions
from ..process.spawn import SpawnSpec
from ..protocol import MAX_CHUNK_SIZE, InvalidParams
from ..signals import signal_name, signal_number
from ..users import Credentials, current_user, resolve_user
from . import Call, Handler, Runtime, param

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# Credit granted for stdin: how much input may be in flight towards a slow reader.
STDIN_WINDOW = 256 << 10
_MAX_TIMEOUT = 10 * 365 * 86400.0


def _parse_signal(value: Any) -> int:
    try:
        return signal_number(value)
    except ValueError as exc:
        raise InvalidParams(str(exc)) from None


def _strings(value: Any, what: str) -> None:
    if not isinstance(value, str) or "\0" in value:
        raise InvalidParams(f"{what} must be a string without NUL bytes")


class ExecService:
    """``exec.*`` methods."""

    name = "exec"

    def __init__(self, runtime: Runtime) -> None:
        self.config = runtime.config
        self.manager = ExecManager(
            runtime.nursery,
            CgroupManager.detect(runtime.config.cgroup_root),
            reattach_grace=runtime.config.reattach_grace,
            finished_retention=runtime.config.finished_retention,
            max_finished=runtime.config.max_finished_execs,
        )
        runtime.cleanups.append(self.manager.shutdown)
        self._own_user = current_user()

    def methods(self) -> dict[str, Handler]:
        return {
            "exec.start": self.start,
            "exec.attach": self.attach,
            "exec.detach": self.detach,
            "exec.resize": self.resize,
            "exec.signal": self.signal,
            "exec.kill": self.kill,
            "exec.wait": self.wait,
            "exec.list": self.list,
        }

    # ---- start -----------------------------------------------------------------------

    def _spec(self, call: Call) -> tuple[SpawnSpec, Credentials]:
        argv = param(call, "argv", list, None)
        command = param(call, "command", str, None)
        if (argv is None) == (command is None):
            raise InvalidParams("exec.start: give exactly one of 'argv' (a list) or 'command'")
        if command is not None:
            argv = ["/bin/sh", "-c", command]
        assert argv is not None
        if not argv:
            raise InvalidParams("exec.start: 'argv' must not be empty")
        for arg in argv:
            _strings(arg, "every argv element")
        user = param(call, "user", (str, int), None)
        creds = resolve_user(str(user)) if user is not None else self._own_user
        env = dict(BASE_ENV)
        env.update(self.config.default_env)
        env.update(creds.login_env())
        pty = param(call, "pty", (dict, bool), None)
        pty_size: tuple[int, int] | None = None
        if pty:
            size = pty if isinstance(pty, dict) else {}
            rows, cols = size.get("rows", 24), size.get("cols", 80)
            if not all(isinstance(v, int) and 0 < v < 65536 for v in (rows, cols)):
                raise InvalidParams("exec.start: pty rows and cols must be 1..65535")
            pty_size = (rows, cols)
            env["TERM"] = "xterm-256color"
        for key, value in param(call, "env", dict, {}).items():
            _strings(key, "env names")
            _strings(value, f"env value of {key}")
            if not key or "=" in key:
                raise InvalidParams(f"exec.start: bad env name {key!r}")
            env[key] = value
        cwd = param(call, "cwd", str, None)
        if cwd is not None:
            _strings(cwd, "cwd")
        else:
            cwd = creds.home if os.path.isdir(creds.home) else "/"
        spec = SpawnSpec(
            argv=tuple(argv),
            env=env,
            cwd=cwd,
            credentials=creds,
            stdin=bool(param(call, "stdin", bool, False)),
            pty_size=pty_size,
        )
        return spec, creds

    def _seconds(self, call: Call, name: str, default: float | None) -> float | None:
        value = param(call, name, (int, float), None)
        if value is None:
            return default
        if not 0 <= value <= _MAX_TIMEOUT:
            raise InvalidParams(f"{call.method}: {name!r} must be 0..{_MAX_TIMEOUT:.0f} seconds")
        return float(value)

    async def start(self, call: Call) -> dict[str, Any]:
        """Spawn; then stream output (or, detached, return the exec id at once)."""
        spec, creds = self._spec(call)
        limits = param(call, "limits", dict, {})
        memory_max, pids_max = limits.get("memory_bytes"), limits.get("pids")
        for value in (memory_max, pids_max):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise InvalidParams("exec.start: limits must be positive integers")
        ring_bytes = param(call, "ring_bytes", int, self.config.output_ring_bytes)
        if not 4096 <= ring_bytes <= 1 << 30:
            raise InvalidParams("exec.start: ring_bytes must be 4 KiB..1 GiB")
        options = ExecOptions(
            user=creds.name,
            timeout=self._seconds(call, "timeout", None),
            kill_grace=self._seconds(call, "kill_grace", self.config.kill_grace) or 0.0,
            ring_bytes=ring_bytes,
            memory_max=memory_max,
            pids_max=pids_max,
        )
        # Every parameter is checked before the spawn: after it, an error would orphan it.
        detach = param(call, "detach", bool, False)
        exec_ = self.manager.start(spec, options)
        started = {
            "exec_id": exec_.id,
            "pid": exec_.pid,
            "cgroup": exec_.cgroup is not None,
            "limits": self._limits_report(exec_, options),
        }
        if detach:
            exec_.detach()
            return {**started, "detached": True}
        return await self._stream(call, exec_, {}, started=started)

    def _limits_report(self, exec_: Exec, options: ExecOptions) -> dict[str, Any]:
        """Each requested limit: applied, or why not (never silently ignored)."""
        report: dict[str, Any] = {}
        applied = exec_.cgroup.limits_applied if exec_.cgroup else {}
        for controller, value in (("memory", options.memory_max), ("pids", options.pids_max)):
            if value is None:
                continue
            if controller in applied:
                report[controller] = {"applied": True, "value": value}
            else:
                reason = (
                    f"no {controller} controller in cgroup2"
                    if exec_.cgroup is not None
                    else "cgroup2 is not writable"
                )
                report[controller] = {"applied": False, "reason": reason}
        return report

    # ---- streaming -------------------------------------------------------------------

    async def attach(self, call: Call) -> dict[str, Any]:
        """Attach to an exec's output from the given offsets (replaying what is kept)."""
        exec_ = self.manager.get(param(call, "exec_id", str))
        offsets = param(call, "offsets", dict, {})
        for name, value in offsets.items():
            if name not in exec_.stream_names or not isinstance(value, int) or value < 0:
                raise InvalidParams(f"exec.attach: bad offset {name}={value!r}")
            if value > exec_.buffers[name].end:
                raise InvalidParams(
                    f"exec.attach: offset {name}={value} is past the {exec_.buffers[name].end}"
                    " bytes produced so far"
                )
        return await self._stream(call, exec_, offsets)

    async def _stream(
        self,
        call: Call,
        exec_: Exec,
        offsets: dict[str, int],
        started: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Attach ``call``; announce it ("started", else "attached"); stream until the end."""
        # Attached before the first await: a cancel from here on abandons the exec (reattach
        # grace, then kill) instead of leaving it unattached and unwatched for ever.
        attachment = exec_.attach(offsets, call)
        call.credit_callback = lambda nbytes: exec_.acknowledge(attachment, nbytes)
        finished = False
        try:
            if started is not None:
                await call.send_event("started", started)
            else:
                await call.send_event(
                    "attached",
                    {
                        "exec_id": exec_.id,
                        "pid": exec_.pid,
                        "offsets": dict(attachment.sent),
                        "lost": dict(attachment.lost),
                    },
                )
            if exec_.stdin is None:
                result = await self._send_output(exec_, attachment)
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._forward_stdin, call, exec_)
                    result = await self._send_output(exec_, attachment)
                    nursery.cancel_scope.cancel()
            finished = True
            return result
        finally:
            call.credit_callback = None
            current = exec_.release(attachment)
            if current and not finished and not attachment.detach_requested:
                # Cancelled or disconnected without detaching: wait for a reattach, then kill.
                self.manager.abandon(exec_)

    async def _send_output(self, exec_: Exec, att: Attachment) -> dict[str, Any]:
        """Replay and backlog; the pumps send live output themselves while caught up."""
        while True:
            progressed = False
            for name in exec_.stream_names:
                chunk = exec_.take_for_sending(att, name, MAX_CHUNK_SIZE)
                if chunk:
                    await exec_.send_taken(att, name, chunk)
                    progressed = True
            if att.superseded or att.detach_requested:
                return {
                    "exec_id": exec_.id,
                    "detached": True,
                    "superseded": att.superseded,
                    "offsets": dict(att.sent),
                }
            if progressed:
                continue
            caught_up = all(att.sent[n] >= exec_.buffers[n].end for n in exec_.stream_names)
            if exec_.ended.is_set() and caught_up:
                return {**exec_.end_status(), "lost": dict(att.lost), "offsets": dict(att.sent)}
            await exec_.wait_changed()

    async def _forward_stdin(self, call: Call, exec_: Exec) -> None:
        """Client stdin frames to the process, granting credit as the pipe takes them."""
        await call.grant(STDIN_WINDOW)
        while data := await call.receive():
            await exec_.write_stdin(data)
            await call.grant(len(data))
        await exec_.close_stdin()

    # ---- control ---------------------------------------------------------------------

    async def detach(self, call: Call) -> dict[str, Any]:
        """End the attached stream; the exec runs on, its output into the ring."""
        exec_ = self.manager.get(param(call, "exec_id", str))
        exec_.detach()
        return {"exec_id": exec_.id}

    async def resize(self, call: Call) -> dict[str, Any]:
        """Set the PTY's window size (the command gets SIGWINCH)."""
        exec_ = self.manager.get(param(call, "exec_id", str))
        rows, cols = param(call, "rows", int), param(call, "cols", int)
        if not (0 < rows < 65536 and 0 < cols < 65536):
            raise InvalidParams("exec.resize: rows and cols must be 1..65535")
        if exec_.spec.pty_size is None:
            raise InvalidParams(f"exec.resize: exec {exec_.id} has no terminal")
        exec_.resize(rows, cols)
        return {}

    async def signal(self, call: Call) -> dict[str, Any]:
        """Send any signal to the whole tree (default) or only the main process."""
        exec_ = self.manager.get(param(call, "exec_id", str))
        signum = _parse_signal(call.params.get("signal", "SIGTERM"))
        exec_.send_signal(signum, tree=param(call, "tree", bool, True))
        return {"exec_id": exec_.id, "signal": signal_name(signum)}

    async def kill(self, call: Call) -> dict[str, Any]:
        """SIGTERM the tree, kill grace, SIGKILL; returns the end status."""
        exec_ = self.manager.get(param(call, "exec_id", str))
        self.manager.kill(exec_, "kill", self._seconds(call, "grace", None))
        await exec_.ended.wait()
        return exec_.end_status()

    async def wait(self, call: Call) -> dict[str, Any]:
        """The end status, once the exec has ended (or its state when ``timeout`` passes)."""
        exec_ = self.manager.get(param(call, "exec_id", str))
        timeout = self._seconds(call, "timeout", None)
        with trio.move_on_after(float("inf") if timeout is None else timeout):
            await exec_.ended.wait()
        return exec_.end_status()

    async def list(self, call: Call) -> dict[str, Any]:
        """Every exec the agent remembers, running or recently finished."""
        return {"execs": [e.summary() for e in self.manager.execs.values()]}
