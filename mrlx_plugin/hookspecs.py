"""The hooks of mrlx_plugin: the whole public extension surface, one function per hook.

Read this file first. Write a module in your own repository with functions of these names,
decorate them with `mrlx_plugin.hookimpl`, and either list the module under `mrlx.plugins` in
your YAML or publish it through the `mrlx_plugin` entry-point group:

    # my_repo/mrlx_hooks.py
    from mrlx_plugin import hookimpl

    @hookimpl
    def mrlx_grade(agent, transcript, episode):
        return 1.0 if "QED" in transcript.answer_text else 0.0

    # my_mrlx.yaml
    mrlx:
      plugins: [my_repo.mrlx_hooks]

Hooks marked *first result wins* stop at the first implementation that returns something other
than None; yours run before the package's defaults (which are registered `trylast`), so returning
None from yours falls through to the default (for `mrlx_grade`, an awaitable of None does too).
Hooks are called with keyword arguments; an implementation may accept any subset of the
arguments listed.

Every hook runs in the rollout process (slime's rollout manager), inside its asyncio event loop:
keep implementations quick, and return an awaitable where you must wait on something (the
`mrlx_grade` hook accepts one).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING

import pluggy

PROJECT = "mrlx_plugin"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

if TYPE_CHECKING:
    from mrlx_plugin.core.config import Settings
    from mrlx_plugin.core.host import HostSample
    from mrlx_plugin.core.transcript import Transcript, Turn
    from mrlx_plugin.episodes import Episode, System


@hookspec
def mrlx_register_systems() -> dict[str, System]:
    """Register agent systems by name.

    Return a mapping of system names to `mrlx_plugin.System` objects. A system's `run(episode)`,
    an async function, drives one episode: it opens transcripts with
    `episode.new_transcript(agent, messages)`, calls `await episode.generate(transcript)` for each
    model turn, may grade with `await episode.grade(transcript)`, and returns the episode's
    `mrlx_plugin.Outcome` (the final answer and the conversation that gave it, the team's reward,
    rewards per agent; `Outcome()` for none). It raises nothing for engine faults: the episode
    turns them into ABORTED samples.

        async def run(episode):
            t = episode.new_transcript("solver", [{"role": "user", "content": episode.problem}])
            await episode.generate(t)
            return Outcome(final_transcript=t)

        SOLO = System(run=run, fan_out=lambda settings: {"solver": 1}, turns=lambda settings: {"solver": 1})

    Called once per process when the plugins load; the systems of every plugin are collected
    then (a name registered twice is an error naming both plugins). Select a system with
    `mrlx.system: NAME`; its settings live under `mrlx.NAME` (given to a plugin's system as
    `episode.system_settings`). The package registers `pipeline`, `dialogue`, `game` and `debate`.

    A system should declare its fan-out, `fan_out(settings) -> {agent: n}`, the number of
    transcripts one episode opens per agent. Every episode then returns exactly that many samples
    per trained agent (ABORTED fillers for what an aborted or short episode did not open), so a
    host step has a fixed sample count, and the plugin checks the host's micro-batch flags against
    it at start-up. A system without `fan_out` returns a varying count and needs the host's
    `--use-dynamic-batch-size`. For per-turn credit (`mrlx.rewards.credit: turn`) a system also
    declares `turns(settings) -> {agent: n}`, the most model turns one transcript of the agent
    takes (an agent left out: 1; a system with a fan-out and no `turns` is refused under per-turn
    credit): an episode then returns fan_out x turns x `rewards.branch` samples per trained agent.

    A system whose samples are weighted by the team's outcome declares `team_shaping=True` (the
    pipeline does); `mrlx_shape_rewards` receives it as its `team_shaping` argument. A system's
    `check(settings, games)` runs at start-up and returns the problems of its settings.

    A system written as ordinary code against OpenAI-compatible endpoints (agents as code) is made
    with `mrlx_plugin.agents.agent_code(run, samples=..., turns=...)` and registered the same way
    (docs/agents-as-code.md).

    Migration: a run function used to set `episode.final_answer`, `episode.final_transcript`,
    `episode.team_reward` and `episode.stopped_early` and return None; it now returns them as an
    `Outcome` (`episode.*` are set from it), and a run function that returns anything else is an
    error naming the system. Earlier still, a system was a bare async function carrying `run.fan_out`,
    `run.turns` and `run.team_shaping` attributes; wrap such a function: `System(run=run, ...)`.
    """


@hookspec(firstresult=True)
def mrlx_grade(agent: str, transcript: Transcript, episode: Episode) -> float | Awaitable[float] | None:
    """Grade one agent's output in an episode: the sample's raw reward. *First result wins.*

    `transcript.answer_text` is the agent's last message with any reasoning (`...</think>`)
    removed; `episode.label` is the ground truth the host loaded. Return a float, an awaitable
    of a float (for a remote reward model; an `async def` implementation returns one), or None
    to defer to the next implementation. An awaitable whose result is None defers too.

    Called by systems through `episode.grade(...)`, and at the end of every episode for each
    trainable transcript that has no reward yet. The default grades math answers with
    math-verify (`mrlx.rewards.grader: math`) or calls the host's `--rm-type` grader (`host`).
    """


@hookspec(firstresult=True)
def mrlx_shape_rewards(episode: Episode, settings: Settings, team_shaping: bool) -> dict[int, float] | None:
    """Decide the rewards each agent trains on, from the graded rewards of one episode.
    *First result wins.*

    Return a dict that maps the position of every graded transcript in `episode.transcripts`
    (those whose `raw_reward` is not None) to its trained reward, a finite float: one entry per
    graded transcript, no other. Read `transcript.raw_reward`, `episode.final_answer`,
    `episode.team_reward` and anything your system stored in `episode.metadata`; do not write
    `transcript.reward` yourself: the episode checks your answer and applies it. Return None to
    defer (with every implementation deferring, each sample trains on its raw reward). A return
    of another shape, a missing or extra position, or a reward that is not a finite number is an
    error naming your plugin.

    `team_shaping` is True when the system declares that its samples are weighted by the team
    outcome (`System(team_shaping=True)`, as the pipeline does; see `mrlx_register_systems`).

    Called once per finished (not aborted) episode, after grading and before the samples are
    built. The default applies the pipeline's team weighting (`mrlx.pipeline.weighting`) when
    `team_shaping`, else `mrlx.rewards.shaping` (independent, cooperative, zero_sum, bilateral,
    asymmetric); see `mrlx_plugin.rewards.shaping`.
    """


@hookspec(firstresult=True)
def mrlx_turn_reward(episode: Episode, transcript: Transcript, index: int, turn: Turn) -> float | None:
    """Score one model turn: its own reward under `mrlx.rewards.credit: turn`. *First result wins.*

    `turn` is the turn to score and `index` its position among `transcript.turns` (the turns
    before it are `transcript.turns[:index]`; the context it was sampled from). With tree
    sampling (`mrlx.rewards.branch: K`) it is also called on each of the K candidates of a turn,
    before the episode goes on, to pick the one to continue from; a candidate the episode did
    not take is not in `transcript.turns`. Return a finite float (from the environment, a rule,
    or a judge), or None to defer; with every implementation deferring the turn's own reward is
    0.0 and only the outcome, discounted by `mrlx.rewards.gamma`, reaches it.

    Called for every turn a system left unscored (a system may score turns itself: the game
    system scores each move by its rules). Not called under `credit: episode`.
    """


@hookspec
def mrlx_register_games() -> dict[str, object]:
    """Register turn-based games by name, for the game system (`mrlx.system: game`).

    Return a mapping of game names to game objects (see `mrlx_plugin.systems.game` for the
    methods a game has: its seats, start state, what each seat sees, the legality check of a
    move, the next state, per-move rewards and the outcome). Select one with
    `mrlx.game.name`. The package registers `nim`, `kuhn_poker` and `chain` itself. Collected
    once when the plugins load, as systems are: a `mrlx.game.name` no plugin registers is a
    start-up error naming the plugins that registered games.
    """


@hookspec(firstresult=True)
def mrlx_should_stop(episode: Episode, agent: str, transcript: Transcript) -> bool | None:
    """Decide whether a turn-taking episode ends after `agent`'s latest turn. *First result wins.*

    Return True to stop now, False to continue, None to defer. Called by the dialogue system
    after every model turn; the default stops on `mrlx.dialogue.stop_patterns` and at
    `mrlx.dialogue.max_turns`. A stop before `max_turns` counts as an early termination.
    """


@hookspec
def mrlx_episode_end(episode: Episode, samples: list[HostSample]) -> None:
    """Observe a finished episode and the samples it returns to the host.

    Called once per episode (aborted ones included, with `episode.aborted` set) after rewards
    are final. For logging, dataset building or bookkeeping; changing the samples here is not
    supported. Return values are ignored.
    """
