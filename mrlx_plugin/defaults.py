"""The package's own hook implementations, registered `trylast` so that users' hooks win."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Awaitable
from functools import lru_cache

from mrlx_plugin.core.config import Settings
from mrlx_plugin.core.transcript import Transcript
from mrlx_plugin.core.values import RewardError, finite_reward
from mrlx_plugin.episodes import Episode, System
from mrlx_plugin.hookspecs import hookimpl
from mrlx_plugin.rewards.grading import grade_math, quick_grade
from mrlx_plugin.rewards.shaping import coupling_matrix, math_verifier, team_weighting
from mrlx_plugin.systems.debate import DEBATE
from mrlx_plugin.systems.dialogue import DIALOGUE
from mrlx_plugin.systems.game import GAME
from mrlx_plugin.systems.games import BUILT_IN_GAMES
from mrlx_plugin.systems.pipeline import PIPELINE


@hookimpl(trylast=True)
def mrlx_register_systems() -> dict[str, System]:
    return {"pipeline": PIPELINE, "dialogue": DIALOGUE, "game": GAME, "debate": DEBATE}


@hookimpl(trylast=True)
def mrlx_register_games() -> dict[str, object]:
    return dict(BUILT_IN_GAMES)


@hookimpl(trylast=True)
def mrlx_grade(agent: str, transcript: Transcript, episode: Episode) -> object:
    if episode.settings.rewards.grader == "host":
        from mrlx_plugin.core.host import host_reward
        from mrlx_plugin.rewards.shaping import _WithoutCustomRm

        sample = transcript.to_sample(episode.sample, episode.rollout_id, aborted=False, meta={})
        sample.response = transcript.answer_text
        return _as_float(host_reward(_WithoutCustomRm(episode.context.args), sample), episode.context.args)
    quick = quick_grade(transcript.answer_text, episode.label)
    if quick is not None:  # settled without algebra: no coroutine, no worker round trip
        return quick
    return grade_math(transcript.answer_text, episode.label, math_verifier(episode.context.args))


async def _as_float(awaitable: Awaitable[object], args: argparse.Namespace) -> float:
    value = await awaitable
    if isinstance(value, dict):
        key = getattr(args, "reward_key", None)
        if not key:
            raise ValueError(
                f"the host's grader returned a dict {sorted(value)}; set --reward-key to pick one"
            )
        value = value[key]
    # Named here: a NaN of the host's grader is not this module's, though this module asked for it.
    rm = getattr(args, "rm_type", None) or getattr(args, "custom_rm_path", None)
    value = float(value) if isinstance(value, bool) else value  # a pass/fail grader's True is 1.0
    return finite_reward(value, f"the host's reward function (rewards.grader: host; {rm or 'no --rm-type'})")


@hookimpl(trylast=True)
def mrlx_shape_rewards(episode: Episode, settings: Settings, team_shaping: bool) -> dict[int, float]:
    graded = [(i, t) for i, t in enumerate(episode.transcripts) if t.raw_reward is not None]
    if team_shaping:
        weighted = {
            i: team_weighting(t.raw_reward, episode.team_reward, settings.pipeline) for i, t in graded
        }
        return _finite(weighted, episode, "mrlx.pipeline.correct_weight and incorrect_weight")
    agents = list(dict.fromkeys(t.agent for _, t in graded))
    matrix = coupling_matrix(settings.rewards.shaping, agents, settings.rewards.coupling)
    own = {
        a: sum(t.raw_reward for _, t in graded if t.agent == a) / sum(1 for _, t in graded if t.agent == a)
        for a in agents
    }
    episode.metadata["coupling"] = matrix  # recorded in every sample's metadata
    shaped = {
        i: sum(w * (t.raw_reward if other == t.agent else own[other]) for other, w in matrix[t.agent].items())
        for i, t in graded
    }
    setting = "mrlx.rewards.coupling" if settings.rewards.shaping == "asymmetric" else "mrlx.rewards.shaping"
    return _finite(shaped, episode, setting)


def _finite(shaped: dict[int, float], episode: Episode, setting: str) -> dict[int, float]:
    """`shaped`, when every value is finite. The raw rewards are (each is checked as it is made),
    so one that is not comes from the shaping's settings: the error names them, not this module."""
    for i, value in shaped.items():
        if not math.isfinite(value):
            t = episode.transcripts[i]
            raise RewardError(
                f"the built-in shaping gave {value!r} for {t.label} (raw reward "
                f"{t.raw_reward!r}) with the settings {setting}; give them finite values"
            )
    return shaped


@lru_cache(maxsize=64)
def _pattern(text: str) -> re.Pattern:
    return re.compile(text)


@hookimpl(trylast=True)
def mrlx_should_stop(episode: Episode, agent: str, transcript: Transcript) -> bool:
    pattern = episode.settings.dialogue.stop_patterns.get(agent)
    return bool(pattern and _pattern(pattern).search(transcript.last_text))
