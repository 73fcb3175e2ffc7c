"""The files service through the trio and blocking clients, on real files."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest
import trio

from guest_agent.client import Client
from guest_agent.protocol import InvalidParams, RemoteOSError
from guest_agent.sync_client import SyncClient
from tests.conftest import StartAgent


def temp_files(directory: Path) -> list[str]:
    """Leftover temp files of atomic writes."""
    return [name for name in os.listdir(directory) if ".ga-tmp-" in name]


def content(path: str) -> bytes:
    """A local file's bytes."""
    with open(path, "rb") as f:
        return f.read()


async def wait_no_temp_files(directory: Path) -> None:
    """The agent removes temp files in shielded cleanup right after the call ends."""
    with trio.move_on_after(5):
        while temp_files(directory):  # noqa: ASYNC110  # a directory, not an event, to watch
            await trio.sleep(0.01)
    assert temp_files(directory) == []


@pytest.mark.parametrize("size", [0, 1, 3 * (1 << 20) + 7])
async def test_write_then_read_round_trip(agent: str, short_tmp: Path, size: int) -> None:
    data = os.urandom(size)
    path = str(short_tmp / "f.bin")
    async with Client.connect(agent) as client:
        result = await client.write_file(path, data)
        assert result == {"path": path, "bytes": size}
        assert await client.read_file(path) == data
        assert await client.read_file(path, offset=size // 2, length=5) == data[size // 2 :][:5]
        info = await client.stat(path)
    assert content(path) == data
    assert info["type"] == "file" and info["size"] == size and info["mode"] == 0o644
    assert info["owner"] == "root" and info["target"] is None
    assert temp_files(short_tmp) == []


async def test_streamed_write_and_read_into_sink(agent: str, short_tmp: Path) -> None:
    path = str(short_tmp / "streamed")
    chunks = [os.urandom(100_000) for _ in range(30)]

    async def produce():  # type: ignore[no-untyped-def]
        for chunk in chunks:
            yield chunk

    received: list[bytes] = []
    async with Client.connect(agent) as client:
        await client.write_file(path, produce())
        result = await client.read_file_into(path, received.append)
        async with client.open_read(path, offset=10, length=20) as stream:
            part = b"".join([chunk async for chunk in stream])
    assert b"".join(received) == b"".join(chunks)
    assert result == {"size": 3_000_000, "bytes": 3_000_000}
    assert part == b"".join(chunks)[10:30]


async def test_write_options(agent: str, short_tmp: Path) -> None:
    async with Client.connect(agent) as client:
        deep = str(short_tmp / "a" / "b" / "c.txt")
        with pytest.raises(RemoteOSError) as missing:
            await client.write_file(deep, b"x")
        assert missing.value.errno == "ENOENT"
        await client.write_file(deep, b"x", parents=True, mode=0o600)
        assert stat.S_IMODE(os.stat(deep).st_mode) == 0o600
        # Replacing keeps the mode and ownership of the file it replaces.
        await client.write_file(deep, b"yy")
        assert stat.S_IMODE(os.stat(deep).st_mode) == 0o600
        with pytest.raises(RemoteOSError) as exists:
            await client.write_file(deep, b"z", exclusive=True)
        assert exists.value.errno == "EEXIST"
        await client.write_file(deep, b"zz", append=True)
        assert content(deep) == b"yyzz"
        fresh = str(short_tmp / "fresh")
        await client.write_file(fresh, b"1", append=True, exclusive=True)
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o644
        owned = str(short_tmp / "owned")
        await client.write_file(owned, b"o", owner="nobody:nogroup")
        assert (os.stat(owned).st_uid, os.stat(owned).st_gid) == (65534, 65534)
        with pytest.raises(RemoteOSError) as is_dir:
            await client.write_file(str(short_tmp), b"x")
        assert is_dir.value.errno == "EISDIR"
    assert temp_files(short_tmp) == []


async def test_write_replaces_a_symlink_instead_of_following_it(
    agent: str, short_tmp: Path
) -> None:
    outside = short_tmp / "outside"
    outside.write_bytes(b"keep")
    (short_tmp / "link").symlink_to(outside)
    async with Client.connect(agent) as client:
        await client.write_file(str(short_tmp / "link"), b"new")
    assert outside.read_bytes() == b"keep"
    assert not (short_tmp / "link").is_symlink()
    assert (short_tmp / "link").read_bytes() == b"new"


async def test_errors_carry_errno_names(agent: str, short_tmp: Path) -> None:
    (short_tmp / "file").write_bytes(b"x")
    (short_tmp / "dir").mkdir()
    (short_tmp / "dir" / "inner").write_bytes(b"")
    async with Client.connect(agent) as client:
        cases = [
            (client.stat(str(short_tmp / "nope")), "ENOENT"),
            (client.read_file(str(short_tmp / "dir")), "EISDIR"),
            (client.list_dir(str(short_tmp / "file")), "ENOTDIR"),
            (client.mkdir(str(short_tmp / "dir")), "EEXIST"),
            (client.remove(str(short_tmp / "dir")), "ENOTEMPTY"),
            (client.rename(str(short_tmp / "nope"), str(short_tmp / "x")), "ENOENT"),
            (client.chmod(str(short_tmp / "nope"), 0o600), "ENOENT"),
        ]
        for coroutine, name in cases:
            with pytest.raises(RemoteOSError) as caught:
                await coroutine
            assert caught.value.errno == name
            assert caught.value.code == "os_error"
        with pytest.raises(InvalidParams, match="absolute"):
            await client.stat("relative/path")
        with pytest.raises(InvalidParams, match="unknown user"):
            await client.stat(str(short_tmp), user="no-such-user-here")
        with pytest.raises(InvalidParams):
            await client.remove("/", recursive=True)


async def test_directory_operations(agent: str, short_tmp: Path) -> None:
    base = short_tmp / "tree"
    async with Client.connect(agent) as client:
        await client.mkdir(str(base / "a" / "b"), parents=True, mode=0o700)
        assert (await client.mkdir(str(base / "a" / "b"), parents=True))["created"] is False
        assert stat.S_IMODE(os.stat(base / "a" / "b").st_mode) == 0o700
        await client.write_file(str(base / "a" / "f"), b"12345")
        (base / "a" / "link").symlink_to("f")
        listing = await client.list_dir(str(base), depth=3)
        by_path = {entry["path"]: entry for entry in listing["entries"]}
        assert sorted(by_path) == ["a", "a/b", "a/f", "a/link"]
        assert by_path["a/link"]["type"] == "symlink" and by_path["a/link"]["target"] == "f"
        assert by_path["a/f"]["size"] == 5 and by_path["a/b"]["mode"] == 0o700
        assert not listing["truncated"]
        shallow = await client.list_dir(str(base))
        assert [entry["path"] for entry in shallow["entries"]] == ["a"]
        followed = await client.stat(str(base / "a" / "link"), follow=True)
        assert followed["type"] == "file"
        await client.chmod(str(base / "a" / "f"), 0o640)
        assert stat.S_IMODE(os.stat(base / "a" / "f").st_mode) == 0o640
        await client.chown(str(base / "a" / "f"), "nobody")
        assert os.stat(base / "a" / "f").st_uid == 65534
        await client.rename(str(base / "a" / "f"), str(base / "g"))
        assert (base / "g").read_bytes() == b"12345"
        await client.remove(str(base / "a" / "link"))
        await client.remove(str(base / "a"), recursive=True)
        assert os.listdir(base) == ["g"]


async def test_list_is_bounded_to_one_frame(agent: str, short_tmp: Path) -> None:
    many = short_tmp / "many"
    many.mkdir()
    for i in range(8000):
        (many / f"file-with-a-longish-name-{i:05d}").touch()
    async with Client.connect(agent) as client:
        listing = await client.list_dir(str(many))
    assert listing["truncated"]
    assert 1000 < len(listing["entries"]) < 8000


async def test_cancelled_write_keeps_old_file_and_no_temp(agent: str, short_tmp: Path) -> None:
    path = short_tmp / "precious"
    path.write_bytes(b"old content")
    async with Client.connect(agent) as client:
        async with client.open_call("file.write", {"path": str(path)}) as call:
            await call.send_data("file", os.urandom(3 << 20))
            # Leaving the block without eof cancels the call on the agent.
        with pytest.raises(Exception, match="cancel"):
            await call.wait_result()
        await wait_no_temp_files(short_tmp)
        # The connection still works.
        assert await client.read_file(str(path)) == b"old content"


async def test_disconnected_writer_keeps_old_file_and_no_temp(agent: str, short_tmp: Path) -> None:
    path = short_tmp / "precious"
    path.write_bytes(b"old content")
    async with (
        Client.connect(agent) as client,
        client.open_call("file.write", {"path": str(path)}) as call,
    ):
        await call.send_data("file", os.urandom(1 << 20))
        # Drop the whole connection mid-write, without a cancel frame.
        await client._stream.aclose()
    await wait_no_temp_files(short_tmp)
    assert path.read_bytes() == b"old content"


async def test_stalled_reader_blocks_neither_writes_nor_other_calls(
    start_agent: StartAgent, short_tmp: Path
) -> None:
    # One worker thread: a read waiting for credit must not be holding it.
    agent = await start_agent(file_workers=1)
    big = short_tmp / "big"
    big.write_bytes(os.urandom(8 << 20))
    other = os.urandom(5 << 20)
    async with Client.connect(agent) as client:
        async with client.open_call("file.read", {"path": str(big)}, window=64 << 10) as stalled:
            first = await stalled.receive()  # started, then never read again
            assert first.data  # type: ignore[union-attr]
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(client.write_file, str(short_tmp / "w1"), other)
                    nursery.start_soon(client.write_file, str(short_tmp / "w2"), other)
                    nursery.start_soon(client.stat, str(big))
                assert await client.read_file(str(short_tmp / "w1")) == other
            assert not stalled.done
    assert (short_tmp / "w2").read_bytes() == other


def test_sync_client(agent_process, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    proc = agent_process()
    source = os.urandom(2_500_000)
    with SyncClient(proc.address) as client:
        path = str(short_tmp / "sync.bin")
        assert client.write_file(path, io.BytesIO(source))["bytes"] == len(source)
        assert client.read_file(path) == source
        client.write_file(path + ".2", [b"a", b"", b"b"], mode=0o600)
        assert client.read_file(path + ".2") == b"ab"
        sink = bytearray()
        assert client.read_file_into(path, sink.extend, offset=1)["bytes"] == len(source) - 1
        assert bytes(sink) == source[1:]
        client.mkdir(str(short_tmp / "d"))
        client.rename(path + ".2", str(short_tmp / "d" / "moved"))
        client.chmod(str(short_tmp / "d" / "moved"), 0o644)
        client.chown(str(short_tmp / "d" / "moved"), "0:0")
        entries = client.list_dir(str(short_tmp / "d"))["entries"]
        assert [(e["path"], e["mode"]) for e in entries] == [("moved", 0o644)]
        assert client.stat(str(short_tmp / "d"))["type"] == "dir"
        client.remove(str(short_tmp / "d"), recursive=True)
        with pytest.raises(RemoteOSError) as caught:
            client.stat(str(short_tmp / "d"))
        assert caught.value.errno == "ENOENT"


async def test_chmod_requires_a_mode(agent: str, short_tmp: Path) -> None:
    target = short_tmp / "f"
    target.write_text("x")
    async with Client.connect(agent) as client:
        with pytest.raises(InvalidParams, match="mode"):
            await client.call("file.chmod", {"path": str(target)})
