"""Running one episode: the system's run and the `Outcome` it returns, then the grades, the turn
rewards and the shaping through the hooks, and the host's samples (episodes.samples), every one
with a reward and the input's rollout id. Engine faults and host aborts come back as ABORTED
samples; a reward that fails ends the episode only.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence

from mrlx_plugin.core.host import HostSample
from mrlx_plugin.core.transcript import Transcript, Turn
from mrlx_plugin.core.values import RewardError, finite_reward
from mrlx_plugin.episodes.context import EpisodeContext
from mrlx_plugin.episodes.episode import Episode
from mrlx_plugin.episodes.errors import EpisodeAborted, HookResultError
from mrlx_plugin.episodes.outcome import Outcome
from mrlx_plugin.episodes.samples import evaluation_sample, samples_of, turn_returns
from mrlx_plugin.episodes.turn import score_turn

logger = logging.getLogger(__name__)


async def run_episode(
    context: EpisodeContext,
    sample: HostSample,
    sampling_params: Mapping[str, object] | None,
    evaluation: bool,
    host_aborted: Callable[[], bool] | None = None,
) -> tuple[Episode, HostSample | list[HostSample]]:
    """Run the configured system on one input sample; return the episode and the host's sample(s).

    Training: a list of samples for the agents this job trains, sharing the input's rollout id.
    Evaluation: one sample holding the team's final answer, its reward the final answer's grade.
    `host_aborted` tells whether the host has ended the rollout (no new turn starts then). Every
    observer of `mrlx_episode_end` sees the finished episode and its samples (a multi-model
    job's outbox takes the samples of agents other jobs train from there).
    """
    episode = Episode(context, sample, sampling_params, evaluation, host_aborted)
    try:
        outcome = await context.system.run(episode)
        if not isinstance(outcome, Outcome):
            shown = repr(outcome) if len(repr(outcome)) <= 200 else repr(outcome)[:200] + "..."
            raise HookResultError(
                f"{context.system.producer(context.settings.system)}: its run function returned {shown}; "
                "a run function returns an Outcome (mrlx_plugin.Outcome: the final answer, the team "
                "reward, rewards per agent; Outcome() for none), see docs/reference.md, writing a system"
            )
        await _finish(episode, outcome)
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
                            t.turn_rewards[i] = await score_turn(episode, t, i, turn, None)
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
                        turn_returns(episode, t)  # checked here: the samples are made from them below
        except RewardError as exc:  # a shaped reward or a return that is not finite: this episode only
            episode.fail_reward(str(exc), exc)
    if evaluation:
        samples = [evaluation_sample(episode)]
    else:
        samples = samples_of(episode, [a for a in context.settings.agents if context.trains_here(a)], False)
    context.hooks.episode_end(episode=episode, samples=samples)
    if episode.aborted:
        logger.debug("episode %s aborted: %s", episode.id, episode.abort_reason)
    return episode, (samples[0] if evaluation else samples)


async def _finish(episode: Episode, outcome: Outcome) -> None:
    """Apply the system's `Outcome`, checked: each agent's rewards to its transcripts, the turns'
    own rewards, the final answer, the conversation that gave it and the team's reward. What is
    wrong raises RewardError naming the system (`System.origin`): that episode ends ABORTED."""
    who = episode.context.system.producer(episode.settings.system)
    declared = episode.context.samples_per_episode
    agents = list(declared) if declared is not None else list(episode.settings.agents)
    rewards, turn_rewards = outcome.rewards, outcome.turn_rewards
    if not isinstance(rewards, Mapping) or not isinstance(turn_rewards, Mapping):
        raise RewardError(
            f"{who} gave rewards of type {type(rewards).__name__} and turn rewards of type "
            f"{type(turn_rewards).__name__}; expected mappings of agent -> reward"
        )
    views: dict[str, list[Transcript]] = {}
    for agent in (*rewards, *turn_rewards):
        if agent not in agents:
            raise RewardError(
                f"{who} returned a reward for {agent!r}, which is none of its agents ({', '.join(agents)})"
            )
        views[agent] = [t for t in episode.transcripts if t.agent == agent]
    for agent, value in rewards.items():
        reward = finite_reward(value, f"{who}: the reward of {agent!r}")
        for t in views[agent]:
            t.raw_reward = t.reward = reward
    for agent, values in turn_rewards.items():
        _apply_turn_rewards(episode, who, agent, values, views[agent])
    final = outcome.final_transcript
    answer = outcome.answer if outcome.answer is not None or final is None else final.answer_text
    if answer is not None and not isinstance(answer, str):
        raise RewardError(f"{who} gave the answer {answer!r}; expected text")
    by = outcome.answered_by
    if by is not None and by not in agents:
        raise RewardError(f"{who} gave answered_by={by!r}, which is none of its agents")
    team = outcome.team_reward
    if answer is not None and final is None:
        answered = [t for t in episode.transcripts if t.turns and by in (None, t.agent)]
        final = answered[-1] if answered else None
        if team is None and final is not None:  # the answer given is what is graded
            team = await grade_answer(episode, answer, final.agent)
    episode.final_answer, episode.final_transcript = answer, final
    episode.team_reward = None if team is None else finite_reward(team, f"{who}: the team reward")
    episode.stopped_early = bool(outcome.stopped_early)


def _apply_turn_rewards(
    episode: Episode, who: str, agent: str, values: object, views: list[Transcript]
) -> None:
    """An `Outcome`'s turn rewards of `agent`: one per turn of its one conversation, each the
    turn's own; per-turn credit trains each turn on its return, episode credit the conversation
    on the outcome plus their sum."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(views) != 1:
        raise RewardError(
            f"{who}: turn_rewards[{agent!r}] must be a list with one reward per turn of "
            f"the agent's one conversation ({len(views)} conversations here)"
        )
    t = views[0]
    if len(values) != len(t.turns):
        raise RewardError(
            f"{who} gave {len(values)} turn reward(s) for {agent!r}, whose conversation "
            f"took {len(t.turns)} turn(s)"
        )
    own = [finite_reward(v, f"{who}: turn {i} of {t.label}") for i, v in enumerate(values)]
    if episode.settings.rewards.credit == "turn" and not episode.evaluation:
        t.turn_rewards = own
        if t.raw_reward is None:  # no outcome given: 0, not the grade hook's (the turns carry it)
            t.raw_reward = t.reward = 0.0
    else:
        total = (t.raw_reward or 0.0) + math.fsum(own)
        t.raw_reward = t.reward = finite_reward(total, f"{who}: the reward of {t.label}")


async def grade_answer(episode: Episode, answer: str, agent: str) -> float:
    """`answer` graded as `agent`'s answer to this episode's task, by the `mrlx_grade` hook."""
    if agent not in episode.context.tokenizers:
        raise KeyError(f"agent {agent!r} is not configured under mrlx.agents")
    # A view that holds only the answer (no ids): what a grader reads of a transcript.
    view = Transcript(
        agent, episode.context.tokenizers[agent], [], trainable=False, label=f"{agent} (graded)"
    )
    view.turns.append(Turn(agent, [], [], answer, "stop", None))
    return await episode.grade(view)


def shaped_rewards(episode: Episode, rewards: object, plugin: str | None) -> dict[int, float]:
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


def _finite_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int past a float's range, e.g. 10**400
        return False


def _real_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_system_rewards(episode: Episode) -> None:
    """The rewards the system itself set (raw and trained rewards of its transcripts, the team's
    reward): RewardError naming the system when one is not finite. The built-in systems check
    theirs where they are made, naming the game or the setting; this catches any other."""
    who = episode.context.system.producer(episode.settings.system)
    for t in episode.transcripts:
        for value, what in ((t.raw_reward, "raw reward"), (t.reward, "reward")):
            if value is not None:
                finite_reward(value, f"{who}: the {what} of {t.label}")
    if episode.team_reward is not None:
        finite_reward(episode.team_reward, f"{who}: the team reward")
