"""The turn-taking dialogue system: N >= 2 named agents speak in turn about one task.

Each agent keeps its own transcript: its system prompt, the task, and the conversation in its
own chat template and token space. Its own turns are the ids its engine sampled (loss mask 1,
with log-probs and weight versions); the other agents' messages are context (loss mask 0). An
agent's transcript opens at its first turn, so it starts from everything said before it.

Settings (`mrlx.dialogue`): `first`, `order`, `max_turns`, `stop_patterns` per agent,
`openings` per agent (its first message, a template over the input sample), and
`final_answer_agent` (default: whoever spoke last). The `mrlx_should_stop` hook may end the
episode after any turn; a stop before `max_turns` counts as an early termination. A full context
stops it too (`stopped_by: context full (AGENT)`): messages an agent's view cannot hold are cut
to fit, and an agent whose first view would leave no room for a turn does not speak (its samples
are ABORTED fillers, counted as over the context).
"""

from __future__ import annotations

import re

from pydantic import Field

from mrlx_plugin.core.config import TOP_KEY, TURNS_WHY, Settings, SystemSection, Text, bounded, show_value
from mrlx_plugin.core.transcript import Transcript
from mrlx_plugin.episodes import Episode, Outcome, System


class DialogueSettings(SystemSection):
    """The dialogue system (`system: dialogue`): two or more agents take turns."""

    about = "the dialogue system (agents take turns)"

    first: Text | None = Field(None, description="who speaks first; none = the first agent listed")
    order: list[Text] | None = Field(None, description="turn order; none = the agents in the order listed")
    max_turns: bounded(int, ge=1, le=1024, why=TURNS_WHY) = Field(8, description="turn limit")
    stop_patterns: dict[str, Text] = Field(
        default_factory=dict, description="agent -> regular expression that ends the episode"
    )
    final_answer_agent: Text | None = Field(
        None, description="whose last message is the episode's final answer; none = the last speaker"
    )
    openings: dict[str, Text] = Field(
        default_factory=dict,
        description="agent -> its first message; `{problem}`, `{label}` and `{metadata[KEY]}` are filled in "
        "from the input sample (so an agent can be told what others must not see); default: "
        "the problem",
    )

    def problems(self, settings: Settings, path: str) -> list[str]:
        names, errors = list(settings.agents), []
        agents = f"(agents: {', '.join(names)})"
        for key, who in (("first", self.first), ("final_answer_agent", self.final_answer_agent)):
            if who is not None and who not in settings.agents:
                errors.append(f"{path}.{key}: {show_value(who)} is not an agent {agents}")
        errors += [
            f"{path}.order[{i}]: {show_value(who)} is not an agent {agents}"
            for i, who in enumerate(self.order or [])
            if who not in settings.agents
        ]
        for who, pattern in self.stop_patterns.items():
            if who not in settings.agents:
                errors.append(f"{path}.stop_patterns.{who}: not an agent {agents}")
                continue
            try:
                re.compile(pattern)
            except re.error as exc:
                errors.append(f"{path}.stop_patterns.{who}: not a regular expression ({exc})")
        for who, text in self.openings.items():
            if who not in settings.agents:
                errors.append(f"{path}.openings.{who}: not an agent {agents}")
                continue
            try:
                text.format(problem="", label="", metadata=_AnyKey())
            except (KeyError, IndexError, ValueError, AttributeError) as exc:
                errors.append(
                    f"{path}.openings.{who}: cannot fill in {exc}; use {{problem}}, {{label}} or "
                    "{metadata[KEY]} (double the braces for literal ones)"
                )
        if len(names) < 2:
            errors.append(
                f"{TOP_KEY}.agents: the dialogue system needs at least two agents; got {len(names)}"
            )
        return errors


class _AnyKey(dict):
    """Stands in for sample metadata when checking an opening template."""

    def __missing__(self, key: str) -> str:
        return ""


def speaking_order(settings) -> list[str]:
    """Who speaks, in turn order, starting with `dialogue.first`."""
    d = settings.dialogue
    order = list(d.order or settings.agents)
    first = d.first or order[0]
    if first in order:
        i = order.index(first)
        order = order[i:] + order[:i]
    else:
        order = [first] + order
    return order


def opening(episode: Episode, agent: str) -> dict[str, str]:
    """The agent's first message: its `dialogue.openings` template filled in, or the problem."""
    template = episode.settings.dialogue.openings.get(agent)
    if template is None:
        return {"role": "user", "content": episode.problem}
    metadata = dict(getattr(episode.sample, "metadata", None) or {})
    try:
        text = template.format(
            problem=episode.problem,
            label=episode.label if episode.label is not None else "",
            metadata=metadata,
        )
    except KeyError as exc:
        raise ValueError(
            f"mrlx.dialogue.openings.{agent}: input sample {episode.sample.index} has no metadata key {exc} "
            f"(its keys: {sorted(metadata)}); add it to the prompt data's metadata"
        ) from None
    return {"role": "user", "content": text}


async def run_dialogue(episode: Episode) -> Outcome:
    d = episode.settings.dialogue
    order = speaking_order(episode.settings)
    views: dict[str, Transcript] = {}
    unread: dict[str, list[dict[str, str]]] = {a: [] for a in order}
    last_speaker, stopped_early = None, False
    for turn in range(d.max_turns):
        agent = order[turn % len(order)]
        t = views.get(agent)
        if t is None:
            messages = [opening(episode, agent)] + unread[agent]
            if turn and not episode.fits(agent, messages):
                # The history has outgrown this agent's context before it spoke: the turns so far
                # stand, its samples are ABORTED fillers counted as over the context. (On the first
                # turn there is nothing to keep: new_transcript aborts the episode.)
                episode.over_context(
                    f"the history is past the context limit of {agent!r} before its first turn"
                )
                episode.metadata["stopped_by"] = f"context full ({agent})"
                break
            t = views[agent] = episode.new_transcript(agent, messages)
        elif not t.append_messages(unread[agent]) or t.full:  # cut to the context: no room for a turn
            episode.metadata["stopped_by"] = f"context full ({agent})"
            break
        unread[agent] = []
        await episode.generate(t)
        last_speaker = agent
        message = {"role": "user", "content": t.answer_text}
        for other in order:
            if other != agent:
                unread[other].append(message)
        if t.full:
            episode.metadata["stopped_by"] = f"context full ({agent})"
            break
        stop = episode.context.hooks.should_stop(episode=episode, agent=agent, transcript=t)
        if stop:
            stopped_early = turn + 1 < d.max_turns
            episode.metadata["stopped_by"] = f"stop rule ({agent})"
            break
    final = d.final_answer_agent or last_speaker
    return Outcome(
        final_transcript=views.get(final) if final is not None else None, stopped_early=stopped_early
    )


def _dialogue_fan_out(settings) -> dict[str, int]:
    """One sample per agent that takes turns (an agent keeps one transcript however often it speaks)."""
    return {agent: 1 for agent in speaking_order(settings)}


def _dialogue_turns(settings) -> dict[str, int]:
    """The most turns each agent takes in one episode: its share of `max_turns` in turn order."""
    order = speaking_order(settings)
    counts = dict.fromkeys(order, 0)
    for turn in range(settings.dialogue.max_turns):
        counts[order[turn % len(order)]] += 1
    return {agent: max(1, n) for agent, n in counts.items()}


DIALOGUE = System(
    run=run_dialogue, fan_out=_dialogue_fan_out, turns=_dialogue_turns, settings=DialogueSettings
)
