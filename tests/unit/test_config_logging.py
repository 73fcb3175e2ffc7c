"""Logging set-up: the rate limiter lets a burst through, then counts what it suppressed."""

from __future__ import annotations

import logging
import time

from guest_agent.logs import RateLimitFilter


def record(msg: str, *args: object, name: str = "guest_agent.server") -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_burst_then_suppression_then_count() -> None:
    limiter = RateLimitFilter(burst=3, window=0.05)
    template = "event=accept_failed error=%r"
    passed = [limiter.filter(record(template, n)) for n in range(10)]
    assert passed == [True] * 3 + [False] * 7
    time.sleep(0.1)  # let the window end (no timing is asserted)
    late = record(template, "again")
    assert limiter.filter(late)
    assert late.getMessage() == "event=accept_failed error='again' suppressed=7"
    # The count starts again from zero in the new window.
    nxt = record(template, "next")
    assert limiter.filter(nxt)
    assert "suppressed" not in nxt.getMessage()


def test_templates_and_loggers_are_limited_separately() -> None:
    limiter = RateLimitFilter(burst=1, window=60)
    assert limiter.filter(record("event=a x=%s", 1))
    assert not limiter.filter(record("event=a x=%s", 2))
    assert limiter.filter(record("event=b x=%s", 1))
    assert limiter.filter(record("event=a x=%s", 1, name="guest_agent.client"))


def test_no_suppressed_count_when_nothing_was_dropped() -> None:
    limiter = RateLimitFilter(burst=2, window=0.01)
    assert limiter.filter(record("event=x"))
    time.sleep(0.05)
    again = record("event=x")
    assert limiter.filter(again)
    assert again.getMessage() == "event=x"


def test_memory_is_bounded() -> None:
    limiter = RateLimitFilter(burst=1, window=60)
    for n in range(5000):
        limiter.filter(record(f"event=unique{n}"))
    assert len(limiter._seen) <= 1001
