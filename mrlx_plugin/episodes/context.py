"""What every episode of a rollout process shares: its settings, the selected system, each agent's
tokenizer and engine client, the host's limits, and the hooks, resolved once when the plugins load.

The root `Runtime` builds one `EpisodeContext` from the host's `args`; episodes only read it.
"""

from __future__ import annotations

import argparse
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from mrlx_plugin.core.config import Settings
from mrlx_plugin.core.engine_client import EngineClient
from mrlx_plugin.core.host import HostLimits
from mrlx_plugin.core.tokenizer import AgentTokenizer
from mrlx_plugin.episodes.system import Registered, System

logger = logging.getLogger(__name__)

# A hook implementation as the plugin manager reaches it, one plugin at a time.
Caller = Callable[..., object]
# (the plugin that answered, its answer), or (None, None) when every plugin deferred.
Answer = tuple[str | None, object]


@dataclass(frozen=True)
class FirstAnswer:
    """A first-result hook, resolved when the plugins load: each implementing plugin's caller,
    in the order pluggy would call them (users' plugins before the package's `trylast` defaults).

    An implementation answers with a value, with an awaitable of one (`async def`), or with None
    (or an awaitable of None) to leave the answer to the next plugin. `ask` awaits each answer
    before asking the next plugin, so an awaited None defers as a returned None does, and says
    which plugin answered (a value the episode refuses is blamed on it). A hook whose answers
    are plain values (`mrlx_shape_rewards`) gets the pair itself."""

    hook: str
    callers: tuple[tuple[str, Caller], ...]

    def ask(self, **kwargs: object) -> Answer | Awaitable[Answer]:
        """(the plugin that answered, its answer), or (None, None) when every plugin deferred: a
        plain pair while the plugins asked answer with plain values (no coroutine, no task: most
        grades are settled that way), else an awaitable of the pair."""
        for i, (plugin, call) in enumerate(self.callers):
            answer = call(**kwargs)
            if answer is None:
                continue
            if inspect.isawaitable(answer):
                return self._finish(plugin, answer, i + 1, kwargs)
            return plugin, answer
        return None, None

    async def _finish(
        self, plugin: str, pending: Awaitable[object], rest: int, kwargs: dict[str, object]
    ) -> Answer:
        answer = await pending
        for other, call in self.callers[rest:]:
            if answer is not None:
                break
            plugin, answer = other, call(**kwargs)
            if inspect.isawaitable(answer):
                answer = await answer
        return (plugin, answer) if answer is not None else (None, None)


@dataclass(frozen=True)
class Hooks:
    """The hooks an episode calls (see `mrlx_plugin.hookspecs`)."""

    grade: FirstAnswer
    shape_rewards: FirstAnswer
    turn_reward: FirstAnswer
    should_stop: Caller  # pluggy's first-result call: the dialogue's stop rule
    episode_end: Caller  # every observer of a finished episode


class GradeFailures:
    """Failed grades of one process: the first few logged with their traceback, then one line in
    a hundred (a reward model that is down fails every grade)."""

    def __init__(self) -> None:
        self.count = 0

    def record(self, reason: str, exc: BaseException) -> None:
        self.count += 1
        if self.count <= 5:
            logger.warning("%s; the episode's samples are ABORTED", reason, exc_info=exc)
        elif self.count % 100 == 0:
            logger.warning("%d grades have failed so far; the latest: %s", self.count, reason)


@dataclass(eq=False)  # compared and hashed by identity: systems key per-process state by it
class EpisodeContext:
    """What the episodes of one rollout process share. `tokenizers` may grow (a responder job loads
    them only when it evaluates); everything else is fixed once built."""

    args: argparse.Namespace  # the host's, read only (the host's grader takes it)
    settings: Settings
    system: System
    hooks: Hooks
    limits: HostLimits
    tokenizers: dict[str, AgentTokenizer]
    clients: Mapping[str, EngineClient]
    urls: Mapping[str, str]
    system_prompts: Mapping[str, str | None]
    # Samples per episode and agent (None: they vary): the system's fan-out (transcripts) times,
    # under per-turn credit, its turns per transcript and the candidates per turn.
    samples_per_episode: Mapping[str, int] | None
    trained: frozenset[str]  # the agents whose samples go back to this job's host
    games: Mapping[str, Registered] = field(default_factory=dict)
    grade_failures: GradeFailures = field(default_factory=GradeFailures)

    def trains_here(self, agent: str) -> bool:
        """Whether this job's trainer trains `agent` (its samples go back to the host)."""
        return agent in self.trained

    def context_limit(self, agent: str, evaluation: bool = False) -> int | None:
        """The most tokens one sample of `agent` may hold (None: no limit known): the host's
        `--rollout-max-context-len` (`--eval-max-context-len` in evaluation) and, for an agent
        the host's model serves or trains, that model's position limit. A peer agent's samples
        are checked against its own model when they are committed (the outbox)."""
        host = self.limits.max_context_eval if evaluation else self.limits.max_context
        on_host_model = self.settings.agents[agent].url == "self" or agent in self.trained
        known = [n for n in (host, self.limits.model_max if on_host_model else None) if n is not None]
        return min(known) if known else None
