"""Processes killed mid-run: the coordinator, the consumer job, the producer job.

Every test runs two agent jobs (real trainer processes), two engines and a coordinator, kills
one of them with SIGKILL at a chosen point, and checks that nothing is lost, nothing is trained
twice, and nothing waits forever.
"""

from __future__ import annotations

import socket

import pytest
from _twojobs import TwoJobs

from mrlx_plugin.core.retry import wait_until
from mrlx_plugin.local.model import ensure_model

pytestmark = pytest.mark.slow  # two agent jobs end to end, each test minutes


def refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault-models")
    return ensure_model(root / "a", preset="tiny", seed=3), ensure_model(
        root / "b", preset="tiny", seed=4, vocab_size=384
    )


@pytest.fixture
def jobs(models, tmp_path):
    run = TwoJobs(tmp_path, *models)
    yield run
    run.stop()


def test_coordinator_killed_mid_step_and_restarted_loses_and_repeats_nothing(jobs):
    jobs.steps = 5
    jobs.start_services()
    jobs.start_job("b")
    jobs.start_job("a")
    # Kill the coordinator once A has finished its first step, while the next is under way.
    wait_until(lambda: len(jobs.rows("a", "metrics.jsonl")) >= 1, deadline=120, details=jobs.logs)
    jobs.coordinator.kill()
    # Back as soon as the old one is observably gone, not after a fixed downtime: the jobs' calls
    # meet the dead address while the new process starts, and a downtime that grows with a loaded
    # machine's slow restart only risks outlasting the retries of the jobs' coordinator calls.
    wait_until(
        lambda: refuses_connections(jobs.coord_port),
        deadline=30,
        what="the killed coordinator's port to refuse connections",
        details=jobs.logs,
    )
    jobs.coordinator = jobs.start_coordinator()  # same database, same port
    assert jobs.wait("b") == 0, jobs.log("b")
    assert jobs.wait("a") == 0, jobs.log("a")
    jobs.assert_b_trained_every_episode_once()
    queue = jobs.queue()
    assert queue["queued_items"] == 0 and queue["leased_items"] == 0  # everything delivered and acknowledged


def test_consumer_killed_after_leasing_gets_its_groups_again_and_trains_them_once(jobs):
    # B trains slowly (many PPO epochs), so it is killed while it holds a lease and before it acks.
    jobs.coordinator_settings = "max_staleness: 1, wait_deadline_s: 120, lease_s: 3"
    jobs.b_trainer_settings = "lr: 0.001, ppo_epochs: 400"
    jobs.start_services()
    b = jobs.start_job("b")
    jobs.start_job("a")
    wait_until(lambda: jobs.queue()["leased_items"] > 0, deadline=120, details=jobs.logs)
    b.kill()
    b.wait(10)
    leased = jobs.queue()["leased_items"]
    assert leased > 0  # the dead consumer's groups are out on a lease nobody will ack
    jobs.b_trainer_settings = "lr: 0.001"
    jobs.start_job("b", "--resume")  # the same job, restarted from its last checkpoint
    assert jobs.wait("b") == 0, jobs.log("b")
    assert jobs.wait("a") == 0, jobs.log("a")
    jobs.assert_b_trained_every_episode_once()


def test_producer_killed_mid_step_ends_the_consumers_wait_with_a_message(jobs):
    # Steps of these tiny models take ~0.1 s: enough of them that A is still running when killed.
    jobs.steps = 40
    jobs.coordinator_settings = "max_staleness: 1, wait_deadline_s: 6, lease_s: 30"
    jobs.start_services()
    b = jobs.start_job("b")
    a = jobs.start_job("a")
    wait_until(lambda: len(jobs.rows("a", "metrics.jsonl")) >= 1, deadline=120, details=jobs.logs)
    a.kill()
    code = b.wait(timeout=120)  # bounded: the wait ends at its deadline, it does not hang
    assert code != 0
    log = jobs.log("b")
    assert "groups in 6s" in log and "'a' last seen" in log, log
    assert len(jobs.rows("b", "metrics.jsonl")) < jobs.steps
