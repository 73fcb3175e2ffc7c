"""How every command prints: a result (text, or JSON under --json) or a one-line failure."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_AGENT_ERROR = 125


def emit(args: argparse.Namespace, value: Any, text: str) -> None:
    """Print ``value`` as JSON under --json, else ``text``."""
    if args.json:
        print(json.dumps(value, indent=2, sort_keys=True, default=str))
    else:
        print(text)


def fail(message: str, code: int = EXIT_AGENT_ERROR) -> int:
    """One line on stderr, then the exit code."""
    print(f"guest-agent-ctl: {message}", file=sys.stderr)
    return code
