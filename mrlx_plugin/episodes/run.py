"""Running one episode: the system's run, then the grades, the turn rewards and the shaping through
the hooks, and the host's samples, every one with a reward and the input's rollout id. Engine
faults and host aborts come back as ABORTED samples; a reward that fails ends the episode only.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Callable
from typing import Any

from mrlx_plugin.core.values import RewardError, finite_reward
from mrlx_plugin.episodes.context import EpisodeContext
from mrlx_plugin.episodes.episode import Episode
from mrlx_plugin.episodes.errors import EpisodeAborted, HookResultError

logger = logging.getLogger(__name__)


def shaped_rewards(episode: Episode, rewards: Any, plugin: str | None) -> dict[int, float]:
    """The rewards an `mrlx_shape_rewards` implementation decided, checked against its contract:
    a dict of position in `episode.transcripts` -> finite float, one entry per graded transcript.
    Raises one HookResultError naming the plugin and everything wrong with the answer; an answer
    whose only fault is numbers that are not finite (a NaN of one episode's arithmetic) raises
    RewardError naming the plugin, which ends that episode only."""
    graded = {i for i, t in enumerate(episode.transcripts) if t.raw_reward is not None}
    where = f"mrlx_shape_rewards of plugin {plugin!r}"
    expected = (
        "expected a dict mapping the position in episode.transcripts of each graded transcript "
        f"(here {sorted(graded)}) to a finite float"
    )
    if not isinstance(rewards, dict):
        shown = repr(rewards) if len(repr(rewards)) <= 200 else repr(rewards)[:200] + "..."
        raise HookResultError(f"{where} returned {shown} ({type(rewards).__name__}); {expected}")
    problems = []
    positions = {k: int(k) for k in rewards if isinstance(k, numbers.Integral) and not isinstance(k, bool)}
    keys = set(positions.values())
    if len(positions) != len(rewards):
        others = sorted(repr(k) for k in rewards if k not in positions)
        problems.append("keys that are not positions: " + ", ".join(others))
    missing = sorted(graded - keys)
    if missing:
        problems.append(
            "no reward for graded transcript(s) "
            + ", ".join(f"{i} ({episode.transcripts[i].label})" for i in missing)
        )
    extra = sorted(keys - graded)
    if extra:
        problems.append(f"positions {extra} are not graded transcripts")
    bad = {k: v for k, v in rewards.items() if not _finite_number(v)}
    if bad:
        problems.append(
            "rewards that are not finite numbers: "
            + ", ".join(f"{k!r}: {v!r}" for k, v in list(bad.items())[:5])
        )
    only_not_finite = bool(bad) and len(problems) == 1 and all(_real_number(v) for v in bad.values())
    if problems and not only_not_finite:
        raise HookResultError(
            f"{where} returned a wrong answer for episode {episode.id}: "
            + "; ".join(problems)
            + f"; {expected}"
        )
    if bad:
        shown = ", ".join(
            f"{v!r} for {k} ({episode.transcripts[positions[k]].label})" for k, v in list(bad.items())[:5]
        )
        raise RewardError(f"{where} gave {shown}; expected finite numbers")
    return {positions[k]: float(v) for k, v in rewards.items()}


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int past a float's range, e.g. 10**400
        return False


def _real_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_system_rewards(episode: Episode) -> None:
    """The rewards the system itself set (raw and trained rewards of its transcripts, the team's
    reward): RewardError naming the system when one is not finite. The built-in systems check
    theirs where they are made, naming the game or the setting; this catches any other."""
    run = episode.context.system.run
    who = f"system {episode.settings.system!r} ({getattr(run, '__module__', None) or 'unknown module'})"
    for t in episode.transcripts:
        for value, what in ((t.raw_reward, "raw reward"), (t.reward, "reward")):
            if value is not None:
                finite_reward(value, f"{who}: the {what} of {t.label}")
    if episode.team_reward is not None:
        finite_reward(episode.team_reward, f"{who}: the team reward")


async def run_episode(
    context: EpisodeContext,
    sample: Any,
    sampling_params: dict[str, Any] | None,
    evaluation: bool,
    host_aborted: Callable[[], bool] | None = None,
) -> tuple[Episode, Any]:
    """Run the configured system on one input sample; return the episode and the host's sample(s).

    Training: a list of samples for the agents this job trains, sharing the input's rollout id.
    Evaluation: one sample holding the team's final answer, its reward the final answer's grade.
    `host_aborted` tells whether the host has ended the rollout (no new turn starts then). Every
    observer of `mrlx_episode_end` sees the finished episode and its samples (a multi-model
    job's outbox takes the samples of agents other jobs train from there).
    """
    episode = Episode(context, sample, sampling_params, evaluation, host_aborted)
    try:
        await context.system.run(episode)
        _check_system_rewards(episode)
    except EpisodeAborted:
        pass
    except RewardError as exc:  # a reward the system made (a game's, a setting's) that is not finite
        episode.fail_reward(str(exc), exc)
    except asyncio.CancelledError:
        raise
    if not episode.aborted:
        try:
            for t in episode.transcripts:
                if t.raw_reward is None and t.turns and context.settings.agents[t.agent].trainable:
                    await episode.grade(t)
            if episode.final_transcript is not None and episode.team_reward is None:
                ft = episode.final_transcript
                episode.team_reward = ft.raw_reward if ft.raw_reward is not None else await episode.grade(ft)
        except EpisodeAborted:
            pass
    if not episode.aborted and not evaluation and context.settings.rewards.credit == "turn":
        try:  # the turns no system scored: the mrlx_turn_reward hook (None -> 0.0)
            for t in episode.transcripts:
                if t.trainable:
                    for i, turn in enumerate(t.turns):
                        if t.turn_rewards[i] is None:
                            t.turn_rewards[i] = await episode.score_turn(t, i, turn, None)
        except EpisodeAborted:
            pass
    if not episode.aborted:
        try:
            found = context.hooks.shape_rewards.ask(
                episode=episode, settings=context.settings, team_shaping=context.system.team_shaping
            )
            if inspect.isawaitable(found):
                found = await asyncio.wait_for(found, context.settings.rewards.grade_timeout_s)
            plugin, rewards = found
            if rewards is not None:
                for i, value in shaped_rewards(episode, rewards, plugin).items():
                    episode.transcripts[i].reward = value
            if not evaluation and context.settings.rewards.credit == "turn":
                for t in episode.transcripts:
                    if t.trainable:
                        episode.turn_returns(t)  # checked here: the samples are made from them below
        except RewardError as exc:  # a shaped reward or a return that is not finite: this episode only
            episode.fail_reward(str(exc), exc)
    if evaluation:
        samples = [_evaluation_sample(episode)]
    else:
        samples = episode.samples_of(
            [a for a in context.settings.agents if context.trains_here(a)], every_agent=False
        )
    context.hooks.episode_end(episode=episode, samples=samples)
    if episode.aborted:
        logger.debug("episode %s aborted: %s", episode.id, episode.abort_reason)
    return episode, (samples[0] if evaluation else samples)


def _evaluation_sample(episode: Episode) -> Any:
    """The team's final answer as one sample; its reward is the final answer's grade (0.0 if none)."""
    if episode.aborted or not episode.transcripts:
        return episode.fallback_sample()
    t = episode.final_transcript or episode.transcripts[-1]
    s = t.to_sample(episode.sample, episode.rollout_id, aborted=False, meta=episode.sample_meta(t))
    if episode._within_context(t.agent, [s])[0] is not s:  # a system's own transcript past the limit
        return episode.fallback_sample(t.agent)
    s.response = episode.final_answer or ""
    s.reward = float(episode.team_reward or 0.0) if episode.final_transcript is not None else 0.0
    return s
