"""One episode: a team of agents working on one input sample, and the samples it returns.

A system's run function (see hookspecs.mrlx_register_systems) drives an `Episode`:

    t = episode.new_transcript("solver", [{"role": "user", "content": episode.problem}])
    await episode.generate(t)          # one engine call on the solver's URL
    await episode.grade(t)             # the mrlx_grade hook
    episode.final_answer = t.answer_text

`run_episode` wraps the run function: it turns engine faults and host aborts into ABORTED
samples, grades and shapes rewards through the hooks, and builds the host's samples, all with
the input's `rollout_id`, every one with a reward.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.core.engine_client import EngineError
from mrlx_plugin.core.transcript import Transcript, Turn
from mrlx_plugin.core.values import RewardError, finite_reward
from mrlx_plugin.episodes.context import EpisodeContext
from mrlx_plugin.episodes.errors import EpisodeAborted, HookResultError, described, stops_the_rollout
from mrlx_plugin.episodes.turn import take_turn

logger = logging.getLogger(__name__)


def problem_text(prompt: Any) -> str:
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
    def __init__(
        self,
        context: EpisodeContext,
        sample: Any,
        sampling_params: dict[str, Any] | None,
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
        self.rollout_id = (
            sample.rollout_id if getattr(sample, "rollout_id", None) is not None else sample.index
        )
        # The system's section: its typed model when it declares one (`System.settings`), else the
        # mapping as written, for the system to read and check itself.
        self.system_settings = (
            getattr(self.settings, self.settings.system)
            if context.system.settings is not None
            else self.settings.extra.get(self.settings.system, {})
        )
        self.base_sampling = (
            dict(sampling_params) if sampling_params else dict(context.limits.default_sampling)
        )
        self.transcripts: list[Transcript] = []
        self.final_answer: str | None = None
        self.final_transcript: Transcript | None = None
        self.team_reward: float | None = None
        self.metadata: dict[str, Any] = {}
        self.aborted = False
        self.abort_reason: str | None = None
        self.stopped_early = False
        self.turns = 0
        self.engine_calls = 0  # every call answered: turns, tree-sampling candidates, rollout moves
        self.retried_turns = 0
        self.aborted_turns = 0
        self.started = time.monotonic()

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

    async def generate(
        self,
        transcript: Transcript,
        score: Callable[[Turn], Any] | None = None,
        *,
        on_fault: Callable[[EngineError], Awaitable[str | None]] | None = None,
        **sampling_overrides: Any,
    ) -> Turn:
        """One model turn for the transcript's agent, appended to the transcript.

        Returns the turn. A transcript with no room left (`transcript.full`) is marked truncated
        and gets no call (the returned turn is empty, finish reason "length"). A turn that hits
        its per-turn cap marks the sample TRUNCATED; the conversation may go on. Engine faults that
        outlast the retries, and `abort` answers from an engine this job owns, end the episode
        (EpisodeAborted). A peer engine's `abort` (it is updating its weights) is retried after
        `engine.abort_retry_wait_s`, until `engine.peer_deadline_s`; its partial text is dropped.
        A malformed answer (values no engine can have sampled, or ids outside the agent's
        vocabulary) is not retried: it ends the episode, recorded as `malformed_answer`. The
        turn's text is what its ids spell in the agent's tokenizer, special tokens left out.

        Tree sampling (`rewards.credit: turn` with `rewards.branch: K > 1`, trainable agents,
        not in evaluation): K candidates are sampled from the same context, each is scored with
        `score(turn)` (a float or an awaitable of one) or, without `score`, the `mrlx_turn_reward`
        hook (the K scored concurrently); the episode goes on from the best one
        (`rewards.branch_pick: best`, ties drawn at random, seeded), one drawn by softmax of the
        scores (`sample`) or one drawn uniformly (`random`). The others are kept for the samples
        (`transcript.branches`); the taken one's score is kept too (`transcript.taken_scores`)
        and is its turn reward until the system sets another.

        `on_fault(error)`, awaited on each engine fault that would be retried until the peer
        deadline, may end the episode at once: it returns the reason (e.g. the peer is known to
        be down), or None to go on retrying.
        """
        return await take_turn(self, transcript, score, on_fault, sampling_overrides)

    def branch_width(self, transcript: Transcript) -> int:
        """How many candidates a turn of this transcript samples (1: no tree sampling)."""
        r = self.settings.rewards
        if r.credit != "turn" or r.branch <= 1 or self.evaluation or not transcript.trainable:
            return 1
        return r.branch

    async def score_turn(
        self, transcript: Transcript, index: int, turn: Turn, score: Callable[[Turn], Any] | None
    ) -> float:
        """A turn's score from `score` or the mrlx_turn_reward hook (None -> 0.0).

        A score that fails (it raises, the hook runs past `rewards.grade_timeout_s`, or it is a
        number that is not finite) ends the episode as a failed grade would, the reason naming its producer
        (the plugin, or what a system's RewardError names: a game and its plugin). A score that is
        no number at all breaks the hook's contract on every turn: HookResultError, naming it."""
        plugin = None
        where = (
            f"the score function of system {self.settings.system!r}"
            if score is not None
            else "the mrlx_turn_reward hook"
        )
        try:
            if score is not None:
                # Not under the grade's deadline: a system's score may play the episode on (a
                # game's rollout), and each of its engine calls has a deadline of its own.
                value = score(turn)
                if inspect.isawaitable(value):
                    value = await value
            else:
                found = self.context.hooks.turn_reward.ask(
                    episode=self, transcript=transcript, index=index, turn=turn
                )
                if inspect.isawaitable(found):
                    found = await asyncio.wait_for(found, self.settings.rewards.grade_timeout_s)
                plugin, value = found
        except (ConfigError, HookResultError, EpisodeAborted):
            raise
        except RewardError as exc:  # a system's score that is not finite, named by the system
            raise self.fail_reward(f"scoring turn {index} of {transcript.label}: {exc}", exc) from None
        except BaseException as exc:  # as a failed grade: the episode ends, not the rollout
            if stops_the_rollout(exc):
                raise
            reason = f"scoring turn {index} of {transcript.label} with {where} failed: {described(exc)}"
            raise self.fail_reward(reason, exc) from None
        if value is None:
            return 0.0
        if plugin is not None:
            where = f"mrlx_turn_reward of plugin {plugin!r}"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise HookResultError(
                f"{where} returned {value!r} for turn {index} of {transcript.label} in episode "
                f"{self.id}; expected a finite number (or None)"
            )
        try:
            return finite_reward(value, f"{where} for turn {index} of {transcript.label}")
        except RewardError as exc:
            raise self.fail_reward(str(exc), exc) from None

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

    async def gather(self, *aws: Awaitable[Any]) -> list[Any]:
        """asyncio.gather that cancels the other calls as soon as one ends the episode."""
        tasks = [asyncio.ensure_future(a) for a in aws]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # --- results -------------------------------------------------------------------------

    def conversation_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.response_ids) for t in self.transcripts)

    def samples_of(self, agents: list[str], every_agent: bool) -> list[Any]:
        """Host samples of the transcripts of `agents`, agent by agent.

        When the system declares its fan-out (`context.fan_out`), each agent gets exactly that
        many samples, ABORTED fillers standing in for transcripts the episode did not open (it
        was aborted, or stopped before that role spoke): the host's data-parallel split needs a
        step's sample count fixed. Otherwise each agent gets one sample per transcript; with
        `every_agent` an agent without a transcript gets a filler (a peer's group must have one
        sample per episode), and an episode with no transcript at all gets one filler.

        Under `rewards.credit: turn` a finished episode's trainable transcripts give one sample
        per model turn (and per candidate, with tree sampling): see `turn_samples`. The fan-out
        then counts turns (the system's `fan_out` x `turns` x `branch`); fillers stand in for
        the turns an episode did not reach.
        """
        fan_out = self.context.fan_out
        per_turn = self.settings.rewards.credit == "turn" and not self.evaluation
        out: list[Any] = []
        for agent in agents:
            own: list[Any] = []
            for t in self.transcripts:
                if t.agent != agent:
                    continue
                if per_turn and t.trainable and not self.aborted:
                    own += self.turn_samples(t)
                else:
                    own.append(
                        t.to_sample(
                            self.sample, self.rollout_id, aborted=self.aborted, meta=self.sample_meta(t)
                        )
                    )
            own = self._within_context(agent, own)
            if fan_out is not None:
                want = fan_out.get(agent, 0)
                if len(own) > want:
                    per = "samples (one per turn and candidate)" if per_turn else "transcripts"
                    raise RuntimeError(
                        f"system {self.settings.system!r} declares {want} sample(s) of agent {agent!r} per "
                        "episode "
                        f"(its fan_out{' x turns x branch' if per_turn else ''}) but episode {self.id} made "
                        f"{len(own)} "
                        f"{per} for it; fix the system's fan_out/turns or the transcripts and turns it makes"
                    )
            else:
                want = max(len(own), 1) if every_agent else len(own)
            out += own + [self.fallback_sample(agent) for _ in range(want - len(own))]
        if not out and fan_out is None and agents:
            out.append(self.fallback_sample(agents[0]))
        return out

    def _within_context(self, agent: str, samples: list[Any]) -> list[Any]:
        """`samples` with any one longer than the agent's context limit replaced by an ABORTED
        filler, counted as over the context. The transcripts of `new_transcript` never grow past
        it; this keeps a system that builds its own from sending the host a sample it cannot pad."""
        limit = self.context_limit(agent)
        if limit is None or all(len(s.tokens) <= limit for s in samples):
            return samples
        out = []
        for s in samples:
            if len(s.tokens) > limit:
                reason = (
                    f"system {self.settings.system!r} made a sample of agent {agent!r} of "
                    f"{len(s.tokens)} tokens, past its context limit of {limit}"
                )
                logger.warning("%s (episode %s); it is replaced by an ABORTED filler", reason, self.id)
                self.over_context(reason)
                s = self.fallback_sample(agent)
            out.append(s)
        return out

    def turn_returns(self, t: Transcript) -> list[float]:
        """Each turn's trained reward under per-turn credit: its own reward plus the outcome
        (the transcript's reward) carried back with discount `rewards.gamma`:
        G_last = r_last + outcome, G_i = r_i + gamma * G_(i+1).

        Nothing that is not finite is carried into a return: a turn reward a system set (the
        hook's are checked as they come), the outcome, or a sum that overflows raises
        RewardError naming it (`run_episode` checks the returns before any sample is made)."""
        gamma = float(self.settings.rewards.gamma)
        g = finite_reward(t.reward if t.reward is not None else 0.0, f"the reward of {t.label}")
        returns = [0.0] * len(t.turns)
        for i in reversed(range(len(t.turns))):
            own = t.turn_rewards[i]
            if own is not None:
                own = finite_reward(
                    own, f"system {self.settings.system!r}: the own reward of turn {i} of {t.label}"
                )
            g = (0.0 if own is None else own) + (g if i == len(t.turns) - 1 else gamma * g)
            if not math.isfinite(g):
                raise RewardError(
                    f"the return of turn {i} of {t.label} overflows to {g!r} (its own reward "
                    f"{own!r}, gamma {gamma:g}); keep the rewards within a float's range"
                )
            returns[i] = g
        return returns

    def turn_samples(self, t: Transcript) -> list[Any]:
        """One sample per model turn of `t`; with tree sampling, after each turn the candidates
        sampled beside it and not taken.

        A turn without candidates trains on its return (`turn_returns`). At a turn with
        candidates (`transcript.branches`), under `rewards.branch_target: score` every one of
        the K, the taken one included, trains on its score: one quantity for the whole group, so
        that equal candidates get equal advantages. Under `taken_return` the taken one trains
        on its realised return and the others on their scores (see docs/credit.md: biased)."""
        returns = self.turn_returns(t)
        by_score = self.settings.rewards.branch_target == "score"
        out = []
        for i, turn in enumerate(t.turns):
            candidates = t.branches.get(i)
            reward = t.taken_scores[i] if candidates is not None and by_score else returns[i]
            out.append(
                t.turn_sample(self.sample, self.rollout_id, i, turn, reward, meta=self.sample_meta(t, i))
            )
            for candidate, score in candidates or []:
                out.append(
                    t.turn_sample(
                        self.sample,
                        self.rollout_id,
                        i,
                        candidate,
                        score,
                        meta=self.sample_meta(t, i, candidate=True),
                    )
                )
        return out

    def credit_group(self, t: Transcript | None, turn: int | None) -> str | None:
        """The set of samples (within one prompt group) an advantage is relative to: the agent
        and its role; per turn, also what the turn saw (the system's key for it, a game's
        information state: `transcript.turn_keys`), else the turn index; with tree sampling,
        the K candidates of one turn of one episode."""
        if t is None:
            return None
        group = t.agent + (f"@{t.role}" if t.role else "")
        if turn is None:
            return group
        keyed = self.settings.rewards.group_turns_by == "observation" and turn < len(t.turn_keys)
        key = t.turn_keys[turn] if keyed else None
        if t.branches.get(turn) is not None:
            return f"{group}/turn{turn}/{self.key}:{t.label}"
        return f"{group}/seen:{key}" if key is not None else f"{group}/turn{turn}"

    def sample_meta(
        self, t: Transcript | None, turn: int | None = None, candidate: bool = False
    ) -> dict[str, Any]:
        return {
            "agent": t.agent if t is not None else None,
            "label": t.label if t is not None else None,
            "role": t.role if t is not None else None,
            # the LoRA adapter that produced the sample's turns (None: the engine's base model)
            "adapter": self.settings.agents[t.agent].adapter if t is not None else None,
            "turn": turn,
            "candidate": candidate,
            "credit_group": self.credit_group(t, turn),
            "episode_id": self.id,
            "system": self.settings.system,
            "turns": self.turns,
            "engine_calls": self.engine_calls,
            "conversation_tokens": self.conversation_tokens(),
            "aborted": self.aborted,
            "abort_reason": self.abort_reason,
            # An ABORTED sample standing for what did not fit a context limit (fillers: fallback_sample).
            "over_context": "over_context" in self.metadata and self.aborted,
            "retried_turns": self.retried_turns,
            "aborted_turns": self.aborted_turns,
            "stopped_early": self.stopped_early,
            "raw_reward": t.raw_reward if t is not None else None,
            "team_reward": self.team_reward,
            "evaluation": self.evaluation,
            "episode": dict(self.metadata),
        }

    def fallback_sample(self, agent: str | None = None) -> Any:
        """A failed sample (in `agent`'s token space) for an agent that has no transcript."""
        agent = agent or next(iter(self.settings.agents))
        messages = self.with_system_prompt(agent, [{"role": "user", "content": self.problem}])
        # Cut to the agent's limit (to_sample): the host pads a filler like any other sample.
        t = Transcript.start(
            agent,
            self.context.tokenizers[agent],
            messages,
            trainable=False,
            max_context=self.context_limit(agent),
        )
        meta = self.sample_meta(t)
        meta["over_context"] = "over_context" in self.metadata  # the episode stopped where it did not fit
        return t.to_sample(self.sample, self.rollout_id, aborted=True, meta=meta)
