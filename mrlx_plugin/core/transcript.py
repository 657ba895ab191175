"""One agent's own view of an episode, in that agent's token space.

A `Transcript` starts from the agent's prompt (its system prompt and the conversation so far,
rendered with its own chat template and tokenizer) and grows by two kinds of appends:
- `append_generated(...)`: ids the agent's engine sampled, kept exactly as returned, with their
  log-probs and the engine's weight version; loss mask 1 (when the agent trains);
- `append_messages(...)`: messages the agent only reads (another agent's turn, feedback),
  rendered through the template, their content encoded as plain text (a special token's string
  in it is text, never the token); loss mask 0, log-prob 0.0.

A turn's text is what its ids spell in the agent's tokenizer, special tokens left out
(`turn_from`): the engine's own `text` is not used, so graders and other agents read exactly
what is trained, never the writer's end-of-turn token or a text the ids do not spell.

`to_sample()` turns it into the host's Sample: `tokens` = prompt ids + every later id,
`response_length` = len(later ids), `loss_mask` and `rollout_log_probs` with one entry per
response token, `weight_versions` with one entry per engine call. `turn_sample()` (per-turn
credit) makes one Sample of one model turn: every token before the turn is its prompt, the
turn's own ids its response.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mrlx_plugin.core.host import HostSample, Status, copy_sample
from mrlx_plugin.core.tokenizer import AgentTokenizer

THINK_END = "</think>"


class MalformedTurn(ValueError):
    """Generated ids this agent's tokenizer cannot hold (an id outside its vocabulary)."""


@dataclass
class Turn:
    """One engine call's result as recorded in a transcript."""

    agent: str
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # stop | length | abort
    weight_version: str | None
    retries: int = 0
    start: int = 0  # where the turn's ids begin in the transcript's response ids


def strip_reasoning(text: str) -> str:
    """The answer part of a message: what follows the last `</think>`, if there is one."""
    if THINK_END in text:
        return text.rsplit(THINK_END, 1)[1].strip()
    return text.strip()


class Mark(NamedTuple):
    """Where a transcript stood (`Transcript.mark`): the lengths of what it appends to."""

    ids: int
    messages: int
    turns: int
    weight_versions: int
    held: list[str | list[int]]
    truncated: bool


@dataclass
class Transcript:
    agent: str
    tokenizer: AgentTokenizer
    messages: list[dict[str, str]]  # the conversation as this agent sees it
    trainable: bool = True
    max_context: int | None = None  # prompt + response tokens (host's rollout_max_context_len)
    max_response: int | None = None  # response tokens (host's rollout_max_response_len)
    prompt_ids: tuple[int, ...] = ()  # shared with the tokenizer's cache and sibling transcripts
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    truncated: bool = False  # a turn hit its token cap, or context was cut: the sample is TRUNCATED
    reward: float | None = None  # shaped reward the agent trains on
    raw_reward: float | None = None  # the grader's reward before shaping
    label: str = ""  # free-form name for logs ("solver-3")
    role: str = ""  # a role within the agent (a game seat): its own baseline when normalising
    # The LoRA adapter this transcript's turns are sampled from when it is not the agent's own
    # (`agent.adapter`): a game seat played by a past snapshot of the agent (`systems.game_pool`).
    adapter: str | None = None
    # One entry per turn: the turn's own reward (None: not scored yet; see episodes.samples.turn_returns).
    turn_rewards: list[float | None] = field(default_factory=list)
    # One entry per turn: what the agent saw when it took the turn, as a key (a game's
    # information state), or None; per-turn credit compares turns with the same key.
    turn_keys: list[str | None] = field(default_factory=list)
    # Tree sampling: turn index -> the candidates sampled beside that turn and not taken, with
    # their scores; and the taken candidate's own score.
    branches: dict[int, list[tuple[Turn, float]]] = field(default_factory=dict)
    taken_scores: dict[int, float] = field(default_factory=dict)
    taken_candidates: dict[int, int] = field(default_factory=dict)  # turn -> the taken one's index
    # A copy played ahead to score a candidate (`fork`): never trained, its turns not the episode's.
    lookahead: bool = False
    # A lookahead's own sampling luck: the turn it plays ahead from (e.g. "rollout@first:2:"), so
    # that its seeds are none of the episode's (`episodes.turn._seeded`); "" for the episode's own.
    luck: str = ""
    prompt_messages: list[dict[str, str]] = field(default_factory=list)
    # OpenAI function specs the chat template renders (agents as code); part of every rendering.
    tools: list[dict] | None = None
    # The text the tokens spell, for rendering continuations. Generated ids are decoded only
    # when a continuation needs them (single-turn agents never pay for it).
    _held: list[str | list[int]] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        agent: str,
        tokenizer: AgentTokenizer,
        messages: list[dict[str, str]],
        tools: list[dict] | None = None,
        tools_key: str = "",
        **kw: Any,  # the other fields, as the constructor takes them
    ) -> Transcript:
        text, ids = tokenizer.prompt_ids(messages, tools, tools_key)
        t = cls(agent=agent, tokenizer=tokenizer, messages=list(messages), tools=tools, **kw)
        t.prompt_messages = list(messages)
        t.prompt_ids = ids
        t._held = [text]
        if t.over_context:  # the episode aborts it (Episode.new_transcript); it never holds a turn
            t.truncated = True
        return t

    # --- sizes ---------------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt_ids, *self.response_ids]

    def room(self) -> int | None:
        """How many more tokens fit, or None when unbounded."""
        limits = []
        if self.max_context is not None:
            limits.append(self.max_context - len(self.prompt_ids) - len(self.response_ids))
        if self.max_response is not None:
            limits.append(self.max_response - len(self.response_ids))
        return max(0, min(limits)) if limits else None

    @property
    def over_context(self) -> bool:
        """The prompt alone leaves no room for one generated token within `max_context`."""
        return self.max_context is not None and len(self.prompt_ids) >= self.max_context

    @property
    def full(self) -> bool:
        """No room for another token: this agent's part of the episode is over."""
        room = self.room()
        return room is not None and room <= 0

    # --- appends -------------------------------------------------------------------------

    def turn_from(
        self,
        token_ids: list[int],
        logprobs: list[float],
        finish_reason: str,
        weight_version: str | None,
        retries: int = 0,
    ) -> Turn:
        """The turn for ids an engine sampled for this agent, with the text they spell.

        Raises MalformedTurn when an id is outside the agent's vocabulary (the trainer would
        index past its embedding; no text can show it to a reader). The text is decoded from the
        ids without special tokens: the writer's end-of-turn token, or any special token it
        sampled, never reaches a grader or another agent as text.
        """
        if token_ids:
            low, top = min(token_ids), max(token_ids)
            if low < 0 or top >= self.tokenizer.vocab_size:
                raise MalformedTurn(
                    f"token id {low if low < 0 else top} is outside the vocabulary of agent {self.agent!r} "
                    f"(ids 0 to {self.tokenizer.vocab_size - 1})"
                )
        text = self.tokenizer.answer_text(token_ids) if token_ids else ""
        return Turn(self.agent, token_ids, logprobs, text, finish_reason, weight_version, retries)

    def append_generated(self, turn: Turn) -> None:
        """Record what the engine sampled: the ids exactly as returned, with their log-probs."""
        if len(turn.token_ids) != len(turn.logprobs):
            raise ValueError(
                f"{len(turn.token_ids)} token ids but {len(turn.logprobs)} log-probs from the engine"
            )
        turn.start = len(self.response_ids)
        self.turns.append(turn)
        self.turn_rewards.append(None)
        self.turn_keys.append(None)
        self.response_ids.extend(turn.token_ids)
        self.loss_mask.extend([1 if self.trainable else 0] * len(turn.token_ids))
        self.logprobs.extend(turn.logprobs if self.trainable else [0.0] * len(turn.token_ids))
        if turn.weight_version is not None:
            self.weight_versions.append(turn.weight_version)
        self.messages.append({"role": "assistant", "content": turn.text})
        self._held.append(turn.token_ids)
        if turn.finish_reason == "length":
            self.truncated = True

    def append_messages(self, new: list[dict[str, str]], add_generation_prompt: bool = True) -> bool:
        """Show the agent messages it did not write (loss mask 0). False when they did not fit.

        Messages that would overflow the context are cut to what fits and the transcript is
        marked truncated; the caller should then end this agent's part of the episode.
        """
        text, ids = self.continuation(new, add_generation_prompt)
        return self.append_continuation(new, text, ids)

    def continuation(
        self, new: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> tuple[str, list[int]]:
        """The text and ids `append_messages(new)` would append (nothing is appended)."""
        return self.tokenizer.continuation(
            self.held_text(), self.messages, new, add_generation_prompt, self.tools, self._tail_ids()
        )

    def _tail_ids(self) -> list[int]:
        """The last ids held (enough to hold a template's closing markup)."""
        return [*self.prompt_ids[-64:], *self.response_ids[-64:]][-64:]

    def append_continuation(self, new: list[dict[str, str]], text: str, ids: list[int]) -> bool:
        """Append what `continuation(new)` gave (see `append_messages`)."""
        history = self.messages
        room = self.room()
        fits = room is None or len(ids) <= room
        if not fits:
            ids = ids[:room]
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            self.truncated = True
        self.messages = history + list(new)
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self._held.append(text)
        return fits

    def fork(self) -> Transcript:
        """A copy to play ahead on (tree sampling's rollouts): what it appends leaves this one as
        it is, it trains nothing (loss mask 0) and it is marked `lookahead`."""
        return dataclasses.replace(
            self,
            messages=list(self.messages),
            trainable=False,
            response_ids=list(self.response_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            weight_versions=list(self.weight_versions),
            turns=[dataclasses.replace(t) for t in self.turns],
            turn_rewards=list(self.turn_rewards),
            turn_keys=list(self.turn_keys),
            branches={},
            taken_scores={},
            taken_candidates={},
            lookahead=True,
            _held=list(self._held),
        )

    def mark(self) -> Mark:
        """Where the transcript stands, for `rollback`."""
        return Mark(
            len(self.response_ids),
            len(self.messages),
            len(self.turns),
            len(self.weight_versions),
            list(self._held),
            self.truncated,
        )

    def rollback(self, mark: Mark) -> None:
        """Undo every append since `mark` was taken, turns included (a request whose turn never
        ran, or whose answer never reached its client)."""
        n, messages, turns, versions, held, truncated = mark
        del self.response_ids[n:], self.loss_mask[n:], self.logprobs[n:], self.messages[messages:]
        del self.turns[turns:], self.turn_rewards[turns:], self.turn_keys[turns:]
        del self.weight_versions[versions:]
        for index in [i for i in self.branches if i >= turns]:
            del self.branches[index]
            self.taken_scores.pop(index, None)
        self._held, self.truncated = held, truncated

    def held_text(self) -> str:
        """What the transcript's tokens spell (special tokens included)."""
        held = self._held[0] if len(self._held) == 1 else None
        if isinstance(held, str):
            return held
        text = "".join(
            p if isinstance(p, str) else self.tokenizer.decode(p, skip_special_tokens=False)
            for p in self._held
        )
        self._held = [text]
        return text

    # --- reading -------------------------------------------------------------------------

    @property
    def last_text(self) -> str:
        return self.turns[-1].text if self.turns else ""

    @property
    def answer_text(self) -> str:
        """The agent's last message without its reasoning: what graders and other agents read."""
        return strip_reasoning(self.last_text)

    @property
    def generated_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns)

    # --- to the host ---------------------------------------------------------------------

    def to_sample(
        self, template: HostSample, rollout_id: int | None, *, aborted: bool, meta: Mapping[str, object]
    ) -> HostSample:
        """The host Sample for this transcript.

        Aborted (and untrainable) samples follow the host's failed-sample pattern: reward 0.0,
        loss mask all zero, `remove_sample`. A response must have at least one token (a
        zero-length response makes the host's `[-response_length:]` slices cover the whole
        sequence), so an empty one gets the end-of-sequence id with loss mask 0. An aborted
        sample trains nothing, yet the host still pads it into a micro-batch: one past
        `max_context` keeps only the start of its prompt and that one pad token.
        """
        response = list(self.response_ids)
        mask = list(self.loss_mask)
        logprobs = list(self.logprobs)
        pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        prompt = self.prompt_ids  # a tuple: copied once, into `tokens`
        if aborted and self.max_context is not None and len(prompt) + len(response) > self.max_context:
            prompt, response = prompt[: max(0, self.max_context - 1)], []
        if not response:
            response, mask, logprobs = [pad], [0], [0.0]
        if aborted:
            status = Status.ABORTED
        elif self.truncated:
            status = Status.TRUNCATED
        else:
            status = Status.COMPLETED
        sample = copy_sample(
            template,
            rollout_id=rollout_id,
            prompt=self.prompt_messages,
            tokens=[*prompt, *response],
            response_length=len(response),
            response="".join(t.text for t in self.turns),
            loss_mask=[0] * len(mask) if aborted else mask,
            rollout_log_probs=[0.0] * len(logprobs) if aborted else logprobs,
            weight_versions=list(self.weight_versions),
            reward=0.0 if aborted else float(self.reward if self.reward is not None else 0.0),
            status=status,
            remove_sample=aborted,
        )
        sample.metadata["mrlx"] = meta
        return sample

    def turn_sample(
        self,
        template: HostSample,
        rollout_id: int | None,
        index: int,
        turn: Turn,
        reward: float,
        *,
        meta: Mapping[str, object],
    ) -> HostSample:
        """The host Sample of one model turn (`turns[index]`, or a candidate sampled beside it):
        prompt = the transcript's tokens before the turn (the context the turn was sampled from),
        response = the turn's ids, every one trained (loss mask 1), with its log-probs and weight
        version. TRUNCATED when the turn hit its token cap."""
        if not self.trainable:
            raise ValueError(f"agent {self.agent!r} is not trainable: its turns make no samples")
        context = [*self.prompt_ids, *self.response_ids[: self.turns[index].start]]
        response, logprobs = list(turn.token_ids), list(turn.logprobs)
        mask = [1] * len(response)
        if not response:  # as in to_sample: the host's slices need one response token
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
            response, mask, logprobs = [pad], [0], [0.0]
        sample = copy_sample(
            template,
            rollout_id=rollout_id,
            prompt=self.messages_before(index),
            tokens=context + response,
            response_length=len(response),
            response=turn.text,
            loss_mask=mask,
            rollout_log_probs=logprobs,
            weight_versions=[turn.weight_version] if turn.weight_version is not None else [],
            reward=float(reward),
            status=Status.TRUNCATED if turn.finish_reason == "length" else Status.COMPLETED,
            remove_sample=False,
        )
        sample.metadata["mrlx"] = meta
        return sample

    def messages_before(self, index: int) -> list[dict[str, str]]:
        """The conversation as this agent saw it when it took turn `index`."""
        seen = 0
        for i, message in enumerate(self.messages):
            if message.get("role") == "assistant" and i >= len(self.prompt_messages):
                if seen == index:
                    return self.messages[:i]
                seen += 1
        return list(self.messages)
