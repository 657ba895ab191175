"""The host's samples of a finished episode: functions over an `Episode`, called once its rewards are
final (`run_episode`, and the multi-model outbox for the agents other jobs train).

Every sample carries the input's rollout id and the episode's facts (`sample_meta`); a system that
declares its fan-out gets exactly that many samples per agent (`samples_of`), ABORTED fillers
(`fallback_sample`) standing in for what the episode did not produce; under per-turn credit each
model turn is a sample trained on its return (`turn_samples`, `turn_returns`), compared within its
credit group (`credit_group`).
"""

from __future__ import annotations

import logging
import math

from mrlx_plugin.core.host import HostSample
from mrlx_plugin.core.transcript import Transcript
from mrlx_plugin.core.values import RewardError, finite_reward
from mrlx_plugin.episodes.episode import Episode

logger = logging.getLogger(__name__)


def samples_of(episode: Episode, agents: list[str], every_agent: bool) -> list[HostSample]:
    """Host samples of the transcripts of `agents`, agent by agent.

    When the system declares its fan-out (`context.samples_per_episode`), each agent gets exactly
    that many samples, ABORTED fillers standing in for transcripts the episode did not open (it
    was aborted, or stopped before that role spoke): the host's data-parallel split needs a
    step's sample count fixed. Otherwise each agent gets one sample per transcript; with
    `every_agent` an agent without a transcript gets a filler (a peer's group must have one
    sample per episode), and an episode with no transcript at all gets one filler.

    Under `rewards.credit: turn` a finished episode's trainable transcripts give one sample
    per model turn (and per candidate, with tree sampling): see `turn_samples`. The count per
    episode is then the system's `fan_out` x `turns` x `branch`; fillers stand in for the turns
    an episode did not reach.
    """
    wanted = episode.context.samples_per_episode
    per_turn = episode.settings.rewards.credit == "turn" and not episode.evaluation
    out: list[HostSample] = []
    for agent in agents:
        own: list[HostSample] = []
        for t in episode.transcripts:
            if t.agent != agent:
                continue
            if per_turn and t.trainable and not episode.aborted:
                own += turn_samples(episode, t)
            else:
                own.append(
                    t.to_sample(
                        episode.sample,
                        episode.rollout_id,
                        aborted=episode.aborted,
                        meta=sample_meta(episode, t),
                    )
                )
        own = within_context(episode, agent, own)
        if wanted is not None:
            want = wanted.get(agent, 0)
            if len(own) > want:
                per = "samples (one per turn and candidate)" if per_turn else "transcripts"
                raise RuntimeError(
                    f"system {episode.settings.system!r} declares {want} sample(s) of agent {agent!r} per "
                    "episode "
                    f"(its fan_out{' x turns x branch' if per_turn else ''}) but episode {episode.id} made "
                    f"{len(own)} "
                    f"{per} for it; fix the system's fan_out/turns or the transcripts and turns it makes"
                )
        else:
            want = max(len(own), 1) if every_agent else len(own)
        out += own + [fallback_sample(episode, agent) for _ in range(want - len(own))]
    if not out and wanted is None and agents:
        out.append(fallback_sample(episode, agents[0]))
    return out


def evaluation_sample(episode: Episode) -> HostSample:
    """The team's final answer as one sample; its reward is the final answer's grade (0.0 if none)."""
    if episode.aborted or not episode.transcripts:
        return fallback_sample(episode)
    t = episode.final_transcript or episode.transcripts[-1]
    s = t.to_sample(episode.sample, episode.rollout_id, aborted=False, meta=sample_meta(episode, t))
    if within_context(episode, t.agent, [s])[0] is not s:  # a system's own transcript past the limit
        return fallback_sample(episode, t.agent)
    s.response = episode.final_answer or ""
    s.reward = float(episode.team_reward or 0.0) if episode.final_transcript is not None else 0.0
    return s


def within_context(episode: Episode, agent: str, samples: list[HostSample]) -> list[HostSample]:
    """`samples` with any one longer than the agent's context limit replaced by an ABORTED
    filler, counted as over the context. The transcripts of `new_transcript` never grow past
    it; this keeps a system that builds its own from sending the host a sample it cannot pad."""
    limit = episode.context_limit(agent)
    if limit is None or all(len(s.tokens) <= limit for s in samples):
        return samples
    out = []
    for s in samples:
        if len(s.tokens) > limit:
            reason = (
                f"system {episode.settings.system!r} made a sample of agent {agent!r} of "
                f"{len(s.tokens)} tokens, past its context limit of {limit}"
            )
            logger.warning("%s (episode %s); it is replaced by an ABORTED filler", reason, episode.id)
            episode.over_context(reason)
            s = fallback_sample(episode, agent)
        out.append(s)
    return out


def turn_returns(episode: Episode, t: Transcript) -> list[float]:
    """Each turn's trained reward under per-turn credit: its own reward plus the outcome
    (the transcript's reward) carried back with discount `rewards.gamma`:
    G_last = r_last + outcome, G_i = r_i + gamma * G_(i+1).

    Nothing that is not finite is carried into a return: a turn reward a system set (the
    hook's are checked as they come), the outcome, or a sum that overflows raises
    RewardError naming it (`run_episode` checks the returns before any sample is made)."""
    gamma = float(episode.settings.rewards.gamma)
    g = finite_reward(t.reward if t.reward is not None else 0.0, f"the reward of {t.label}")
    returns = [0.0] * len(t.turns)
    for i in reversed(range(len(t.turns))):
        own = t.turn_rewards[i]
        if own is not None:
            own = finite_reward(
                own, f"system {episode.settings.system!r}: the own reward of turn {i} of {t.label}"
            )
        g = (0.0 if own is None else own) + (g if i == len(t.turns) - 1 else gamma * g)
        if not math.isfinite(g):
            raise RewardError(
                f"the return of turn {i} of {t.label} overflows to {g!r} (its own reward "
                f"{own!r}, gamma {gamma:g}); keep the rewards within a float's range"
            )
        returns[i] = g
    return returns


def turn_samples(episode: Episode, t: Transcript) -> list[HostSample]:
    """One sample per model turn of `t`; with tree sampling, after each turn the candidates
    sampled beside it and not taken.

    A turn without candidates trains on its return (`turn_returns`). At a turn with
    candidates (`transcript.branches`), under `rewards.branch_target: score` every one of
    the K, the taken one included, trains on its score: one quantity for the whole group, so
    that equal candidates get equal advantages. Under `taken_return` the taken one trains
    on its realised return and the others on their scores (see docs/credit.md: biased)."""
    returns = turn_returns(episode, t)
    by_score = episode.settings.rewards.branch_target == "score"
    out = []
    for i, turn in enumerate(t.turns):
        candidates = t.branches.get(i)
        reward = t.taken_scores[i] if candidates is not None and by_score else returns[i]
        taken = t.taken_candidates.get(i)
        meta = sample_meta(episode, t, i, index=taken)
        out.append(t.turn_sample(episode.sample, episode.rollout_id, i, turn, reward, meta=meta))
        others = [k for k in range(len(candidates or []) + 1) if k != taken]
        for k, (candidate, score) in zip(others, candidates or []):
            meta = sample_meta(episode, t, i, candidate=True, index=k)
            out.append(t.turn_sample(episode.sample, episode.rollout_id, i, candidate, score, meta=meta))
    return out


def credit_group(episode: Episode, t: Transcript | None, turn: int | None) -> str | None:
    """The set of samples (within one prompt group) an advantage is relative to: the agent
    and its role; per turn, also what the turn saw (the system's key for it, a game's
    information state: `transcript.turn_keys`), else the turn index; with tree sampling,
    the K candidates of one turn of one episode."""
    if t is None:
        return None
    group = t.agent + (f"@{t.role}" if t.role else "")
    if turn is None:
        return group
    keyed = episode.settings.rewards.group_turns_by == "observation" and turn < len(t.turn_keys)
    key = t.turn_keys[turn] if keyed else None
    if t.branches.get(turn) is not None:
        return f"{group}/turn{turn}/{episode.key}:{t.label}"
    return f"{group}/seen:{key}" if key is not None else f"{group}/turn{turn}"


def sample_meta(
    episode: Episode,
    t: Transcript | None,
    turn: int | None = None,
    candidate: bool = False,
    index: int | None = None,
) -> dict[str, object]:
    """What every sample of the episode carries in `metadata["mrlx"]` (`index`: a tree-sampled
    turn's candidate, in the order the K were sampled)."""
    counts = episode.counts
    return {
        "agent": t.agent if t is not None else None,
        "label": t.label if t is not None else None,
        "role": t.role if t is not None else None,
        # the LoRA adapter that produced the sample's turns (None: the engine's base model)
        "adapter": (t.adapter or episode.settings.agents[t.agent].adapter) if t is not None else None,
        "turn": turn,
        "candidate": candidate,  # sampled beside the turn the episode went on from
        "candidate_index": index,
        "credit_group": credit_group(episode, t, turn),
        "episode_id": episode.id,
        "system": episode.settings.system,
        "turns": counts.turns,
        "engine_calls": counts.engine_calls,
        "conversation_tokens": sum(len(v.prompt_ids) + len(v.response_ids) for v in episode.transcripts),
        "aborted": episode.aborted,
        "abort_reason": episode.abort_reason,
        # An ABORTED sample standing for what did not fit a context limit (fillers: fallback_sample).
        "over_context": "over_context" in episode.metadata and episode.aborted,
        "retried_turns": counts.retried_turns,
        "aborted_turns": counts.aborted_turns,
        "stopped_early": episode.stopped_early,
        "raw_reward": t.raw_reward if t is not None else None,
        "team_reward": episode.team_reward,
        "evaluation": episode.evaluation,
        "episode": dict(episode.metadata),
    }


def fallback_sample(episode: Episode, agent: str | None = None) -> HostSample:
    """A failed sample (in `agent`'s token space) for an agent that has no transcript."""
    agent = agent or next(iter(episode.settings.agents))
    messages = episode.with_system_prompt(agent, [{"role": "user", "content": episode.problem}])
    # Cut to the agent's limit (to_sample): the host pads a filler like any other sample.
    t = Transcript.start(
        agent,
        episode.context.tokenizers[agent],
        messages,
        trainable=False,
        max_context=episode.context_limit(agent),
    )
    meta = sample_meta(episode, t)
    meta["over_context"] = "over_context" in episode.metadata  # the episode stopped where it did not fit
    return t.to_sample(episode.sample, episode.rollout_id, aborted=True, meta=meta)
