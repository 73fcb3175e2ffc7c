"""File operations run with the requesting user's credentials: real users, real EACCES."""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from guest_agent.client import Client
from guest_agent.protocol import RemoteOSError
from tests.conftest import StartAgent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

NOBODY = 65534
# A user with a supplementary group, created once on this machine (idempotently).
TEST_USER = "ga-files-test"
TEST_GROUP = "ga-files-extra"


@pytest.fixture(scope="module")
def test_user() -> tuple[int, int]:
    """(uid, supplementary gid) of a real unprivileged user with an extra group."""
    try:
        grp.getgrnam(TEST_GROUP)
    except KeyError:
        subprocess.run(["groupadd", "-f", TEST_GROUP], check=True)
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "-G",
                TEST_GROUP,
                TEST_USER,
            ],
            check=True,
        )
    return pwd.getpwnam(TEST_USER).pw_uid, grp.getgrnam(TEST_GROUP).gr_gid


@pytest.fixture
def area(short_tmp: Path) -> Iterator[Path]:
    """A root-owned 0755 directory holding a root-only file and a directory nobody owns."""
    os.chmod(short_tmp, 0o755)
    area = short_tmp / "area"
    area.mkdir(mode=0o755)
    (area / "secret").write_bytes(b"root only")
    os.chmod(area / "secret", 0o600)
    (area / "mine").mkdir()
    os.chown(area / "mine", NOBODY, NOBODY)
    yield area


async def test_unprivileged_user_gets_eacces(agent: str, area: Path) -> None:
    async with Client.connect(agent) as client:
        for attempt in (
            client.read_file(str(area / "secret"), user="nobody"),
            client.write_file(str(area / "new"), b"x", user="nobody"),
            client.write_file(str(area / "secret"), b"x", user="nobody"),
            client.mkdir(str(area / "newdir"), user="nobody"),
            client.remove(str(area / "secret"), user="nobody"),
            client.chmod(str(area / "secret"), 0o644, user="nobody"),
            client.rename(str(area / "secret"), str(area / "mine" / "s"), user="nobody"),
        ):
            with pytest.raises(RemoteOSError) as caught:
                await attempt
            assert caught.value.errno in ("EACCES", "EPERM"), caught.value
        # Root's CAP_CHOWN does not leak into the user's thread.
        await client.write_file(str(area / "mine" / "f"), b"x", user="nobody")
        with pytest.raises(RemoteOSError) as chown:
            await client.chown(str(area / "mine" / "f"), "root", user="nobody")
        assert chown.value.errno == "EPERM"
    assert (area / "secret").read_bytes() == b"root only"
    assert sorted(os.listdir(area)) == ["mine", "secret"]
    assert os.listdir(area / "mine") == ["f"]


async def test_created_files_belong_to_the_user(agent: str, area: Path) -> None:
    mine = area / "mine"
    async with Client.connect(agent) as client:
        await client.write_file(str(mine / "a" / "f"), b"x", parents=True, user="nobody")
        await client.mkdir(str(mine / "d"), user=NOBODY)
        await client.write_file(str(mine / "g"), b"x", append=True, user="nobody")
        info = await client.stat(str(mine / "a" / "f"), user="nobody")
    for path in (mine / "a", mine / "a" / "f", mine / "d", mine / "g"):
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), path
    assert (info["owner"], info["uid"]) == ("nobody", NOBODY)


async def test_default_user_comes_from_config(start_agent: StartAgent, area: Path) -> None:
    agent = await start_agent(default_user="nobody")
    async with Client.connect(agent) as client:
        with pytest.raises(RemoteOSError) as caught:
            await client.read_file(str(area / "secret"))
        assert caught.value.errno == "EACCES"
        await client.write_file(str(area / "mine" / "f"), b"x")
        # An explicit user wins over the default.
        assert await client.read_file(str(area / "secret"), user="root") == b"root only"
    assert os.stat(area / "mine" / "f").st_uid == NOBODY


async def test_groups_apply(agent: str, area: Path, test_user: tuple[int, int]) -> None:
    uid, extra_gid = test_user
    shared = area / "shared"
    shared.write_bytes(b"group readable")
    os.chown(shared, 0, extra_gid)
    os.chmod(shared, 0o640)
    async with Client.connect(agent) as client:
        # Through the supplementary group: allowed; nobody is not in it.
        assert await client.read_file(str(shared), user=TEST_USER) == b"group readable"
        with pytest.raises(RemoteOSError) as caught:
            await client.read_file(str(shared), user="nobody")
        assert caught.value.errno == "EACCES"
        # A uid without a passwd entry is still a real identity.
        with pytest.raises(RemoteOSError):
            await client.write_file(str(area / "mine" / "x"), b"x", user=str(uid + 100_000))


async def test_tar_upload_as_user(agent: str, area: Path, tmp_path: Path) -> None:
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "sub" / "f").write_bytes(b"data")
    async with Client.connect(agent) as client:
        await client.upload_dir(str(tmp_path / "src"), str(area / "mine" / "t"), user="nobody")
        with pytest.raises(RemoteOSError) as caught:
            await client.upload_dir(str(tmp_path / "src"), str(area / "t"), user="nobody")
        assert caught.value.errno == "EACCES"
    for path in (
        area / "mine" / "t",
        area / "mine" / "t" / "sub",
        area / "mine" / "t" / "sub" / "f",
    ):
        assert os.stat(path).st_uid == NOBODY
