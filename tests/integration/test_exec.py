"""Exec over real sockets with real processes: output, exit codes, timeouts, trees, stdin, PTY."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest
import trio

from guest_agent.client import Client
from guest_agent.protocol import (
    Cancel,
    Error,
    Event,
    InvalidParams,
    NotFound,
    RemoteOSError,
    Request,
    Result,
)
from guest_agent.sync_client import SyncClient

from ..rawclient import RawClient
from .proctools import alive, wait_until_dead


async def test_exit_codes_and_signals(agent: str) -> None:
    async with Client.connect(agent) as client:
        assert (await client.exec(["true"])).exit_code == 0
        assert (await client.exec(["sh", "-c", "exit 7"])).exit_code == 7
        killed = await client.exec(["sh", "-c", "kill -TERM $$"])
        assert killed.exit_code is None
        assert killed.signal == "SIGTERM"
        assert not killed.timed_out


async def test_stdout_and_stderr_are_separate_and_ordered(agent: str) -> None:
    script = "for i in $(seq 1 2000); do echo out$i; echo err$i >&2; done"
    async with Client.connect(agent) as client:
        result = await client.exec(command=script)
    assert result.stdout.decode().split() == [f"out{i}" for i in range(1, 2001)]
    assert result.stderr.decode().split() == [f"err{i}" for i in range(1, 2001)]
    assert result.status["bytes"] == {"stdout": len(result.stdout), "stderr": len(result.stderr)}


async def test_100_mib_stdout_sha256(agent: str) -> None:
    size = 100 << 20
    command = f"head -c {size} /dev/urandom > /tmp/ga-100m.$$ && sha256sum /tmp/ga-100m.$$ >&2"
    command += " && cat /tmp/ga-100m.$$; rc=$?; rm -f /tmp/ga-100m.$$; exit $rc"
    async with Client.connect(agent) as client:
        result = await client.exec(command=command)
    assert result.exit_code == 0, result.stderr
    assert len(result.stdout) == size
    assert hashlib.sha256(result.stdout).hexdigest() == result.stderr.split()[0].decode()


async def test_stdin_round_trip(agent: str) -> None:
    payload = os.urandom(3 << 20)
    async with Client.connect(agent) as client:
        result = await client.exec(["cat"], input=payload)
    assert result.exit_code == 0
    assert result.stdout == payload


async def test_stdin_eof_without_data(agent: str) -> None:
    async with Client.connect(agent) as client:
        result = await client.exec(["wc", "-c"], input=b"")
    assert result.stdout.strip() == b"0"


async def test_yes_head_ends(agent: str) -> None:
    async with Client.connect(agent) as client:
        with trio.fail_after(20):
            result = await client.exec(command="yes | head -1")
    assert result.stdout == b"y\n"
    assert result.exit_code == 0


@pytest.mark.parametrize(
    ("argv", "errno"),
    [
        (["/definitely/not/here"], "ENOENT"),
        (["no-such-command-anywhere"], "ENOENT"),
        (["{tmp}/not-executable"], "EACCES"),
    ],
)
async def test_start_failures_are_typed_and_fast(
    agent: str, short_tmp: Path, argv: list[str], errno: str
) -> None:
    (short_tmp / "not-executable").write_text("echo hi\n")
    (short_tmp / "not-executable").chmod(0o644)
    argv = [arg.format(tmp=short_tmp) for arg in argv]
    async with Client.connect(agent) as client:
        with trio.fail_after(10), pytest.raises(RemoteOSError) as info:
            await client.exec(argv)
    assert info.value.errno == errno


async def test_bad_cwd_and_unknown_user(agent: str) -> None:
    async with Client.connect(agent) as client:
        with pytest.raises(RemoteOSError) as info:
            await client.exec(["true"], cwd="/no/such/dir")
        assert info.value.errno == "ENOENT"
        with pytest.raises(InvalidParams, match="unknown user"):
            await client.exec(["true"], user="no-such-user-xyz")
        with pytest.raises(InvalidParams):
            await client.call("exec.start", {"argv": []})
        with pytest.raises(InvalidParams):
            await client.call("exec.start", {"argv": ["true"], "command": "true"})
        with pytest.raises(InvalidParams):
            await client.call("exec.start", {"argv": ["true"], "env": {"A=B": "c"}})
        with pytest.raises(NotFound):
            await client.exec_wait("nope")


async def test_timeout_kills_the_whole_tree(agent: str, short_tmp: Path) -> None:
    pids = short_tmp / "pids"
    script = f"""
        setsid sh -c 'echo $$ >> {pids}; exec sleep 300' &
        nohup sh -c 'echo $$ >> {pids}; exec sleep 300' >/dev/null 2>&1 &
        sh -c 'trap "" TERM; echo $$ >> {pids}; while :; do sleep 1; done' &
        ( setsid sh -c 'sh -c "echo \\$\\$ >> {pids}; exec sleep 300" &' ) &
        echo started
        sleep 300
    """
    async with Client.connect(agent) as client:
        started = time.monotonic()
        result = await client.exec(command=script, timeout=1.5, kill_grace=0.5)
    assert time.monotonic() - started < 30
    assert result.timed_out
    assert result.status["killed_by_agent"]
    assert result.stdout == b"started\n"  # output before the kill is delivered
    recorded = [int(p) for p in pids.read_text().split()]
    assert len(recorded) == 4
    assert wait_until_dead(recorded), [p for p in recorded if alive(p)]


async def test_background_grandchild_does_not_keep_exec_open(agent: str) -> None:
    async with Client.connect(agent) as client:
        with trio.fail_after(15):
            result = await client.exec(command="sleep 30 & echo done")
        assert result.stdout == b"done\n"
        assert result.exit_code == 0
        # The background sleep is left running (servers started this way must survive).
        leftovers = await client.exec(command="pgrep -f 'sleep 30' || true")
        assert leftovers.stdout.strip()


async def test_child_environment_is_clean(agent: str) -> None:
    command = (
        "env; echo fds=$(ls /proc/self/fd | wc -l); "
        "echo oom=$(cat /proc/self/oom_score_adj); "
        "grep -E '^(SigIgn|SigBlk)' /proc/self/status"
    )
    async with Client.connect(agent) as client:
        result = await client.exec(command=command, env={"EXTRA": "1"})
    env = dict(line.split("=", 1) for line in result.stdout.decode().splitlines() if "=" in line)
    assert env["EXTRA"] == "1"
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert "VIRTUAL_ENV" not in env
    assert not [key for key in env if key.startswith("PYTHON")]
    assert env["HOME"] and env["USER"] and env["LOGNAME"] and env["SHELL"]
    assert env["fds"] == "4"  # 0, 1, 2 and ls's own directory fd: no agent fds
    assert env["oom"] == "0"
    sigign = next(line for line in result.stdout.decode().splitlines() if line.startswith("SigIgn"))
    assert int(sigign.split()[1], 16) & (1 << (signal.SIGPIPE - 1)) == 0


async def test_user_switching(agent: str) -> None:
    async with Client.connect(agent) as client:
        result = await client.exec(command="id -u; id -g; echo $HOME $USER", user="nobody")
        numeric = await client.exec(["id", "-u"], user="65534:65534")
    uid, gid, rest = result.stdout.decode().split("\n", 2)
    assert (uid, gid) == ("65534", "65534")
    assert rest.split() == ["/nonexistent", "nobody"]
    assert numeric.stdout == b"65534\n"


async def test_pty_has_a_terminal_and_resize_reaches_the_child(agent: str) -> None:
    script = "trap 'stty size' WINCH; tty; echo ready; while :; do sleep 0.05; done"
    async with (
        Client.connect(agent) as client,
        client.open_exec(command=script, pty=(24, 80), timeout=30) as ex,
    ):
        seen = b""
        resized = False
        with trio.fail_after(20):
            async for name, data in ex:
                assert name == "pty"
                seen += data
                if b"ready" in seen and not resized:
                    await ex.resize(40, 132)
                    resized = True
                if b"40 132" in seen:
                    await ex.signal("SIGKILL")
    assert b"/dev/pts/" in seen
    assert b"40 132" in seen


async def test_pty_stdin(agent: str) -> None:
    async with Client.connect(agent) as client:
        result = await client.exec(
            ["sh", "-c", "read line; echo got:$line"], input=b"hi\n", pty=(24, 80)
        )
    assert b"got:hi" in result.stdout


async def test_200_concurrent_execs_keep_their_exit_codes(agent: str) -> None:
    results: dict[int, int | None] = {}

    async def one(client: Client, i: int) -> None:
        result = await client.exec(["sh", "-c", f"sleep 0.$(( {i} % 5 )); exit $(( {i} % 256 ))"])
        results[i] = result.exit_code

    async with Client.connect(agent) as client, trio.open_nursery() as nursery:
        for i in range(200):
            nursery.start_soon(one, client, i)
    assert results == {i: i % 256 for i in range(200)}


async def test_detached_exec_wait_and_replay(agent: str) -> None:
    async with Client.connect(agent) as client:
        exec_id = await client.start_detached(command="echo one; echo two >&2; exit 3")
        status = await client.exec_wait(exec_id, timeout=20)
        assert status["state"] == "exited" and status["exit_code"] == 3
        async with client.attach_exec(exec_id) as ex:
            chunks = [item async for item in ex]
        assert ("stdout", b"one\n") in chunks and ("stderr", b"two\n") in chunks
        assert ex.result is not None and ex.result["exit_code"] == 3
        listed = {e["exec_id"]: e for e in await client.exec_list()}
        assert listed[exec_id]["state"] == "exited"


async def test_detached_ring_overflow_reports_lost_bytes(start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = await start_agent(output_ring_bytes=64 << 10)
    async with Client.connect(agent) as client:
        exec_id = await client.start_detached(command="head -c 1000000 /dev/zero; echo end")
        await client.exec_wait(exec_id, timeout=20)
        async with client.attach_exec(exec_id) as ex:
            data = b"".join([chunk async for _, chunk in ex])
        lost = ex.announcement["lost"]["stdout"]
    assert lost > 0
    assert lost + len(data) == 1_000_004
    assert data.endswith(b"end\n")
    assert 64 << 10 <= len(data) < 1_000_004


async def test_reattach_mid_stream_loses_and_duplicates_nothing(agent: str) -> None:
    total = 3_000_000
    command = f"head -c {total} /dev/urandom > /tmp/ga-re.$$; sha256sum < /tmp/ga-re.$$ >&2; "
    command += "cat /tmp/ga-re.$$; rm /tmp/ga-re.$$"
    received = bytearray()
    stderr = b""
    async with Client.connect(agent) as client:
        async with client.open_exec(command=command) as ex:
            exec_id = ex.exec_id
            async for name, data in ex:
                if name == "stdout":
                    received += data
                else:
                    stderr += data
                if len(received) > 500_000:
                    break  # walk away mid-stream, without detaching
            offsets = dict(ex.offsets)
    async with Client.connect(agent) as client, client.attach_exec(exec_id, offsets) as ex:
        async for name, data in ex:
            if name == "stdout":
                received += data
            else:
                stderr += data
        assert ex.announcement["lost"] == {"stdout": 0, "stderr": 0}
    assert len(received) == total
    assert hashlib.sha256(received).hexdigest() == stderr.split()[0].decode()


async def test_abandoned_exec_is_killed_after_the_grace(start_agent, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    agent = await start_agent(reattach_grace=0.5)
    pidfile = short_tmp / "pid"
    async with Client.connect(agent) as client:
        async with client.open_exec(command=f"echo $$ > {pidfile}; echo hi; exec sleep 300") as ex:
            async for _ in ex:
                break
            exec_id = ex.exec_id
        status = await client.exec_wait(exec_id, timeout=30)
    assert status["killed_by_agent"] and status["kill_reason"] == "abandoned"
    assert wait_until_dead([int(pidfile.read_text())])


async def test_reattach_within_grace_keeps_it_running(start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = await start_agent(reattach_grace=2)
    async with Client.connect(agent) as client:
        async with client.open_exec(command="echo a; sleep 3; echo b") as ex:
            async for _ in ex:
                break
            exec_id, offsets = ex.exec_id, dict(ex.offsets)
    await trio.sleep(0.5)
    async with Client.connect(agent) as client, client.attach_exec(exec_id, offsets) as ex:
        rest = b"".join([data async for _, data in ex])
    assert rest == b"b\n"
    assert ex.result is not None and ex.result["exit_code"] == 0


async def test_detach_mid_stream_then_wait(agent: str) -> None:
    async with Client.connect(agent) as client:
        async with client.open_exec(command="echo a; sleep 1; echo b; exit 5") as ex:
            async for _ in ex:
                await ex.detach()
        assert ex.result is not None and ex.result["detached"]
        status = await client.exec_wait(ex.exec_id, timeout=20)
    assert status["exit_code"] == 5 and not status["killed_by_agent"]


async def test_kill_and_signal(agent: str) -> None:
    async with Client.connect(agent) as client:
        exec_id = await client.start_detached(
            command="trap 'exit 9' USR1; while :; do sleep 0.1; done"
        )
        await trio.sleep(0.3)
        await client.exec_signal(exec_id, "USR1")
        assert (await client.exec_wait(exec_id, timeout=20))["exit_code"] == 9
        exec_id = await client.start_detached(["sleep", "300"])
        status = await client.exec_kill(exec_id, grace=0.2)
    assert status["signal"] == "SIGTERM" and status["killed_by_agent"]


async def test_finished_execs_are_forgotten(start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = await start_agent(finished_retention=0.3)
    async with Client.connect(agent) as client:
        exec_id = await client.start_detached(["true"])
        assert (await client.exec_wait(exec_id, timeout=20))["exit_code"] == 0
        await trio.sleep(1)
        with pytest.raises(NotFound):
            await client.exec_wait(exec_id)


async def test_limits_are_applied_or_reported(agent: str) -> None:
    async with (
        Client.connect(agent) as client,
        client.open_exec(["true"], memory_bytes=64 << 20, pids=50) as ex,
    ):
        await ex.wait()
    limits = ex.announcement["limits"]
    for controller in ("memory", "pids"):
        assert limits[controller]["applied"] or limits[controller]["reason"]


async def test_without_cgroups_the_process_group_is_killed(start_agent, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    agent = await start_agent(cgroup_root="/proc/no-cgroups-here")
    pids = short_tmp / "pids"
    async with Client.connect(agent) as client:
        result = await client.exec(
            command=f"sh -c 'echo $$ >> {pids}; exec sleep 300' & "
            f"setsid sh -c 'echo $$ >> {pids}; exec sleep 300' & "
            f"echo $$ >> {pids}; sleep 300",
            timeout=0.5,
            kill_grace=0.2,
        )
    assert result.timed_out
    recorded = [int(p) for p in pids.read_text().split()]
    assert len(recorded) == 3
    assert wait_until_dead(recorded)


async def test_real_time_signals_are_named(agent: str) -> None:
    async with Client.connect(agent) as client:
        result = await client.exec(["sh", "-c", f"kill -{signal.SIGRTMIN + 6} $$"])
        assert result.signal == "SIGRTMIN+6"
        exec_id = await client.start_detached(["sleep", "30"])
        await client.exec_signal(exec_id, "SIGRTMIN+6")
        assert (await client.exec_wait(exec_id, timeout=20))["signal"] == "SIGRTMIN+6"


async def test_detach_during_the_grace_saves_the_exec(start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = await start_agent(reattach_grace=0.3)
    async with Client.connect(agent) as client:
        async with client.open_exec(command="echo a; sleep 1.5; echo b") as ex:
            async for _ in ex:
                break  # abandoned: the grace starts
        await client.call("exec.detach", {"exec_id": ex.exec_id})
        status = await client.exec_wait(ex.exec_id, timeout=20)
    assert status["exit_code"] == 0 and not status["killed_by_agent"]


async def test_watching_a_detached_exec_does_not_endanger_it(start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = await start_agent(reattach_grace=0.3)
    async with Client.connect(agent) as client:
        exec_id = await client.start_detached(command="echo a; sleep 1.5; echo b")
        async with client.attach_exec(exec_id) as ex:
            async for _ in ex:
                break  # look, then walk away without detaching
        status = await client.exec_wait(exec_id, timeout=20)
    assert status["exit_code"] == 0 and not status["killed_by_agent"]


async def test_bad_attach_offsets_and_resize_without_terminal(agent: str) -> None:
    async with Client.connect(agent) as client:
        exec_id = await client.start_detached(["echo", "hi"])
        await client.exec_wait(exec_id, timeout=20)
        with pytest.raises(InvalidParams, match="past"):
            async with client.attach_exec(exec_id, {"stdout": 10}):
                pass
        with pytest.raises(InvalidParams, match="no terminal"):
            await client.call("exec.resize", {"exec_id": exec_id, "rows": 10, "cols": 10})


def test_blocking_client_exec(agent_process) -> None:  # type: ignore[no-untyped-def]
    proc = agent_process()
    with SyncClient(proc.address) as client:
        result = client.exec(["sh", "-c", "cat; echo err >&2; exit 4"], input=b"in")
        assert (result.exit_code, result.stdout, result.stderr) == (4, b"in", b"err\n")
        exec_id = client.start_detached(["sleep", "30"])
        assert any(e["exec_id"] == exec_id for e in client.exec_list())
        client.exec_signal(exec_id, "TERM")
        assert client.exec_wait(exec_id, timeout=20)["signal"] == "SIGTERM"
        assert client.exec_kill(client.start_detached(["sleep", "30"]), grace=0.1)["signal"]


async def test_cancel_mid_frame_finishes_the_frame(agent: str) -> None:
    """A cancellation never cuts a frame short: the connection and its other calls go on."""
    raw = await RawClient.open(agent)
    try:
        await raw.hello()
        await raw.send(
            Request(1, "exec.start", {"argv": ["head", "-c", str(64 << 20), "/dev/zero"]}, 64 << 20)
        )
        await trio.sleep(0.5)  # the agent fills the socket and blocks, most likely mid-frame
        await raw.send(Cancel(1))
        # Every byte decodes into whole frames up to the final one (a garbled stream raises
        # RemoteProtocolError here), and the connection still answers afterwards.
        messages: list[object] = []
        with trio.fail_after(30):
            while not messages or not isinstance(messages[-1], (Result, Error)):
                messages.append(await raw.receive())
        final = messages[-1]
        assert isinstance(final, Error) and final.code == "cancelled", final
        assert isinstance(await raw.call(2, "system.ping"), Result)
    finally:
        await raw.aclose()


async def test_cancel_before_the_stream_attaches_still_abandons(start_agent) -> None:  # type: ignore[no-untyped-def]
    agent = await start_agent(reattach_grace=0.3)
    raw = await RawClient.open(agent)
    try:
        await raw.hello()
        request = Request(1, "exec.start", {"argv": ["sleep", "300"]}, 1 << 20)
        # Request and cancel in one write: the cancel lands between spawn and attach.
        await raw.send_raw(raw.conn.send(request) + raw.conn.send(Cancel(1)))
        started = await raw.receive()
        exec_id = started.body["exec_id"] if isinstance(started, Event) else None
    finally:
        await raw.aclose()
    async with Client.connect(agent) as client:
        execs = await client.exec_list()
        assert exec_id is not None or len(execs) == 1
        status = await client.exec_wait(exec_id or execs[0]["exec_id"], timeout=30)
    assert status["state"] == "exited" and status["kill_reason"] == "abandoned"
