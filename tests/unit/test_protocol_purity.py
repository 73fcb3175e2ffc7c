"""The protocol package is sans-IO: it imports no trio, socket or os (design.md, section 2)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import guest_agent.protocol

PACKAGE_DIR = Path(guest_agent.protocol.__file__).parent
# Nothing that does I/O or runs an event loop; msgpack and pure stdlib helpers are fine.
FORBIDDEN = {
    "trio", "socket", "os", "asyncio", "anyio", "select", "selectors", "subprocess",
    "threading", "io", "pathlib", "shutil", "signal", "sys",
}  # fmt: skip


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every absolute import in a module, at any nesting level."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            names.add("__import__")
    return names


def test_protocol_modules_import_nothing_that_does_io() -> None:
    modules = sorted(PACKAGE_DIR.glob("*.py"))
    assert len(modules) >= 4
    for path in modules:
        assert not imported_modules(path) & (FORBIDDEN | {"__import__", "importlib"}), path


def test_importing_the_protocol_loads_no_io_modules() -> None:
    # A fresh interpreter: the test process itself has imported trio long ago.
    code = (
        "import sys\n"
        "import guest_agent.protocol\n"
        "print(' '.join(sorted(m for m in ('trio', 'socket', 'asyncio', 'selectors', "
        "'subprocess', 'threading') if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "", out.stdout
