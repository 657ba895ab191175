"""`agent_code(run, samples=..., turns=...)`: a `System` whose episode is the user's async function.

The function gets the task and, per agent, an `Endpoint`: an OpenAI-compatible base URL and key,
served by this rollout process for this episode only. Every call on an agent's endpoint is one
model turn on that agent's engine (its own model, or the shared one), recorded with the exact
ids and log-probs the engine returned (see `mrlx_plugin.agents.chat`). The function returns the
rewards; the episode then goes on as any system's does: the `mrlx_grade` hook grades an agent the
function gave no reward, per-turn credit, shaping, normalisation and the multi-model link apply.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from mrlx_plugin.agents.chat import AgentSession
from mrlx_plugin.agents.parsers import ReasoningParser, ToolParser, reasoning_parser, tool_parser
from mrlx_plugin.agents.server import server_for
from mrlx_plugin.core.config import Seconds, Section, Settings, Text
from mrlx_plugin.core.netutil import is_loopback
from mrlx_plugin.core.transcript import Transcript, Turn
from mrlx_plugin.core.values import RewardError, finite_reward
from mrlx_plugin.episodes.episode import Episode
from mrlx_plugin.episodes.errors import EpisodeAborted, described, stops_the_rollout
from mrlx_plugin.episodes.system import Registered, System


@dataclass(frozen=True)
class Endpoint:
    """One agent's OpenAI-compatible endpoint for one episode."""

    base_url: str  # e.g. http://127.0.0.1:PORT/v1 (give it to openai.AsyncOpenAI(base_url=...))
    api_key: str  # the session: valid for this episode and this agent only
    model: str  # the agent's name (the endpoint serves only this agent whatever `model` says)


@dataclass(frozen=True)
class Task:
    """The episode's input, from the host's sample."""

    problem: str  # the prompt's text (the last user message of a chat prompt)
    label: Any
    prompt: Any  # the host sample's prompt as it came
    metadata: Mapping[str, Any]
    evaluation: bool
    episode_id: str
    _grade: Callable[[str, str], Awaitable[float]] = field(repr=False, compare=False)

    async def grade(self, answer: str, agent: str) -> float:
        """`answer` graded as `agent`'s answer to this task, by the `mrlx_grade` hook (the grader
        every built-in system uses). A grade that fails ends the episode, as a built-in's does."""
        return await self._grade(answer, agent)


@dataclass
class Outcome:
    """What an episode of agent code ended with. Returning a plain mapping means `Outcome(rewards=it)`.

    `rewards[agent]`: the outcome reward of each of the agent's conversations (an agent in neither
    mapping is graded by the `mrlx_grade` hook; one with turn rewards only has outcome 0).
    `turn_rewards[agent]`: one reward per turn of the agent's
    one conversation, its turns' own rewards: under `rewards.credit: turn` each turn trains on its
    return (its own reward plus the discounted later ones and the outcome), under episode credit
    the conversation trains on the outcome plus their sum. `answer`: the team's final answer
    (evaluation reads it), from the last conversation of agent `answered_by` (none: the last
    conversation); `team_reward`: its grade (none: graded by the hook, as that agent's answer)."""

    rewards: Mapping[str, float] = field(default_factory=dict)
    turn_rewards: Mapping[str, Sequence[float]] = field(default_factory=dict)
    answer: str | None = None
    team_reward: float | None = None
    answered_by: str | None = None  # the agent whose conversation gave `answer` (none: the last one)


AgentRun = Callable[[Task, dict[str, Endpoint]], Awaitable[Any]]


class AgentCodeSettings(Section):
    """The section `mrlx.NAME` of a system made with `agent_code`."""

    timeout_s: Seconds = Field(600.0, description="the most one episode's agent code may run")
    allow_remote: bool = Field(
        False,
        description="let `host` be an address other machines reach (the session keys are then the only "
        "guard: a trusted network only)",
    )
    host: Text = Field(
        "127.0.0.1",
        description="address the endpoints listen on (loopback: agent code runs in the rollout process "
        "or beside it; another address needs `allow_remote`)",
    )
    port: int = Field(0, ge=0, le=65535, description="port of the endpoints (0: a free one)")

    @field_validator("host")
    @classmethod
    def _loopback_unless_allowed(cls, host: str, info: ValidationInfo) -> str:
        # As the engines refuse it: a session key is the endpoint's only guard, and it travels in clear.
        if not info.data.get("allow_remote") and not is_loopback(host):
            raise ValueError(
                f"{host!r} is reachable from other machines, and the endpoints' only guard is each "
                "episode's session key (sent in clear); keep 127.0.0.1, or set allow_remote: true on a "
                "trusted network"
            )
        return host


def agent_code(
    run: AgentRun,
    *,
    samples: Mapping[str, int],
    turns: Mapping[str, int],
    parsers: Mapping[str, ToolParser] | None = None,
    reasoning_parsers: Mapping[str, ReasoningParser] | None = None,
) -> System:
    """A system whose episode is `await run(task, endpoints)`.

    `samples[agent]`: the most conversations (threads: first calls, parallel calls, rewritten
    histories) the agent may open in one episode; `turns[agent]`: the most calls one conversation
    may make. Every episode returns exactly `samples` samples per trained agent (x `turns` under
    per-turn credit), so host steps keep a fixed size; a request past either is answered 429.
    `parsers`/`reasoning_parsers`: tool-call and reasoning parsers of this system, by the names the
    agents' `tool_parser`/`reasoning_parser` settings use (beside the built-in ones).
    """
    if not inspect.iscoroutinefunction(run):
        raise TypeError(f"agent_code needs an async function run(task, endpoints); got {run!r}")
    for what, counts in (("samples", samples), ("turns", turns)):
        bad = {a: n for a, n in counts.items() if isinstance(n, bool) or not isinstance(n, int) or n < 1}
        if bad:
            raise ValueError(f"agent_code: {what} must map agents to integers >= 1; got {bad}")
    if set(turns) - set(samples):
        raise ValueError(
            f"agent_code: turns names agents without samples: {sorted(set(turns) - set(samples))}"
        )
    extra_tools, extra_reasoning = dict(parsers or {}), dict(reasoning_parsers or {})
    who = f"{getattr(run, '__module__', '?')}.{getattr(run, '__qualname__', '?')}"

    async def run_episode(episode: Episode) -> None:
        settings: AgentCodeSettings = episode.system_settings
        server = await server_for(settings.host, settings.port)
        sessions: dict[str, AgentSession] = {}
        keys: dict[str, str] = {}
        for agent in samples:
            a = episode.settings.agents[agent]
            sessions[agent] = AgentSession(
                episode,
                agent,
                max_threads=samples[agent],
                max_turns=turns.get(agent, 1),
                tool_parser=tool_parser(a.tool_parser, extra_tools),
                reasoning_parser=reasoning_parser(a.reasoning_parser, extra_reasoning),
            )
            keys[agent] = server.open(sessions[agent])
        endpoints = {agent: Endpoint(server.base_url, keys[agent], agent) for agent in samples}
        s = episode.sample
        task = Task(
            episode.problem,
            s.label,
            s.prompt,
            dict(s.metadata or {}),
            episode.evaluation,
            episode.id,
            lambda answer, agent: _grade(episode, answer, agent),
        )
        # The function runs as a task that is left behind at its deadline: code that catches its
        # cancellation cannot hold the episode (its sessions are closed: it reaches no engine).
        work = asyncio.ensure_future(_contained(run(task, endpoints)))
        try:
            try:
                done, _ = await asyncio.wait({work}, timeout=settings.timeout_s)
            except asyncio.CancelledError:  # the host's abort: the episode goes, and its code with it
                work.cancel()
                work.add_done_callback(_retrieve)
                raise
            if not done:
                work.cancel()
                work.add_done_callback(_retrieve)
                episode.abort(f"the agent code {who} ran past mrlx.{episode.settings.system}.timeout_s")
                raise EpisodeAborted(episode.abort_reason)
            # Whatever the code raised ends this episode, named, and nothing else: its own
            # CancelledError (nothing cancelled it), SystemExit, any BaseException.
            failure = _UserCodeFailed(asyncio.CancelledError()) if work.cancelled() else work.exception()
            if isinstance(failure, EpisodeAborted):
                raise failure
            if failure is not None:
                raised = failure.raised if isinstance(failure, _UserCodeFailed) else failure
                if not episode.aborted:  # else it failed on an endpoint's answer after the episode ended
                    episode.abort(f"the agent code {who} raised {described(raised)}")
                raise EpisodeAborted(episode.abort_reason)
            result = work.result()
        finally:
            for key in keys.values():
                await server.close(key, f"episode {episode.id} has ended")
            episode.metadata["agent_code"] = {a: sess.stats.as_dict() for a, sess in sessions.items()}
            # A conversation whose turn never ran (cancelled as the episode ended) is no sample:
            # a filler stands in for it.
            episode.transcripts = [t for t in episode.transcripts if t.turns or t.agent not in sessions]
        await _apply(episode, result, sessions, who)

    def check(settings: Settings, games: Mapping[str, Registered]) -> list[str]:
        problems = []
        for agent in samples:
            a = settings.agents.get(agent)
            if a is None:
                problems.append(f"mrlx.agents: the agent code {who} talks to agent {agent!r}; configure it")
                continue
            for key, make, extra in (
                ("tool_parser", tool_parser, extra_tools),
                ("reasoning_parser", reasoning_parser, extra_reasoning),
            ):
                try:
                    make(getattr(a, key), extra)
                except ValueError as exc:
                    problems.append(f"mrlx.agents.{agent}.{key}: {exc}")
        return problems

    return System(
        run=run_episode,
        fan_out=lambda settings: dict(samples),
        turns=lambda settings: {agent: turns.get(agent, 1) for agent in samples},
        settings=AgentCodeSettings,
        check=check,
    )


async def _grade(episode: Episode, answer: str, agent: str) -> float:
    if agent not in episode.context.tokenizers:
        raise KeyError(f"agent {agent!r} is not configured under mrlx.agents")
    # A view that holds only the answer (no ids): what a grader reads of a transcript.
    view = Transcript(
        agent, episode.context.tokenizers[agent], [], trainable=False, label=f"{agent} (graded)"
    )
    view.turns.append(Turn(agent, [], [], answer, "stop", None))
    return await episode.grade(view)


class _UserCodeFailed(Exception):
    """What the agent code raised that must not leave its task as itself: asyncio re-raises a
    task's SystemExit out of the event loop, ending every episode of the rollout."""

    def __init__(self, raised: BaseException):
        super().__init__(described(raised))
        self.raised = raised


async def _contained(work: Awaitable[Any]) -> Any:
    """`await work`, with anything it raises that is not an Exception (SystemExit, a CancelledError
    of its own, ...) held as a `_UserCodeFailed`, short of what `stops_the_rollout`."""
    try:
        return await work
    except Exception:
        raise
    except BaseException as exc:
        if stops_the_rollout(exc):
            raise
        raise _UserCodeFailed(exc) from None


def _retrieve(task: asyncio.Future) -> None:
    """Consume the outcome of agent code left behind at its deadline (no 'never retrieved' noise)."""
    if not task.cancelled():
        task.exception()


async def _apply(episode: Episode, result: Any, sessions: Mapping[str, AgentSession], who: str) -> None:
    """Set the transcripts' rewards from what the agent code returned."""
    outcome = result if isinstance(result, Outcome) else Outcome(rewards=result if result is not None else {})
    if not isinstance(outcome.rewards, Mapping) or not isinstance(outcome.turn_rewards, Mapping):
        raise RewardError(
            f"the agent code {who} returned {type(result).__name__}; expected a mapping of agent -> reward, "
            "an Outcome or None"
        )
    for agent in (*outcome.rewards, *outcome.turn_rewards):
        if agent not in sessions:
            raise RewardError(
                f"the agent code {who} returned a reward for {agent!r}, which is none of its agents "
                f"({', '.join(sessions)})"
            )
    for agent, value in outcome.rewards.items():
        reward = finite_reward(value, f"the agent code {who}: the reward of {agent!r}")
        for thread in sessions[agent].threads:
            thread.transcript.raw_reward = thread.transcript.reward = reward
    per_turn = episode.settings.rewards.credit == "turn" and not episode.evaluation
    for agent, values in outcome.turn_rewards.items():
        threads = [thread.transcript for thread in sessions[agent].threads]
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(threads) != 1:
            raise RewardError(
                f"the agent code {who}: turn_rewards[{agent!r}] must be a list with one reward per turn of "
                f"the agent's one conversation ({len(threads)} conversations here)"
            )
        t = threads[0]
        if len(values) != len(t.turns):
            raise RewardError(
                f"the agent code {who} gave {len(values)} turn reward(s) for {agent!r}, whose conversation "
                f"took {len(t.turns)} turn(s)"
            )
        own = [finite_reward(v, f"the agent code {who}: turn {i} of {t.label}") for i, v in enumerate(values)]
        if per_turn:
            t.turn_rewards = own
            if t.raw_reward is None:  # no outcome given: 0, not the grade hook's (the turns carry it)
                t.raw_reward = t.reward = 0.0
        else:
            total = (t.raw_reward or 0.0) + math.fsum(own)
            t.raw_reward = t.reward = finite_reward(total, f"the agent code {who}: the reward of {t.label}")
    if outcome.answer is not None:
        if not isinstance(outcome.answer, str):
            raise RewardError(f"the agent code {who} gave the answer {outcome.answer!r}; expected text")
        by = outcome.answered_by
        if by is not None and by not in sessions:
            raise RewardError(f"the agent code {who} gave answered_by={by!r}, which is none of its agents")
        answered = [t for t in episode.transcripts if t.turns and by in (None, t.agent)]
        episode.final_answer = outcome.answer
        episode.final_transcript = answered[-1] if answered else None
        if outcome.team_reward is None and answered:  # the answer given is what is graded
            episode.team_reward = await _grade(episode, outcome.answer, answered[-1].agent)
    if outcome.team_reward is not None:
        episode.team_reward = finite_reward(outcome.team_reward, f"the agent code {who}: the team reward")
