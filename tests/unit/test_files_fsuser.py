"""Per-thread credentials are real and stay in their thread; archive member checks."""

from __future__ import annotations

import os
import threading

import pytest

from guest_agent.filesystem.credentials import parse_owner, run_as
from guest_agent.filesystem.tar import UnsafeArchive, _check_symlink, member_parts
from guest_agent.protocol import InvalidParams
from guest_agent.users import Credentials, resolve_user

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
NOBODY = Credentials(65534, 65534, (65534,), "nobody")


def thread_ids() -> dict[str, list[int]]:
    """This thread's Uid/Gid lines (real, effective, saved, fs) and groups from /proc."""
    ids: dict[str, list[int]] = {}
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Uid", "Gid", "Groups"):
                ids[key] = [int(v) for v in value.split()]
    return ids


@needs_root
def test_identity_applies_to_this_thread_only_and_is_restored() -> None:
    before = thread_ids()
    inside: dict[str, list[int]] = {}
    other: dict[str, list[int]] = {}
    switched = threading.Event()
    checked = threading.Event()

    def as_nobody() -> None:
        inside.update(thread_ids())
        switched.set()
        checked.wait(5)  # hold the identity while another thread looks at its own

    def observer() -> None:
        switched.wait(5)
        other.update(thread_ids())
        checked.set()

    worker = threading.Thread(target=run_as, args=(NOBODY, as_nobody))
    watcher = threading.Thread(target=observer)
    worker.start()
    watcher.start()
    worker.join()
    watcher.join()
    assert inside["Uid"][3] == 65534 and inside["Gid"][3] == 65534
    assert inside["Groups"] == [65534]
    assert inside["Uid"][1] == 0  # only the filesystem identity changes
    assert other == before
    assert thread_ids() == before


@needs_root
def test_identity_is_restored_after_an_error(tmp_path: os.PathLike[str]) -> None:
    secret = os.path.join(tmp_path, "secret")
    with open(secret, "w") as f:
        f.write("x")
    os.chmod(secret, 0o600)
    before = thread_ids()
    with pytest.raises(PermissionError):
        run_as(NOBODY, open, secret)
    assert thread_ids() == before
    with open(secret) as f:  # root again
        assert f.read() == "x"


def test_resolve_user() -> None:
    root = resolve_user("root")
    assert (root.uid, root.gid) == (0, 0)
    assert resolve_user(0) == root
    assert resolve_user("424242") == Credentials(424242, 424242, (424242,), "424242")
    with pytest.raises(InvalidParams, match="unknown user"):
        resolve_user("no-such-user-here")


def test_parse_owner() -> None:
    assert parse_owner("nobody") == (65534, -1)
    assert parse_owner("nobody:") == (65534, 65534)
    assert parse_owner("0:0") == (0, 0)
    assert parse_owner(":0") == (-1, 0)
    assert parse_owner(1234) == (1234, -1)
    with pytest.raises(InvalidParams):
        parse_owner("nobody:no-such-group-here")
    with pytest.raises(InvalidParams):
        parse_owner(":")


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../x", "a/..", "a\0b"])
def test_member_names_refused(name: str) -> None:
    with pytest.raises(UnsafeArchive):
        member_parts(name)


def test_member_names_accepted() -> None:
    assert member_parts("./a//b/./c") == ["a", "b", "c"]
    assert member_parts(".") == []


@pytest.mark.parametrize(
    ("where", "target", "safe"),
    [
        (["a", "l"], "b", True),
        (["a", "l"], "../b", True),
        (["a", "l"], "../../b", False),
        (["l"], "..", False),
        (["l"], "/etc", False),
        (["a", "b", "l"], "../../c", True),
        # ".." after a name could climb through another link ("x -> ."): refused.
        (["a", "b", "l"], "../x/../../c", False),
        (["e"], "d/../outside", False),
    ],
)
def test_symlink_targets(where: list[str], target: str, safe: bool) -> None:
    if safe:
        _check_symlink(where, target)
    else:
        with pytest.raises(UnsafeArchive):
            _check_symlink(where, target)
