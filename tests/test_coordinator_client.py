"""The coordinator's async client against a real coordinator process: retries across a restart
and under backpressure, errors that must not be retried, wait timeouts, and its small helpers."""

from __future__ import annotations

import asyncio
import json

import pytest
from _coord_procs import CoordinatorProcess, attempts_of, make_items, waits_in_progress

from mrlx_plugin.core.netutil import free_port
from mrlx_plugin.core.retry import async_wait_until
from mrlx_plugin.link.auth import token_from_env_or_file
from mrlx_plugin.link.client import (
    CoordinatorClient,
    CoordinatorError,
    CoordinatorUnavailable,
    CoordinatorWaitTimeout,
)


@pytest.fixture
def coord(start_coordinator):
    """A coordinator the test starts (and restarts) itself."""
    return start_coordinator(start=False)


def client(coord: CoordinatorProcess, agent: str, **kwargs) -> CoordinatorClient:
    kwargs.setdefault("token", coord.token)
    return CoordinatorClient(coord.url, run_id=coord.run_id, agent=agent, backoff_max_s=0.5, **kwargs)


def requests_seen(coord: CoordinatorProcess, endpoint: str, status: int) -> int:
    text = coord.http("GET", "/metrics")[2].decode()
    prefix = f'mrlx_coordinator_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    return sum(int(float(line[len(prefix) :])) for line in text.splitlines() if line.startswith(prefix))


def test_commit_during_downtime_succeeds_once_the_coordinator_is_back(coord):
    coord.start()
    coord.kill()

    async def scenario():
        producer = client(coord, "doctor")
        consumer = client(coord, "patient")
        attempts = attempts_of(producer)
        commit = asyncio.ensure_future(producer.commit("patient", make_items(3, "g0"), deadline_s=60))
        # a second attempt starts only once the first has failed against the dead address
        await async_wait_until(
            lambda: attempts() >= 2, 30, what="the commit retrying against the dead address"
        )
        assert not commit.done()  # still retrying against the dead address
        await asyncio.get_running_loop().run_in_executor(None, lambda: coord.start(same_port=True))
        result = await asyncio.wait_for(commit, 60)
        assert (result.accepted, result.duplicates) == (3, 0)
        lease = await consumer.lease(10, 60, 1)
        assert [len(g) for g in lease.groups] == [3]
        await producer.close()
        await consumer.close()

    asyncio.run(scenario())


def test_wait_version_rides_out_a_restart(coord):
    coord.start()

    async def scenario():
        producer = client(coord, "doctor")
        consumer = client(coord, "patient")
        await producer.report_version(1)
        attempts = attempts_of(consumer)
        waiter = asyncio.ensure_future(consumer.wait_version("doctor", 2, deadline_s=60, poll_s=1.0))
        await async_wait_until(
            lambda: waits_in_progress(coord, "version") >= 1,
            30,
            what="the waiter's long poll at the coordinator",
        )
        await asyncio.get_running_loop().run_in_executor(None, coord.kill)
        # Every attempt started from now on meets the dead address; a second one starts only
        # once the first has failed there.
        before = attempts()
        await async_wait_until(
            lambda: attempts() >= before + 2, 30, what="the waiter retrying against the dead coordinator"
        )
        await asyncio.get_running_loop().run_in_executor(None, lambda: coord.start(same_port=True))
        assert not waiter.done()
        await producer.report_version(2)
        assert await asyncio.wait_for(waiter, 30) == 2
        await producer.close()
        await consumer.close()

    asyncio.run(scenario())


def test_commit_retries_backpressure_until_the_consumer_acks(start_coordinator):
    coord = start_coordinator(extra=["--max-depth", "4"])
    try:

        async def scenario():
            producer = client(coord, "doctor")
            consumer = client(coord, "patient")
            await producer.commit("patient", make_items(4, "g0"))
            blocked = asyncio.ensure_future(
                producer.commit("patient", make_items(2, "g1", start=4), deadline_s=60)
            )
            await async_wait_until(
                lambda: requests_seen(coord, "commit", 429) >= 1,
                30,
                what="a commit refused with 429 (the queue is full)",
            )
            assert not blocked.done()
            assert requests_seen(coord, "commit", 429) >= 1
            lease = await consumer.lease(1, 60, 0)
            await consumer.ack(lease.lease_id)
            assert (await asyncio.wait_for(blocked, 30)).accepted == 2
            with pytest.raises(CoordinatorUnavailable) as full:
                await producer.commit("patient", make_items(3, "g2", start=6), deadline_s=0.5)
            assert full.value.status == 429 and "maximum depth 4" in str(full.value)
            await producer.close()
            await consumer.close()

        asyncio.run(scenario())
    finally:
        coord.stop()


def test_errors_the_caller_must_fix_are_raised_at_once(coord):
    coord.start()

    async def scenario():
        producer = client(coord, "doctor")
        bad = make_items(1, "g0")
        bad[0].loss_mask = [2] * bad[0].response_length
        with pytest.raises(CoordinatorError) as rejected:
            await producer.commit("patient", bad, deadline_s=60)
        assert rejected.value.status == 422
        assert "'ep0:patient'" in str(rejected.value) and "loss_mask holds 2" in str(rejected.value)
        assert requests_seen(coord, "commit", 422) == 1  # not retried
        intruder = client(coord, "doctor", token="not-the-token")
        with pytest.raises(CoordinatorError) as denied:
            await intruder.report_version(1)
        assert denied.value.status == 401
        with pytest.raises(CoordinatorError) as unknown:
            await producer.commit("nobody", make_items(1, "g0"))
        assert unknown.value.status == 404
        await producer.close()
        await intruder.close()

    asyncio.run(scenario())


def test_wait_timeout_names_the_agent_and_when_it_was_last_seen(coord):
    coord.start()

    async def scenario():
        patient = client(coord, "patient")
        doctor = client(coord, "doctor")
        with pytest.raises(CoordinatorWaitTimeout) as never:
            await patient.wait_version("doctor", 1, deadline_s=0.3)
        assert "agent 'doctor' has reported no version yet, waiting for >= 1; never seen" in str(never.value)
        await doctor.heartbeat()
        await doctor.report_version(4)
        with pytest.raises(CoordinatorWaitTimeout) as behind:
            await patient.wait_version("doctor", 6, deadline_s=0.3)
        message = str(behind.value)
        assert (
            "agent 'doctor' is at version 4, waiting for >= 6; last seen" in message
            and "s ago (pid" in message
        )
        await patient.close()
        await doctor.close()

    asyncio.run(scenario())


def test_unreachable_coordinator_fails_after_the_deadline_with_the_address(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    producer = CoordinatorClient(url, run_id="run1", agent="doctor", backoff_max_s=0.2)

    async def scenario():
        with pytest.raises(CoordinatorUnavailable) as down:
            await producer.commit("patient", make_items(1, "g0"), deadline_s=0.5)
        assert url in str(down.value) and "attempts" in str(down.value)
        await producer.close()

    asyncio.run(scenario())


def test_large_commit_is_cut_into_requests_and_one_client_serves_two_loops(coord):
    coord.start()
    producer = client(coord, "doctor", max_commit_bytes=64 << 10)
    consumer = client(coord, "patient")
    items = make_items(24, "big", tokens=2000)

    async def send(expected):
        result = await producer.commit("patient", items)
        assert (result.accepted, result.duplicates) == expected
        await producer.close()

    async def take():
        lease = await consumer.lease(1, 60, 1)
        # The pieces of one commit are stored concurrently: a group arrives whole, in no set order.
        got = {i.key: i for i in lease.groups[0]}
        assert sorted(got) == sorted(i.key for i in items)
        assert got[items[-1].key].tokens == items[-1].tokens
        await consumer.close()

    asyncio.run(send((24, 0)))
    assert requests_seen(coord, "commit", 200) > 3
    asyncio.run(take())  # a second event loop
    asyncio.run(send((0, 24)))  # and the first client again, on a third loop: all duplicates now
    info = json.loads(coord.http("GET", "/v1/runs/run1")[2])
    assert info["agents"]["doctor"]["pid"] is not None and info["queues"]["patient"]["leased_items"] == 24


def test_token_from_env_or_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MRLX_TEST_TOKEN", " from-env \n")
    assert token_from_env_or_file("MRLX_TEST_TOKEN", None) == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert token_from_env_or_file("MRLX_TEST_TOKEN", str(token_file)) == "from-file"
    monkeypatch.delenv("MRLX_TEST_TOKEN")
    assert token_from_env_or_file("MRLX_TEST_TOKEN", None) is None
    with pytest.raises(ValueError, match="cannot read the token file"):
        token_from_env_or_file("MRLX_TEST_TOKEN", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        token_from_env_or_file(None, str(tmp_path / "empty"))
    assert "secret" not in repr(
        CoordinatorClient("http://127.0.0.1:1", run_id="r", agent="a", token="secret")
    )
