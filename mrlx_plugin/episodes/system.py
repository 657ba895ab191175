"""What an agent system is: one `System` holds how an episode runs, how many samples it makes, how its
samples are weighted, its settings and its start-up checks.

A plugin registers systems by name (`mrlx_register_systems`), as it registers games
(`mrlx_register_games`); both are collected once when the plugins load, and the selected system's
start-up check runs then, so a misspelled name fails before the first episode.

    async def run(episode): ...

    SOLO = System(run=run, fan_out=lambda settings: {"solver": 1})
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from mrlx_plugin.core.config import Settings
    from mrlx_plugin.episodes.episode import Episode

Counts = Callable[["Settings"], Mapping[str, int]]


@dataclass(frozen=True)
class Registered:
    """Something a plugin registered by name (a system, a game), with the plugin that did."""

    name: str
    value: object
    plugin: str


@dataclass(frozen=True)
class System:
    """An agent system.

    `run(episode)` drives one episode (see `Episode`). `fan_out(settings)` declares the
    transcripts one episode opens per agent (0 or more): every episode then returns exactly that
    many samples per trained agent, ABORTED fillers standing in for what it did not open, so a
    host step has a fixed size; without it the count varies and the host needs
    `--use-dynamic-batch-size`. `turns(settings)` declares the most model turns one transcript of
    an agent takes (1 or more; an agent left out: 1), needed under per-turn credit.
    `team_shaping`: the samples are weighted by the team's outcome (the `mrlx_shape_rewards`
    hook receives it). `settings`: the model of the system's section of the config (`mrlx.NAME`).
    `check(settings, games)`: the system's start-up checks of the settings, given the registered
    games; it returns the problems it found (each one line naming the key), none when all is well.
    `scores_candidates`: the system scores tree sampling's candidates itself (it passes `score`
    to `Episode.generate`, as the game system does by its rules); without it, tree sampling
    needs an `mrlx_turn_reward` implementation.
    """

    run: Callable[[Episode], Awaitable[None]]
    fan_out: Counts | None = None
    turns: Counts | None = None
    team_shaping: bool = False
    settings: type[BaseModel] | None = None
    check: Callable[[Settings, Mapping[str, Registered]], list[str]] | None = None
    scores_candidates: bool = False

    def __post_init__(self) -> None:
        if not inspect.iscoroutinefunction(self.run):
            raise TypeError(f"System.run must be an async function run(episode); got {self.run!r}")
