"""One module per service; ``build_handlers`` maps every method name to its handler."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from ..config import Config
from ._call import Call, Handler, param

__all__ = ["Call", "Handler", "Runtime", "build_handlers", "param"]


@dataclass
class Runtime:
    """Agent-wide things a service may use: the config, and a nursery that outlives connections."""

    config: Config
    nursery: trio.Nursery
    # Seconds since boot (CLOCK_BOOTTIME) at agent milestones: process start, imports done, ready.
    timings: dict[str, float] = field(default_factory=dict)
    capabilities: list[str] = field(default_factory=list)
    # Run (shielded) after the nursery has closed, when the agent stops.
    cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


class Service(Protocol):
    """A service: a capability name and the methods it answers."""

    name: str

    def methods(self) -> dict[str, Handler]: ...


def build_handlers(runtime: Runtime) -> dict[str, Handler]:
    """Instantiate every service and collect its methods; fills ``runtime.capabilities``."""
    from .exec import ExecService
    from .files import FilesService
    from .system import SystemService

    services: list[Service] = [SystemService(runtime), ExecService(runtime), FilesService(runtime)]
    handlers: dict[str, Handler] = {}
    for service in services:
        runtime.capabilities.append(service.name)
        handlers.update(service.methods())
    return handlers
