"""Delivery between the two jobs of a multi-model run across crashes, outages and bad items.

Every test runs the two agent jobs as real trainer processes (`tests/_twojobs.py`), two engines
and a coordinator, and checks what the README promises: B's step k trains exactly A's step k's
groups, each of A's episodes reaches B's surviving model once (resumed jobs included), a
coordinator outage of many seconds costs waiting and nothing else, an item B cannot train is set
aside (a step of ABORTED fillers of the same shape stands in for it) instead of crashing B on
every redelivery, and a queue too small for one step is refused at start-up by name.
"""

from __future__ import annotations

import asyncio
import re
import socket

import pytest
from _coord_procs import TOKEN_ENV
from _twojobs import TOKEN, TwoJobs, two_job_config

from mrlx_plugin.core.retry import wait_until
from mrlx_plugin.link.client import CoordinatorClient
from mrlx_plugin.link.wire import QueueItem
from mrlx_plugin.local.model import ensure_model

B_VOCAB = 384


def refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("delivery-models")
    return (
        ensure_model(root / "a", preset="tiny", seed=3),
        ensure_model(root / "b", preset="tiny", seed=4, vocab_size=B_VOCAB),
    )


@pytest.fixture
def jobs(models, tmp_path):
    run = TwoJobs(tmp_path, *models)
    yield run
    run.stop()


def alive(jobs: TwoJobs, *names: str) -> None:
    """Stop a wait early, with the job's log, when a job that must keep running has exited."""
    for name in names:
        code = jobs.jobs[name].poll()
        if code is not None:
            raise AssertionError(
                f"job {name} exited ({code}) where it had to keep running:\n{jobs.log(name)}"
            )


def b_is_training_a_step(jobs: TwoJobs) -> bool:
    """B has finished a step, leased the whole next one and not saved it yet: it is training it."""
    alive(jobs, "a", "b")
    done = len(jobs.rows("b", "metrics.jsonl"))
    return (
        done >= 1
        and jobs.latest_checkpoint("b") == done - 1
        and jobs.queue()["leased_items"] >= jobs.groups * jobs.per_prompt
    )


def kill(jobs: TwoJobs, name: str) -> None:
    job = jobs.jobs[name]
    if job.poll() is None:
        job.kill()
    job.wait(30)


@pytest.mark.slow
def test_jobs_resumed_after_a_crash_between_save_and_ack_train_each_step_once_and_in_step(jobs):
    """Finding 1: the coordinator dies while B trains a step; B saves that step but cannot
    acknowledge it; both jobs die and are resumed from their checkpoints. B must not train the
    saved step again, and A's last step must not be left queued."""
    jobs.steps = 4
    jobs.b_trainer_settings = "lr: 0.001, ppo_epochs: 200"  # B's steps take a while: room to act
    jobs.start_services()
    jobs.start_job("b")
    jobs.start_job("a")
    wait_until(
        lambda: b_is_training_a_step(jobs),
        deadline=300,
        what="B training its second step or later",
        details=jobs.logs,
    )
    jobs.coordinator.kill()
    # B finishes the step and saves it; what it says to the coordinator next cannot arrive.
    wait_until(
        lambda: (jobs.latest_checkpoint("b") or 0) >= len(jobs.rows("b", "metrics.jsonl")),
        deadline=300,
        what="B saving the step it trained while the coordinator was down",
        details=jobs.logs,
    )
    kill(jobs, "b")
    kill(jobs, "a")
    wait_until(
        lambda: refuses_connections(jobs.coord_port),
        deadline=30,
        what="the killed coordinator's port to refuse connections",
        details=jobs.logs,
    )
    jobs.coordinator = jobs.start_coordinator()  # same database, same port
    jobs.b_trainer_settings = "lr: 0.001"
    jobs.start_job("b", "--resume")
    jobs.start_job("a", "--resume")
    assert jobs.wait("b", 400) == 0, jobs.log("b")
    assert jobs.wait("a", 400) == 0, jobs.log("a")
    jobs.assert_b_trained_every_episode_once()
    jobs.assert_b_steps_are_a_steps()
    queue = jobs.queue()
    assert queue["queued_items"] == 0 and queue["leased_items"] == 0, queue  # A's last step too


@pytest.mark.slow
def test_consumer_resumed_before_its_lease_expires_trains_the_same_steps_within_the_staleness_bound(jobs):
    """Finding 2: B is SIGKILLed mid-step and resumed at once (its lease, 30 s, still held by the
    dead process). B's step k must train A's step k, the staleness bound must hold, and the
    resumed B takes its dead predecessor's leases over instead of waiting them out."""
    jobs.steps = 5
    jobs.b_trainer_settings = "lr: 0.001, ppo_epochs: 200"  # B's steps take a while: room to act
    jobs.start_services()
    b = jobs.start_job("b")
    jobs.start_job("a")
    wait_until(
        lambda: b_is_training_a_step(jobs),
        deadline=300,
        what="B training its second step or later",
        details=jobs.logs,
    )
    b.kill()
    b.wait(30)
    assert jobs.queue()["leased_items"] > 0  # the dead process's lease, 30 s long, still holds its step
    jobs.b_trainer_settings = "lr: 0.001"
    jobs.start_job("b", "--resume")
    assert jobs.wait("b", 400) == 0, jobs.log("b")
    assert jobs.wait("a", 400) == 0, jobs.log("a")
    jobs.assert_b_trained_every_episode_once()
    jobs.assert_b_steps_are_a_steps()
    b_rows, a_rows = jobs.rows("b", "metrics.jsonl"), jobs.rows("a", "metrics.jsonl")
    assert [r["step"] for r in b_rows] == list(range(jobs.steps))
    for rows, who in ((a_rows, "A"), (b_rows, "B")):
        over = [(r["step"], r["staleness/b"]) for r in rows if r["staleness/b"] > 1]
        assert not over, f"{who}'s steps over max_staleness 1 (step, staleness/b): {over}"
    resumed = next(r for r in b_rows if r.get("resumed_from"))
    assert resumed.get("coordinator/leases_taken_over", 0) >= 1, resumed


def unreachable_seconds(log: str) -> float:
    """The longest time a job's log says it has been waiting for the coordinator."""
    found = [float(x) for x in re.findall(r"coordinator unreachable for (\d+(?:\.\d+)?) s", log)]
    return max(found, default=0.0)


@pytest.mark.slow
def test_a_coordinator_outage_longer_than_the_old_retries_costs_both_jobs_waiting_only(jobs):
    """Finding 3: both jobs ride out a coordinator outage of at least 10 seconds (their old
    retries gave up after about 2 s of backoff, 4-7 s in all) and finish with nothing lost."""
    jobs.steps = 4
    jobs.start_services()
    jobs.start_job("b")
    jobs.start_job("a")
    wait_until(
        lambda: alive(jobs, "a", "b") or len(jobs.rows("a", "metrics.jsonl")) >= 1,
        deadline=300,
        what="A's first step",
        details=jobs.logs,
    )
    jobs.coordinator.kill()
    # Down until a job reports having waited 10 s for it (the jobs' own view of the outage).
    wait_until(
        lambda: (
            alive(jobs, "a", "b")
            or max(unreachable_seconds(jobs.log("a")), unreachable_seconds(jobs.log("b"))) >= 10
        ),
        deadline=300,
        every=0.2,
        what="a job waiting 10 s for the dead coordinator",
        details=jobs.logs,
    )
    jobs.coordinator = jobs.start_coordinator()
    assert jobs.wait("b", 400) == 0, jobs.log("b")
    assert jobs.wait("a", 400) == 0, jobs.log("a")
    jobs.assert_b_trained_every_episode_once()
    jobs.assert_b_steps_are_a_steps()
    queue = jobs.queue()
    assert queue["queued_items"] == 0 and queue["leased_items"] == 0, queue


def poison_group(step: int, size: int) -> list[QueueItem]:
    """A group for B of step `step` whose token ids lie outside B's vocabulary."""
    return [
        QueueItem(
            key=f"poison-{step}-{i}:b",
            group=f"poison:{step}",
            group_size=size,
            producer="a",
            step=step,
            tokens=[5, B_VOCAB + 16, B_VOCAB + 17, 7],
            response_length=2,
            loss_mask=[1, 1],
            rollout_log_probs=[-0.5, -0.5],
            fields={
                "reward": 1.0,
                "status": "completed",
                "weight_versions": [str(step)],
                "group_index": 10_000 + step,
                "index": 10_000 + 10 * step + i,
                "rollout_id": step,
                "metadata": {
                    "mrlx": {
                        "episode_id": f"poison-{step}-{i}",
                        "agent": "b",
                        "turns": 1,
                        "raw_reward": 1.0,
                        "episode": {},
                    }
                },
            },
        )
        for i in range(size)
    ]


@pytest.mark.slow
def test_items_b_cannot_train_are_set_aside_and_replaced_by_fillers_of_the_same_shape(jobs):
    """Finding 4: a group whose token ids lie outside B's vocabulary, in each of B's steps. B sets
    it aside (dead-letter, counted by the coordinator and in B's metrics) and trains the rest of
    the step, with ABORTED fillers of the group's size in its place; B never crashes on it."""
    jobs.steps = 3
    jobs.b_groups = jobs.groups + 1  # each of B's steps: A's groups and one poison group
    jobs.start_services()

    async def commit_poison() -> None:
        client = CoordinatorClient(
            f"http://127.0.0.1:{jobs.coord_port}", run_id="jobs", agent="a", token=TOKEN
        )
        try:
            for step in range(jobs.steps):
                assert (
                    await client.commit("b", poison_group(step, jobs.per_prompt))
                ).accepted == jobs.per_prompt
        finally:
            await client.close()

    asyncio.run(commit_poison())
    jobs.start_job("b")
    jobs.start_job("a")
    assert jobs.wait("b", 400) == 0, jobs.log("b")
    assert jobs.wait("a", 400) == 0, jobs.log("a")
    jobs.assert_b_trained_every_episode_once()
    jobs.assert_b_steps_are_a_steps()
    shape = (jobs.groups + 1) * jobs.per_prompt
    samples = jobs.rows("b", "samples.jsonl")
    for step in range(jobs.steps):
        mine = [s for s in samples if s["step"] == step]
        assert len(mine) == shape, f"step {step}: {len(mine)} samples, not {shape}: the step lost its shape"
        fillers = [s for s in mine if "dead_letter" in s["metadata"]["mrlx"]]
        assert len(fillers) == jobs.per_prompt, fillers
        for s in fillers:
            assert (s["status"], s["remove_sample"], s["reward"]) == ("aborted", True, 0.0), s
            assert not any(s["loss_mask"]) and max(s["tokens"]) < B_VOCAB, s
        ids = [s["rollout_id"] for s in fillers]
        assert len(set(ids)) == len(ids) and not set(ids) & {
            s["rollout_id"] for s in mine if s not in fillers
        }
    for row in jobs.rows("b", "metrics.jsonl"):
        assert row["coordinator/dead_lettered_groups"] == 1, row
    dead = [
        line
        for line in jobs.metrics().splitlines()
        if line.startswith("mrlx_coordinator_items_dead_lettered_total") and 'consumer="b"' in line
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in dead) == jobs.steps * jobs.per_prompt, dead


@pytest.mark.slow
def test_a_queue_smaller_than_one_step_is_refused_at_start_naming_the_limit_and_the_flag(jobs):
    """Finding 11: `--max-depth` below one step's items deadlocked both jobs; both refuse to start."""
    jobs.coordinator_extra = ("--max-depth", "3")  # one step: 2 groups x 2 samples = 4 items
    jobs.coordinator_settings = "max_staleness: 1, wait_deadline_s: 30, lease_s: 30"
    jobs.start_services()
    jobs.start_job("b")
    jobs.start_job("a")
    for name in ("b", "a"):
        assert jobs.wait(name, 300) != 0, jobs.log(name)
        log = jobs.log(name)
        assert "(--max-depth 3)" in log and "--max-depth 4 or more" in log, log


@pytest.mark.slow  # builds two models (~12 s)
def test_the_initiator_sends_fillers_for_samples_its_peer_model_cannot_take(
    engine, tiny_model_dir, tmp_path, monkeypatch, start_coordinator
):
    """Finding 4, the producer's side: A checks B's samples against B's model (as A knows it from
    B's tokenizer directory) before committing them; one B cannot take goes as an ABORTED filler
    (the group stays whole), counted in A's rollout metrics."""
    import json
    import shutil

    from _host import slime_args

    from mrlx_plugin.core.host import run_in_host_loop
    from mrlx_plugin.local.trainer.fake_host import LocalDataSource
    from mrlx_plugin.rollout import initiator_rollout
    from mrlx_plugin.runtime import runtime_for

    b_model = tmp_path / "b-model"  # B's model as A knows it: at most 8 tokens, shorter than any episode
    shutil.copytree(tiny_model_dir, b_model)
    config = json.loads((b_model / "config.json").read_text())
    config["max_position_embeddings"] = 8
    (b_model / "config.json").write_text(json.dumps(config))
    coordinator = start_coordinator(run_id="refuse", agents=("a", "b"), token=TOKEN)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    try:
        mrlx = two_job_config(
            "a",
            run_id="refuse",
            urls={"b": engine.url},
            coordinator=coordinator.url,
            tokenizers={"b": b_model},
            max_new_tokens=4,
            coordinator_settings={"wait_deadline_s": 20},
            dialogue={"max_turns": 2},
        )
        args = slime_args(engine.url, str(tiny_model_dir), mrlx, rollout_batch_size=1, n_samples_per_prompt=2)
        out = initiator_rollout(args, 0, LocalDataSource([("What is 1 + 1?", "2")], 2))
        run_in_host_loop(runtime_for(args).aclose())
        assert out.metrics["coordinator/items_refused"] == 2 and out.metrics["coordinator/samples_sent"] == 2

        async def take():
            client = CoordinatorClient(coordinator.url, run_id="refuse", agent="b", token=TOKEN)
            try:
                return await client.lease(10, lease_s=60, wait_s=0, step=0)
            finally:
                await client.close()

        lease = asyncio.run(take())
        assert [len(g) for g in lease.groups] == [2]
        for item in lease.groups[0]:
            assert item.fields["status"] == "aborted" and item.fields["remove_sample"] is True, item.fields
            assert list(item.loss_mask) == [0] and len(item.tokens) <= 8
            assert "more than 'b'" in item.fields["metadata"]["mrlx"]["refused"]
    finally:
        coordinator.stop()


@pytest.mark.parametrize(
    "flags, expected",
    [
        # slime saves after steps 1, 3, 5 (every 2nd and the last); at the top of step k the responder
        # acknowledges through the last save before k ...
        ({"save_interval": 2}, [None, None, 1, 1, 3, 3]),
        # ... with --async-save through the save before that one (the newest may not be on disk yet) ...
        ({"save_interval": 2, "async_save": True}, [None, None, None, None, 1, 1]),
        # ... and without --save nothing can be resumed: through the step before.
        ({"save": None}, [None, 0, 1, 2, 3, 4]),
    ],
)
def test_a_slime_responder_acknowledges_through_the_last_durable_save(
    tiny_model_dir, tmp_path, monkeypatch, start_coordinator, flags, expected
):
    """Finding 1, for a real slime responder (no hook after its save): at the top of each step it
    acknowledges exactly the steps that a job resumed now would not train again."""
    from _host import slime_args

    from mrlx_plugin.core.host import run_in_host_loop
    from mrlx_plugin.rollout import responder_rollout
    from mrlx_plugin.runtime import cached_runtime, responder_for

    coordinator = start_coordinator(run_id="acks", agents=("a", "b"), token=TOKEN)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    nowhere = "http://127.0.0.1:9"  # no episode runs here: no engine is called
    mrlx = two_job_config(
        "b",
        run_id="acks",
        urls={"a": nowhere},
        coordinator=coordinator.url,
        coordinator_settings={"wait_deadline_s": 60},
    )
    host = {
        "save": str(tmp_path / "ckpt"),
        "save_interval": None,
        "async_save": False,
        "num_rollout": 6,
        **flags,
    }
    args = slime_args(
        nowhere, str(tiny_model_dir), mrlx, rollout_batch_size=1, n_samples_per_prompt=2, **host
    )

    def group(step: int) -> list[QueueItem]:
        return [
            QueueItem(
                key=f"e{step}-{i}:b",
                group=f"a:{step}",
                group_size=2,
                producer="a",
                step=step,
                tokens=[5, 6, 7, 8],
                response_length=2,
                loss_mask=[1, 1],
                rollout_log_probs=[-0.5, -0.5],
                fields={
                    "reward": float(i),
                    "status": "completed",
                    "weight_versions": [str(step)],
                    "group_index": step,
                    "index": 2 * step + i,
                    "metadata": {
                        "mrlx": {
                            "episode_id": f"e{step}-{i}",
                            "agent": "b",
                            "turns": 1,
                            "raw_reward": float(i),
                            "episode": {},
                        }
                    },
                },
            )
            for i in range(2)
        ]

    async def commit(step: int) -> dict:
        client = CoordinatorClient(coordinator.url, run_id="acks", agent="a", token=TOKEN)
        try:
            await client.commit("b", group(step))
            return await client.queue_info("b")
        finally:
            await client.close()

    try:
        seen = []
        for step in range(6):
            asyncio.run(commit(step))
            out = responder_rollout(args, step, None)
            assert [[s.metadata["mrlx"]["episode_id"] for s in g] for g in out.samples] == [
                [f"e{step}-0", f"e{step}-1"]
            ]
            seen.append(asyncio.run(commit(step))["acked_through"])  # committing again: duplicates only
        assert seen == expected
        assert cached_runtime(args) is None  # leasing builds no episode machinery
        run_in_host_loop(responder_for(args).aclose())
    finally:
        coordinator.stop()
