"""Baselines of the normaliser: the running baseline of samples alone in their group
(`rewards.lone_baseline: running`), and the mean-only choice (no division by the group's spread),
in slime's args and in those the embedded trainer builds."""

from __future__ import annotations

import argparse
import itertools
import math

import pytest
import yaml
from _host import slime_args

from mrlx_plugin.core.config import ConfigError, parse_settings
from mrlx_plugin.core.host import Sample, Status
from mrlx_plugin.local.trainer.fake_host import add_host_arguments, host_args
from mrlx_plugin.local.trainer.settings import SECTIONS
from mrlx_plugin.rollout import normalize
from mrlx_plugin.settings import job_sections

_RUNS = itertools.count()


def _mrlx(**rewards) -> dict:
    # A fresh run id per job: the running baselines are kept per run in the process.
    return {
        "run_id": f"baselines-{next(_RUNS)}",
        "system": "dialogue",
        "agents": {a: {"url": "self"} for a in ("p", "q")},
        "rewards": {"credit": "turn", **rewards},
    }


def _args(**rewards) -> argparse.Namespace:
    return slime_args(None, "unused-tokenizer", _mrlx(**rewards))


_INDEX = itertools.count()


def _turn(
    group: int, agent: str, role: str, key: str, reward: float, status=Status.COMPLETED, **meta
) -> Sample:
    """A per-turn sample as `episodes.samples` makes it: its credit group names agent, role and key."""
    s = Sample(group_index=group, index=next(_INDEX), reward=reward, status=status)
    s.metadata["mrlx"] = {
        "agent": agent,
        "role": role,
        "turn": 0,
        "candidate": False,
        "credit_group": f"{agent}@{role}/{key}",
        **meta,
    }
    return s


def _by_index(samples: list[Sample], advantages: list[float]) -> dict[int, float]:
    return {s.index: a for s, a in zip(samples, advantages)}


def test_a_lone_turn_is_measured_against_its_credit_groups_earlier_steps():
    args = _args(lone_baseline="running")  # baseline_decay: 0.9 (default)
    # Step 1: `seen:K` has a pair in prompt group 0 and a lone turn in group 1 (mean of the three:
    # 2/3); `seen:J` one lone turn (1.0) and an ABORTED one (5.0, left out).
    pair = [_turn(0, "p", "second", "seen:K", 1.0), _turn(0, "p", "second", "seen:K", 0.0)]
    lone_k1 = _turn(1, "p", "second", "seen:K", 1.0)
    lone_j1 = _turn(2, "p", "second", "seen:J", 1.0)
    aborted = _turn(2, "p", "second", "seen:J", 5.0, Status.ABORTED)
    step1 = [*pair, lone_k1, lone_j1, aborted]
    raw, adv = normalize(args, step1)
    assert raw == [1.0, 0.0, 1.0, 1.0, 5.0]
    first = _by_index(step1, adv)
    assert first[lone_k1.index] == 0.0 and first[lone_j1.index] == 0.0  # no earlier step: no baseline
    assert first[aborted.index] == 0.0
    # a group of two is GRPO's as before: +-1/sqrt(2) under std normalisation
    assert first[pair[0].index] == pytest.approx(1 / math.sqrt(2), abs=1e-5)
    assert first[pair[1].index] == pytest.approx(-1 / math.sqrt(2), abs=1e-5)

    # Step 2: lone turns of both keys, and of the same key under another role and another agent.
    lone_k2 = _turn(0, "p", "second", "seen:K", 0.0)
    lone_j2 = _turn(1, "p", "second", "seen:J", -1.0)
    other_role = _turn(2, "p", "first", "seen:J", 1.0)
    other_agent = _turn(3, "q", "second", "seen:J", 1.0)
    aborted2 = _turn(4, "p", "second", "seen:J", 3.0, Status.ABORTED)
    step2 = [lone_k2, lone_j2, other_role, other_agent, aborted2]
    second = _by_index(step2, normalize(args, step2)[1])
    assert second[lone_k2.index] == pytest.approx(0.0 - 2 / 3)  # the mean over the step, not per group
    assert second[lone_j2.index] == pytest.approx(-1.0 - 1.0)  # step 1's mean; the ABORTED 5.0 left out
    assert second[other_role.index] == 0.0 and second[other_agent.index] == 0.0  # their own baselines
    assert second[aborted2.index] == 0.0

    # Step 3: the running mean of `seen:J` is 0.9 * 1.0 + 0.1 * -1.0 = 0.8 (step 2 folded in after use).
    lone_j3 = _turn(0, "p", "second", "seen:J", 0.0)
    assert normalize(args, [lone_j3])[1] == [pytest.approx(-0.8)]


def test_the_running_baseline_is_kept_per_run():
    a, b = _args(lone_baseline="running"), _args(lone_baseline="running")
    normalize(a, [_turn(0, "p", "second", "seen:K", 4.0)])
    assert normalize(a, [_turn(0, "p", "second", "seen:K", 1.0)])[1] == [pytest.approx(-3.0)]
    assert normalize(b, [_turn(0, "p", "second", "seen:K", 1.0)])[1] == [0.0]  # another run: none yet


def test_tree_sampling_groups_never_use_the_running_baseline():
    args = _args(lone_baseline="running", branch=2)
    tree = "turn0/e1:p"  # the K candidates of one turn of one episode
    for reward in (1.0, 3.0):  # the same credit group twice: a baseline would exist the second time
        taken = _turn(0, "p", "second", tree, reward, candidate_index=1)
        lost = _turn(0, "p", "second", tree, 0.0, Status.ABORTED, candidate=True, candidate_index=0)
        assert normalize(args, [taken, lost])[1] == [0.0, 0.0]
    # a key that merely looks like one (`seen:` keys are free text) still gets its baseline
    normalize(args, [_turn(0, "p", "second", "seen:turn0/x:y", 1.0)])
    assert normalize(args, [_turn(0, "p", "second", "seen:turn0/x:y", 3.0)])[1] == [pytest.approx(2.0)]


def test_none_keeps_lone_turns_at_zero():
    args = _args()  # lone_baseline: none (default)
    no_settings = argparse.Namespace(
        advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True, reward_key=None
    )
    for reward in (1.0, -2.0):
        samples = [
            _turn(0, "p", "second", "seen:J", reward),
            _turn(1, "p", "second", "seen:K", 1.0),
            _turn(1, "p", "second", "seen:K", 0.0),
        ]
        adv = normalize(args, samples)[1]
        assert adv[0] == 0.0 and adv[1] == pytest.approx(-adv[2]) and adv[1] > 0
        assert adv == normalize(no_settings, samples)[1]


def test_lone_baseline_settings_are_checked():
    with pytest.raises(ConfigError, match="rewards.lone_baseline"):
        parse_settings(_mrlx(lone_baseline="mean"), sections=job_sections())
    with pytest.raises(ConfigError, match="rewards.baseline_decay"):
        parse_settings(_mrlx(lone_baseline="running", baseline_decay=1.0), sections=job_sections())
    s = parse_settings(_mrlx(lone_baseline="running", baseline_decay=0.5), sections=job_sections())
    assert (s.rewards.lone_baseline, s.rewards.baseline_decay) == ("running", 0.5)


def _trainer_args(tmp_path, trainer: dict) -> argparse.Namespace:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"mrlx": {**_mrlx(), "trainer": trainer}}))
    parser = argparse.ArgumentParser()
    add_host_arguments(parser)
    return host_args(parser.parse_args([]), str(config))


def test_the_embedded_trainer_passes_its_std_normalisation_to_the_host_args(tmp_path):
    samples = [_turn(0, "p", "second", "seen:K", r) for r in (3.0, 1.0, 2.0)]
    off = _trainer_args(tmp_path, {"grpo_std_normalization": False})
    assert off.grpo_std_normalization is False
    assert normalize(off, samples)[1] == pytest.approx([1.0, -1.0, 0.0])  # mean-centred, not z-scores
    on = _trainer_args(tmp_path, {})
    assert on.grpo_std_normalization is True  # slime's default
    assert normalize(on, samples)[1] == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)  # std of (3, 1, 2) is 1
    samples[0].reward, samples[2].reward = 4.0, 1.0  # spread sqrt(3): z-scores, not the centred values
    z = 1 / math.sqrt(3)
    assert normalize(on, samples)[1] == pytest.approx([2 * z, -z, -z], abs=1e-5)
    assert normalize(off, samples)[1] == pytest.approx([2.0, -1.0, -1.0])


def test_a_std_normalisation_that_is_no_bool_is_refused_with_its_path():
    raw = {**_mrlx(), "trainer": {"grpo_std_normalization": "no"}}
    with pytest.raises(ConfigError, match="trainer.grpo_std_normalization"):
        parse_settings(raw, sections=job_sections(read_here=SECTIONS))
