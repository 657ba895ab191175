"""The values a model's answer and a reward can hold: one definition for the engine client, which
checks an engine's answers, the wire protocol, which checks what the coordinator queues, and
everything that makes a reward (`finite_reward`)."""

from __future__ import annotations

import decimal
import math
import numbers
from typing import cast

# Log-probs must be <= 0; a sampler's float arithmetic can land a hair above zero for a token of
# probability ~1, so values up to this epsilon are accepted as they are (not clamped).
LOG_PROB_EPSILON = 1e-3
# The lowest log-prob accepted. An engine samples a token from a float32 softmax, in which a
# probability below the smallest positive float32 (about 1.4e-45, log -103.3) is zero and never
# sampled; a log-prob reported from another distribution than the one sampled from (before the
# temperature, or for a token a grammar forced) is lower by the logit gap, a few hundred at most
# for real models. -1e4 accepts all of these and keeps every accepted value, and its difference
# to any other log-prob, an ordinary float32, while -1e30 makes a trainer's loss infinite and
# -1e39 is past float32 (the coordinator's frames cannot carry it).
MIN_LOG_PROB = -1e4
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 (mrlx_plugin.link.wire)

# A value as JSON holds it (a request body, an answer, a settings file once parsed).
JSON = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
JSONObject = dict[str, JSON]


class RewardError(ValueError):
    """A reward that is not a finite number, its message naming who made it (a plugin, a game, a
    setting). It ends the episode like a failed grade: ABORTED samples, never a 0.0 in its place."""


def finite_reward(value: object, producer: str) -> float:
    """`value` as a float when it is a finite number; else RewardError naming `producer`, e.g.
    "game 'nim' (registered by plugin 'my_games'): move_reward of seat first's move 2"."""
    # A number is a real number: not text that float() would parse ("0.5"), not a truth value
    # (True, numpy's bool_), whatever float() makes of them.
    is_number = (
        isinstance(value, (numbers.Real, decimal.Decimal))
        and not isinstance(value, bool)
        and type(value).__name__ != "bool_"
    )
    try:
        number = float(cast("numbers.Real | decimal.Decimal", value)) if is_number else math.nan
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number):
        try:
            shown = repr(value)
        except ValueError:  # an int of more digits than Python will print
            shown = f"an int of {cast(int, value).bit_length()} bits"
        raise RewardError(f"{producer} gave {shown[:200]}; expected a finite number")
    return number
