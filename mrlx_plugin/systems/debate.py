"""The debate system: two debaters argue in turn about the input's question, a judge picks a winner.

One episode per input sample (`mrlx.debate`):
1. The debaters (`debaters`, side A first) speak in turn, `rounds` speeches each: A, B, A, B, ...
   Each keeps its own transcript (its own chat template and token space); the other side's
   speeches reach it as plain-text user messages (context, loss mask 0), as in the dialogue.
2. The judge (`judge`, usually `trainable: false`, its own model behind its own URL) reads the
   whole debate in one user message, every speech quoted (`systems.quoting.quote`) under its
   side's heading, and must end its answer with the line "Winner: A" or "Winner: B": the last
   line of the answer, nothing else on it, is the verdict.
3. The winner's transcript earns `win_reward`, the loser's `lose_reward` (raw and trained reward,
   before the `mrlx_shape_rewards` hook, whose default leaves them as they are). A last line
   that is no verdict (a missing, cut-off or ambiguous one) leaves both debaters 0.0 and is
   recorded as `invalid_verdict` (`debate/invalid_verdict_rate`).

`episode.metadata`: `winner` (the agent, or None), `winner_side` ("A", "B" or None), `verdict`
(the last line of the judge's answer, or None when it is blank), `invalid_verdict` (bool),
`judge_answer` (the end of the judge's answer).

Evaluation: the episode's final transcript is that of the debater this job trains (`mrlx.self`
when it debates, else side A), and `team_reward` is 1.0 when that debater won, else 0.0: an
evaluation's mean reward is its win rate against the other side, as this judge sees it.

A trainable judge has no outcome of its own here: it is graded by the `mrlx_grade` hook (give one
that compares its verdict with a reference, e.g. the input's label). A frozen judge is the usual
recipe: a judge trained on the same episodes as the debaters has no fixed standard, and the two
can drift together (a judge that learns to favour one side or one style rewards debaters for
exploiting it).

Replace the prompts with `make_debate(DebatePrompts(...))`, registered under your own system name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import Field

from mrlx_plugin.core.config import TURNS_WHY, Number, Settings, SystemSection, Text, bounded, show_value
from mrlx_plugin.core.transcript import Transcript
from mrlx_plugin.core.values import finite_reward
from mrlx_plugin.episodes import Episode, Outcome, System
from mrlx_plugin.systems.pipeline import final_line, fit_solutions
from mrlx_plugin.systems.quoting import quote

SIDES = ("A", "B")


class DebateSettings(SystemSection):
    """The debate system (`system: debate`): two debaters argue in turn, a judge picks the winner."""

    about = "the debate-with-a-judge system"

    debaters: list[Text] | None = Field(
        None, description="the two debating agents, first speaker first; none = the first two agents listed"
    )
    judge: Text | None = Field(
        None, description="the judging agent (usually `trainable: false`); none = the third agent"
    )
    rounds: bounded(int, ge=1, le=512, why=TURNS_WHY) = Field(2, description="speeches per debater")
    win_reward: Number = Field(1.0, description="outcome of the debater the judge picks")
    lose_reward: Number = Field(-0.5, description="outcome of the other debater")

    def problems(self, settings: Settings, path: str) -> list[str]:
        names, errors = list(settings.agents), []
        agents = f"(agents: {', '.join(names)})"
        debaters = self.debaters if self.debaters is not None else names[:2]
        judge = self.judge if self.judge is not None else (names[2] if len(names) > 2 else None)
        if len(debaters) != 2 or len(set(debaters)) != 2:
            errors.append(f"{path}.debaters: expected two different agents; got {debaters}")
        errors += [
            f"{path}.debaters: {show_value(who)} is not an agent {agents}"
            for who in debaters
            if who not in settings.agents
        ]
        if judge is None:
            errors.append(f"{path}.judge: name the judging agent (or list a third agent)")
        elif judge not in settings.agents:
            errors.append(f"{path}.judge: {show_value(judge)} is not an agent {agents}")
        elif judge in debaters:
            errors.append(f"{path}.judge: {show_value(judge)} also debates; the judge must be another agent")
        return errors


# The whole last line, nothing else on it (bold, brackets, "Debater" and a final period
# allowed): words such as "no clear winner: a draw." name no side.
_VERDICT = re.compile(
    r"\**\s*winner\s*:\s*\**\s*\[?\s*(?:debater\s+)?([ab])\s*\]?\s*\.?\s*\**", re.IGNORECASE
)


def debater_prompt(problem: str, side: str, rounds: int) -> str:
    return (
        f"Debate question:\n{problem}\n\n"
        f"You are debater {side}; the other debater argues against you. Take a clear position, argue for it "
        f"and answer your opponent's points. You speak {rounds} time(s); a judge will pick the more "
        "convincing side."
    )


def opponent_message(side: str, text: str) -> str:
    """What a debater reads of a speech of the other side (`side`)."""
    return f"Debater {side}:\n{text}"


def judge_prompt(problem: str, speeches: list[tuple[str, str]]) -> str:
    # Each speech quoted (`quote`): a heading a debater writes is a line of its speech, not a section.
    debate = "\n\n".join(f"### Debater {side}\n{quote(text)}" for side, text in speeches)
    return (
        f"Debate question:\n{quote(problem)}\n\n"
        "Two debaters, A and B, argued the question, in the order shown below, each speech quoted "
        "between lines of backticks. Decide which debater was more convincing and correct, and end "
        "your reply with one of these lines, alone and last:\n"
        "Winner: A\nWinner: B\n\n"
        f"{debate}"
    )


@dataclass(frozen=True)
class DebatePrompts:
    """The messages of the debate. Replace any of them with `make_debate(...)`."""

    debater: Callable[[str, str, int], str] = debater_prompt
    opponent: Callable[[str, str], str] = opponent_message
    judge: Callable[[str, list[tuple[str, str]]], str] = judge_prompt


def parse_verdict(text: str) -> str | None:
    """The side ("A" or "B") the judge's answer names on its last line, which must be "Winner: X"
    and nothing else; None otherwise (no verdict, a cut-off or ambiguous one)."""
    found = _VERDICT.fullmatch(final_line(text) or "")
    return found.group(1).upper() if found else None


def debate_agents(settings) -> tuple[str, str, str]:
    """(side A's debater, side B's debater, the judge), with the defaults of `mrlx.debate`."""
    d, names = settings.debate, list(settings.agents)
    a, b = d.debaters if d.debaters is not None else names[:2]
    return a, b, d.judge if d.judge is not None else names[2]


def make_debate(prompts: DebatePrompts = DebatePrompts()):
    """A debate run function with these prompts (register it under your own system name)."""

    async def run(episode: Episode) -> Outcome:
        d = episode.settings.debate
        a, b, judge = debate_agents(episode.settings)
        debaters = dict(zip(SIDES, (a, b)))
        views: dict[str, Transcript] = {}
        unread: dict[str, list[dict[str, str]]] = {side: [] for side in SIDES}
        speeches: list[tuple[str, str]] = []
        for turn in range(2 * d.rounds):
            side, other = SIDES[turn % 2], SIDES[1 - turn % 2]
            t = views.get(side)
            if t is None:
                opening = {"role": "user", "content": prompts.debater(episode.problem, side, d.rounds)}
                t = views[side] = episode.new_transcript(
                    debaters[side], [opening] + unread[side], f"debater-{side}"
                )
            elif not t.append_messages(unread[side]):
                episode.metadata["stopped_by"] = f"context full ({debaters[side]})"
                break
            unread[side] = []
            before = len(t.turns)
            await episode.generate(t)
            if len(t.turns) == before:  # no room was left for a speech
                episode.metadata["stopped_by"] = f"context full ({debaters[side]})"
                break
            speeches.append((side, t.answer_text))
            unread[other].append({"role": "user", "content": prompts.opponent(side, t.answer_text)})
            if t.full:
                episode.metadata["stopped_by"] = f"context full ({debaters[side]})"
                break

        # Every speech in the judge's one message, each cut (keeping its end) if they would not fit.
        sides = [side for side, _ in speeches]
        message = fit_solutions(
            episode,
            judge,
            lambda texts: prompts.judge(episode.problem, list(zip(sides, texts))),
            [text for _, text in speeches],
            None,
        )
        judge_t = episode.new_transcript(judge, [{"role": "user", "content": message}], "judge")
        await episode.generate(judge_t)
        answer = judge_t.answer_text
        winner = parse_verdict(answer)
        episode.metadata.update(
            winner=debaters.get(winner),
            winner_side=winner,
            verdict=final_line(answer),
            invalid_verdict=winner is None,
            judge_answer=answer[-300:],
        )
        for side, t in views.items():
            outcome = 0.0 if winner is None else d.win_reward if side == winner else d.lose_reward
            setting = "mrlx.debate." + ("win_reward" if side == winner else "lose_reward")
            t.raw_reward = t.reward = finite_reward(outcome, f"the setting {setting}")  # no NaN trained on
        me = episode.settings.self_agent
        focus = next((side for side, agent in debaters.items() if agent == me), "A")
        return Outcome(final_transcript=views.get(focus), team_reward=1.0 if winner == focus else 0.0)

    return System(run=run, fan_out=debate_fan_out, turns=debate_turns)


def debate_fan_out(settings) -> dict[str, int]:
    """One transcript per debater, and the judge's when it is trainable."""
    a, b, judge = debate_agents(settings)
    out = {a: 1, b: 1}
    if settings.agents[judge].trainable:
        out[judge] = 1
    return out


def debate_turns(settings) -> dict[str, int]:
    """Model turns per transcript: `rounds` for each debater, one for the judge."""
    a, b, judge = debate_agents(settings)
    return {a: settings.debate.rounds, b: settings.debate.rounds, judge: 1}


# The system registered as `debate` owns the `mrlx.debate` section (its checks); a variant built
# with `make_debate` under another name reads the same section.
DEBATE = dataclasses.replace(make_debate(), settings=DebateSettings)
