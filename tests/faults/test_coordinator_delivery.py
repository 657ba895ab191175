"""The coordinator's delivery guarantees against a real coordinator process: step watermarks
(ack through a step, durably, idempotently), taking over a dead consumer's leases, setting aside
items that are delivered again and again or that the consumer rejects (dead-letter, counted),
and a client that rides out an outage longer than its old retries."""

from __future__ import annotations

import asyncio
import logging

import pytest
from _coord_procs import CoordinatorProcess, attempts_of, make_items

from mrlx_plugin.core.retry import async_wait_until
from mrlx_plugin.link.client import CoordinatorClient, CoordinatorError


@pytest.fixture
def coord(start_coordinator):
    """coord(*flags): a started coordinator with these extra flags."""
    return lambda *extra: start_coordinator(extra=extra)


def clients(coord: CoordinatorProcess) -> tuple[CoordinatorClient, CoordinatorClient]:
    return tuple(  # type: ignore[return-value]
        CoordinatorClient(coord.url, run_id=coord.run_id, agent=agent, token=coord.token, backoff_max_s=0.5)
        for agent in ("doctor", "patient")
    )


def metric(coord: CoordinatorProcess, name: str, **labels: str) -> float:
    """The sum of a /metrics series over the rows whose labels include `labels`."""
    text = coord.http("GET", "/metrics")[2].decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
    return total


def names(lease) -> list[str]:
    return [g[0].group for g in lease.groups]


def test_a_group_delivered_max_deliveries_times_is_set_aside_reported_and_counted(coord):
    coord = coord("--max-deliveries", "2")

    async def scenario():
        producer, consumer = clients(coord)
        try:
            await producer.commit(
                "patient", make_items(2, "g0", step=0) + make_items(2, "g1", step=0, start=2)
            )
            first = await consumer.lease(10, lease_s=600, wait_s=0, step=0)
            assert names(first) == ["g0", "g1"] and first.dead == []
            # The consumer dies holding the lease; its successor takes the lease over at once
            # (no waiting out 600 s) and gets the same groups again.
            assert await consumer.release() == 2
            second = await consumer.lease(10, lease_s=600, wait_s=0, step=0)
            assert names(second) == ["g0", "g1"] and all(g["redelivered"] for g in second.group_info)
            assert await consumer.release() == 2
            # Delivered twice (--max-deliveries 2) and never acknowledged: set aside, not delivered.
            third = await consumer.lease(10, lease_s=600, wait_s=0, step=0)
            assert third.groups == [] and [d["group"] for d in third.dead] == ["g0", "g1"]
            assert all(d["size"] == 2 and d["step"] == 0 and "2 times" in d["reason"] for d in third.dead)
            # Reported again to whoever asks for that step (a consumer restarted after the report).
            again = await consumer.lease(10, lease_s=600, wait_s=0, step=0)
            assert [d["group"] for d in again.dead] == ["g0", "g1"] and again.groups == []
            info = await consumer.queue_info()
            assert (info["queued_items"], info["leased_items"], info["dead_items"]) == (0, 0, 4), info
            # Kept by key: committing them again queues nothing.
            repeat = await producer.commit(
                "patient", make_items(2, "g0", step=0) + make_items(2, "g1", step=0, start=2)
            )
            assert (repeat.accepted, repeat.duplicates) == (0, 4)
        finally:
            await producer.close()
            await consumer.close()

    asyncio.run(scenario())
    assert (
        metric(coord, "mrlx_coordinator_items_dead_lettered_total", consumer="patient", reason="deliveries")
        == 4
    )
    assert metric(coord, "mrlx_coordinator_queue_dead_items", consumer="patient") == 4


def test_a_rejected_group_is_set_aside_at_once_with_its_reason(coord):
    coord = coord()

    async def scenario():
        producer, consumer = clients(coord)
        try:
            await producer.commit(
                "patient", make_items(2, "g0", step=3) + make_items(2, "g1", step=3, start=2)
            )
            lease = await consumer.lease(10, lease_s=600, wait_s=0, step=3)
            assert names(lease) == ["g0", "g1"]
            answer = await consumer.reject("g0", "token id 400 is outside the vocabulary (384 ids)")
            assert answer["items"] == 2 and answer["already"] is False
            assert (await consumer.reject("g0", "again"))["already"] is True  # idempotent
            await consumer.release()
            after = await consumer.lease(10, lease_s=600, wait_s=0, step=3)
            assert names(after) == ["g1"]
            assert [(d["group"], d["reason"]) for d in after.dead] == [
                ("g0", "token id 400 is outside the vocabulary (384 ids)")
            ]
            with pytest.raises(CoordinatorError) as unknown:
                await consumer.reject("no-such-group", "x")
            assert unknown.value.status == 404
        finally:
            await producer.close()
            await consumer.close()

    asyncio.run(scenario())
    assert (
        metric(coord, "mrlx_coordinator_items_dead_lettered_total", consumer="patient", reason="rejected")
        == 2
    )


def test_ack_through_a_step_is_durable_idempotent_and_drops_late_items_of_acked_steps(coord):
    coord = coord()

    async def first_life():
        producer, consumer = clients(coord)
        try:
            await producer.commit(
                "patient",
                make_items(2, "g0", step=0)
                + make_items(2, "g1", step=1, start=2)
                + make_items(2, "g2", step=2, start=4),
            )
            held = await consumer.lease(10, lease_s=600, wait_s=0, step=1)
            assert names(held) == ["g1"]
            # Through step 1: the queued group of step 0 and the leased one of step 1.
            done = await consumer.ack_through(1)
            assert (done["through_step"], done["acked_groups"], done["acked_items"]) == (1, 2, 4)
            assert (await consumer.ack_through(1))["acked_items"] == 0  # idempotent
            assert (await consumer.ack_through(0))["through_step"] == 1  # a watermark never goes back
            assert (await consumer.ack(held.lease_id))["already_acked"] is True  # the lease is done too
        finally:
            await producer.close()
            await consumer.close()

    asyncio.run(first_life())
    coord.kill()
    coord.start(same_port=True)

    async def second_life():
        producer, consumer = clients(coord)
        try:
            info = await consumer.queue_info()
            assert (info["queued_items"], info["acked_through"]) == (2, 1), info
            # An item of a step the consumer has acknowledged through arrives late (its producer
            # re-ran the step): remembered by key, never queued, never delivered.
            late = await producer.commit("patient", make_items(1, "g1-late", step=1, start=10))
            assert (late.accepted, late.stale) == (0, 1)
            assert (await consumer.queue_info())["queued_items"] == 2
            assert (await consumer.lease(10, lease_s=600, wait_s=0, step=1)).groups == []
            assert names(await consumer.lease(10, lease_s=600, wait_s=0, step=2)) == ["g2"]
        finally:
            await producer.close()
            await consumer.close()

    asyncio.run(second_life())


@pytest.mark.slow
def test_a_client_call_rides_out_an_outage_longer_than_its_old_retries(coord, caplog):
    coord = coord()
    caplog.set_level(logging.WARNING)

    async def scenario():
        _, consumer = clients(coord)
        attempts = attempts_of(consumer)
        try:
            await asyncio.get_running_loop().run_in_executor(None, coord.kill)
            call = asyncio.ensure_future(consumer.heartbeat())
            # 15 attempts: past the 8 retries after which the client used to give up.
            await async_wait_until(
                lambda: call.done() or attempts() >= 15,
                120,
                what="the call retrying against the dead coordinator",
            )
            assert not call.done(), f"the call gave up during the outage: {call.exception()!r}"
            await asyncio.get_running_loop().run_in_executor(None, lambda: coord.start(same_port=True))
            assert (await asyncio.wait_for(call, 120))["agent"] == "patient"
        finally:
            await consumer.close()

    asyncio.run(scenario())
    waited = [r.getMessage() for r in caplog.records if "coordinator unreachable for" in r.getMessage()]
    assert waited and "/heartbeat" in waited[0], [r.getMessage() for r in caplog.records]
