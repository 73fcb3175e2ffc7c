"""Same-user execs take the vfork path: only a real identity change switches (and forks)."""

from __future__ import annotations

import os

from guest_agent.process.spawn import switches_identity
from guest_agent.users import current_user, resolve_user


def test_the_agents_own_user_does_not_switch() -> None:
    assert not switches_identity(current_user())
    assert not switches_identity(resolve_user(current_user().name))


def test_another_user_or_group_switches() -> None:
    assert switches_identity(resolve_user("nobody"))
    own = current_user()
    other_gid = 65534 if os.getegid() != 65534 else 0
    assert switches_identity(resolve_user(f"{own.uid}:{other_gid}"))
