"""One model turn, top to bottom: the sampling parameters, the engine call and its retries, the
answer's checks, and the turn appended to the agent's transcript (`take_turn`, which
`Episode.generate` runs).

The retries are one policy at two levels (`mrlx_plugin.core.retry` at both): the engine client
retries a failure that may pass (a refused connection, a timeout, a 5xx) within one call's budget
(`engine.max_retries`); this module retries the whole call of a peer agent's engine
(`retry_on_abort`) that aborted the turn or whose retries ran out, every
`engine.abort_retry_wait_s`, until `engine.peer_deadline_s` (a peer's engines come and go while it
updates its weights). An engine this job owns is not retried here: its faults end the episode.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NoReturn

from mrlx_plugin.core.config import AgentSettings
from mrlx_plugin.core.engine_client import EngineError, GenerateResult, MalformedAnswer
from mrlx_plugin.core.retry import Backoff, Deadline, RetriesExhausted, retry
from mrlx_plugin.core.transcript import MalformedTurn, Transcript, Turn
from mrlx_plugin.episodes.errors import EpisodeAborted

if TYPE_CHECKING:
    from mrlx_plugin.episodes.episode import Episode

Score = Callable[[Turn], object]
OnFault = Callable[[EngineError], Awaitable[str | None]]


class _PeerAborted(Exception):
    """A peer engine answered the turn with finish reason `abort` (it is updating its weights)."""


async def take_turn(
    episode: Episode,
    transcript: Transcript,
    score: Score | None,
    on_fault: OnFault | None,
    overrides: dict[str, object],
) -> Turn:
    """One model turn for `transcript`'s agent, appended to it (see `Episode.generate`)."""
    episode.check_alive()
    agent = episode.settings.agents[transcript.agent]
    params = sampling_for(episode.base_sampling, agent, overrides)
    room = transcript.room()
    if room is not None:
        params["max_new_tokens"] = min(int(params.get("max_new_tokens", room)), room)
    if params.get("max_new_tokens", 1) <= 0:
        transcript.truncated = True
        return Turn(transcript.agent, [], [], "", "length", None)
    k = episode.branch_width(transcript)
    if k == 1:
        turn = await _sample(episode, transcript, agent, params, 0, on_fault)
        transcript.append_generated(turn)
        if not transcript.lookahead:
            episode.turns += 1
        return turn
    # Tree sampling: K candidates from the same context, each scored (concurrently: a score may
    # play the game on from its candidate); the episode goes on from one.
    candidates = await episode.gather(
        *(_sample(episode, transcript, agent, params, c, on_fault) for c in range(k))
    )
    index = len(transcript.turns)
    scores = await episode.gather(*(episode.score_turn(transcript, index, t, score) for t in candidates))
    taken = _pick(episode, scores, transcript, index)
    transcript.append_generated(candidates[taken])
    transcript.turn_rewards[-1] = scores[taken]
    transcript.taken_scores[index] = scores[taken]
    transcript.branches[index] = [(c, s) for i, (c, s) in enumerate(zip(candidates, scores)) if i != taken]
    episode.turns += 1
    episode.metadata["branch_candidates"] = episode.metadata.get("branch_candidates", 0) + k - 1
    return candidates[taken]


def sampling_for(base: dict[str, object], agent: AgentSettings, overrides: dict[str, object]) -> dict:
    """The episode's sampling parameters, the agent's own settings over them, the call's over those."""
    params = dict(base)
    s = agent.sampling
    for key in ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids"):
        value = getattr(s, key)
        if value is not None:
            params[key] = value
    params.update(overrides)
    return params


def _pick(episode: Episode, scores: list[float], transcript: Transcript, index: int) -> int:
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


def _seeded(episode: Episode, transcript: Transcript, params: dict, candidate: int) -> dict:
    """`params` with the turn's sampling seed, when there is one: `engine.sampling_seed` mixed with
    the episode, the transcript and the turn; the candidates of one turn must differ, so each
    candidate after the first gets a seed derived from it (from the host's own seed too: slime's
    deterministic inference sends one per sample, and all K would otherwise be the same answer)."""
    seed = episode.settings.engine.sampling_seed
    where = f"{episode.id}:{transcript.label}:{len(transcript.turns)}"
    if seed is not None and "sampling_seed" not in params:
        key = f"{seed}:{where}" + (f":{candidate}" if candidate else "")
    elif candidate and "sampling_seed" in params:
        key = f"{params['sampling_seed']}:{where}:{candidate}"
    else:
        return params
    return {**params, "sampling_seed": zlib.crc32(key.encode()) & 0x7FFFFFFF}


async def _sample(
    episode: Episode,
    transcript: Transcript,
    agent: AgentSettings,
    params: dict,
    candidate: int,
    on_fault: OnFault | None,
) -> Turn:
    """One engine call for the transcript's next turn (not appended), with the retries above."""
    params = _seeded(episode, transcript, params, candidate)
    client = episode.context.clients[transcript.agent]
    e = episode.settings.engine
    peer = bool(agent.retry_on_abort)
    deadline = Deadline(e.peer_deadline_s if peer else e.request_timeout_s * (e.max_retries + 1))
    retried = False
    # An agent served as a LoRA adapter: the engine applies the adapter this request names.
    route = {"lora_path": agent.adapter} if agent.adapter else None

    async def call(attempt: int) -> GenerateResult:
        nonlocal retried
        if attempt:
            retried = True
            episode.check_alive()  # the host may have ended the rollout while this turn waited
        try:
            result = await client.generate(transcript.tokens, params, deadline=deadline.at, extra=route)
        except MalformedAnswer as exc:
            _malformed(episode, f"{exc.url}: {exc.detail}")
        except EngineError as exc:
            episode.aborted_turns += 1
            if not (peer and exc.retryable):
                _end(episode, f"engine fault: {exc}")
            why = await on_fault(exc) if on_fault is not None else None
            if why is not None:  # the system knows this peer will not come back soon
                _end(episode, why)
            raise
        retried = retried or result.retries > 0
        episode.engine_calls += 1
        if result.finish_reason == "abort":
            episode.aborted_turns += 1
            if not peer:
                _end(episode, f"{client.url} aborted the turn")
            raise _PeerAborted()
        return result

    wait = e.abort_retry_wait_s  # a fixed wait: the peer's weight update takes what it takes
    try:
        result = await retry(
            call,
            retryable=lambda exc: isinstance(exc, (EngineError, _PeerAborted)),
            deadline=deadline,
            backoff=Backoff(base_s=wait, max_s=wait, jitter=False),
        )
    except RetriesExhausted as exc:
        if isinstance(exc.last, _PeerAborted):
            _end(episode, f"{client.url} aborted the turn until the deadline")
        _end(episode, f"engine fault: {exc.last}")
    if retried:
        episode.retried_turns += 1
    try:  # the ids against the agent's vocabulary; the text is what they spell, not the engine's
        return transcript.turn_from(
            result.token_ids, result.logprobs, result.finish_reason, result.weight_version, result.retries
        )
    except MalformedTurn as exc:
        _malformed(episode, f"{client.url}/generate: {exc}")


def _end(episode: Episode, reason: str) -> NoReturn:
    episode.abort(reason)
    raise EpisodeAborted(episode.abort_reason)


def _malformed(episode: Episode, reason: str) -> NoReturn:
    """An engine answer no one may train on: the episode ends, its samples ABORTED, the reason
    kept in the samples' metadata (`episode.malformed_answer`, counted in the metrics)."""
    episode.aborted_turns += 1
    episode.metadata.setdefault("malformed_answer", reason)
    _end(episode, f"malformed answer from {reason}")
