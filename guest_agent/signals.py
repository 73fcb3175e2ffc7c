"""Signal names on the wire: SIGTERM, ..., and SIGRTMIN+N for real-time signals.

Shared by the agent (which reports how a command ended) and the CLI (which turns that
back into 128+N), so both read real-time signals the same way.
"""

from __future__ import annotations

import signal


def signal_name(number: int) -> str:
    """The wire name of a signal number."""
    try:
        return signal.Signals(number).name
    except ValueError:
        if signal.SIGRTMIN <= number <= signal.SIGRTMAX:
            return f"SIGRTMIN+{number - signal.SIGRTMIN}"
        return f"SIG{number}"


def signal_number(value: str | int) -> int:
    """A signal number from a name (SIGTERM, TERM, SIGRTMIN+2) or number; ValueError if none."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        base, plus, offset = name.partition("+")
        if base == "SIGRTMIN" and (not plus or offset.isdigit()):
            number = signal.SIGRTMIN + int(offset or 0)
        elif name[3:].isdigit():
            number = int(name[3:])
        else:
            try:
                number = int(signal.Signals[name])
            except KeyError:
                raise ValueError(f"unknown signal {value!r}") from None
    else:
        raise ValueError("a signal is a name (SIGTERM, TERM, SIGRTMIN+2) or a number")
    if number not in signal.valid_signals():
        raise ValueError(f"signal {value!r} is not valid here")
    return number
