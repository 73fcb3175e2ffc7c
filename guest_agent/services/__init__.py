"""One module per service; ``build_handlers`` maps every method name to its handler."""

from __future__ import annotations

from dataclasses import dataclass, field

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


def build_handlers(runtime: Runtime) -> dict[str, Handler]:
    """Instantiate every service and collect its methods; fills ``runtime.capabilities``."""
    from .system import SystemService

    services = [SystemService(runtime)]
    handlers: dict[str, Handler] = {}
    for service in services:
        runtime.capabilities.append(service.name)
        handlers.update(service.methods())
    return handlers
