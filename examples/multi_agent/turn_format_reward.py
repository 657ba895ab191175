"""A turn reward as a user writes one (`mrlx_turn_reward`): each model turn scores 1.0 when it
gives a boxed answer (`\\boxed{...}`) and 0.0 when it does not. A format reward, the plainest
turn-level signal: under `rewards.credit: turn` it is each turn's own reward, and with tree
sampling (`rewards.branch: K`) it is what a turn's K candidates are compared by. Replace it with
your task's: a rule, the environment's feedback, or a judge model (an `async def` is awaited).

    mrlx:
      plugins: [examples.multi_agent.turn_format_reward]
      rewards: {credit: turn, branch: 2}
"""

from __future__ import annotations

from mrlx_plugin import hookimpl
from mrlx_plugin.systems.games import boxed


@hookimpl
def mrlx_turn_reward(episode, transcript, index, turn) -> float:
    return 1.0 if boxed(turn.text) is not None else 0.0
