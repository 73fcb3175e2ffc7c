"""A full disk during a write says ENOSPC and leaves the old file intact (real tmpfs)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from guest_agent.client import Client
from guest_agent.protocol import RemoteOSError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_tmpfs(short_tmp: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted at teardown whatever happened."""
    mountpoint = short_tmp / "small"
    mountpoint.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "ga-test-tmpfs", str(mountpoint)],
        check=True,
    )
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


async def test_full_disk_keeps_old_file(agent: str, small_tmpfs: Path) -> None:
    path = small_tmpfs / "data"
    path.write_bytes(b"old" * 1000)
    async with Client.connect(agent) as client:
        for options in ({}, {"append": True}):
            with pytest.raises(RemoteOSError) as caught:
                await client.write_file(str(path), os.urandom(3 << 20), **options)
            assert caught.value.errno == "ENOSPC"
            assert str(path) in caught.value.message
            if not options:
                assert path.read_bytes() == b"old" * 1000
        # The space of the failed atomic write was given back: small writes work again.
        path.write_bytes(b"old" * 1000)
        await client.write_file(str(small_tmpfs / "small"), b"fits")
    assert sorted(os.listdir(small_tmpfs)) == ["data", "small"]


def test_full_disk_from_the_cli(agent_process, ctl, small_tmpfs: Path) -> None:  # type: ignore[no-untyped-def]
    proc = agent_process()
    result = ctl(proc.address, "cp", "-", f"guest:{small_tmpfs}/big", input=os.urandom(2 << 20))
    assert result.returncode == 1
    assert "cp -: ENOSPC: No space left on device" in result.stderr.decode()
    assert len(result.stderr.decode().strip().splitlines()) == 1
    assert os.listdir(small_tmpfs) == []
