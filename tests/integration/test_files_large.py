"""1 GiB through the agent and back: identical bytes, bounded agent memory."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import trio

from guest_agent.client import Client

SIZE = 1 << 30
CHUNK = 1 << 20
# The agent may not hold more than a few windows' worth of data, whatever the file size.
MAX_RSS_GROWTH = 150 << 20


@pytest.mark.slow
async def test_one_gib_round_trip_with_bounded_memory(agent_process, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    proc = agent_process()
    agent = psutil.Process(proc.proc.pid)
    path = str(short_tmp / "big.bin")
    block = os.urandom(CHUNK)
    sent = hashlib.sha256()
    received = hashlib.sha256()
    peak = 0

    async def source() -> AsyncIterator[bytes]:
        for i in range(SIZE // CHUNK):
            # Every chunk differs, so a misplaced chunk changes the digest.
            chunk = i.to_bytes(8, "big") + block[8:]
            sent.update(chunk)
            yield chunk

    async def watch_memory() -> None:
        nonlocal peak
        while True:
            peak = max(peak, agent.memory_info().rss)
            await trio.sleep(0.02)

    async with Client.connect(proc.address) as client:
        await client.ping()
        baseline = agent.memory_info().rss
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_memory)
            started = time.perf_counter()
            result = await client.write_file(path, source())
            wrote = time.perf_counter() - started
            started = time.perf_counter()
            read = await client.read_file_into(path, received.update)
            read_time = time.perf_counter() - started
            nursery.cancel_scope.cancel()
    assert result["bytes"] == SIZE and read == {"size": SIZE, "bytes": SIZE}
    assert received.hexdigest() == sent.hexdigest()
    growth = peak - baseline
    print(
        f"\n1 GiB: write {SIZE / wrote / 2**20:.0f} MiB/s, read {SIZE / read_time / 2**20:.0f} "
        f"MiB/s; agent RSS {baseline / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB"
    )
    assert growth < MAX_RSS_GROWTH, f"agent RSS grew by {growth / 2**20:.0f} MiB"
