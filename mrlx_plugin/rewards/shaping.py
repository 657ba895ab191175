"""Rewards: the host-facing reward and normalisation functions, and episode-level shaping.

- `reward(args, sample_or_samples)`: a `--custom-rm-path` function. slime calls it with one
  Sample, or once with the whole list when a generate function returned several.
- `normalize(args, samples)`: a `--custom-reward-post-process-path` function. It replaces the
  host's GRPO normalisation, which mixes prompts and roles whenever a generate function returns a
  variable number of samples (docs/host-contract.md section 5), by normalising within each
  (prompt group, agent) pair.
- `team_weighting(...)` and `coupling_matrix(...)`: the built-in shapings behind the
  `mrlx_shape_rewards` hook's default.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, SupportsFloat, cast

import numpy as np

from mrlx_plugin.core.host import HOST, HOST_PROCESS, HostSample, Status, host_reward
from mrlx_plugin.core.transcript import strip_reasoning
from mrlx_plugin.core.values import finite_reward
from mrlx_plugin.rewards.grading import MathVerifier, grade_math

if TYPE_CHECKING:
    from mrlx_plugin.core.config import Settings

GRPO_FAMILY = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
STD_NORMALIZED = ("grpo", "gspo", "cispo")


def math_verifier(args: argparse.Namespace | _WithoutCustomRm) -> MathVerifier:
    """The math-verify worker of the host's `args`: one per rollout process, shared by the
    `mrlx_grade` default (through the Runtime) and `reward` (called with `args` alone), and owned
    by the process registry (`HOST_PROCESS`) that keeps what flat host calls share."""
    if isinstance(args, _WithoutCustomRm):  # the host grader's view of the same args: the same worker
        args = args._args
    return HOST_PROCESS.for_args(args, "math_verifier", MathVerifier)


# --------------------------------------------------------------------------------------------
# --custom-rm-path
# --------------------------------------------------------------------------------------------


async def reward(args: argparse.Namespace, samples: HostSample | list[HostSample], **_: object) -> object:
    """Grade one Sample (returns a float) or a list of them (returns a list of floats).

    With a host installed and `--rm-type` set (or a sample's `metadata["rm_type"]`), the host's
    grader decides; otherwise the math grader compares the response's boxed or final answer to
    the sample's label.
    """
    if isinstance(samples, list):
        return list(await asyncio.gather(*(_reward_one(args, s) for s in samples)))
    return await _reward_one(args, samples)


async def _reward_one(args: argparse.Namespace, sample: HostSample) -> object:
    rm_type = (sample.metadata or {}).get("rm_type") or getattr(args, "rm_type", None)
    if HOST is not None and rm_type:
        value = await host_reward(_WithoutCustomRm(args), sample)
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # a dict: --reward-key picks
            finite_reward(value, f"the host's grader (--rm-type {rm_type}) for sample {sample.index}")
        return value
    return await grade_math(strip_reasoning(sample.response or ""), sample.label, math_verifier(args))


class _WithoutCustomRm:
    """A read-only view of `args` whose custom_rm_path is None, so the host's grader does not call
    back into this function. The host's `args` itself is never written to."""

    def __init__(self, args: argparse.Namespace):
        self._args = args

    @property
    def custom_rm_path(self) -> None:
        return None

    def __getattr__(self, name: str) -> object:
        return getattr(self._args, name)


# --------------------------------------------------------------------------------------------
# --custom-reward-post-process-path
# --------------------------------------------------------------------------------------------


def _reward_value(sample: HostSample, reward_key: str | None) -> float:
    value: object = sample.reward
    if isinstance(value, dict):
        if not reward_key:
            raise ValueError(
                f"sample {sample.index} has a dict reward {sorted(value)}; set --reward-key to pick one"
            )
        value = value[reward_key]
    if value is None:
        return 0.0
    number = float(cast("SupportsFloat | str", value))  # what float() takes; it raises on the rest
    if not math.isfinite(number):
        # Every reward mrlx makes is checked where it is made; one that is not finite here came
        # from elsewhere, and a 0.0 in its place would train on a reward nobody computed.
        meta = _record(sample)
        who = (
            f" (agent {meta.get('agent')!r}, episode {meta.get('episode_id')!r})"
            if meta
            else " (not an mrlx sample: the host's own grader or generate function made it)"
        )
        raise ValueError(f"sample {sample.index}{who} has reward {value!r}; rewards must be finite numbers")
    return number


def group_key(sample: HostSample) -> tuple[int | None, object]:
    """(prompt group, credit group): the set of samples a sample's advantage is relative to.

    The credit group is the agent and its role (a game seat); under `rewards.credit: turn` also
    the turn index, so that a turn is compared with the same turn of the prompt group's other
    episodes; with tree sampling, the K candidates of one turn of one episode."""
    meta = _record(sample)
    return (sample.group_index, meta.get("credit_group") or meta.get("agent"))


def _record(sample: HostSample) -> Mapping[str, object]:
    """The sample's `metadata["mrlx"]` (`episodes.samples.sample_meta`); empty for one mrlx did not make."""
    return cast("Mapping[str, object]", (sample.metadata or {}).get("mrlx") or {})


# `rewards.lone_baseline: running`: the running mean of each credit group's rewards, keyed by
# (run id, credit group), for the samples alone in their group. In this process's memory only:
# a restarted rollout process starts afresh (its first step treats lone samples as `none` does).
_LONE_BASELINES: dict[tuple[str, str], float] = {}


def _in_tree_group(sample: HostSample) -> bool:
    """Whether the sample is one of a tree-sampled turn's K candidates (the taken one included)."""
    return _record(sample).get("candidate_index") is not None


def normalize(
    args: argparse.Namespace, samples: Sequence[HostSample], settings: Settings | None = None
) -> tuple[list[float], list[float]]:
    """Return (raw_rewards, normalised_rewards), one per sample, in the order given.

    Within each group (`group_key`: the prompt group and the agent, with its role; per turn
    under `rewards.credit: turn`): subtract the mean and, for GRPO-style estimators with std
    normalisation on, divide by the standard deviation (+1e-6). Groups with no spread get 0.0,
    never NaN. A group of one gets 0.0 (a turn only one episode of the prompt group reached
    teaches nothing), or under `rewards.lone_baseline: running` its reward minus the running
    mean of its credit group over earlier steps, where there is one (`_lone_advantages`). A turn
    some episodes never reached is compared among those that did (the others' fillers are
    ABORTED). ABORTED and removed samples take no part in the statistics and get 0.0. With
    `--disable-rewards-normalization`, or an estimator outside the GRPO family, the raw rewards
    are returned unchanged. `settings`: the job's (`mrlx_plugin.rollout.normalize`, the function
    the host's flag names, passes them); without them lone turns get 0.0.
    """
    flat = list(samples)
    reward_key = getattr(args, "reward_key", None)
    raw = [_reward_value(s, reward_key) for s in flat]
    estimator = getattr(args, "advantage_estimator", "grpo")
    if estimator not in GRPO_FAMILY or not getattr(args, "rewards_normalization", True):
        return raw, list(raw)
    use_std = estimator in STD_NORMALIZED and getattr(args, "grpo_std_normalization", True)

    groups: dict[tuple[int | None, object], list[int]] = defaultdict(list)
    for i, s in enumerate(flat):
        if s.status == Status.ABORTED or getattr(s, "remove_sample", False):
            continue
        groups[group_key(s)].append(i)
    out = [0.0] * len(flat)
    if settings is not None and settings.rewards.lone_baseline == "running":
        _lone_advantages(settings, flat, raw, groups, out)
    values = np.asarray(raw, dtype=np.float64)
    for members in groups.values():
        if len(members) < 2:
            continue
        v = values[members]
        centred = v - v.mean()
        if use_std:
            std = v.std(ddof=1)
            centred = centred / (std + 1e-6) if std > 0 else np.zeros_like(centred)
        for i, x in zip(members, centred.tolist()):
            out[i] = x
    return raw, out


def _lone_advantages(
    settings: Settings,
    flat: list[HostSample],
    raw: list[float],
    groups: Mapping[tuple[int | None, object], list[int]],
    out: list[float],
) -> None:
    """`rewards.lone_baseline: running`: set `out` for each sample alone in its group to its raw
    reward minus its credit group's running mean from earlier steps (left 0.0 where none exists),
    then fold this step's mean of each credit group into that running mean.

    The baseline is read before this step's update, so a sample never counts in its own baseline.
    It is a plain difference, not divided by a spread: one sample has none. Tree-sampling groups
    are left out both ways: their group is the K candidates of one context, whose comparison is
    the estimator (a lone one is a turn whose siblings were lost), and their credit group names
    the episode, so it never comes back in a later step."""
    run, decay = settings.run_id, settings.rewards.baseline_decay
    step: dict[str, list[float]] = defaultdict(list)
    for (_, credit), members in groups.items():
        if not isinstance(credit, str) or any(_in_tree_group(flat[i]) for i in members):
            continue
        step[credit] += [raw[i] for i in members]
        baseline = _LONE_BASELINES.get((run, credit))
        if len(members) == 1 and baseline is not None:
            out[members[0]] = raw[members[0]] - baseline
    for credit, rewards in step.items():
        mean = float(np.mean(rewards))
        old = _LONE_BASELINES.get((run, credit))
        # The first value is the mean itself: an EMA started at 0 would pull early baselines toward 0.
        _LONE_BASELINES[(run, credit)] = mean if old is None else decay * old + (1.0 - decay) * mean


# --------------------------------------------------------------------------------------------
# Episode shaping (default of the mrlx_shape_rewards hook)
# --------------------------------------------------------------------------------------------


def team_is_right(team_reward: float | None) -> bool:
    """The team's final answer earned a full mark (the host example's `reward == 1` test)."""
    return team_reward is not None and team_reward >= 1.0


class TeamWeights(Protocol):
    """The settings `team_weighting` reads (the pipeline's section, `mrlx.pipeline`)."""

    correct_weight: float
    incorrect_weight: float
    weighting: str


def team_weighting(raw: float, team_reward: float | None, p: TeamWeights) -> float:
    """A pipeline sample's reward given its own grade and the team's outcome.

    `multiplicative` is the host example's rule, raw * weight: a wrong answer scores 0 whatever
    the team did, so the team outcome only ever scales right answers. `offset` (the default)
    adds weight - 1 instead: right answers get exactly the host's 1.2 / 0.8, and wrong answers
    get +0.2 / -0.2, so every sample feels the team's outcome.
    """
    w = p.correct_weight if team_is_right(team_reward) else p.incorrect_weight
    if p.weighting == "multiplicative":
        return raw * w
    if p.weighting == "offset":
        return raw + (w - 1.0)
    return raw


def coupling_matrix(
    kind: str, agents: list[str], custom: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """How each agent's trained reward mixes every agent's own reward: r'_i = sum_j C[i][j] r_j.

    independent: C = I. cooperative: everyone gets the team mean. zero_sum: r_i minus the mean
    of the others (two agents: r_a - r_b). bilateral: half one's own, half the others' mean.
    asymmetric: the `mrlx.rewards.coupling` rows as given (agents without a row keep their own).
    """
    n = len(agents)
    others = 1.0 / (n - 1) if n > 1 else 0.0
    matrix: dict[str, dict[str, float]] = {}
    for i in agents:
        row = {}
        for j in agents:
            same = i == j
            if kind == "independent":
                row[j] = 1.0 if same else 0.0
            elif kind == "cooperative":
                row[j] = 1.0 / n
            elif kind == "zero_sum":
                row[j] = 1.0 if same else -others
            elif kind == "bilateral":
                row[j] = 0.5 if same else 0.5 * others
            elif kind == "asymmetric":
                row[j] = custom[i].get(j, 0.0) if i in custom else (1.0 if same else 0.0)
            else:
                raise ValueError(f"unknown shaping {kind!r}")
        matrix[i] = row
    return matrix
