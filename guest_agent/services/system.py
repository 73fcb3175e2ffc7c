"""The system service: liveness and facts about the agent and its VM."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from .. import __version__
from ..protocol import PROTOCOL_VERSION
from . import Call, Handler, Runtime


class SystemService:
    """``system.ping`` and ``system.info``."""

    name = "system"

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def methods(self) -> dict[str, Handler]:
        return {"system.ping": self.ping, "system.info": self.info}

    async def ping(self, call: Call) -> dict[str, Any]:
        """Answer at once; the round trip is the health check."""
        return {}

    async def info(self, call: Call) -> dict[str, Any]:
        """Versions, capabilities, hostname, uptimes and the agent's own start-up timing."""
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        timings = self.runtime.timings
        started = timings.get("process_start", now)
        return {
            "agent_version": __version__,
            "protocol": list(PROTOCOL_VERSION),
            "capabilities": sorted(self.runtime.capabilities),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "system_uptime": round(now, 3),
            "agent_uptime": round(now - started, 3),
            "boot": {name: round(value - started, 4) for name, value in timings.items()},
            "wall_clock": time.time(),
        }
