"""`agent_code(run, samples=..., turns=...)`: a `System` whose episode is the user's async function.

The function gets the task and, per agent, an `Endpoint`: an OpenAI-compatible base URL and key,
served by this rollout process for this episode only. Every call on an agent's endpoint is one
model turn on that agent's engine (its own model, or the shared one), recorded with the exact
ids and log-probs the engine returned (see `mrlx_plugin.agents.chat`). The function returns the
rewards (a mapping of agent -> reward, or an `Outcome`), which the system returns as its episode's
`Outcome`; the episode then goes on as any system's does: the `mrlx_grade` hook grades an agent the
function gave no reward, per-turn credit, shaping, normalisation and the multi-model link apply.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import Field, ValidationInfo, field_validator

from mrlx_plugin.agents.chat import AgentSession
from mrlx_plugin.agents.parsers import ReasoningParser, ToolParser, reasoning_parser, tool_parser
from mrlx_plugin.agents.server import server_for
from mrlx_plugin.core.config import Seconds, Section, Settings, Text
from mrlx_plugin.core.netutil import is_loopback
from mrlx_plugin.core.values import RewardError
from mrlx_plugin.episodes.episode import Episode
from mrlx_plugin.episodes.errors import EpisodeAborted, described, stops_the_rollout
from mrlx_plugin.episodes.outcome import Outcome
from mrlx_plugin.episodes.run import grade_answer
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
    label: object  # the host sample's label, as it came
    prompt: str | list[dict[str, str]]  # the host sample's prompt as it came
    metadata: Mapping[str, object]
    evaluation: bool
    episode_id: str
    _grade: Callable[[str, str], Awaitable[float]] = field(repr=False, compare=False)

    async def grade(self, answer: str, agent: str) -> float:
        """`answer` graded as `agent`'s answer to this task, by the `mrlx_grade` hook (the grader
        every built-in system uses). A grade that fails ends the episode, as a built-in's does."""
        return await self._grade(answer, agent)


# Returns a mapping of agent -> reward, an Outcome or None (anything else ends the episode, named).
AgentRun = Callable[[Task, dict[str, Endpoint]], Awaitable[object]]

T = TypeVar("T")


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
    code = _Code(
        run,
        f"{getattr(run, '__module__', '?')}.{getattr(run, '__qualname__', '?')}",
        dict(samples),
        {agent: turns.get(agent, 1) for agent in samples},
        dict(parsers or {}),
        dict(reasoning_parsers or {}),
    )
    return System(
        run=code.episode,
        fan_out=lambda settings: dict(code.samples),
        turns=lambda settings: dict(code.turns),
        settings=AgentCodeSettings,
        check=code.check,
        origin=f"the agent code {code.who}",
    )


@dataclass(frozen=True)
class _Code:
    """The user's function of one `agent_code` system, with what it declared."""

    run: AgentRun
    who: str  # the function, as errors name it
    samples: dict[str, int]
    turns: dict[str, int]
    tool_parsers: dict[str, ToolParser]
    reasoning_parsers: dict[str, ReasoningParser]

    async def episode(self, episode: Episode) -> Outcome:
        """One episode (`System.run`): each agent's endpoint opened, the function run until it
        returns or its deadline, the endpoints closed, and what it returned as the Outcome."""
        settings: AgentCodeSettings = episode.system_settings
        server = await server_for(settings.host, settings.port)
        sessions: dict[str, AgentSession] = {}
        keys: dict[str, str] = {}
        for agent in self.samples:
            a = episode.settings.agents[agent]
            sessions[agent] = AgentSession(
                episode,
                agent,
                max_threads=self.samples[agent],
                max_turns=self.turns[agent],
                tool_parser=tool_parser(a.tool_parser, self.tool_parsers),
                reasoning_parser=reasoning_parser(a.reasoning_parser, self.reasoning_parsers),
            )
            keys[agent] = server.open(sessions[agent])
        endpoints = {agent: Endpoint(server.base_url, keys[agent], agent) for agent in self.samples}
        s = episode.sample
        task = Task(
            episode.problem,
            s.label,
            s.prompt,
            dict(s.metadata or {}),
            episode.evaluation,
            episode.id,
            lambda answer, agent: grade_answer(episode, answer, agent),
        )
        try:
            result = await self._call(episode, task, endpoints, settings.timeout_s)
        finally:
            for key in keys.values():
                await server.close(key, f"episode {episode.id} has ended")
            episode.metadata["agent_code"] = {a: sess.stats.as_dict() for a, sess in sessions.items()}
            # A conversation whose turn never ran (cancelled as the episode ended) is no sample:
            # a filler stands in for it.
            episode.transcripts = [t for t in episode.transcripts if t.turns or t.agent not in sessions]
        if isinstance(result, Outcome):
            return result
        if result is None or isinstance(result, Mapping):
            return Outcome(rewards=result if result is not None else {})
        raise RewardError(
            f"the agent code {self.who} returned {type(result).__name__}; expected a mapping of agent -> "
            "reward, an Outcome or None"
        )

    async def _call(
        self, episode: Episode, task: Task, endpoints: dict[str, Endpoint], timeout_s: float
    ) -> object:
        """What `run(task, endpoints)` returns. It runs as a task that is left behind at its
        deadline: code that catches its cancellation cannot hold the episode (its sessions are
        closed: it reaches no engine). Whatever it raises ends this episode, named, and nothing
        else: its own CancelledError (nothing cancelled it), SystemExit, any BaseException."""
        work = asyncio.ensure_future(_contained(self.run(task, endpoints)))
        try:
            done, _ = await asyncio.wait({work}, timeout=timeout_s)
        except asyncio.CancelledError:  # the host's abort: the episode goes, and its code with it
            work.cancel()
            work.add_done_callback(_retrieve)
            raise
        if not done:
            work.cancel()
            work.add_done_callback(_retrieve)
            episode.abort(f"the agent code {self.who} ran past mrlx.{episode.settings.system}.timeout_s")
            raise EpisodeAborted(episode.abort_reason)
        failure = _UserCodeFailed(asyncio.CancelledError()) if work.cancelled() else work.exception()
        if isinstance(failure, EpisodeAborted):
            raise failure
        if failure is not None:
            raised = failure.raised if isinstance(failure, _UserCodeFailed) else failure
            if not episode.aborted:  # else it failed on an endpoint's answer after the episode ended
                episode.abort(f"the agent code {self.who} raised {described(raised)}")
            raise EpisodeAborted(episode.abort_reason)
        return work.result()

    def check(self, settings: Settings, games: Mapping[str, Registered]) -> list[str]:
        """The start-up check (`System.check`): every agent the code talks to is configured, with
        parsers this system knows."""
        problems = []
        for agent in self.samples:
            a = settings.agents.get(agent)
            if a is None:
                problems.append(
                    f"mrlx.agents: the agent code {self.who} talks to agent {agent!r}; configure it"
                )
                continue
            for key, make, extra in (
                ("tool_parser", tool_parser, self.tool_parsers),
                ("reasoning_parser", reasoning_parser, self.reasoning_parsers),
            ):
                try:
                    make(getattr(a, key), extra)
                except ValueError as exc:
                    problems.append(f"mrlx.agents.{agent}.{key}: {exc}")
        return problems


class _UserCodeFailed(Exception):
    """What the agent code raised that must not leave its task as itself: asyncio re-raises a
    task's SystemExit out of the event loop, ending every episode of the rollout."""

    def __init__(self, raised: BaseException):
        super().__init__(described(raised))
        self.raised = raised


async def _contained(work: Awaitable[T]) -> T:
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
