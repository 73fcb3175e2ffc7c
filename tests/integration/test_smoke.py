from guest_agent.client import Client


async def test_ping_and_info(agent: str) -> None:
    async with Client.connect(agent) as client:
        await client.ping()
        info = await client.info()
    assert info["capabilities"] == ["exec", "file", "system"]
    assert info["protocol"] == [1, 0]


def test_ctl_ping(agent_process, ctl) -> None:  # type: ignore[no-untyped-def]
    proc = agent_process()
    result = ctl(proc.address, "ping")
    assert result.returncode == 0, result.stderr
    assert b"pong" in result.stdout
