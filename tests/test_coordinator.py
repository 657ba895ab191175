"""The coordinator service, as a real process on 127.0.0.1: queues, leases and acks, validation,
auth, limits, durability across SIGKILL, the version barrier and end-of-stream."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from _coord_procs import CoordinatorProcess, error_of, make_items, waits_in_progress

from mrlx_plugin.core.host import Sample
from mrlx_plugin.core.retry import async_wait_until
from mrlx_plugin.link.client import CoordinatorClient, CoordinatorError, CoordinatorWaitTimeout
from mrlx_plugin.link.codec import sample_from_item
from mrlx_plugin.link.wire import CONTENT_TYPE, QueueItem, encode_items

COMMIT = "/v1/runs/run1/queues/patient/commit"


def clients(coord: CoordinatorProcess) -> tuple[CoordinatorClient, CoordinatorClient]:
    """(producer doctor, consumer patient)."""
    return tuple(  # type: ignore[return-value]
        CoordinatorClient(coord.url, run_id=coord.run_id, agent=agent, token=coord.token, max_retries=2)
        for agent in ("doctor", "patient")
    )


def run(coro):
    return asyncio.run(coro)


def frame_post(coord: CoordinatorProcess, items: list[QueueItem], path: str = COMMIT, **kwargs):
    return coord.http("POST", path, encode_items(items), headers={"Content-Type": CONTENT_TYPE}, **kwargs)


def test_round_trip_preserves_ids_masks_and_log_probs(start_coordinator):
    coord = start_coordinator()
    sent = make_items(3, "step0:g0") + make_items(2, "step0:g1", start=3)

    async def scenario():
        producer, consumer = clients(coord)
        result = await producer.commit("patient", sent)
        assert (result.accepted, result.duplicates) == (5, 0)
        lease = await consumer.lease(max_groups=10, lease_s=60, wait_s=1)
        assert lease.lease_id and not lease.end
        assert [[item.key for item in group] for group in lease.groups] == [
            ["ep0:patient", "ep1:patient", "ep2:patient"],
            ["ep3:patient", "ep4:patient"],
        ]
        got = [item for group in lease.groups for item in group]
        for mine, theirs in zip(sent, got):
            assert theirs.tokens == mine.tokens and all(type(t) is int for t in theirs.tokens)
            assert theirs.loss_mask == mine.loss_mask
            # log-probs travel as float32: exactly the float32 nearest to what was sent
            assert theirs.rollout_log_probs == np.asarray(mine.rollout_log_probs, dtype=np.float32).tolist()
            assert theirs.response_length == mine.response_length
            assert theirs.fields == mine.fields
            assert (theirs.group, theirs.group_size, theirs.producer, theirs.step) == (
                mine.group,
                mine.group_size,
                "doctor",
                0,
            )
        sample = sample_from_item(got[0])
        assert isinstance(sample, Sample) and sample.status == Sample.Status.COMPLETED
        assert sample.tokens == sent[0].tokens and sample.prompt == sent[0].fields["prompt"]
        assert (await consumer.ack(lease.lease_id))["acked_items"] == 5
        assert (await consumer.queue_info())["queued_items"] == 0
        await producer.close()
        await consumer.close()

    run(scenario())


def test_recommit_is_a_duplicate_before_and_after_ack(start_coordinator):
    coord = start_coordinator()
    items = make_items(2, "g0")

    async def scenario():
        producer, consumer = clients(coord)
        assert (await producer.commit("patient", items)).accepted == 2
        again = await producer.commit("patient", items)
        assert (again.accepted, again.duplicates, sorted(again.duplicate_keys)) == (
            0,
            2,
            ["ep0:patient", "ep1:patient"],
        )
        lease = await consumer.lease(10, 60, 0)
        assert [len(g) for g in lease.groups] == [2]  # one copy, not two
        await consumer.ack(lease.lease_id)
        assert (await producer.commit("patient", items)).duplicates == 2
        assert (await consumer.lease(10, 60, 0)).groups == []  # acked keys never come back
        await producer.close()
        await consumer.close()

    run(scenario())


def test_lease_expiry_redelivers_whole_groups_and_ack_stops_it(start_coordinator):
    coord = start_coordinator()

    async def scenario():
        producer, consumer = clients(coord)
        await producer.commit("patient", make_items(3, "g0"))
        # Long enough that the next call comes before it expires however loaded the machine; the
        # long poll after it returns as soon as it has expired.
        first = await consumer.lease(10, lease_s=2.0, wait_s=0)
        assert [len(g) for g in first.groups] == [3]
        assert (await consumer.lease(10, 60, 0)).groups == []  # still leased
        second = await consumer.lease(10, lease_s=60, wait_s=30)  # wakes when the first lease expires
        assert [[i.key for i in g] for g in second.groups] == [["ep0:patient", "ep1:patient", "ep2:patient"]]
        assert second.group_info[0]["redelivered"] is True
        with pytest.raises(CoordinatorError) as stale:
            await consumer.ack(first.lease_id)
        assert stale.value.status == 409 and "delivered again" in str(stale.value)
        assert (await consumer.ack(second.lease_id))["acked_groups"] == 1
        assert (await consumer.ack(second.lease_id))["already_acked"] is True
        assert (await consumer.lease(10, 60, 0)).groups == []
        await producer.close()
        await consumer.close()

    run(scenario())


def test_extend_keeps_a_lease(start_coordinator):
    coord = start_coordinator()

    async def scenario():
        producer, consumer = clients(coord)
        await producer.commit("patient", make_items(1, "g0"))
        lease = await consumer.lease(1, lease_s=0.4, wait_s=0)
        assert await consumer.extend(lease.lease_id, 60) > 50
        # Past the lease's first expiry however slow the machine (it was granted before this
        # sleep began); the extended one is 60 s away.
        await asyncio.sleep(0.6)
        assert (await consumer.lease(1, 60, 0)).groups == []  # not redelivered: the lease was kept
        await consumer.ack(lease.lease_id)
        with pytest.raises(CoordinatorError) as done:
            await consumer.extend(lease.lease_id, 60)
        assert done.value.status == 409
        await producer.close()
        await consumer.close()

    run(scenario())


def test_incomplete_group_waits_until_complete_or_sealed(start_coordinator):
    coord = start_coordinator()

    async def scenario():
        producer, consumer = clients(coord)
        await producer.commit("patient", make_items(2, "g0", group_size=3))
        waited = await consumer.lease(10, 60, wait_s=0.2)
        assert waited.groups == [] and not waited.end
        assert "1 incomplete groups" in waited.message and "'doctor' last seen" in waited.message
        await producer.commit("patient", make_items(1, "g0", group_size=3, start=2))
        assert [len(g) for g in (await consumer.lease(10, 60, 0)).groups] == [3]

        await producer.commit("patient", make_items(2, "g1", group_size=4, start=10))
        assert (await consumer.lease(10, 60, 0)).groups == []
        with pytest.raises(CoordinatorError) as too_small:
            await producer.seal("patient", "g1", 1)
        assert too_small.value.status == 422 and "already holds 2" in str(too_small.value)
        with pytest.raises(CoordinatorError) as unknown:
            await producer.seal("patient", "nope", 1)
        assert unknown.value.status == 404
        assert await producer.seal("patient", "g1", 2) is True
        assert [[i.key for i in g] for g in (await consumer.lease(10, 60, 0)).groups] == [
            ["ep10:patient", "ep11:patient"]
        ]
        with pytest.raises(CoordinatorError) as over:
            await producer.commit("patient", make_items(1, "g1", group_size=4, start=12))
        assert over.value.status == 422 and "sealed at 2" in str(over.value)
        await producer.close()
        await consumer.close()

    run(scenario())


def test_backpressure_429_at_max_depth_writes_nothing(start_coordinator):
    coord = start_coordinator(extra=["--max-depth", "4"])

    async def fill():
        producer, _ = clients(coord)
        assert (await producer.commit("patient", make_items(4, "g0"))).accepted == 4
        await producer.close()

    run(fill())
    status, headers, body = frame_post(coord, make_items(2, "g1", start=4))
    assert status == 429 and headers.get("Retry-After") == "1"
    assert "maximum depth 4" in error_of(body)
    status, _, body = frame_post(coord, make_items(4, "g0"))  # duplicates only: no room needed
    assert status == 200 and json.loads(body)["duplicates"] == 4
    status, _, body = coord.http("GET", "/v1/runs/run1/queues/patient")
    assert json.loads(body)["queued_items"] == 4


def test_auth_health_metrics_and_openapi(start_coordinator):
    coord = start_coordinator()
    status, _, body = coord.http("GET", "/health")
    assert status == 200 and json.loads(body)["run_id"] == "run1" and json.loads(body)["status"] == "ok"
    for token in (None, "wrong"):
        status, headers, body = coord.http("GET", "/v1/runs/run1/agents/doctor/version", token=token)
        assert status == 401 and "signed" in error_of(body) and "Mrlx-HMAC" in headers["WWW-Authenticate"]
        assert frame_post(coord, make_items(1, "g0"), token=token)[0] == 401
        assert coord.http("GET", "/metrics", token=token)[0] == 401
    assert coord.http("GET", "/v1/runs/run1", token=None)[0] == 401

    async def traffic():
        producer, consumer = clients(coord)
        await producer.commit("patient", make_items(2, "g0"))
        await producer.commit("patient", make_items(2, "g0"))
        await producer.report_version(7)
        await consumer.ack((await consumer.lease(1, 60, 0)).lease_id)
        await producer.close()
        await consumer.close()

    run(traffic())
    status, _, body = coord.http("GET", "/metrics")
    text = body.decode()
    assert status == 200
    for line in (
        'mrlx_coordinator_items_enqueued_total{consumer="patient"} 2',
        'mrlx_coordinator_items_duplicate_total{consumer="patient"} 2',
        'mrlx_coordinator_items_acked_total{consumer="patient"} 2',
        'mrlx_coordinator_agent_version{agent="doctor"} 7',
        'mrlx_coordinator_queue_items{consumer="patient",state="queued"} 0',
        'mrlx_coordinator_requests_total{endpoint="commit",status="200"} 2',
    ):
        assert line in text, line
    assert "# TYPE mrlx_coordinator_queue_oldest_item_age_seconds gauge" in text
    status, _, body = coord.http("GET", "/openapi.json", token=None)
    paths = json.loads(body)["paths"]
    assert status == 200 and "/v1/runs/{run}/queues/{consumer}/lease" in paths
    assert "/v1/runs/{run}/agents/{agent}/wait_version" in paths


def test_openapi_document_lists_every_route():
    from mrlx_plugin.coordinator.config import CoordinatorConfig
    from mrlx_plugin.coordinator.openapi import openapi_document
    from mrlx_plugin.coordinator.service import Coordinator
    from mrlx_plugin.coordinator.storage import LoadedState

    app = Coordinator(
        CoordinatorConfig(db="unused", run_id="r", agents=["a"]), None, LoadedState()
    ).build_app()  # type: ignore[arg-type]
    served = {
        (route.method, route.resource.canonical) for route in app.router.routes() if route.method != "HEAD"
    }
    documented = {
        (method.upper(), path) for path, ops in openapi_document()["paths"].items() for method in ops
    }
    assert served == documented


def test_request_over_the_size_limit_is_413(start_coordinator):
    coord = start_coordinator(extra=["--max-request-mb", "0.5"])
    big = make_items(1, "g0", tokens=200_000)  # ~1.2 MB frame
    status, _, body = frame_post(coord, big)
    assert status == 413 and "--max-request-mb" in error_of(body)
    assert json.loads(coord.http("GET", "/v1/runs/run1/queues/patient")[2])["queued_items"] == 0


def test_bad_input_is_422_or_404_and_writes_nothing(start_coordinator):
    coord = start_coordinator()
    good = make_items(2, "g0")
    short_mask = make_items(1, "g0", start=2)[0]
    short_mask.loss_mask = short_mask.loss_mask[:-1]
    status, _, body = frame_post(coord, [*good, short_mask])
    assert status == 422 and "'ep2:patient'" in error_of(body) and "loss_mask" in error_of(body)
    bad_log_probs = make_items(1, "g0", start=3)[0]
    bad_log_probs.rollout_log_probs = bad_log_probs.rollout_log_probs + [-0.5]
    status, _, body = frame_post(coord, [bad_log_probs])
    assert status == 422 and "rollout_log_probs" in error_of(body) and "'ep3:patient'" in error_of(body)
    positive = make_items(1, "g0", start=4)[0]
    positive.rollout_log_probs = [0.5] * positive.response_length
    assert "positive" in error_of(frame_post(coord, [positive])[2])
    # Finite float32 but no model's output: a trainer's loss over it would be infinite.
    tiny = make_items(1, "g0", start=5)[0]
    tiny.rollout_log_probs = [-1e30] * tiny.response_length
    status, _, body = frame_post(coord, [tiny])
    assert status == 422 and "below -10000" in error_of(body) and "'ep5:patient'" in error_of(body)
    nan_reward = make_items(1, "g0", start=5)[0]
    nan_reward.fields["reward"] = float("nan")
    assert "reward" in error_of(frame_post(coord, [nan_reward])[2])
    stranger = make_items(1, "g0", start=6, producer="stranger")
    status, _, body = frame_post(coord, stranger)
    assert status == 422 and "'stranger'" in error_of(body)
    status, _, body = frame_post(coord, good, path="/v1/runs/run1/queues/nobody/commit")
    assert status == 404 and "unknown consumer 'nobody'" in error_of(body)
    status, _, body = frame_post(coord, good, path="/v1/runs/other-run/queues/patient/commit")
    assert status == 404 and "not 'other-run'" in error_of(body)
    status, _, body = coord.http("POST", COMMIT, b"not a frame at all")
    assert status == 422 and "magic" in error_of(body)
    # nothing of the rejected batches was written
    assert json.loads(coord.http("GET", "/v1/runs/run1/queues/patient")[2])["queued_items"] == 0

    lease = "/v1/runs/run1/queues/patient/lease"
    status, _, body = coord.http("POST", lease, {"max_groups": 1, "surprise": True})
    assert status == 422 and "unknown fields ['surprise']" in error_of(body)
    status, _, body = coord.http("POST", lease, {"max_groups": "1"})
    assert status == 422 and "'max_groups' must be an int" in error_of(body)
    status, _, body = coord.http("POST", "/v1/runs/run1/agents/doctor/version", {"version": True})
    assert status == 422
    status, _, body = coord.http(
        "POST", "/v1/runs/run1/agents/doctor/version", b"{", headers={"Content-Type": "application/json"}
    )
    assert status == 422 and "not valid JSON" in error_of(body)
    status, _, body = coord.http("GET", "/v1/runs/run1/agents/ghost/version")
    assert status == 404 and "unknown agent 'ghost'" in error_of(body)


def test_sigkill_and_restart_loses_nothing(start_coordinator):
    coord = start_coordinator()

    async def before():
        producer, consumer = clients(coord)
        for name, start in (("A", 0), ("B", 2), ("C", 4)):
            await producer.commit("patient", make_items(2, name, start=start))
        await producer.report_version(3)
        acked = await consumer.lease(1, 60, 0)
        assert [g[0].group for g in acked.groups] == ["A"]
        await consumer.ack(acked.lease_id)
        # Outlives the SIGKILL and the restart below (seconds on a loaded machine): B must still
        # be leased when the restarted coordinator is first asked.
        held = await consumer.lease(1, lease_s=5.0, wait_s=0)
        assert [g[0].group for g in held.groups] == ["B"]
        await producer.close()
        await consumer.close()
        return held.groups[0]

    held = run(before())
    coord.kill()
    coord.start(same_port=True)

    async def after():
        producer, consumer = clients(coord)
        assert await producer.get_version("doctor") == 3
        assert (await producer.commit("patient", make_items(2, "A"))).duplicates == 2  # acked keys remembered
        now = await consumer.lease(10, 60, 0)
        assert [g[0].group for g in now.groups] == ["C"]  # A is acked, B is still leased
        later = await consumer.lease(10, 60, wait_s=30)  # B's lease expires (wall clock, kept in the file)
        assert [[i.key for i in g] for g in later.groups] == [[i.key for i in held]]
        assert later.groups[0][0].tokens == held[0].tokens
        await consumer.ack(now.lease_id)
        await consumer.ack(later.lease_id)
        assert (await consumer.lease(10, 60, 0)).groups == []
        await producer.close()
        await consumer.close()

    run(after())


def test_wait_version_wakes_on_report_and_times_out_naming_the_agent(start_coordinator):
    coord = start_coordinator()

    async def scenario():
        producer, consumer = clients(coord)
        await producer.report_version(1)
        waiter = asyncio.ensure_future(consumer.wait_version("doctor", 2, deadline_s=30))
        await async_wait_until(
            lambda: waits_in_progress(coord, "version") >= 1,
            30,
            what="the waiter's long poll at the coordinator",
        )
        assert not waiter.done()
        assert await producer.report_version(2) == 2
        assert await asyncio.wait_for(waiter, 10) == 2
        assert await producer.report_version(1) == 2  # lower versions are ignored, not an error
        with pytest.raises(CoordinatorWaitTimeout) as late:
            await consumer.wait_version("doctor", 5, deadline_s=0.3)
        message = str(late.value)
        assert "agent 'doctor' is at version 2, waiting for >= 5" in message and "last seen" in message
        assert "pid" in message
        with pytest.raises(CoordinatorWaitTimeout) as never:
            await producer.wait_version("patient", 1, deadline_s=0.2)
        assert "agent 'patient' has reported no version yet" in str(never.value)
        await producer.close()
        await consumer.close()

    run(scenario())


def test_end_of_stream(start_coordinator):
    coord = start_coordinator()

    async def scenario():
        producer, consumer = clients(coord)
        await producer.commit("patient", make_items(2, "g0", group_size=3))
        assert await producer.end_stream("patient") == 1  # the short group is sealed as it is
        lease = await consumer.lease(10, 60, 0)
        assert [len(g) for g in lease.groups] == [2] and not lease.end
        assert (await consumer.lease(10, 60, 0)).end is False  # a lease is out: items may come back
        await consumer.ack(lease.lease_id)
        started = time.monotonic()
        assert (await consumer.lease(10, 60, wait_s=20)).end is True
        assert time.monotonic() - started < 10  # answered at once, not after the wait
        with pytest.raises(CoordinatorError) as closed:
            await producer.commit("patient", make_items(1, "g9", start=9))
        assert closed.value.status == 409 and "ended" in str(closed.value)
        await producer.close()
        await consumer.close()

    run(scenario())


def test_database_full_is_507_and_recovers(start_coordinator):
    coord = start_coordinator(extra=["--max-db-mb", "1"])

    async def scenario():
        producer, consumer = clients(coord)
        producer.commit_deadline_s = 5
        committed = 0
        with pytest.raises(CoordinatorError) as full:
            for start in range(0, 400, 2):
                await producer.commit("patient", make_items(2, f"g{start}", start=start, tokens=4000))
                committed += 2
        assert full.value.status == 507 and "full" in str(full.value)
        assert (await consumer.queue_info())["queued_items"] == committed  # reads still work
        lease = await consumer.lease(1000, 60, 0)
        await consumer.ack(lease.lease_id)  # frees the records' pages
        assert (
            await producer.commit("patient", make_items(2, "again", start=1000, tokens=4000))
        ).accepted == 2
        await producer.close()
        await consumer.close()

    run(scenario())


def test_refuses_public_address_without_token_and_other_runs_database(tmp_path, start_coordinator):
    import subprocess
    import sys

    from _coord_procs import REPO

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "mrlx_plugin.coordinator.server", "--db", str(tmp_path / "c.sqlite")]
    argv += ["--agents", "a,b", "--token-env", "MRLX_TEST_NO_SUCH_VAR", "--port", "0"]
    out = subprocess.run(
        [*argv, "--run-id", "r1", "--host", "0.0.0.0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and "without a token" in out.stderr
    coord = start_coordinator(run_id="r1", agents=("a", "b"), token=None)
    coord.stop()
    out = subprocess.run(
        [*argv[:4], str(coord.db), *argv[5:], "--run-id", "r2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and "belongs to run 'r1'" in out.stderr
