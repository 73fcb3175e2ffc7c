"""guest-agent-ctl cp, cat, ls, stat, rm, mkdir, mv, chmod, chown against a real agent."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest


@pytest.fixture
def run(agent_process, ctl):  # type: ignore[no-untyped-def]
    """``run(*args, input=b"")``: ctl against one agent subprocess."""
    proc = agent_process()

    def run_ctl(*args: str, **kwargs):  # type: ignore[no-untyped-def]
        return ctl(proc.address, *args, **kwargs)

    return run_ctl


def ok(result) -> bytes:  # type: ignore[no-untyped-def]
    assert result.returncode == 0, result.stderr.decode()
    return bytes(result.stdout)


def test_cp_files_both_ways_and_stdio(run, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    local = short_tmp / "local.bin"
    data = os.urandom(3_000_000)
    local.write_bytes(data)
    os.chmod(local, 0o640)
    (short_tmp / "g").mkdir()
    ok(run("cp", str(local), f"guest:{short_tmp}/g/copy.bin"))
    assert (short_tmp / "g" / "copy.bin").read_bytes() == data
    assert stat.S_IMODE(os.stat(short_tmp / "g" / "copy.bin").st_mode) == 0o640
    # Into an existing guest directory: keeps the name, as cp does.
    ok(run("cp", str(local), f"guest:{short_tmp}/g"))
    assert (short_tmp / "g" / "local.bin").read_bytes() == data
    ok(run("cp", f"guest:{short_tmp}/g/copy.bin", str(short_tmp / "back.bin")))
    assert (short_tmp / "back.bin").read_bytes() == data
    ok(run("cp", "-", f"guest:{short_tmp}/g/stdin.txt", input=b"from stdin"))
    assert ok(run("cp", f"guest:{short_tmp}/g/stdin.txt", "-")) == b"from stdin"
    assert ok(run("cat", f"{short_tmp}/g/stdin.txt")) == b"from stdin"


def test_cp_directories_both_ways(run, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    tree = short_tmp / "tree"
    (tree / "sub" / "empty").mkdir(parents=True)
    (tree / "sub" / "f").write_bytes(b"f")
    (tree / "link").symlink_to("sub/f")
    ok(run("cp", str(tree), f"guest:{short_tmp}/up"))
    assert (short_tmp / "up" / "sub" / "f").read_bytes() == b"f"
    assert os.readlink(short_tmp / "up" / "link") == "sub/f"
    (short_tmp / "down").mkdir()
    ok(run("cp", f"guest:{short_tmp}/up", str(short_tmp / "down")))
    assert (short_tmp / "down" / "up" / "sub" / "empty").is_dir()
    assert (short_tmp / "down" / "up" / "sub" / "f").read_bytes() == b"f"
    tar = ok(run("cp", f"guest:{short_tmp}/up", "-"))
    assert tar[257:262] == b"ustar"


def test_listing_and_metadata_commands(run, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    base = f"{short_tmp}/m"
    ok(run("mkdir", "-p", "-m", "750", f"{base}/a/b"))
    assert stat.S_IMODE(os.stat(f"{base}/a/b").st_mode) == 0o750
    ok(run("cp", "-", f"guest:{base}/a/file", input=b"12345"))
    os.symlink("file", f"{base}/a/link")
    assert ok(run("ls", f"{base}/a")).decode().split() == ["b", "file", "link"]
    long_lines = ok(run("ls", "-l", f"{base}/a")).decode().splitlines()
    assert long_lines[1].startswith("-rw-r--r-- root")
    assert long_lines[2].endswith("link -> file")
    listing = json.loads(ok(run("ls", "--json", "--depth", "2", base)))
    assert [e["path"] for e in listing["entries"]] == ["a", "a/b", "a/file", "a/link"]
    assert ok(run("ls", f"{base}/a/file")).decode().strip() == "file"
    info = json.loads(ok(run("--json", "stat", f"{base}/a/file")))
    assert (info["type"], info["size"], info["mode"]) == ("file", 5, 0o644)
    assert "mode: 0644" in ok(run("stat", f"{base}/a/file")).decode()
    ok(run("chmod", "600", f"{base}/a/file"))
    assert stat.S_IMODE(os.stat(f"{base}/a/file").st_mode) == 0o600
    ok(run("chown", "nobody:nogroup", f"{base}/a/file"))
    assert os.stat(f"{base}/a/file").st_uid == 65534
    ok(run("mv", f"{base}/a/file", f"{base}/moved"))
    assert Path(f"{base}/moved").read_bytes() == b"12345"
    ok(run("rm", f"{base}/moved"))
    ok(run("rm", "-r", f"{base}/a"))
    assert os.listdir(base) == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("stat", "/nope"), "stat /nope: ENOENT: No such file or directory"),
        (("cat", "/nope"), "cat /nope: ENOENT: No such file or directory"),
        (("ls", "/nope"), "ls /nope: ENOENT: No such file or directory"),
        (("rm", "/nope"), "rm /nope: ENOENT: No such file or directory"),
        (("cat", "/root"), "cat /root: EISDIR: Is a directory"),
        (("cat", "--user", "nobody", "/root/x"), "cat /root/x: EACCES: Permission denied"),
        (("mkdir", "/"), "mkdir /: EEXIST: File exists"),
        (("cp", "guest:/nope", "/tmp/x"), "cp guest:/nope: ENOENT: No such file or directory"),
        (("cp", "/nope", "guest:/tmp/x"), "cp /nope: No such file or directory: /nope"),
        (("stat", "--user", "no-such-user-here", "/"), "stat /: unknown user"),
    ],
)
def test_errors_are_one_line_and_exit_1(run, args, expected) -> None:  # type: ignore[no-untyped-def]
    result = run(*args)
    assert result.returncode == 1
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"guest-agent-ctl: {expected}")
