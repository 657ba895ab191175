"""An opponent-pool member that is down: a frozen model (`trainable: false`, its own URL) that a game
seat draws from the pool (`mrlx.game.opponents`) and that nothing answers at its URL. Its episodes
end at once for `POOL_DOWN_S`, recorded as `opponent_down`, instead of each waiting
`engine.peer_deadline_s` (a frozen model has no weight update to wait for).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable

from mrlx_plugin.core.config import Settings
from mrlx_plugin.core.engine_client import EngineError
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
