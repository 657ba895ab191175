"""One episode: a team of agents working on one input sample, as a system's run function drives it.

A system's run function (see hookspecs.mrlx_register_systems) drives an `Episode` and returns its
`Outcome`:

    t = episode.new_transcript("solver", [{"role": "user", "content": episode.problem}])
    await episode.generate(t)          # one engine call on the solver's URL (episodes.turn)
    await episode.grade(t)             # the mrlx_grade hook
    return Outcome(final_transcript=t)

`run_episode` (episodes.run) wraps the run function: it turns engine faults and host aborts into
ABORTED samples, applies the outcome, grades and shapes rewards through the hooks, and builds
the host's samples (episodes.samples), all with the input's `rollout_id`, every one with a reward.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.core.host import HostSample
from mrlx_plugin.core.sglang import SamplingParams
from mrlx_plugin.core.transcript import Transcript
from mrlx_plugin.core.values import RewardError, finite_reward
from mrlx_plugin.episodes.context import EpisodeContext
from mrlx_plugin.episodes.errors import EpisodeAborted, described, stops_the_rollout
from mrlx_plugin.episodes.turn import TurnCounts, take_turn

T = TypeVar("T")


def problem_text(prompt: object) -> str:
    """The task text of a host sample: the prompt string, or the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        for message in reversed(prompt):
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content", "")
                return content if isinstance(content, str) else str(content)
    raise ValueError(f"cannot read a task from a prompt of type {type(prompt).__name__}")


class Episode:
    """What a system drives: the episode's input, the agents' transcripts, one model turn
    (`generate`), a grade (`grade`), and its end (`abort`). Its facts go to `metadata`; how it
    ended is the `Outcome` the system returns."""

    def __init__(
        self,
        context: EpisodeContext,
        sample: HostSample,
        sampling_params: Mapping[str, object] | None,
        evaluation: bool,
        host_aborted: Callable[[], bool] | None = None,
    ):
        self.context = context
        self.host_aborted = host_aborted or (lambda: False)  # the host's "this rollout is over" flag
        self.settings = context.settings
        self.sample = sample
        self.evaluation = evaluation
        self.problem = problem_text(sample.prompt)
        self.label = sample.label
        self.key = str(sample.index) if sample.index is not None else uuid.uuid4().hex
        self.id = f"{self.settings.run_id}:{self.key}"
        rollout_id = getattr(sample, "rollout_id", None)  # a Miles release before the field has none
        self.rollout_id: int | None = rollout_id if rollout_id is not None else sample.index
        # The system's section: its typed model when it declares one (`System.settings`), else the
        # mapping as written, for the system to read and check itself.
        self.system_settings = (
            getattr(self.settings, self.settings.system)
            if context.system.settings is not None
            else self.settings.extra.get(self.settings.system, {})
        )
        self.base_sampling: SamplingParams = (
            dict(sampling_params) if sampling_params else dict(context.limits.default_sampling)
        )
        self.transcripts: list[Transcript] = []  # the views opened (`new_transcript`), in order
        # the episode's facts, free-form: each system writes and reads its own (every sample carries them)
        self.metadata: dict[str, Any] = {}
        self.counts = TurnCounts()
        self.aborted = False
        self.abort_reason: str | None = None
        # How it ended, from the system's `Outcome` (`run_episode` sets them, before grading).
        self.final_answer: str | None = None
        self.final_transcript: Transcript | None = None
        self.team_reward: float | None = None
        self.stopped_early = False

    # --- for systems ---------------------------------------------------------------------

    def new_transcript(
        self, agent: str, messages: list[dict[str, str]], label: str = "", role: str = ""
    ) -> Transcript:
        """Open `agent`'s view starting from `messages` (its system prompt is put first). `role`
        names a role within the agent (a game seat): samples are normalised per role.

        A prompt that leaves no room for one generated token within the agent's context limit
        (`context_limit`) ends the episode before any engine call: its samples are ABORTED and
        counted as over the context (`multi_agent/over_context_samples`). A system that may go
        on without this view checks `fits` first."""
        t = self.open_transcript(agent, messages, label, role)
        if isinstance(t, str):
            self.over_context(t)
            self.abort(self.metadata["over_context"])
            raise EpisodeAborted(self.abort_reason)
        return t

    def open_transcript(
        self,
        agent: str,
        messages: list[dict[str, str]],
        label: str = "",
        role: str = "",
        tools: list[dict] | None = None,
        tools_key: str = "",
        lookahead: bool = False,
    ) -> Transcript | str:
        """`new_transcript` for a system that goes on when a prompt does not fit: the transcript,
        or the reason it was not opened (its prompt leaves no room for a turn; nothing is
        recorded). `tools`: OpenAI function specs the chat template renders (`tools_key`, their
        canonical JSON, keys the prompt cache). `lookahead`: a view opened while playing ahead to
        score a candidate (`Transcript.fork`): not the episode's, never trained."""
        limit = self.context_limit(agent)
        t = Transcript.start(
            agent,
            self.context.tokenizers[agent],
            self.with_system_prompt(agent, messages),
            tools,
            tools_key,
            trainable=bool(self.settings.agents[agent].trainable),
            max_context=limit,
            max_response=self.context.limits.max_response,
            label=label or agent,
            role=role,
        )
        if t.over_context:
            return (
                f"the prompt of {t.label} is {len(t.prompt_ids)} tokens, which leaves no room "
                f"for a turn within its context limit of {limit} tokens"
            )
        if lookahead:
            t.trainable, t.lookahead = False, True
        else:
            self.transcripts.append(t)
        return t

    def context_limit(self, agent: str) -> int | None:
        """The most tokens a sample of `agent` may hold (None: unbounded): the host's context limit
        (`--rollout-max-context-len`, or `--eval-max-context-len` in evaluation) and, for an agent
        on the host's model, that model's position limit (see `EpisodeContext.context_limit`)."""
        return self.context.context_limit(agent, self.evaluation)

    def fits(self, agent: str, messages: list[dict[str, str]]) -> bool:
        """Whether a view of `agent` opened with `messages` leaves room for a turn (the prompt's
        tokens are cached: opening it afterwards costs nothing more)."""
        limit = self.context_limit(agent)
        return limit is None or self.prompt_tokens(agent, messages) < limit

    def over_context(self, reason: str) -> None:
        """Record that something of this episode did not fit a context limit: the samples the
        episode cannot fill (all of them when it is aborted, its fillers otherwise) are counted
        as over the context."""
        self.metadata.setdefault("over_context", reason)

    def with_system_prompt(self, agent: str, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        if agent not in self.settings.agents:
            raise KeyError(f"agent {agent!r} is not configured under mrlx.agents")
        system_prompt = self.context.system_prompts[agent]
        if system_prompt and not (messages and messages[0].get("role") == "system"):
            return [{"role": "system", "content": system_prompt}] + list(messages)
        return list(messages)

    def prompt_tokens(self, agent: str, messages: list[dict[str, str]]) -> int:
        """How many tokens `agent`'s transcript would start with (cached: opening it is then free)."""
        return len(self.context.tokenizers[agent].prompt_ids(self.with_system_prompt(agent, messages))[1])

    def abort(self, reason: str) -> None:
        if not self.aborted:
            self.aborted = True
            self.abort_reason = reason

    def fail_reward(self, reason: str, exc: BaseException) -> EpisodeAborted:
        """A reward that failed (a grade, a turn score, a shaping, a value that is not a finite
        number): logged and counted as a failed grade, the episode aborted. Returns the
        EpisodeAborted to raise where the episode cannot go on."""
        self.context.grade_failures.record(f"episode {self.id}: {reason}", exc)
        self.abort(reason)
        return EpisodeAborted(self.abort_reason)

    def check_alive(self) -> None:
        if not self.aborted and self.host_aborted():
            self.abort("the host ended the rollout")
        if self.aborted:
            raise EpisodeAborted(self.abort_reason)

    # One model turn, top to bottom (`mrlx_plugin.episodes.turn`, whose docstring is this method's):
    # `await episode.generate(transcript, score=None, *, on_fault=None, on_tokens=None,
    # **sampling_overrides)`.
    generate = take_turn

    async def grade(self, transcript: Transcript) -> float:
        """The transcript's raw reward from the mrlx_grade hook (also stored on the transcript).

        A grade that fails (its deadline `rewards.grade_timeout_s` passes, a remote reward model
        is down, the hook raises or returns no finite number) aborts the episode: its samples
        leave ABORTED with a zero loss mask rather than with a reward nobody computed. A grade
        that is no finite number is blamed on the plugin that gave it.
        """
        timeout = self.settings.rewards.grade_timeout_s
        try:
            # One plugin at a time (hooks.grade): an awaited None defers like a returned None.
            found = self.context.hooks.grade.ask(agent=transcript.agent, transcript=transcript, episode=self)
            if inspect.isawaitable(found):
                found = await asyncio.wait_for(found, timeout)
            plugin, result = found
            # as float() reads it: None is 0.0 and a bool grade 0 or 1
            value = (
                0.0
                if result is None
                else finite_reward(
                    float(result) if isinstance(result, bool) else result, f"mrlx_grade of plugin {plugin!r}"
                )
            )
        except ConfigError:
            raise
        except BaseException as exc:  # one failed grade must not end the host's rollout
            if stops_the_rollout(exc):
                raise
            if isinstance(exc, asyncio.TimeoutError):
                reason = (
                    f"grading agent {transcript.agent!r} took longer than rewards.grade_timeout_s "
                    f"({timeout:g} s)"
                )
            elif isinstance(exc, RewardError):
                reason = f"grading agent {transcript.agent!r} failed: {exc}"
            else:
                reason = f"grading agent {transcript.agent!r} failed: {described(exc)}"
            raise self.fail_reward(reason, exc) from None
        transcript.raw_reward = transcript.reward = value
        return value

    async def gather(self, *aws: Awaitable[T]) -> list[T]:
        """asyncio.gather that cancels the other calls as soon as one ends the episode."""
        tasks = [asyncio.ensure_future(a) for a in aws]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
