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

from mrlx_plugin.core.episode import Episode
from mrlx_plugin.core.transcript import Transcript


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


async def run_dialogue(episode: Episode) -> None:
    d = episode.settings.dialogue
    order = speaking_order(episode.settings)
    views: dict[str, Transcript] = {}
    unread: dict[str, list[dict[str, str]]] = {a: [] for a in order}
    last_speaker = None
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
        stop = episode.runtime.hooks.mrlx_should_stop(episode=episode, agent=agent, transcript=t)
        if stop:
            episode.stopped_early = turn + 1 < d.max_turns
            episode.metadata["stopped_by"] = f"stop rule ({agent})"
            break
    final = d.final_answer_agent or last_speaker
    if final in views:
        episode.final_transcript = views[final]
        episode.final_answer = views[final].answer_text


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


run_dialogue.fan_out = _dialogue_fan_out  # type: ignore[attr-defined]
run_dialogue.turns = _dialogue_turns  # type: ignore[attr-defined]
