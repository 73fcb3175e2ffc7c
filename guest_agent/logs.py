"""Logging set-up: one key=value line per event on stderr, repeated lines rate-limited."""

from __future__ import annotations

import logging
import sys
import time


class RateLimitFilter(logging.Filter):
    """Lets ``burst`` records of one message template through per ``window`` seconds.

    When a window with suppressed records ends, the next record of that template carries
    ``suppressed=N`` so the operator knows how many were dropped.
    """

    def __init__(self, burst: int = 5, window: float = 10.0) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        # template -> [window start, records seen in window, suppressed in window]
        self._seen: dict[tuple[str, object], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.msg)
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window:
            suppressed = int(entry[2]) if entry is not None else 0
            self._seen[key] = [now, 1, 0]
            if len(self._seen) > 1000:  # bounded: forget the oldest templates
                for old in list(self._seen)[:500]:
                    del self._seen[old]
            if suppressed:
                record.msg = f"{record.msg} suppressed={suppressed}"
            return True
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        entry[2] += 1
        return False


def setup_logging(level: int) -> None:
    """Log to stderr with timestamps, through the rate limiter."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    handler.addFilter(RateLimitFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
