"""A long-tail workload for a dialogue: a prompt whose metadata holds `rounds: N` is discussed for N
rounds (every agent speaks N times) instead of one, so its episodes make N times the engine calls.

A plugin module (`mrlx.plugins: [mrlx_lab.examples.long_tail]`) for `system: dialogue` with
`dialogue.max_turns` at least the longest prompt's rounds times the agents. The work is real: each
extra turn is a model turn sampled on the engine, seen by the others, trained on and graded as any
other (every agent's reward is its last answer's). `mrlx demo --long-tail` gives a fraction of its
questions many rounds, so some episodes take many times the median's turns.
"""

from __future__ import annotations

from mrlx_plugin import hookimpl

ROUNDS_KEY = "rounds"  # the input sample's metadata key


def rounds_of(metadata: object) -> int | None:
    """The rounds a prompt's metadata asks for (None: not set, the dialogue's own limits apply)."""
    value = metadata.get(ROUNDS_KEY) if isinstance(metadata, dict) else None
    return value if type(value) is int and value >= 1 else None


@hookimpl
def mrlx_should_stop(episode, agent, transcript) -> bool | None:
    """Stop once every agent has spoken `rounds` times; defer to the other rules before that."""
    rounds = rounds_of(getattr(episode.sample, "metadata", None))
    if rounds is None:
        return None
    turns = sum(len(t.turns) for t in episode.transcripts)
    return True if turns >= rounds * len(episode.settings.agents) else None
