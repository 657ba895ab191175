"""Rewards: the math grader, the host reward function, the per-(group, agent) normaliser, shaping."""

from __future__ import annotations

import argparse
import asyncio
import math

import pytest

from mrlx_plugin.core.host import Sample, Status
from mrlx_plugin.rewards.grading import MathVerifier, extract_answer, grade_math, quick_grade
from mrlx_plugin.rewards.shaping import coupling_matrix, normalize, reward, team_weighting
from mrlx_plugin.systems.pipeline import PipelineSettings


def sample(group, agent, r, status=Status.COMPLETED, removed=False, index=0):
    s = Sample(group_index=group, index=index, reward=r, status=status, remove_sample=removed)
    s.metadata["mrlx"] = {"agent": agent}
    return s


ARGS = argparse.Namespace(
    advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True, reward_key=None
)


def test_normaliser_centres_each_group_and_agent_separately():
    samples = [sample(0, "solver", r) for r in (1, 0, 0, 1, 1)] + [
        sample(0, "rewriter", r) for r in (1.2, 0.8)
    ]
    samples += [sample(1, "solver", r) for r in (0, 0, 1)] + [sample(0, "selector", 1.2)]
    raw, adv = normalize(ARGS, samples)
    assert raw == [s.reward for s in samples]
    by_key: dict = {}
    for s, a in zip(samples, adv):
        by_key.setdefault((s.group_index, s.metadata["mrlx"]["agent"]), []).append(a)
    for key, values in by_key.items():
        assert abs(sum(values) / len(values)) < 1e-9, key
    # std-normalised: a group's advantages have unit sample standard deviation
    solver0 = by_key[(0, "solver")]
    mean = sum(solver0) / len(solver0)
    std = math.sqrt(sum((x - mean) ** 2 for x in solver0) / (len(solver0) - 1))
    assert abs(std - 1.0) < 1e-4


def test_groups_of_one_and_zero_spread_give_zero_not_nan():
    samples = [sample(0, "selector", 1.2), sample(1, "solver", 1.0), sample(1, "solver", 1.0)]
    _, adv = normalize(ARGS, samples)
    assert adv == [0.0, 0.0, 0.0]


def test_aborted_and_removed_samples_stay_out_of_the_statistics():
    samples = [
        sample(0, "solver", 1.0),
        sample(0, "solver", 0.0),
        sample(0, "solver", 0.0, Status.ABORTED),
        sample(0, "solver", 0.0, removed=True),
    ]
    _, adv = normalize(ARGS, samples)
    assert adv[2] == 0.0 and adv[3] == 0.0
    assert adv[0] > 0 > adv[1] and abs(adv[0] + adv[1]) < 1e-9


def test_mean_only_without_std_and_passthrough_when_disabled():
    samples = [sample(0, "solver", 3.0), sample(0, "solver", 1.0)]
    no_std = argparse.Namespace(**{**vars(ARGS), "grpo_std_normalization": False})
    assert normalize(no_std, samples)[1] == [1.0, -1.0]
    off = argparse.Namespace(**{**vars(ARGS), "rewards_normalization": False})
    assert normalize(off, samples)[1] == [3.0, 1.0]
    ppo = argparse.Namespace(**{**vars(ARGS), "advantage_estimator": "ppo"})
    assert normalize(ppo, samples)[1] == [3.0, 1.0]


def test_dict_rewards_need_a_reward_key():
    s = [sample(0, "solver", {"score": 1.0}), sample(0, "solver", {"score": 0.0})]
    with pytest.raises(ValueError, match="--reward-key"):
        normalize(ARGS, s)
    keyed = argparse.Namespace(**{**vars(ARGS), "reward_key": "score"})
    assert normalize(keyed, s)[0] == [1.0, 0.0]


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("so \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
        ("The final answer is 1,000.", "1000", 1.0),
        ("#### 7", "8", 0.0),
        ("\\boxed{ 3 }", "3", 1.0),
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),
    ],
)
def test_quick_grade(response, label, expected):
    assert quick_grade(response, label) == expected


def test_quick_grade_defers_what_needs_algebra():
    assert quick_grade("\\boxed{\\sqrt{4}}", "2") is None
    assert extract_answer("no answer here") is None
    assert extract_answer("a \\boxed{\\frac{a}{b}} and later \\boxed{x^{2}}") == "x^{2}"


def test_math_verify_worker_settles_equivalent_forms():
    async def run():
        v = MathVerifier(timeout_s=60)
        try:
            right = await grade_math("We get \\boxed{\\sqrt{4}}", "2", v)
            wrong = await grade_math("We get \\boxed{\\sqrt{5}}", "2", v)
            algebra = await grade_math("\\boxed{\\frac{2}{4}+\\frac{1}{4}}", "\\frac{3}{4}", v)
            no_label = await grade_math("\\boxed{1}", None, v)
            return right, wrong, algebra, no_label
        finally:
            await v.aclose()

    assert asyncio.run(run()) == (1.0, 0.0, 1.0, 0.0)


def test_reward_function_takes_one_sample_or_a_list():
    async def run():
        one = Sample(response="thinking</think>The answer is \\boxed{12}", label="12")
        many = [Sample(response="\\boxed{3}", label="3"), Sample(response="\\boxed{4}", label="3")]
        return await reward(argparse.Namespace(rm_type=None), one), await reward(
            argparse.Namespace(rm_type=None), many
        )

    single, batch = asyncio.run(run())
    assert single == 1.0
    assert batch == [1.0, 0.0]


def test_team_weighting_offset_and_multiplicative():
    p = PipelineSettings()
    assert team_weighting(1.0, 1.0, p) == pytest.approx(1.2)
    assert team_weighting(1.0, 0.0, p) == pytest.approx(0.8)
    assert team_weighting(0.0, 1.0, p) == pytest.approx(0.2)  # wrong answers feel the team outcome
    assert team_weighting(0.0, 0.0, p) == pytest.approx(-0.2)
    host = PipelineSettings(weighting="multiplicative")
    assert team_weighting(0.0, 1.0, host) == 0.0 and team_weighting(1.0, 1.0, host) == pytest.approx(1.2)
    assert team_weighting(0.7, None, PipelineSettings(weighting="none")) == 0.7


def test_coupling_matrices():
    agents = ["a", "b"]
    assert coupling_matrix("zero_sum", agents, {}) == {"a": {"a": 1.0, "b": -1.0}, "b": {"a": -1.0, "b": 1.0}}
    assert coupling_matrix("cooperative", agents, {})["a"] == {"a": 0.5, "b": 0.5}
    assert coupling_matrix("bilateral", agents, {})["b"] == {"a": 0.5, "b": 0.5}
    asym = coupling_matrix("asymmetric", agents, {"a": {"a": 1.0, "b": 0.3}})
    assert asym == {"a": {"a": 1.0, "b": 0.3}, "b": {"a": 0.0, "b": 1.0}}


@pytest.mark.parametrize(
    "value",
    [10**400, 10**5000, float("nan"), float("-inf"), True],
    ids=["1e400", "1e5000", "nan", "-inf", "bool"],
)
def test_a_reward_past_a_floats_range_is_refused_naming_its_producer(value):
    from mrlx_plugin.core.values import RewardError, finite_reward
    from mrlx_plugin.episodes.run import _finite_number

    assert not _finite_number(value)
    with pytest.raises(RewardError, match="plugin 'my_grader'"):
        finite_reward(value, "plugin 'my_grader'")
