"""Directory transfer as tar both ways: a faithful round trip, and hostile archives refused."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from guest_agent.client import Client
from guest_agent.protocol import InvalidParams


def make_tree(root: Path) -> None:
    """Files with assorted modes, empty and restrictive directories, symlinks, a hard link."""
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "private").mkdir(mode=0o700)
    (root / "readonly").mkdir()
    (root / "readonly" / "inside").write_bytes(b"inside a 0555 directory")
    os.chmod(root / "readonly", 0o555)
    (root / "a.txt").write_bytes(b"alpha\n")
    os.chmod(root / "a.txt", 0o640)
    (root / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "run.sh", 0o755)
    (root / "sub" / "deeper" / "big.bin").write_bytes(os.urandom(3 << 20))
    (root / "private" / "key").write_bytes(b"k")
    os.chmod(root / "private" / "key", 0o600)
    (root / "sub" / "link-to-a").symlink_to("../a.txt")
    (root / "sub" / "dangling").symlink_to("missing/target")
    (root / "dirlink").symlink_to("sub/deeper")
    os.link(root / "a.txt", root / "sub" / "hard-a")
    (root / "name with spaces & ünïcödé").write_bytes(b"x")
    os.mkfifo(root / "fifo")


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Type, mode and content (or link target) of everything under root."""
    found: dict[str, tuple[Any, ...]] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            st = path.lstat()
            kind = stat.S_IFMT(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                detail: Any = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                detail = path.read_bytes()
            else:
                detail = None
            found[str(path.relative_to(root))] = (kind, stat.S_IMODE(st.st_mode), detail)
    return found


async def test_tree_round_trip(agent: str, short_tmp: Path) -> None:
    source, guest, back = short_tmp / "source", short_tmp / "guest", short_tmp / "back"
    source.mkdir()
    make_tree(source)
    os.chmod(source, 0o750)
    async with Client.connect(agent) as client:
        up = await client.upload_dir(str(source), str(guest))
        down = await client.download_dir(str(guest), str(back))
    assert snapshot(guest) == snapshot(source)
    assert snapshot(back) == snapshot(source)
    assert up["members"] == down["members"] == len(snapshot(source))
    assert stat.S_IMODE(os.stat(guest).st_mode) == 0o750  # created: takes the archive's mode
    assert os.stat(guest / "a.txt").st_ino == os.stat(guest / "sub" / "hard-a").st_ino
    mtime = os.stat(source / "a.txt").st_mtime
    assert abs(os.stat(back / "a.txt").st_mtime - mtime) < 1
    assert not [p for p in snapshot(guest) if ".ga-tmp-" in p]


async def test_extract_into_existing_directory_keeps_its_mode(agent: str, short_tmp: Path) -> None:
    target = short_tmp / "existing"
    target.mkdir(mode=0o1777)
    os.chmod(target, 0o1777)
    (target / "kept").write_bytes(b"kept")
    (target / "a.txt").write_bytes(b"old")
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        root = tarfile.TarInfo(".")
        root.type, root.mode = tarfile.DIRTYPE, 0o700
        tar.addfile(root)
        member = tarfile.TarInfo("a.txt")
        member.size = 3
        tar.addfile(member, io.BytesIO(b"new"))
    async with Client.connect(agent) as client:
        await client.upload_tar(str(target), archive.getvalue())
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o1777
    assert (target / "a.txt").read_bytes() == b"new"
    assert (target / "kept").read_bytes() == b"kept"


async def test_download_of_a_single_file_and_raw_tar(agent: str, short_tmp: Path) -> None:
    (short_tmp / "one.txt").write_bytes(b"just one")
    chunks: list[bytes] = []
    async with Client.connect(agent) as client:
        await client.download_tar(str(short_tmp / "one.txt"), chunks.append)
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["one.txt"]
        assert tar.extractfile(members[0]).read() == b"just one"  # type: ignore[union-attr]


def archive_of(*members: tuple[str, str, str]) -> bytes:
    """A tar of (kind, name, link-target-or-content) members."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for kind, name, extra in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(extra)
                tar.addfile(info, io.BytesIO(extra.encode()))
                continue
            info.type = {
                "dir": tarfile.DIRTYPE,
                "symlink": tarfile.SYMTYPE,
                "hardlink": tarfile.LNKTYPE,
            }[kind]
            info.linkname = extra
            tar.addfile(info)
    return out.getvalue()


HOSTILE = {
    "dotdot": archive_of(("file", "../escaped", "evil")),
    "dotdot-deep": archive_of(("file", "ok/../../escaped", "evil")),
    "absolute": archive_of(("file", "{outside}/escaped", "evil")),
    "symlink-absolute": archive_of(("symlink", "link", "{outside}")),
    "symlink-up": archive_of(("symlink", "a/link", "../../outside")),
    "through-symlink": archive_of(("symlink", "d", "."), ("file", "d/d/d/escaped", "evil")),
    "symlink-chain": archive_of(
        ("symlink", "d", "."),
        ("symlink", "d/d/up", "../outside"),
    ),
    "write-through-own-symlink": archive_of(
        ("dir", "x", ""), ("symlink", "x/l", ".."), ("file", "x/l/escaped", "evil")
    ),
    "hardlink-out": archive_of(("hardlink", "h", "../outside/secret")),
    "hardlink-to-symlink": archive_of(
        ("dir", "a", ""),
        ("dir", "a/b", ""),
        ("symlink", "a/b/s", "../../x"),
        ("hardlink", "s2", "a/b/s"),
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_archives_are_refused(agent: str, short_tmp: Path, case: str) -> None:
    outside = short_tmp / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    target = short_tmp / "target"
    data = HOSTILE[case].replace(b"{outside}", str(outside).encode())
    if b"{outside}" in HOSTILE[case]:
        # The placeholder changed length: rebuild so the headers stay valid.
        data = _rebuild(HOSTILE[case], str(outside))
    before = snapshot(short_tmp)
    async with Client.connect(agent) as client:
        with pytest.raises(InvalidParams, match=r"archive|symlink|link"):
            await client.upload_tar(str(target), data)
    after = snapshot(short_tmp)
    outside_before = {k: v for k, v in before.items() if not k.startswith("target")}
    outside_after = {k: v for k, v in after.items() if not k.startswith("target")}
    assert outside_after == outside_before
    assert not (short_tmp / "escaped").exists()
    assert (outside / "secret").read_bytes() == b"secret"


async def test_planted_symlink_in_target_is_not_followed(agent: str, short_tmp: Path) -> None:
    outside = short_tmp / "outside"
    outside.mkdir()
    target = short_tmp / "target"
    target.mkdir()
    (target / "planted").symlink_to(outside)
    async with Client.connect(agent) as client:
        with pytest.raises(InvalidParams, match="symlink"):
            await client.upload_tar(str(target), archive_of(("file", "planted/x", "evil")))
    assert os.listdir(outside) == []


async def test_garbage_is_not_an_archive(agent: str, short_tmp: Path) -> None:
    async with Client.connect(agent) as client:
        with pytest.raises(InvalidParams, match="tar"):
            await client.upload_tar(str(short_tmp / "t"), b"this is not a tar archive" * 100)


def _rebuild(template: bytes, outside: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(template)) as tar:
        members = []
        for info in tar.getmembers():
            content = tar.extractfile(info).read().decode() if info.isfile() else ""  # type: ignore[union-attr]
            kind = "file" if info.isfile() else "symlink" if info.issym() else "dir"
            name = info.name.replace("{outside}", outside)
            extra = content if info.isfile() else info.linkname.replace("{outside}", outside)
            members.append((kind, name, extra))
    return archive_of(*members)


async def test_interrupted_upload_keeps_old_files_and_no_temp(agent: str, short_tmp: Path) -> None:
    target = short_tmp / "target"
    target.mkdir()
    (target / "big.bin").write_bytes(b"old")
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        info = tarfile.TarInfo("big.bin")
        info.size = 8 << 20
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    async with Client.connect(agent) as client:
        async with client.open_call("file.write_tar", {"path": str(target)}) as call:
            await call.send_data("tar", archive.getvalue()[: 3 << 20])
            # Leaving without eof cancels the call mid-member.
        with pytest.raises(Exception, match="cancel"):
            await call.wait_result()
        await client.ping()
    assert sorted(os.listdir(target)) == ["big.bin"]
    assert (target / "big.bin").read_bytes() == b"old"


async def test_setuid_and_setgid_bits_are_dropped(agent: str, short_tmp: Path) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, mode in (("suid", 0o4755), ("sgid-dir", 0o2775)):
            info = tarfile.TarInfo(name)
            info.mode = mode
            if name == "sgid-dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = 2
                tar.addfile(info, io.BytesIO(b"hi"))
    target = short_tmp / "t"
    async with Client.connect(agent) as client:
        await client.upload_tar(str(target), out.getvalue())
    assert stat.S_IMODE((target / "suid").stat().st_mode) == 0o755
    assert stat.S_IMODE((target / "sgid-dir").stat().st_mode) == 0o775
