"""An opponent-pool member that is down: a frozen model (`trainable: false`, its own URL) that a game
seat draws from the pool (`mrlx.game.opponents`) and that nothing answers at its URL. Its episodes
end at once for `POOL_DOWN_S`, recorded as `opponent_down`, instead of each waiting
`engine.peer_deadline_s` (a frozen model has no weight update to wait for).

Also the population of past policies (`mrlx.game.population`): the seats one trained agent plays
are filled, per prompt group, with its latest policy (one seat, drawn, always: the learner) or one
of its past snapshots, served as LoRA adapters `ADAPTER@VERSION` of the same base on the same
engine (the embedded trainer loads them: `mrlx_plugin.local.trainer.weights.Snapshots`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import urllib.parse
import weakref
import zlib
from collections.abc import Awaitable, Callable

from pydantic import Field

from mrlx_plugin.core.config import ConfigError, Section, Settings, Text, bounded
from mrlx_plugin.core.engine_client import EngineError
from mrlx_plugin.core.transcript import Transcript
from mrlx_plugin.episodes import Episode, EpisodeAborted

logger = logging.getLogger(__name__)

# A frozen pool member found down (nothing accepts a connection at its URL) is not called again
# for this long: the episodes that draw it end at once, counted as `opponent_down`, rather than
# each waiting out `engine.peer_deadline_s` (a frozen model has no weight update to wait for).
POOL_DOWN_S = 30.0
# Per process (its episodes' context): pool member -> (the monotonic time its mark ends, why it is down).
_DOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def frozen_agent(settings: Settings, player: str) -> bool:
    """An agent that no job trains, served at its own URL (a past checkpoint, a fixed model)."""
    agent = settings.agents.get(player)
    return agent is not None and not agent.trainable and agent.url != "self"


def _member_down(episode: Episode, player: str) -> str | None:
    """Why pool member `player` is marked down, or None when it is not (or no longer) marked."""
    mark = _DOWN.get(episode.context, {}).get(player)
    return mark[1] if mark is not None and mark[0] > time.monotonic() else None


def _down_reason(episode: Episode, player: str, why: str) -> str:
    episode.metadata["opponent_down"] = player
    return (
        f"opponent-pool member {player!r} is down ({why}); the episodes that draw it end at once for "
        f"{POOL_DOWN_S:g} s after it was found down, instead of waiting engine.peer_deadline_s"
    )


def check_member(episode: Episode, player: str) -> None:
    why = _member_down(episode, player)
    if why is not None:
        episode.abort(_down_reason(episode, player, why))
        raise EpisodeAborted(episode.abort_reason)


async def _unreachable(url: str, timeout: float) -> str | None:
    """Why nothing accepts a TCP connection at `url`'s host and port, or None when something does."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        return f"{url}: no connection within engine.connect_timeout_s ({timeout:g} s)"
    except OSError as exc:
        return f"{url}: {exc.strerror or exc}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


def watch_member(episode: Episode, player: str) -> Callable[[EngineError], Awaitable[str | None]]:
    """The `on_fault` of pool member `player`'s turns: on an engine fault (its client's retries
    spent), probe its address; nothing listening marks it down (`POOL_DOWN_S`) and ends the
    episode at once. An engine that accepts connections but fails is waited for as before."""

    async def on_fault(error: EngineError) -> str | None:
        why = _member_down(episode, player)
        if why is None:
            why = await _unreachable(episode.context.urls[player], episode.settings.engine.connect_timeout_s)
            if why is None:
                return None
            _DOWN.setdefault(episode.context, {})[player] = (time.monotonic() + POOL_DOWN_S, why)
            logger.warning(
                "opponent-pool member %r is down (%s; the last call: %s): the episodes that draw "
                "it end at once for the next %g s",
                player,
                why,
                error,
                POOL_DOWN_S,
            )
        return _down_reason(episode, player, why)

    return on_fault


# --- the population of past policies (`mrlx.game.population`) ------------------------------------

SNAPSHOT_MARK = "@"  # a snapshot's adapter is `ADAPTER@VERSION`; its seat's player `AGENT@VERSION`
# The engines' limit on an adapter's name (SGLang's, and the embedded engine's) less "@" and 8 digits.
_ADAPTER_NAME_ROOM = 128 - 9


class PopulationSettings(Section):
    """Self-play against a growing population of the agent's own past policies (fictitious-self-play
    like): in the seats `agent` plays, one seat (drawn per prompt group) plays and trains the latest
    policy; each of its other seats plays the latest policy too (probability `latest`) or one of
    its last `keep` snapshots, each a LoRA adapter `ADAPTER@VERSION` the embedded trainer loads."""

    agent: Text | None = Field(
        None,
        description="the trained agent whose past policies form the population: an agent served as a "
        "LoRA adapter (`adapter`), trainable, that plays at least one seat (or is in the pool of a "
        "`pool` seat); the trainer of this agent takes the snapshots; none = `mrlx.self`",
    )
    every: bounded(int, ge=1) = Field(
        1,
        description="a snapshot every N weight versions: versions 0 (the start), N, 2N, ... (the embedded "
        "trainer's weight version at rollout r is r)",
    )
    keep: bounded(
        int, ge=1, le=64, why="each snapshot drawn from is one more adapter loaded on every engine"
    ) = Field(
        4,
        description="how many of the most recent snapshots are drawn from (older ones are unloaded from "
        "the engines and never drawn again)",
    )
    latest: bounded(float, ge=0, le=1) = Field(
        0.5,
        description="probability that a seat of the agent other than the learner's plays the latest "
        "policy (trained, as in plain self-play) rather than a snapshot (not trained); 1 is plain "
        "self-play, 0 always a snapshot",
    )


def population_problems(
    settings: Settings, path: str, seats_of: Callable[[Settings], dict[str, list[int]]]
) -> list[str]:
    """What is wrong with `mrlx.game.population` (at `path`) beside the other settings: its agent
    must be an agent served as a LoRA adapter, trainable, that plays a seat (`seats_of`: the seats
    each agent may play)."""
    if settings.game.population is None:
        return []
    name = population_agent(settings)
    if name is None:
        return [f"{path}.agent: name the agent whose past policies form the population (or set mrlx.self)"]
    agent = settings.agents.get(name)
    where = f"{path}.agent: {name!r}"
    if agent is None:
        return [f"{where} is not an agent (agents: {', '.join(settings.agents)})"]
    if not agent.adapter:
        return [
            f"{where} is not served as a LoRA adapter: set mrlx.agents.{name}.adapter (its snapshots "
            "are adapters of the same base on the same engine)"
        ]
    if len(agent.adapter) > _ADAPTER_NAME_ROOM:
        return [
            f"mrlx.agents.{name}.adapter: {agent.adapter!r} is longer than {_ADAPTER_NAME_ROOM} "
            f"characters: its snapshots' names (`{agent.adapter}@VERSION`) would pass the engines' 128"
        ]
    if not agent.trainable:
        return [f"{where} is not trainable (mrlx.agents.{name}.trainable): it has no past policies"]
    if not seats_of(settings).get(name):
        return [f"{where} plays no seat: list it in mrlx.game.seats (or in the opponents of a `pool` seat)"]
    return []


def population_agent(settings: Settings) -> str | None:
    """The agent of `mrlx.game.population` (its `agent`, else `mrlx.self`); None without one."""
    pop = settings.game.population
    return None if pop is None else pop.agent or settings.self_agent


def snapshot_versions(version: int, every: int, keep: int) -> list[int]:
    """The snapshot versions that exist at weight version `version` and are drawn from: the last
    `keep` of 0, `every`, 2 x `every`, ... up to `version`."""
    top = max(0, version) // every
    return [k * every for k in range(max(0, top - keep + 1), top + 1)]


def population_draw(
    key: str, players: list[str], agent: str, version: int | None, pop: PopulationSettings
) -> tuple[list[str], int | None]:
    """Who plays each seat when `players` (one per seat) are filled from the population of `agent`
    at weight version `version`, drawn from `key` alone (a prompt group: `systems.game.pool_key`, so
    its episodes meet the same players): (the players, a snapshot's seat `AGENT@VERSION`; the
    learner's seat). Among the seats `agent` plays one, drawn uniformly, is the learner (the latest
    policy); each other plays the latest policy with probability `latest`, else a snapshot drawn
    uniformly from `snapshot_versions`. No seat of `agent`: `players` as they are, no learner; no
    version known: no snapshot."""
    seats = [i for i, who in enumerate(players) if who == agent]
    if not seats:
        return list(players), None
    rng = random.Random(zlib.crc32(f"{key}:population".encode()))
    learner = rng.choice(seats)
    versions = snapshot_versions(version, pop.every, pop.keep) if version is not None else []
    out = list(players)
    for i in seats:
        # Both draws are made for every seat: a seat's draw does not depend on another's outcome.
        latest, snapshot = rng.random() < pop.latest, rng.choice(versions) if versions else None
        if i != learner and not latest and snapshot is not None:
            out[i] = f"{agent}{SNAPSHOT_MARK}{snapshot}"
    return out, learner


# The host args' attribute holding the weight version a training rollout's engines serve: the
# embedded trainer sets it to the rollout step r before each rollout (it pushed step r-1's weights
# as version r, the start as 0). The host's Sample.rollout_id is no step: it names a generate call.
WEIGHT_VERSION_ARG = "mrlx_weight_version"


def population_seats(
    episode: Episode, key: str, players: list[str], names: tuple[str, ...]
) -> tuple[list[str], int | None]:
    """`population_draw` for an episode (`mrlx.game.population`; none, or an evaluation: the
    players as they are, no learner), at the weight version its rollout's engines serve
    (`WEIGHT_VERSION_ARG`: a host that does not say is a ConfigError), the learner's seat
    recorded in its metadata (`learner`)."""
    pop, agent = episode.settings.game.population, population_agent(episode.settings)
    if pop is None or agent is None or episode.evaluation:
        return players, None
    version = getattr(episode.context.args, WEIGHT_VERSION_ARG, None)
    if not isinstance(version, int):
        raise ConfigError(
            "mrlx.game.population: the host does not say which weight version this rollout's engines "
            f"serve (args.{WEIGHT_VERSION_ARG}, which the embedded trainer sets before each rollout), so "
            "no snapshot is known to exist; train the population's agent with the embedded trainer "
            "(`python -m mrlx_plugin.local.trainer --adapter DIR`), or leave out mrlx.game.population"
        )
    drawn, learner = population_draw(key, players, agent, version, pop)
    if learner is not None:
        episode.metadata["learner"] = names[learner]
    return drawn, learner


def snapshot_player(settings: Settings, player: str) -> tuple[str, str | None]:
    """The agent a seat's player is, and the adapter of the snapshot it plays (None: the agent's
    own): `AGENT@VERSION` (`population_draw`) is the population's agent at snapshot VERSION."""
    if settings.game.population is None or player in settings.agents:
        return player, None
    agent, mark, version = player.rpartition(SNAPSHOT_MARK)
    if mark and agent == population_agent(settings) and version.isdigit():
        return agent, f"{settings.agents[agent].adapter}{SNAPSHOT_MARK}{int(version)}"
    return player, None


def seat_view(episode: Episode, player: str, messages: list[dict[str, str]], seat: str) -> Transcript:
    """Open the view of the seat named `seat` for its player (`Episode.new_transcript`). A
    snapshot's view (`snapshot_player`) is its agent's (tokenizer, sampling, role) with its requests
    sent to the snapshot's adapter, and it trains nothing (loss mask 0; its sample keeps the fan-out)."""
    agent, snapshot = snapshot_player(episode.settings, player)
    return _as_snapshot(episode.new_transcript(agent, messages, label=seat, role=seat), snapshot)


def lookahead_view(
    episode: Episode, player: str, messages: list[dict[str, str]], seat: str
) -> Transcript | str:
    """`seat_view` of a view opened while playing ahead (`Episode.open_transcript` with
    `lookahead`: never trained), or why its prompt did not fit."""
    agent, snapshot = snapshot_player(episode.settings, player)
    t = episode.open_transcript(agent, messages, label=seat, role=seat, lookahead=True)
    return t if isinstance(t, str) else _as_snapshot(t, snapshot)


def _as_snapshot(t: Transcript, snapshot: str | None) -> Transcript:
    if snapshot is not None:  # before any turn: its loss mask and log-probs are filled as it goes
        t.adapter, t.trainable = snapshot, False
    return t
