"""TextArena envs as games of the game system: `textarena:ENV_ID` (see `systems.library_games`).

TextArena is an optional extra (`pip install 'mrlx-plugin[textarena]'`), imported only when one of
its games is named. Options `max_moves` (required: TextArena does not bound a game's length, and
the samples per episode are built on a bound) and `num_players` (2). Seats `player0`, ... A seat
is shown the env's messages to it since its last move (quoted: the env writes them, and they hold
the other players' free text) and answers in the env's own action format (e.g. `[4]`); the env
judges the answer, invalid moves included, by its own rules, and its rewards are the outcome. A
live env is kept per game in flight (`TextArenaGame.LIVE`, grown as needed); a move whose env is
gone replays its game from the seed, counted in the episode's facts (`replays`).
"""

from __future__ import annotations

import contextlib
import importlib
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from mrlx_plugin.systems.games import Game, GameOptions
from mrlx_plugin.systems.libraries import TEXTARENA, import_library, unknown_game
from mrlx_plugin.systems.quoting import quote

# A TextArena env, and the process-wide random states (`random`'s and numpy's) an env draws from:
# the library's own objects, untyped, held here and handed back to it.
Env = Any
Randomness = tuple[Any, Any]


@dataclass
class _Tally:
    """What one game of a TextArena env cost, shared by every state played from its start
    (tree-sampling candidates included): its moves that replayed the game from the seed."""

    replays: int = 0


@dataclass(frozen=True)
class ArenaState:
    """A position of a TextArena game, as a value: the env is rebuilt from `seed` and `actions`
    (or a live copy looked up), and what the seats were told is kept here, so that reading a state
    never touches an env."""

    seed: int
    actions: tuple[str, ...]
    player: int | None  # the seat TextArena has to move; None once the env is done
    inbox: str  # the env's messages to `player` since its last move
    knows: tuple[tuple[tuple[str, str], ...], ...]  # per seat: ("told", messages) and ("moved", action)
    moves: tuple[int, ...]  # moves made per seat, invalid ones included
    rewards: tuple[object, ...] | None = None  # TextArena's rewards per seat, once it is done (unchecked)
    tally: _Tally = field(default_factory=_Tally, compare=False, repr=False)


@contextlib.contextmanager
def _own_random(saved: Randomness | None, out: list[Randomness]) -> Iterator[None]:
    """Run TextArena code on its own global random state: TextArena envs draw from (and
    `reset` reseeds) the process-wide `random` (a few, numpy's); the caller's states are put
    back afterwards, and the env's own, appended to `out`, is restored before its next step, so
    a live env and one replayed from the seed draw the same."""
    import numpy as np

    outer = (random.getstate(), np.random.get_state())
    try:
        if saved is not None:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
        yield
        out.append((random.getstate(), np.random.get_state()))
    finally:
        random.setstate(outer[0])
        np.random.set_state(outer[1])


def _render(messages: Iterable[tuple[int, str, object] | tuple[int, str]], roles: Mapping[int, str]) -> str:
    """TextArena's messages as one text, each line led by its sender: `[GAME]` or the player."""
    lines = []
    for sender, text, *_ in messages:
        lines.append(f"[{'GAME' if sender < 0 else roles.get(sender, f'Player {sender}')}] {text}")
    return "\n".join(lines)


class TextArenaGame(Game[ArenaState, str]):
    """A TextArena env through the game protocol (see the module's docstring)."""

    scripts: tuple[str, ...] = ()  # TextArena lists no legal moves to draw a random one from
    # Live envs kept, one per game in flight, so that a move steps one rather than replaying the
    # game from its seed (every move so far again, on the event loop). The bound starts at LIVE
    # and doubles, up to LIVE_MAX, when a game in flight needs the env that the bound evicted: a
    # run with more games in flight replays each of those once, then none. An env left behind (an
    # episode that ended early, a tree-sampling candidate not taken) is the one evicted first.
    LIVE = 256
    LIVE_MAX = 65_536

    def __init__(self, env_id: str, options: GameOptions):
        ta = import_library("textarena", "TextArena", "textarena", f"mrlx.game.name {TEXTARENA + env_id!r}")
        registry = importlib.import_module("textarena.envs.registration").ENV_REGISTRY
        if env_id not in registry:
            raise unknown_game(
                "TextArena",
                env_id,
                sorted(registry),
                "python -c 'import textarena.envs.registration as r; print(sorted(r.ENV_REGISTRY))'",
            )
        unknown = sorted(set(options) - {"max_moves", "num_players"})
        if unknown:
            raise ValueError(
                f"mrlx.game.options: {', '.join(map(repr, unknown))} is no option of {TEXTARENA}{env_id} "
                "(its options: max_moves, the most moves per seat, required; num_players, default 2)"
            )
        if "max_moves" not in options:
            raise ValueError(
                f"mrlx.game.options.max_moves: {TEXTARENA}{env_id} needs it: the most moves one seat "
                "makes in a game, invalid ones included (TextArena does not bound a game's length, and "
                "the samples per episode are built on it); a seat that reaches it ends the game as a draw"
            )
        counts: dict[str, int] = {}
        for key in ("max_moves", "num_players"):
            value = options.get(key, 2)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mrlx.game.options.{key}: got {value!r}; expected an integer of 1 or more")
            counts[key] = value
        self.ta, self.env_id = ta, env_id
        self.max_moves_per_seat = counts["max_moves"]
        self.seats = tuple(f"player{i}" for i in range(counts["num_players"]))
        self._live: OrderedDict[tuple[int, tuple[str, ...]], tuple[Env, Randomness]] = OrderedDict()
        self.live_bound = self.LIVE
        self._evicted: OrderedDict[int, int] = OrderedDict()  # hash of a state's key -> the bound then
        self.replays = 0  # moves that replayed their game from the seed, in this process
        try:
            self._replay(0, ())  # the env loads and takes this many players
        except Exception as exc:
            raise ValueError(
                f"mrlx.game.name: TextArena's {env_id} did not start with {len(self.seats)} players "
                f"(mrlx.game.options.num_players): {type(exc).__name__}: {exc}"
            ) from exc
        self._live.clear()

    def _replay(self, seed: int, actions: tuple[str, ...], tally: _Tally | None = None) -> ArenaState:
        """The env reset with `seed` and stepped through `actions`, as TextArena's own loop does
        (the player to move reads its messages, then acts); the live env is kept for the next move.
        The states share `tally` (a new one: a new game)."""
        tally = _Tally() if tally is None else tally
        saved: list[Randomness] = []
        with _own_random(None, saved):
            import numpy as np

            random.seed(seed)  # for an env that draws as it is made, before `reset` seeds it
            np.random.seed(seed)
            env = self.ta.make(self.env_id)
            env.reset(num_players=len(self.seats), seed=seed)
            state = self._told(env, seed, (), ((),) * len(self.seats), (0,) * len(self.seats), tally)
            for action in actions:
                state = self._step(env, state, action)
        if state.player is not None:
            self._keep(state, env, saved[0])
        return state

    def _told(
        self,
        env: Env,
        seed: int,
        actions: tuple[str, ...],
        knows: tuple[tuple[tuple[str, str], ...], ...],
        moves: tuple[int, ...],
        tally: _Tally,
    ) -> ArenaState:
        """The state once the player to move has read its messages."""
        raw = env
        while isinstance(raw, self.ta.Wrapper):  # its messages as the env writes them, not a wrapper's view
            raw = raw.env
        player, messages = raw.get_observation()
        inbox = _render(messages, getattr(raw.state, "role_mapping", {}))
        knows = tuple(k + ((("told", inbox),) if i == player else ()) for i, k in enumerate(knows))
        return ArenaState(seed, actions, player, inbox, knows, moves, tally=tally)

    def _step(self, env: Env, state: ArenaState, action: str) -> ArenaState:
        seat = state.player
        assert seat is not None
        knows = tuple(k + ((("moved", action),) if i == seat else ()) for i, k in enumerate(state.knows))
        moves = tuple(n + (i == seat) for i, n in enumerate(state.moves))
        done, _ = env.step(action)
        if not done:
            return self._told(env, state.seed, state.actions + (action,), knows, moves, state.tally)
        rewards, _ = env.close()
        rewards = rewards or {}
        return ArenaState(
            state.seed,
            state.actions + (action,),
            None,
            "",
            knows,
            moves,
            tuple(rewards.get(i) for i in range(len(self.seats))),
            state.tally,
        )

    def _keep(self, state: ArenaState, env: Env, randomness: Randomness) -> None:
        self._live[(state.seed, state.actions)] = (env, randomness)
        while len(self._live) > self.live_bound:
            key, _ = self._live.popitem(last=False)
            self._evicted[hash(key)] = self.live_bound
            while len(self._evicted) > self.live_bound:
                self._evicted.popitem(last=False)

    def start(self, problem: str, label: object, rng: random.Random, options: GameOptions) -> ArenaState:
        return self._replay(rng.randrange(2**31), ())

    def to_move(self, state: ArenaState) -> int | None:
        if state.player is None or state.moves[state.player] >= self.max_moves_per_seat:
            return None
        return state.player

    def observation(self, state: ArenaState, seat: int) -> str:
        return (
            f"TextArena {self.env_id}; you are {self.seats[seat]} (Player {seat}). The game's messages "
            f"to you:\n{quote(state.inbox)}\nAnswer with your move in the format the game asks for."
        )

    def information_state(self, state: ArenaState, seat: int) -> None:
        """None: a TextArena seat's information state is all it was told and wrote, free text that
        two episodes hardly ever share after a seat's first move, so that grouping turns by it
        would leave nearly every later turn alone in its group (advantage 0). Its turns are
        compared by index instead (docs/credit.md)."""
        return None

    def legal_moves(self, state: ArenaState, seat: int) -> list[str]:
        """TextArena lists none: any text is a move, which the env judges when it is played."""
        return []

    def parse_move(self, state: ArenaState, seat: int, text: str) -> str:
        """The answer itself: the env reads its own action format in it (invalid moves are the
        env's to judge and score, in `play`)."""
        return text.strip()

    def play(self, state: ArenaState, seat: int, move: str) -> ArenaState:
        if seat != state.player:
            raise ValueError(f"{TEXTARENA}{self.env_id}: {self.seats[seat]} moved, but it is not its turn")
        key = (state.seed, state.actions)
        live = self._live.pop(key, None)
        if live is None:  # a state played from twice (tree sampling), or its env evicted
            if self._evicted.pop(hash(key), None) == self.live_bound:  # in flight, evicted at this bound
                self.live_bound = min(2 * self.live_bound, self.LIVE_MAX)
            self.replays += 1
            state.tally.replays += 1
            self._replay(state.seed, state.actions, state.tally)
            live = self._live.pop(key)
        env, randomness = live
        saved: list[Randomness] = []
        with _own_random(randomness, saved):
            after = self._step(env, state, move)
        if after.player is not None:
            self._keep(after, env, saved[0])
        return after

    def move_reward(self, state: ArenaState, seat: int, move: str, next_state: ArenaState) -> float:
        return 0.0

    def episode_facts(self, state: ArenaState) -> dict[str, object]:
        """`replays`: the game's moves that replayed it from the seed (its env no longer kept)."""
        return {"replays": state.tally.replays}

    def outcome(self, state: ArenaState) -> list[float]:
        """TextArena's rewards (the system checks each is a finite number); a game cut short at
        `max_moves` is a draw, every seat 0, as one cut short at `max_turns`."""
        if state.rewards is None:
            return [0.0] * len(self.seats)
        return cast(list[float], list(state.rewards))  # as TextArena gave them: `game_outcome` checks them

    def max_moves(self, options: GameOptions) -> dict[int, int]:
        return {seat: self.max_moves_per_seat for seat in range(len(self.seats))}

    def scripted_move(self, state: ArenaState, seat: int, script: str, rng: random.Random) -> str:
        raise ValueError(f"no scripted player {script!r}: TextArena games have none (no legal moves listed)")

    def describe_move(self, state: ArenaState, seat: int, move: str) -> str:
        """Only that the seat moved: the env's own messages (`observation`) report the move."""
        return f"{self.seats[seat]} has moved."
