"""The embedded trainer's fully asynchronous mode end to end: two agent jobs as real processes (the
embedded trainer per agent, an engine per agent, the coordinator), the initiator running
`mrlx_plugin.rollout.async_rollout`, the responder `responder_rollout`; `mrlx bench async` at its
smallest; and the stand-in data source taking given-back groups."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _twojobs import TwoJobs

from mrlx_plugin.async_rollout import BORN_KEY
from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.local.model import ensure_model
from mrlx_plugin.local.trainer.fake_host import LocalDataSource, read_prompts
from mrlx_plugin.local.trainer.loop import step_engine_calls

REPO = Path(__file__).resolve().parent.parent
BOUND = 2  # async_rollout.max_staleness's default


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("async-models")
    return ensure_model(root / "a", preset="tiny", seed=5), ensure_model(
        root / "b", preset="tiny", seed=6, vocab_size=384
    )


@pytest.mark.slow  # two trainer jobs end to end
def test_async_initiator_keeps_groups_across_steps_and_the_responder_trains_each_once(models, tmp_path):
    jobs = TwoJobs(tmp_path, *models, steps=5, groups=2, per_prompt=2)
    try:
        jobs.start_services()
        jobs.start_job("b")
        # The flag given last wins: the initiator's job runs the fully asynchronous rollout.
        jobs.start_job("a", "--rollout-function", "mrlx_plugin.rollout.async_rollout")
        for name in ("a", "b"):
            assert jobs.wait(name, timeout=300) == 0, jobs.logs()

        trained = jobs.rows("a", "samples.jsonl")
        assert trained, jobs.logs()
        ages = []
        for s in trained:
            born = s["metadata"][BORN_KEY]
            own = s["step"] - born["step"]
            peer = s["step"] - born["peers"]["b"]
            assert 0 <= own <= BOUND and 0 <= peer <= BOUND, (s["step"], born)
            ages.append(own)
        # Episodes generated while the trainer trained: groups born in one step, trained in a later one.
        assert any(age >= 1 for age in ages), f"every group was trained in the step it was born in: {ages}"

        # The responder's steps are full and train exactly the initiator's step of the same number,
        # each episode once (regenerated groups keep their episode ids; none is trained twice).
        per_step = {}
        for s in jobs.b_trained():
            per_step[s["step"]] = per_step.get(s["step"], 0) + 1
        assert per_step == {k: jobs.groups * jobs.per_prompt for k in range(jobs.steps)}
        jobs.assert_b_steps_are_a_steps()
        jobs.assert_b_trained_every_episode_once()

        rows = [r for r in jobs.rows("a", "metrics.jsonl") if r["step"] >= 0]
        assert len(rows) == jobs.steps
        for r in rows:
            # what `mrlx bench async` reads: the trainer's wait and the step's wall time, the staleness
            assert 0 <= r["rollout_s"] <= r["step_s"]
            counted = sum(v for k, v in r.items() if k.startswith("staleness_trained/a/"))
            assert counted == jobs.groups
            assert r["engine_calls"] >= jobs.groups * jobs.per_prompt  # every episode makes a call
        # The producer runs while the trainer trains: the later steps wait for less than a whole
        # rollout's worth of groups (some were already queued when the step began).
        assert any(r["multi_agent/queued_groups"] + r["multi_agent/in_flight_groups"] > 0 for r in rows)
    finally:
        jobs.stop()


@pytest.mark.slow  # two demo runs, each two trainer jobs
def test_bench_async_smoke_writes_every_measure(tmp_path):
    out = tmp_path / "async.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mrlx_plugin.cli",
            "bench",
            "async",
            "--seeds",
            "1",
            "--steps",
            "2",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
            "--preset",
            "tiny",
            "--prompts-per-step",
            "2",
            "--samples-per-prompt",
            "2",
            "--warmup-steps",
            "2",
            "--tail-fraction",
            "1",
            "--tail-rounds",
            "2",
            "--eval-prompts",
            "2",
            "--eval-interval",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["arms"]) == {"sync", "async"}
    for arm, summary in report["arms"].items():
        for key in ("idle_proposer", "episode_wait_proposer", "idle_decider", "samples_per_s"):
            cell = summary[key]
            assert cell is not None and cell["low"] <= cell["mean"] <= cell["high"], (arm, key, cell)
        assert 0.0 <= summary["idle_proposer"]["mean"] <= 1.0
        assert 0.0 <= summary["held_out_last"]["mean"] <= 1.0
        # 2 steps of 2 groups each, counted for both agents
        assert sum(summary["staleness"]["proposer"].values()) == 4
        assert sum(summary["staleness"]["decider"].values()) == 4
        # held out: before training, then after each step
        assert [p["version"] for p in summary["held_out_curve"]] == [0, 1, 2]
        (run,) = report["runs"][arm]
        assert run["steps"] == 2 and run["samples_trained"]["proposer"] == 2 * 2 * 2
        # every question of two rounds: more than one call per agent and episode (the rounds are run)
        assert run["engine_calls"] > 2 * 2 * 2 * 2
    assert set(report["arms"]["sync"]["staleness"]["proposer"]) == {"0"}  # a sync step trains its own groups
    assert set(report["goals"]) >= {
        "async_proposer_waits_for_episodes_under_10pct",
        "held_out_no_worse_within_intervals",
    }
    assert "mean [95% interval] over seeds" in proc.stdout


def test_prompt_metadata_reaches_every_sample_and_given_back_groups_come_first(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "p0", "label": "0", "metadata": {"rounds": 3}}, {"prompt": "p1", "label": "1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = read_prompts(str(path), "prompt", "label")
    source = LocalDataSource(prompts, 2)
    first, second = source.get_samples(2)
    assert [s.metadata for s in first] == [{"rounds": 3}] * 2 and [s.metadata for s in second] == [{}] * 2
    first[0].metadata["mrlx_born"] = {"step": 0, "peers": {}}  # each sample has its own metadata
    assert first[1].metadata == {"rounds": 3}

    source.add_samples([first])  # too stale to train: handed out again before any new prompt
    state = source.state_dict()
    again = LocalDataSource(prompts, 2)
    again.load_state_dict(state)  # a checkpoint keeps it
    for src in (source, again):
        (back,) = src.get_samples(1)
        assert [(s.group_index, s.index, s.prompt) for s in back] == [(0, 0, "p0"), (0, 1, "p0")]
        (new,) = src.get_samples(1)
        assert [s.index for s in new] == [4, 5]  # the run's counters went on

    path.write_text(json.dumps({"prompt": "p", "metadata": [1]}) + "\n")
    with pytest.raises(ConfigError, match="'metadata' is list; expected a JSON object"):
        read_prompts(str(path), "prompt", "label")


def test_engine_calls_of_given_back_groups_count_toward_the_budget():
    trained = {"multi_agent/episodes": 4.0, "multi_agent/engine_calls": 2.5}
    assert step_engine_calls(trained) == 10.0
    assert step_engine_calls({**trained, "multi_agent/engine_calls_given_back": 6.0}) == 16.0
