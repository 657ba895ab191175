"""The turn-based game system (`mrlx.system: game`): agents play a game whose rules are user code.

A game is a plain object with the methods of `Game` below (subclass it, or write any class with
those methods) registered by name through the `mrlx_register_games` hook; the package registers
`nim`, `kuhn_poker` and `chain` (`mrlx_plugin.systems.games`), and any OpenSpiel or TextArena game
is one by name, `openspiel:NAME` or `textarena:ENV_ID` (`mrlx_plugin.systems.library_games`, an
optional extra each). The system owns the play: who
sits where, whose turn it is, what each seat is shown, the legality check, the per-move rewards,
the outcome and the fixed number of samples per episode. The game owns the rules.

One episode per input sample (`mrlx.game`):
1. Each seat gets its player from `seats`: an agent, `script:NAME` (a scripted player the game
   provides, moving without an engine call) or `pool` (one of `opponents`, drawn per prompt
   group: `pool_key`). `game.start` builds the state from the input's prompt text.
2. While a seat is to move (and fewer than `max_turns` moves were made): an agent's seat reads
   what happened since its last turn (`describe_move` of the other seats' moves) and what it
   sees now (`observation`), as one plain-text user message in its own transcript (role = the
   seat's name), and answers in one model turn. `parse_move` is the legality check: an answer
   that is no legal move ends the episode, that seat's outcome `illegal_penalty`, the others' 0.
3. Each move's own reward (`move_reward`) is the turn's reward under `rewards.credit: turn`;
   the seat's outcome reaches its turns through the return (see `episodes.samples.turn_returns`). Tree
   sampling (`rewards.branch: K`) compares K candidate moves by their score: the own reward,
   plus the seat's outcome when the move ends the game; `illegal_penalty` for an illegal one.
4. At the end each agent seat's transcript gets its seat's outcome as its reward.

Three ways to play: self-play (`seats: [p, p]`, one model in both seats, a baseline per seat),
against a frozen model (`seats: [p, opp]`, `opp` with `trainable: false` behind its own URL)
and against an opponent pool (`seats: [p, pool]`, `opponents: [agents and script:NAME]`). A
frozen pool member found down (nothing accepts a connection at its URL) ends its episodes at
once for `POOL_DOWN_S` (`systems.game_pool`), recorded as `opponent_down`, instead of waiting
`engine.peer_deadline_s`.

`episode.metadata` (read by the `game/` metrics): `game`, `seats` (their names), `players` (who
played each seat), `first_seat` (the seat whose result the episode reports: `first_agent_seat`),
`opponent` (who played the other seat(s) against it), `winner` (a seat name, or None for a
draw), `outcome` (per seat), `moves`, `illegal_move` (the seat, when one was), `stopped_by`
(`max_turns` or `context full (SEAT)`, when the game was cut short: a draw, every seat 0),
`opponent_down` (the pool member that was down, in an episode that ended for it), and the
game's own (`episode_facts`: a TextArena game's `replays`).

Evaluation (`mrlx rollout --evaluation`): the final transcript is the first seat's, and
`team_reward` its outcome, so an evaluation's mean reward is that seat's mean result.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, cast

from pydantic import Field

from mrlx_plugin.core.config import (
    TURNS_WHY,
    ConfigError,
    Number,
    Settings,
    SystemSection,
    Text,
    bounded,
    show_value,
)
from mrlx_plugin.core.engine_client import EngineError
from mrlx_plugin.core.transcript import Transcript, Turn, strip_reasoning
from mrlx_plugin.core.values import finite_reward
from mrlx_plugin.episodes import Episode, EpisodeContext, Outcome, Registered, System
from mrlx_plugin.episodes.samples import turn_returns
from mrlx_plugin.systems.game_pool import (
    PopulationSettings,
    check_member,
    frozen_agent,
    lookahead_view,
    population_problems,
    population_seats,
    seat_view,
    watch_member,
)
from mrlx_plugin.systems.games import BUILT_IN_GAMES, Game, M, S, SomeGame, boxed
from mrlx_plugin.systems.libraries import is_library_game
from mrlx_plugin.systems.library_games import library_game
from mrlx_plugin.systems.quoting import quote

__all__ = ["GAME", "Game", "GameSettings", "boxed", "quote", "run_game"]

SCRIPT_PREFIX, POOL_SEAT = "script:", "pool"


class GameSettings(SystemSection):
    """The turn-based game system (`system: game`): rules, legality and outcome come from a game
    registered through the `mrlx_register_games` hook (built in: `nim`, `kuhn_poker`, `chain`)."""

    about = "the turn-based game system"

    name: Text = Field(
        "nim",
        description="the game, by the name it is registered under, or `openspiel:NAME` / "
        "`textarena:ENV_ID` for a game of those libraries",
    )
    seats: list[Text] | None = Field(
        None,
        description="who plays each seat, in the game's seat order: an agent, `script:NAME` (a scripted "
        "player the game provides, e.g. `script:random`), or `pool` (one of `opponents`, one "
        "drawn per prompt group); none = the agents in the order listed",
    )
    opponents: list[Text] = Field(
        default_factory=list,
        description="the opponent pool of a `pool` seat: agents (frozen models, past "
        "checkpoints behind their own URL) or `script:NAME` players",
    )
    max_turns: bounded(int, ge=1, le=1024, why=TURNS_WHY) = Field(
        16, description="moves per episode, all seats together"
    )
    illegal_penalty: Number = Field(
        -1.0, description="outcome of a seat whose move is illegal (the episode ends there; counted)"
    )
    # Any YAML values, the game checks them (`object` would show as such in docs/reference.md).
    options: dict[str, Any] = Field(default_factory=dict, description="the game's own options (see the game)")
    branch_score: Literal["rollout", "settle"] = Field(
        "rollout",
        description="tree sampling (`rewards.branch`): a candidate move's score. `rollout`: its return, the "
        "game played on from it to the end by every seat's own player (one engine call per model move, "
        "nothing trained); `settle`: its own reward plus what it settles at once (the outcome of a "
        "move that ends the game, the penalty of an illegal one)",
    )
    population: PopulationSettings | None = Field(
        None,
        description="self-play against a population of the agent's own past policies, served as LoRA "
        "adapters of the same base (docs/games.md); none = every seat plays its player's latest policy",
    )

    def problems(self, settings: Settings, path: str) -> list[str]:
        """Who sits where names agents, scripts or the pool (the game's own checks, of its seats
        and scripts, run at start-up: `check_game`)."""
        errors: list[str] = []
        agents = f"(agents: {', '.join(settings.agents)})"

        def check_player(where: str, who: str, pool_ok: bool) -> None:
            if who.startswith(SCRIPT_PREFIX):
                if not who[len(SCRIPT_PREFIX) :]:
                    errors.append(f"{where}: {show_value(who)} names no script; e.g. `script:random`")
            elif who == POOL_SEAT:
                if not pool_ok:
                    errors.append(f"{where}: `pool` cannot be in the pool itself")
                elif not self.opponents:
                    errors.append(f"{where}: a `pool` seat needs {path}.opponents (agents or `script:NAME`)")
            elif who not in settings.agents:
                errors.append(f"{where}: {show_value(who)} is not an agent {agents}, `script:NAME` or `pool`")

        for i, who in enumerate(self.seats or []):
            check_player(f"{path}.seats[{i}]", who, pool_ok=True)
        for i, who in enumerate(self.opponents):
            check_player(f"{path}.opponents[{i}]", who, pool_ok=False)
        if self.seats is not None and len(self.seats) < 1:
            errors.append(f"{path}.seats: list at least one seat")
        return errors + population_problems(settings, f"{path}.population", _seats_of)


# --- which game, who plays ------------------------------------------------------------------

logger = logging.getLogger(__name__)


def game_producer(context: EpisodeContext, name: str) -> str:
    """How errors name game `name`'s values: the game and the plugin that registered it (or the
    adapter that built it)."""
    found = context.games.get(name)
    if found is None and is_library_game(name):
        return f"game {name!r} (built by mrlx_plugin.systems.library_games)"
    return f"game {name!r} (registered by plugin {found.plugin if found else 'unknown'!r})"


def the_game(context: EpisodeContext) -> SomeGame:
    """The game `mrlx.game.name` names (checked at start-up: `check_game`): a registered one, else
    a library game's adapter (built once per name and options)."""
    g = context.settings.game
    found = context.games.get(g.name)
    # A registered game: any object with the methods of `Game`, of whatever class.
    return cast(SomeGame, found.value) if found is not None else library_game(g.name, g.options)


def check_game(settings: Settings, games: Mapping[str, Registered]) -> list[str]:
    """The game system's start-up check: `mrlx.game.name` is a registered game (or a library game
    that builds here: its library installed, its name and options valid), and the seats, the
    scripted players and the game's options suit it."""
    g = settings.game
    game: SomeGame
    if g.name in games:
        game = cast(SomeGame, games[g.name].value)
    elif is_library_game(g.name):
        try:
            game = library_game(g.name, g.options)
        except (ImportError, ValueError) as exc:
            return [str(exc)]
    else:
        plugins = sorted({r.plugin for r in games.values()})
        return [
            f"mrlx.game.name: no game named {g.name!r} is registered (known: {', '.join(sorted(games))}, "
            f"registered by {', '.join(plugins) or 'no plugin'}); list the module that registers it "
            "under mrlx.plugins, or name a library game: openspiel:NAME or textarena:ENV_ID"
        ]
    try:
        check_players(game, settings, "")
        game.max_moves(dict(g.options))  # the options' own checks
    except (ConfigError, ValueError) as exc:
        return [str(exc)]
    r = settings.rewards
    hidden = not getattr(game, "perfect_information", False)
    if r.credit == "turn" and r.branch > 1 and hidden and not can_resample(game):
        return [
            f"mrlx.rewards.branch: game {g.name!r} hides information from its seats (it does not "
            "declare perfect_information) and cannot redraw it (no working `resample`): tree "
            "sampling would score each candidate on the true state, so the pick and the scores "
            "would use what the seat cannot see (a poker seat's candidates judged by the other's "
            "hidden card). Set rewards.branch: 1 (per-turn credit without tree sampling), or give "
            "the game `perfect_information = True` if no seat ever lacks information, or a "
            "`resample` method (docs/games.md)"
        ]
    return []


def can_resample(game: SomeGame) -> bool:
    """Whether `game` redraws hidden information (`Game.resample` overridden, and the game does not
    say that it cannot: a library adapter's `resamples`)."""
    method = getattr(type(game), "resample", None)
    return method is not None and method is not Game.resample and bool(getattr(game, "resamples", True))


def check_players(game: SomeGame, settings: Settings, source: str) -> None:
    """One player per seat of `game`, and every `script:NAME` a scripted player it has."""
    g, where = settings.game, f"{source}: " if source else ""
    seats = seat_players(settings)
    if len(seats) != len(game.seats):
        raise ConfigError(
            f"{where}mrlx.game.seats: game {g.name!r} has {len(game.seats)} seat(s) "
            f"({', '.join(game.seats)}); got {len(seats)} player(s) {seats}: list one per seat"
        )
    for key, who in [
        *((f"seats[{i}]", w) for i, w in enumerate(seats)),
        *((f"opponents[{i}]", w) for i, w in enumerate(g.opponents)),
    ]:
        if is_script(who) and who[len(SCRIPT_PREFIX) :] not in game.scripts:
            raise ConfigError(
                f"{where}mrlx.game.{key}: game {g.name!r} has no scripted player {who!r} "
                f"(it has: {', '.join(SCRIPT_PREFIX + s for s in game.scripts) or 'none'})"
            )


def seat_players(settings: Settings) -> list[str]:
    """`mrlx.game.seats`, or the agents in the order listed."""
    return list(settings.game.seats or settings.agents)


def pool_key(episode: Episode) -> str:
    """What a pool draw is made from: the prompt group (its episodes all meet the same opponent,
    so that their advantages compare like with like), or the episode's id when the host gave no
    group."""
    group = getattr(episode.sample, "group_index", None)
    return f"{episode.settings.run_id}:group{group}" if group is not None else episode.id


def pool_draw(key: str, opponents: list[str], seat: int) -> str:
    """The opponent a `pool` seat gets: drawn from `pool_key` alone, so a rerun (or another
    process) draws the same."""
    return opponents[zlib.crc32(f"{key}:pool:{seat}".encode()) % len(opponents)]


def first_agent_seat(players: list[str], settings: Settings) -> int | None:
    """The seat whose result the episode reports (evaluation, `game/win_rate/vs/`): the seat of
    the agent this job trains (`mrlx.self`), else the first trainable agent's, else the first
    agent's; None when scripts play every seat."""
    seats = [i for i, who in enumerate(players) if not is_script(who)]
    for wanted in (
        lambda a: a == settings.self_agent,
        lambda a: bool(settings.agents[a].trainable),
        lambda a: True,
    ):
        for i in seats:
            if wanted(players[i]):
                return i
    return None


def is_script(player: str) -> bool:
    return player.startswith(SCRIPT_PREFIX)


# --- one episode ----------------------------------------------------------------------------


def judge_move(
    game: Game[S, M], state: S, seat: int, text: str, penalty: float, producer: str = "the game"
) -> tuple[M | None, S | None, float, float]:
    """(move, next state, own reward, score) of an answer. The own reward is the move's
    (`move_reward`); the score adds the seat's outcome when the move ends the game. An answer
    that makes no legal move: (None, None, 0.0, penalty), the penalty being its outcome.

    A reward that is not a finite number raises RewardError naming `producer` (`game_producer`:
    the game and its plugin), or the setting for the penalty: it is never trained on."""
    move = game.parse_move(state, seat, text)
    if move is None:
        return None, None, 0.0, finite_reward(penalty, "the setting mrlx.game.illegal_penalty")
    after = game.play(state, seat, move)
    own = finite_reward(
        game.move_reward(state, seat, move, after),
        f"{producer}: move_reward of seat {game.seats[seat]}'s move {move!r}",
    )
    if game.to_move(after) is not None:
        return move, after, own, own
    score = own + game_outcome(game, after, producer)[seat]
    return (
        move,
        after,
        own,
        finite_reward(score, f"{producer}: move_reward plus outcome of seat {game.seats[seat]}"),
    )


def game_outcome(game: Game[S, M], state: S, producer: str = "the game") -> list[float]:
    """`game.outcome(state)` as floats, each a finite number (else RewardError naming `producer`)."""
    return [
        finite_reward(x, f"{producer}: outcome of seat {game.seats[i] if i < len(game.seats) else i}")
        for i, x in enumerate(game.outcome(state))
    ]


def winner_of(outcome: list[float], names: tuple[str, ...]) -> str | None:
    """The seat with the highest outcome, alone; one seat wins with an outcome above 0; else None."""
    if len(outcome) == 1:
        return names[0] if outcome[0] > 0 else None
    best = max(outcome)
    return names[outcome.index(best)] if outcome.count(best) == 1 else None


class _Stop(Exception):
    """The game cannot go on (a seat's transcript is full); the outcome is a draw."""


OnFault = Callable[[EngineError], Awaitable[str | None]]


@dataclass
class _Table(Generic[S]):
    """Where one game stands: what `_play` reads and changes. A candidate's rollout plays on a
    `fork`, which leaves the episode's table as it was."""

    state: S
    players: list[str]
    views: dict[int, Transcript]  # each agent seat's transcript, once it has moved
    unread: dict[int, list[str]]  # per seat: the other seats' moves it has not been told of
    made: list[int]  # moves made per seat
    rng: random.Random  # the scripted players' draws
    watched: dict[int, OnFault]  # the `on_fault` of each seat a frozen pool member plays
    start: S  # the state the game started from
    # Every move made, in order: the seat, the move, and the model turn that made it (None: a script's).
    moves: list[tuple[int, M, Turn | None]] = dataclasses.field(default_factory=list)
    lookahead: bool = False
    luck: str = ""  # a lookahead's: its transcripts' `luck` (their own sampling seeds)

    def fork(self, rng: random.Random, luck: str) -> _Table[S]:
        views = {i: t.fork() for i, t in self.views.items()}
        for t in views.values():
            t.luck = luck
        return _Table(
            self.state,
            self.players,
            views,
            {i: list(u) for i, u in self.unread.items()},
            list(self.made),
            rng,
            self.watched,
            self.start,
            list(self.moves),
            lookahead=True,
            luck=luck,
        )

    def advance(self, game: Game[S, M], seat: int, move: M, after: S, turn: Turn | None = None) -> None:
        """`seat` made the legal `move` (giving `after`), in model turn `turn`: the others are told of it."""
        self.made[seat] += 1
        self.moves.append((seat, move, turn))
        for other in self.unread:
            if other != seat:
                self.unread[other].append(game.describe_move(self.state, seat, move))
        self.state = after


@dataclass
class _End:
    outcome: list[float] | None  # None: cut short, a draw
    stopped_by: str | None = None
    illegal: int | None = None  # the seat whose move was illegal


async def _play(episode: Episode, game: Game[S, M], table: _Table[S]) -> _End:
    """Play `table` on until the game ends, `max_turns` moves are made, a seat's context is
    full, or a move is illegal."""
    g = episode.settings.game
    names, bound = tuple(game.seats), game.max_moves(dict(g.options))
    while (seat := game.to_move(table.state)) is not None:
        if sum(table.made) >= g.max_turns:
            return _End(None, stopped_by="max_turns")
        if table.made[seat] >= bound.get(seat, 0):
            raise RuntimeError(
                f"game {g.name!r}: seat {names[seat]} is to make move {table.made[seat] + 1}, more than "
                f"its max_moves ({bound.get(seat, 0)}); fix the game's max_moves"
            )
        player = table.players[seat]
        if is_script(player):
            move = game.scripted_move(table.state, seat, player[len(SCRIPT_PREFIX) :], table.rng)
            table.advance(game, seat, move, game.play(table.state, seat, move))
            continue
        if seat in table.watched:  # another episode may have found the member down since
            check_member(episode, player)
        text = " ".join([*table.unread[seat], game.observation(table.state, seat)])
        table.unread[seat] = []
        try:
            played = await _agent_move(episode, game, table, seat, text)
        except _Stop as stop:
            return _End(None, stopped_by=str(stop))
        if played is None:  # illegal: the game ends, this seat penalised
            table.made[seat] += 1
            outcome = [0.0] * len(names)
            outcome[seat] = finite_reward(g.illegal_penalty, "the setting mrlx.game.illegal_penalty")
            return _End(outcome, illegal=seat)
        table.advance(game, seat, *played)
    return _End(game_outcome(game, table.state, game_producer(episode.context, g.name)))


async def _agent_move(
    episode: Episode, game: Game[S, M], table: _Table[S], seat: int, text: str
) -> tuple[M, S, Turn] | None:
    """One model turn of the agent in `seat`, shown `text`: (move, next state, the turn), None if illegal."""
    g = episode.settings.game
    name, player, state = game.seats[seat], table.players[seat], table.state
    producer = game_producer(episode.context, g.name)
    message = [{"role": "user", "content": text}]
    t = table.views.get(seat)
    if t is None and table.lookahead:
        opened = lookahead_view(episode, player, message, name)
        if isinstance(opened, str):
            raise _Stop(f"context full ({name})")
        t = table.views[seat] = opened
        t.luck = table.luck
    elif t is None:
        t = table.views[seat] = seat_view(episode, player, message, name)
    elif not t.append_messages(message):
        raise _Stop(f"context full ({name})")

    # Tree sampling scores each candidate where the seat could believe it is: in a game that hides
    # information, a table redrawn from what the seat knows, never the true one (which would let
    # the pick and the scores use what the seat cannot see). One table per turn, redrawn at the
    # first candidate's score; each candidate plays on from a fork of it with the same luck.
    luck = f"rollout@{name}:{table.made[seat]}:"
    seed = zlib.crc32(f"{episode.id}:{luck}".encode())
    scored_on: list[_Table[S] | None] = []

    async def score(turn: Turn) -> float:  # a candidate move, for tree sampling
        if not scored_on:
            try:
                hidden = not getattr(game, "perfect_information", False)
                scored_on.append(
                    _believed(episode, game, table, seat, random.Random(seed), luck) if hidden else table
                )
            except _Stop:  # another seat's redrawn view outgrew its context: as a game cut short
                scored_on.append(None)
        base = scored_on[0]
        if base is None:
            return 0.0  # a draw
        move, after, own, settled = judge_move(
            game, base.state, seat, strip_reasoning(turn.text), g.illegal_penalty, producer
        )
        if move is None or g.branch_score == "settle":
            return settled
        reached = cast(S, after)  # a legal move's next state
        if game.to_move(reached) is None:
            return settled
        fork = base.fork(random.Random(seed), luck)
        return await _rollout(episode, game, fork, seat, turn, (move, reached, own))

    before = len(t.turns)
    await episode.generate(t, score=score, on_fault=table.watched.get(seat))
    if len(t.turns) == before:  # no room was left for a turn
        raise _Stop(f"context full ({name})")
    move, after, own, _ = judge_move(game, state, seat, t.answer_text, g.illegal_penalty, producer)
    # The turn's own reward, without the outcome: the outcome (the transcript's reward) reaches
    # every turn through the return, the last turn's undiscounted; counted here it would count
    # twice. A candidate of tree sampling is compared by its score, outcome included.
    t.turn_rewards[-1] = own
    # What the seat knew, to compare the turn with those that knew the same (an optional method).
    known = getattr(game, "information_state", None)
    t.turn_keys[-1] = None if known is None else known(state, seat)
    return None if move is None else (move, cast(S, after), t.turns[-1])  # a legal move has its next state


async def _rollout(
    episode: Episode, game: Game[S, M], fork: _Table[S], seat: int, turn: Turn, judged: tuple[M, S, float]
) -> float:
    """A candidate move's return (`branch_score: rollout`): the game played on from it to its
    end on `fork` (a copy of the table, or in a game that hides information the table as the
    seat could believe it: `_believed`), every seat by its own player, one engine call per model
    move and no tree sampling; the return as a turn's under per-turn credit
    (`episodes.samples.turn_returns`).

    The draws (scripted players, the engine's sampling seeds, the redrawn hidden information)
    come from the episode and the turn scored (the fork's `luck`), not from the candidate:
    candidates that are the same text get the same score, and different ones meet the same luck;
    and none is the episode's own, so nothing the episode plays later shares a rollout's luck."""
    move, after, own = judged
    t = fork.views[seat]
    t.append_generated(dataclasses.replace(turn))
    t.turn_rewards[-1] = own
    index = len(t.turns) - 1
    fork.advance(game, seat, move, after, t.turns[-1])
    end = await _play(episode, game, fork)
    t = fork.views[seat]  # the same transcript (a seat's view opens before its first move)
    t.reward = (end.outcome or [0.0] * len(game.seats))[seat]
    return turn_returns(episode, t)[index]


def _believed(
    episode: Episode, game: Game[S, M], table: _Table[S], seat: int, rng: random.Random, luck: str
) -> _Table[S]:
    """The table as `seat` could believe it is, to play a candidate on from: a start state the game
    redraws from what the seat knows (`resample`), and the moves made replayed on it, each seat's
    view rendered as the game renders it and each model turn as it was taken. The seat's own view
    must come out as it is (it knows nothing that changed), which is checked."""
    g, names = episode.settings.game, game.seats
    producer = game_producer(episode.context, g.name)
    if not can_resample(game):  # refused at start-up (check_game)
        raise RuntimeError(f"{producer} hides information and cannot resample it")
    start = game.resample(table.start, [(s, m) for s, m, _ in table.moves], seat, rng)
    fork = _Table(
        start,
        table.players,
        {},
        {i: [] for i in table.unread},
        [0] * len(table.made),
        rng,
        table.watched,
        start,
        lookahead=True,
        luck=luck,
    )

    def show(s: int) -> Transcript:  # what `_play` and `_agent_move` show seat s before its move
        text = " ".join([*fork.unread[s], game.observation(fork.state, s)])
        fork.unread[s] = []
        message = [{"role": "user", "content": text}]
        t = fork.views.get(s)
        if t is None:
            opened = lookahead_view(episode, table.players[s], message, names[s])
            if isinstance(opened, str):  # the true view held it: this one's text is longer
                raise _Stop(f"context full ({names[s]})")
            t = fork.views[s] = opened
            t.luck = luck
        elif not t.append_messages(message):
            raise _Stop(f"context full ({names[s]})")
        return t

    for s, move, turn in table.moves:
        if turn is not None:
            show(s).append_generated(dataclasses.replace(turn))
        fork.advance(game, s, move, game.play(fork.state, s, move), turn)
    if game.to_move(fork.state) == seat:
        show(seat)
    mine, real = fork.views.get(seat), table.views.get(seat)
    if (mine and mine.tokens) != (real and real.tokens) or (game.to_move(fork.state) != seat):
        raise RuntimeError(
            f"{producer}: resample gave seat {names[seat]} a state it can tell from the true one (its "
            "view or its turn to move differs after the moves were replayed); resample must keep "
            "everything the seat knows"
        )
    return fork


async def run_game(episode: Episode) -> Outcome:
    g = episode.settings.game
    game = the_game(episode.context)
    names = tuple(game.seats)
    players = [
        pool_draw(pool_key(episode), g.opponents, i) if who == POOL_SEAT else who
        for i, who in enumerate(seat_players(episode.settings))
    ]
    # A population (`population`): the trained agent's seats filled with its latest policy or its
    # snapshots (`AGENT@VERSION`), per prompt group; the learner's seat reports the episode.
    players, learner = population_seats(episode, pool_key(episode), players, names)
    first = learner if learner is not None else first_agent_seat(players, episode.settings)
    others = [who for i, who in enumerate(players) if i != first]
    episode.metadata.update(
        game=g.name,
        seats=list(names),
        players=players,
        first_seat=None if first is None else names[first],
        opponent=" + ".join(others) if first is not None and others else None,
    )
    watched = {
        i: watch_member(episode, players[i])
        for i, who in enumerate(seat_players(episode.settings))
        if who == POOL_SEAT and frozen_agent(episode.settings, players[i])
    }
    for i in watched:
        check_member(episode, players[i])  # a member known to be down: no move is made at all
    rng = random.Random(zlib.crc32(episode.id.encode()))
    state = game.start(episode.problem, episode.label, rng, dict(g.options))
    table = _Table(
        state, players, {}, {i: [] for i in range(len(names))}, [0] * len(names), rng, watched, state
    )
    end = await _play(episode, game, table)
    if end.stopped_by is not None:
        episode.metadata["stopped_by"] = end.stopped_by
    if end.illegal is not None:
        episode.metadata["illegal_move"] = names[end.illegal]
    outcome = end.outcome or [0.0] * len(names)  # a game cut short (max_turns, a full context) is a draw
    facts = getattr(game, "episode_facts", None)  # optional: a game need not subclass Game
    if facts is not None:
        episode.metadata.update(facts(table.state))
    episode.metadata.update(winner=winner_of(outcome, names), outcome=outcome, moves=sum(table.made))
    whole = episode.settings.rewards.credit == "episode"
    for seat, t in table.views.items():
        # One sample per transcript trains on the outcome plus its moves' own rewards: the
        # return of its first turn with no discount, what per-turn credit trains on in total.
        own = sum(r for r in t.turn_rewards if r is not None) if whole else 0.0
        t.raw_reward = t.reward = finite_reward(
            outcome[seat] + own, f"{game_producer(episode.context, g.name)}: outcome plus move rewards"
        )
    if first is None:
        return Outcome()
    return Outcome(final_transcript=table.views.get(first), team_reward=outcome[first])


def _seats_of(settings: Settings) -> dict[str, list[int]]:
    """For each agent, the seats it may play (a `pool` seat counts for every agent in the pool)."""
    g = settings.game
    out: dict[str, list[int]] = {a: [] for a in settings.agents}
    for i, who in enumerate(seat_players(settings)):
        if who in out:
            out[who].append(i)
        elif who == POOL_SEAT:
            for agent in dict.fromkeys(g.opponents):
                if agent in out:
                    out[agent].append(i)
    return out


def _built_in(settings: Settings) -> SomeGame | None:
    """The built-in or library game `mrlx.game.name` names (its players and options are checked
    at start-up: `check_game`, which also reports a library game that does not build); None for
    a game a plugin registers."""
    name = settings.game.name
    if name in BUILT_IN_GAMES or not is_library_game(name):
        return BUILT_IN_GAMES.get(name)
    try:
        return library_game(name, settings.game.options)
    except (ImportError, ValueError):
        return None


def game_fan_out(settings: Settings) -> dict[str, int]:
    """Transcripts per episode and agent: the seats the agent can occupy (a pool seat counts
    once for each agent in the pool, whether or not the draw picks it)."""
    return {agent: len(seats) for agent, seats in _seats_of(settings).items()}


def game_turns(settings: Settings) -> dict[str, int]:
    """Model turns per transcript and agent: the most moves of any seat it can occupy, by the
    game's `max_moves`, capped by `max_turns`. A game a plugin registers is not known here
    (this runs before any episode): its bound is `max_turns`."""
    g, game = settings.game, _built_in(settings)
    bound = game.max_moves(dict(g.options)) if game is not None else {}
    return {
        agent: max((min(bound.get(i, g.max_turns), g.max_turns) for i in seats), default=1)
        for agent, seats in _seats_of(settings).items()
    }


GAME = System(
    run=run_game,
    fan_out=game_fan_out,
    turns=game_turns,
    settings=GameSettings,
    check=check_game,
    scores_candidates=True,
)
