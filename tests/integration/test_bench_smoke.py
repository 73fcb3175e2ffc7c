"""`python -m bench.run --quick`: the harness runs, cleans up and writes its table and JSON.

A smoke check only: it never asserts a speed. Peers that cannot be installed here are
reported as skipped, which is fine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench.procs import CGROUP2_MOUNT
from bench.run import BENCHMARKS

REPO = Path(__file__).resolve().parents[2]
# Only turns a hang into a failure (the quick run takes ~15 s, plus apt on a fresh machine).
HANG_TIMEOUT = 110


@pytest.mark.timeout(HANG_TIMEOUT + 10)
def test_quick_bench_runs_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.run", "--quick", "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = proc.communicate(timeout=HANG_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr.decode(errors="replace")[-4000:]

    table = (out / "latest.md").read_text()
    assert "| comparison | side | median |" in table
    assert "| target | measured | met |" in table
    assert table in stdout.decode()
    data = json.loads((out / "latest.json").read_text())
    assert data["quick"] is True
    comparisons = {c["key"]: c for c in data["comparisons"]}
    expected = {"spawn", "startup", "idle_rss", "exec", "stream", "file_read", "file_write"}
    assert expected | {"concurrency"} <= set(comparisons)
    assert set(BENCHMARKS) <= {key.split("_")[0] for key in comparisons} | {"files"}
    for comparison in comparisons.values():
        for side in comparison["sides"]:
            if side["role"] == "agent":
                assert side["skipped"] is None, (comparison["key"], side)
                assert side["samples"], (comparison["key"], side["name"])
            if side["skipped"] is None:
                # Any number will do (a quick run's RSS growth can even be negative).
                assert math.isfinite(side["summary"]["median"]), (comparison["key"], side)
            elif side["role"] == "floor":
                # Only the C floor may be missing, on a machine where gcc cannot be installed.
                assert "compiler" in side["skipped"], side
        assert comparison["targets"] or comparison["key"] == "spawn"

    # Everything the harness started is gone: its exec cgroups and its temp directories.
    assert not (CGROUP2_MOUNT / f"ga-bench-{proc.pid}").exists()
    for workdir in data["workdirs"]:
        assert not Path(workdir).exists(), workdir
    leftovers = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if any(w in " ".join(p.info["cmdline"] or ()) for w in data["workdirs"])
    ]
    assert not leftovers
