"""One model turn, top to bottom: the sampling parameters, the engine call, the answer's checks, and
the turn appended to the agent's transcript (`take_turn`: it is `Episode.generate`), with tree
sampling's candidates and their scores (`score_turn`).

One engine call is one retry loop, the engine client's (`EngineClient.generate`): it retries the
failures that may pass within `engine.max_retries`, and, for a peer agent's engine
(`retry_on_abort`), an `abort` answer or a fault that outlived those retries, every
`engine.abort_retry_wait_s` until `engine.peer_deadline_s`: the peer policy (`PeerRetry`) and the
deadline are passed down from here. An engine this job owns is not retried on `abort`: that and
every fault the call could not pass end the episode (docs/guarantees.md, "Engine faults and
retries"). A turn reads its episode through `TurnEpisode` (an `Episode` is one).

A turn may be streamed to whoever waits for it (`on_tokens`: the agent endpoint shows the text to
its client as the engine samples it), but only a turn whose one engine answer is certainly the
turn kept: one candidate (no tree sampling) on an engine that is not a peer retried on `abort`.
A branched turn keeps one of K answers, and a peer's call may be answered again after an abort,
so the tokens shown could belong to an answer that is not recorded; such a turn is not streamed.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import random
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

from mrlx_plugin.core.config import AgentSettings, ConfigError, Settings
from mrlx_plugin.core.engine_client import EngineError, MalformedAnswer, PeerRetry
from mrlx_plugin.core.retry import Deadline
from mrlx_plugin.core.sglang import SamplingParams
from mrlx_plugin.core.transcript import MalformedTurn, Transcript, Turn
from mrlx_plugin.core.values import RewardError, finite_reward
from mrlx_plugin.episodes.context import EpisodeContext
from mrlx_plugin.episodes.errors import EpisodeAborted, HookResultError, described, stops_the_rollout

T = TypeVar("T")
Score = Callable[[Turn], object]
OnFault = Callable[[EngineError], Awaitable[str | None]]
OnTokens = Callable[[list[int]], Awaitable[object]]


@dataclass
class TurnCounts:
    """What the turns of one episode counted (every sample's metadata carries them)."""

    turns: int = 0  # model turns taken (a lookahead's not counted)
    engine_calls: int = 0  # every call answered: turns, tree-sampling candidates, rollout moves, aborts
    retried_turns: int = 0  # calls that needed any retry
    aborted_turns: int = 0  # every failed call, malformed answer or `abort` answer


class TurnEpisode(Protocol):
    """What a turn reads and changes of its episode (`Episode` is one)."""

    id: str
    settings: Settings
    context: EpisodeContext
    evaluation: bool
    base_sampling: SamplingParams
    metadata: dict[str, Any]  # the episode's free-form facts (`Episode.metadata`)
    counts: TurnCounts
    abort_reason: str | None

    def check_alive(self) -> None: ...

    def abort(self, reason: str) -> None: ...

    def fail_reward(self, reason: str, exc: BaseException) -> EpisodeAborted: ...

    async def gather(self, *aws: Awaitable[T]) -> list[T]: ...


async def take_turn(
    episode: TurnEpisode,
    transcript: Transcript,
    score: Score | None = None,
    *,
    on_fault: OnFault | None = None,
    on_tokens: OnTokens | None = None,
    **sampling_overrides: object,
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

    `on_tokens(ids)` is awaited with each chunk's new ids as the engine streams them (the
    answer's ids in order; they add up to the turn's `token_ids`), for a turn of one candidate
    on an engine not retried on `abort` (`agent.retry_on_abort` false); for any other turn it
    is never called, since the tokens shown could be those of an answer not kept. The turn
    recorded is the one an unstreamed call records. A fault after the first `on_tokens` call
    is not retried: it ends the episode as a lasting engine fault does. What `on_tokens`
    raises passes through as it is: no turn is appended, and the engine's request is aborted.
    """
    episode.check_alive()
    agent = episode.settings.agents[transcript.agent]
    params = sampling_for(episode.base_sampling, agent, sampling_overrides)
    room = transcript.room()
    if room is not None:
        params["max_new_tokens"] = min(int(params.get("max_new_tokens", room)), room)
    if params.get("max_new_tokens", 1) <= 0:
        transcript.truncated = True
        return Turn(transcript.agent, [], [], "", "length", None)
    k = branch_width(episode, transcript)
    if k == 1:
        stream = None if agent.retry_on_abort else on_tokens
        turn = await _sample(episode, transcript, agent, params, 0, on_fault, stream)
        transcript.append_generated(turn)
        if not transcript.lookahead:
            episode.counts.turns += 1
        return turn
    # Tree sampling: K candidates from the same context, each scored (concurrently: a score may
    # play the game on from its candidate); the episode goes on from one.
    candidates = await episode.gather(
        *(_sample(episode, transcript, agent, params, c, on_fault) for c in range(k))
    )
    index = len(transcript.turns)
    scores = await episode.gather(*(score_turn(episode, transcript, index, t, score) for t in candidates))
    taken = _pick(episode, scores, transcript, index)
    transcript.append_generated(candidates[taken])
    transcript.turn_rewards[-1] = scores[taken]
    transcript.taken_scores[index] = scores[taken]
    transcript.taken_candidates[index] = taken
    transcript.branches[index] = [(c, s) for i, (c, s) in enumerate(zip(candidates, scores)) if i != taken]
    episode.counts.turns += 1
    episode.metadata["branch_candidates"] = episode.metadata.get("branch_candidates", 0) + k - 1
    return candidates[taken]


def sampling_for(
    base: Mapping[str, object], agent: AgentSettings, overrides: Mapping[str, object]
) -> SamplingParams:
    """The episode's sampling parameters, the agent's own settings over them, the call's over those."""
    params: SamplingParams = dict(base)
    s = agent.sampling
    for key in ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids"):
        value = getattr(s, key)
        if value is not None:
            params[key] = value
    params.update(overrides)
    return params


def branch_width(episode: TurnEpisode, transcript: Transcript) -> int:
    """How many candidates a turn of this transcript samples (1: no tree sampling)."""
    r = episode.settings.rewards
    if r.credit != "turn" or r.branch <= 1 or episode.evaluation or not transcript.trainable:
        return 1
    return r.branch


async def _sample(
    episode: TurnEpisode,
    transcript: Transcript,
    agent: AgentSettings,
    params: SamplingParams,
    candidate: int,
    on_fault: OnFault | None,
    on_tokens: OnTokens | None = None,
) -> Turn:
    """One engine call for the transcript's next turn (not appended), streamed to `on_tokens`."""
    client = episode.context.clients[transcript.agent]
    e, counts = episode.settings.engine, episode.counts
    peer = None
    if agent.retry_on_abort:  # a peer's engine: its `abort` answers and lasting faults are retried

        async def failed(error: EngineError | None) -> None:
            counts.aborted_turns += 1
            if error is None:
                counts.engine_calls += 1  # an `abort` answer is an answer
            elif on_fault is not None and (why := await on_fault(error)) is not None:
                _end(episode, why)  # the system knows this peer will not come back soon

        peer = PeerRetry(e.abort_retry_wait_s, episode.check_alive, failed)
    deadline = Deadline(e.peer_deadline_s if peer else e.request_timeout_s * (e.max_retries + 1))
    # An agent served as a LoRA adapter: the engine applies the adapter this request names.
    route = {"lora_path": lora} if (lora := transcript.adapter or agent.adapter) else None
    try:
        result = await client.generate(
            transcript.tokens,
            _seeded(episode, transcript, params, candidate),
            deadline=deadline.at,
            extra=route,
            peer=peer,
            on_tokens=on_tokens,
        )
    except MalformedAnswer as exc:
        _malformed(episode, f"{exc.url}: {exc.detail}")
    except EngineError as exc:
        counts.aborted_turns += 1
        if peer is not None and exc.retryable and on_fault is not None:
            why = await on_fault(exc)
            if why is not None:
                _end(episode, why)
        _end(episode, f"engine fault: {exc}")
    counts.engine_calls += 1
    # An `abort` from this job's engine (the rollout is ending), or a peer's last before the deadline.
    if result.finish_reason == "abort":
        counts.aborted_turns += 1
        _end(episode, f"{client.url} aborted the turn" + (" until the deadline" if peer else ""))
    if result.retries:
        counts.retried_turns += 1
    try:  # the ids against the agent's vocabulary; the text is what they spell, not the engine's
        return transcript.turn_from(
            result.token_ids, result.logprobs, result.finish_reason, result.weight_version, result.retries
        )
    except MalformedTurn as exc:
        _malformed(episode, f"{client.url}/generate: {exc}")


def _seeded(
    episode: TurnEpisode, transcript: Transcript, params: SamplingParams, candidate: int
) -> SamplingParams:
    """`params` with the turn's sampling seed, when there is one: `engine.sampling_seed` (or the
    host's own seed: slime's deterministic inference sends one per sample) mixed with the episode,
    the transcript and the turn. The candidates of one turn must differ, so each candidate after
    the first gets a seed derived from it. A transcript played ahead (a rollout's, whose `luck`
    names the turn it scores) draws its own seeds: were they the episode's, a rollout would sample
    exactly what the episode's next candidate 0 samples, and a best pick would select on that
    shared luck (candidate 0 of later turns biased; docs/credit.md)."""
    seed = episode.settings.engine.sampling_seed
    where = f"{episode.id}:{transcript.luck}{transcript.label}:{len(transcript.turns)}"
    suffix = f":{candidate}" if candidate else ""
    if seed is not None and "sampling_seed" not in params:
        key = f"{seed}:{where}{suffix}"
    elif (candidate or transcript.luck) and "sampling_seed" in params:
        key = f"{params['sampling_seed']}:{where}{suffix}"
    else:
        return params
    return {**params, "sampling_seed": zlib.crc32(key.encode()) & 0x7FFFFFFF}


def _end(episode: TurnEpisode, reason: str) -> NoReturn:
    episode.abort(reason)
    raise EpisodeAborted(episode.abort_reason)


def _malformed(episode: TurnEpisode, reason: str) -> NoReturn:
    """An engine answer no one may train on: the episode ends, its samples ABORTED, the reason
    kept in the samples' metadata (`episode.malformed_answer`, counted in the metrics)."""
    episode.counts.aborted_turns += 1
    episode.metadata.setdefault("malformed_answer", reason)
    _end(episode, f"malformed answer from {reason}")


# --- scores of turns ----------------------------------------------------------------------------


async def score_turn(
    episode: TurnEpisode, transcript: Transcript, index: int, turn: Turn, score: Score | None
) -> float:
    """A turn's score from `score` or the mrlx_turn_reward hook (None -> 0.0).

    A score that fails (it raises, the hook runs past `rewards.grade_timeout_s`, or it is a
    number that is not finite) ends the episode as a failed grade would, the reason naming its producer
    (the plugin, or what a system's RewardError names: a game and its plugin). A score that is
    no number at all breaks the hook's contract on every turn: HookResultError, naming it."""
    plugin = None
    where = (
        f"the score function of system {episode.settings.system!r}"
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
            found = episode.context.hooks.turn_reward.ask(
                episode=episode, transcript=transcript, index=index, turn=turn
            )
            if inspect.isawaitable(found):
                found = await asyncio.wait_for(found, episode.settings.rewards.grade_timeout_s)
            plugin, value = found
    except (ConfigError, HookResultError, EpisodeAborted):
        raise
    except RewardError as exc:  # a system's score that is not finite, named by the system
        raise episode.fail_reward(f"scoring turn {index} of {transcript.label}: {exc}", exc) from None
    except BaseException as exc:  # as a failed grade: the episode ends, not the rollout
        if stops_the_rollout(exc):
            raise
        reason = f"scoring turn {index} of {transcript.label} with {where} failed: {described(exc)}"
        raise episode.fail_reward(reason, exc) from None
    if value is None:
        return 0.0
    if plugin is not None:
        where = f"mrlx_turn_reward of plugin {plugin!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HookResultError(
            f"{where} returned {value!r} for turn {index} of {transcript.label} in episode "
            f"{episode.id}; expected a finite number (or None)"
        )
    try:
        return finite_reward(value, f"{where} for turn {index} of {transcript.label}")
    except RewardError as exc:
        raise episode.fail_reward(str(exc), exc) from None


def _pick(episode: TurnEpisode, scores: list[float], transcript: Transcript, index: int) -> int:
    """The candidate the episode goes on from (`rewards.branch_pick`). Every draw, ties of `best`
    included, is seeded by the episode, the transcript and the turn: a rerun picks the same, and
    no candidate position is favoured (first-on-ties would nearly always take candidate 0 where
    scores are equal, as they are before a game's end)."""
    rng = random.Random(zlib.crc32(f"{episode.id}:{transcript.label}:{index}".encode()))
    pick = episode.settings.rewards.branch_pick
    if pick == "random":
        return rng.randrange(len(scores))
    if pick == "best":
        top = max(scores)
        return rng.choice([i for i, s in enumerate(scores) if s == top])
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    return rng.choices(range(len(scores)), weights=weights)[0]
