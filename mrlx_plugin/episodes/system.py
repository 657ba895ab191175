"""What an agent system is, and how the selected one starts: one `System` holds how an episode runs,
how many samples it makes, how its samples are weighted, its settings and its start-up checks;
`start_system` runs those checks once per process and counts the samples of an episode.

A plugin registers systems by name (`mrlx_register_systems`), as it registers games
(`mrlx_register_games`); both are collected once when the plugins load, and the selected system's
start-up check runs then, so a misspelled name fails before the first episode.

    async def run(episode):
        ...
        return Outcome(final_transcript=t)

    SOLO = System(run=run, fan_out=lambda settings: {"solver": 1})
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel

from mrlx_plugin.core.config import ConfigError, Settings
from mrlx_plugin.episodes.outcome import Outcome

Counts = Callable[[Settings], Mapping[str, int]]


@dataclass(frozen=True)
class Registered:
    """Something a plugin registered by name (a system, a game), with the plugin that did."""

    name: str
    value: object
    plugin: str


@dataclass(frozen=True)
class System:
    """An agent system.

    `run(episode)` drives one episode (an `Episode`, `mrlx_plugin.episodes.episode`) and returns
    its `Outcome`. `fan_out(settings)` declares the
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
    needs an `mrlx_turn_reward` implementation. `origin`: how errors about the rewards and the
    `Outcome` the system gives name their producer (none: `system NAME (the module of run)`).
    """

    # Given the episode's `Episode` (not imported here: a system's type sits below the episode).
    run: Callable[..., Awaitable[Outcome]]
    fan_out: Counts | None = None
    turns: Counts | None = None
    team_shaping: bool = False
    settings: type[BaseModel] | None = None
    check: Callable[[Settings, Mapping[str, Registered]], list[str]] | None = None
    scores_candidates: bool = False
    origin: str | None = None

    def __post_init__(self) -> None:
        if not inspect.iscoroutinefunction(self.run):
            raise TypeError(f"System.run must be an async function run(episode); got {self.run!r}")

    def producer(self, name: str) -> str:
        """How errors name this system, registered as `name`."""
        return self.origin or f"system {name!r} ({getattr(self.run, '__module__', None) or 'unknown module'})"


# --- start-up ---------------------------------------------------------------------------------

# The plugins other than the package's own defaults that implement a hook, by the hook's name.
HookUsers = Callable[[str], set[str]]


def start_system(
    systems: Mapping[str, Registered],
    games: Mapping[str, Registered],
    settings: Settings,
    source: str,
    hook_users: HookUsers,
) -> tuple[System, dict[str, int] | None]:
    """The selected system, its start-up checks passed, and the samples one episode returns per
    agent (`samples_per_agent`): what start-up computes, also for `mrlx check`."""
    if settings.system not in systems:
        raise ConfigError(
            f"{source}: mrlx.system: no system named {settings.system!r} is registered "
            f"(known: {', '.join(sorted(systems))})"
        )
    system = systems[settings.system].value
    assert isinstance(system, System)  # collect_systems takes no other kind
    problems = system.check(settings, games) if system.check is not None else []
    problems += tree_sampling_problems(system, settings, hook_users)
    if problems:
        raise ConfigError("; ".join(f"{source}: {p}" for p in problems))
    return system, samples_per_agent(system, settings, source)


def tree_sampling_problems(system: System, settings: Settings, hook_users: HookUsers) -> list[str]:
    """Tree sampling (`rewards.branch` > 1) trains every candidate on its score (docs/credit.md):
    something must score the candidates, and under `branch_target: score` no shaping may be
    expected to reach them (a score is the system's or the hook's number, never shaped)."""
    r = settings.rewards
    if r.branch <= 1:
        return []
    problems = []
    if not system.scores_candidates and not hook_users("mrlx_turn_reward"):
        problems.append(
            f"mrlx.rewards.branch: {r.branch} candidates per turn are compared by their score, and "
            f"nothing scores them: system {settings.system!r} does not, and no plugin implements "
            "mrlx_turn_reward (every candidate would score 0.0, and the episode's outcome reaches no "
            "tree-sampled turn); implement mrlx_turn_reward, or set branch: 1"
        )
    shapers = hook_users("mrlx_shape_rewards")
    if r.branch_target == "score" and (r.shaping != "independent" or system.team_shaping or shapers):
        what = (
            f"plugin {sorted(shapers)[0]!r} implements mrlx_shape_rewards"
            if shapers
            else f"system {settings.system!r} weights its samples by the team"
            if system.team_shaping
            else f"mrlx.rewards.shaping is {r.shaping!r}"
        )
        problems.append(
            f"mrlx.rewards.branch: tree-sampled turns train on their candidates' scores, which no episode "
            f"shaping reaches, but {what}; use shaping: independent with tree sampling (or branch: 1)"
        )
    return problems


def declared_counts(system: System, settings: Settings, source: str, what: str) -> dict[str, int] | None:
    """What `system` declares (see `System`): `fan_out(settings)`, transcripts per episode and
    agent (0 or more), or `turns(settings)`, the most model turns one transcript of an agent
    takes (1 or more); None when it declares none."""
    declare = system.fan_out if what == "fan_out" else system.turns
    if declare is None:
        return None
    counts = declare(settings)
    least, meaning = (
        (0, "transcripts per episode") if what == "fan_out" else (1, "the most turns one transcript takes")
    )
    if not isinstance(counts, dict) or not all(
        a in settings.agents and isinstance(n, int) and n >= least for a, n in counts.items()
    ):
        raise ConfigError(
            f"{source}: system {settings.system!r}: {what}(settings) returned {counts!r}; expected a mapping "
            f"of configured agents ({', '.join(settings.agents)}) to {meaning} ({least} or more)"
        )
    return counts


def samples_per_agent(system: System, settings: Settings, source: str) -> dict[str, int] | None:
    """Samples one episode returns per agent: the declared fan-out (transcripts), times, under
    `rewards.credit: turn`, the declared turns per transcript and `rewards.branch`."""
    transcripts = declared_counts(system, settings, source, "fan_out")
    if transcripts is None or settings.rewards.credit != "turn":
        return transcripts
    turns = declared_counts(system, settings, source, "turns")
    if turns is None:
        raise ConfigError(
            f"{source}: mrlx.rewards.credit is `turn`, but system {settings.system!r} declares no "
            "turns(settings) (the most model turns one transcript takes), so the samples of an episode "
            "cannot be counted; give its System `turns=lambda settings: {agent: n}`, or use credit: episode"
        )
    branch = settings.rewards.branch
    return {a: n * turns.get(a, 1) * branch for a, n in transcripts.items()}
