"""A wake-up signal that costs nothing while nobody waits on it."""

from __future__ import annotations

import trio


class Wakeup:
    """Wakes the tasks waiting at the moment ``notify`` is called (like a Condition).

    Its Event is made only when a task waits, and dropped when it fires: execs and calls
    hold several of these, and most are never waited on.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: trio.Event | None = None

    def notify(self) -> None:
        """Wake every task waiting now."""
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        """Sleep until the next ``notify``."""
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()
