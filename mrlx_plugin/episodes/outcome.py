"""What a system's run function returns: the `Outcome` of its episode (built-in systems, systems a
plugin registers and agent code alike). `run_episode` applies it, checked, before grading."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mrlx_plugin.core.transcript import Transcript


@dataclass
class Outcome:
    """How an episode ended. Every field is optional: `Outcome()` says the system set no reward and
    gives no answer (the `mrlx_grade` hook grades its trainable transcripts).

    `rewards[agent]`: the outcome reward of each of the agent's conversations (an agent in neither
    mapping, and a transcript whose reward the system did not set, is graded by the `mrlx_grade`
    hook; one with turn rewards only has outcome 0). `turn_rewards[agent]`: one reward per turn of
    the agent's one conversation, its turns' own rewards: under `rewards.credit: turn` each turn
    trains on its return (its own reward plus the discounted later ones and the outcome), under
    episode credit the conversation trains on the outcome plus their sum.

    `answer`: the team's final answer (evaluation returns it; `mrlx_shape_rewards` reads it as
    `episode.final_answer`; none: the answer text of `final_transcript`, if named).
    `final_transcript`: the conversation that gave it, whose sample is evaluation's (none: the last
    conversation of agent `answered_by`, or of any agent, when there is an `answer`).
    `team_reward`: the answer's grade; none: the final transcript's own grade when the system names
    that transcript, else `answer` graded by the `mrlx_grade` hook as its agent's answer.
    `stopped_early`: the episode stopped before its turn limit (an early termination, counted)."""

    rewards: Mapping[str, float] = field(default_factory=dict)
    turn_rewards: Mapping[str, Sequence[float]] = field(default_factory=dict)
    answer: str | None = None
    team_reward: float | None = None
    answered_by: str | None = None  # the agent whose conversation gave `answer` (none: the last one)
    final_transcript: Transcript | None = None
    stopped_early: bool = False
