"""The rules every game gives (`Game`, the protocol the game system calls) and the built-in games:
`nim`, `kuhn_poker` and `chain`.

- `nim`: one pile, two seats take 1 to `max_take` stones in turn; who takes the last stone wins.
  Small enough for the demo's tiny CPU models; the optimal move is known (leave a multiple of
  `max_take + 1`). Prompts: "Nim: 7 stones" (`mrlx_plugin.local.trainer.tasks.nim_prompts`).
- `kuhn_poker`: three cards J < Q < K, one each, ante 1 chip; check, bet (1 chip), call or fold;
  each seat sees only its own card; the outcome is the chips won or lost (zero-sum). For real
  runs. Prompts: "Kuhn poker: K vs J" fixes the deal (first seat's card first); a prompt with no
  deal is dealt from the episode's random generator.
- `chain`: one seat, a chain of arithmetic steps: a start value and operations ("+2", "-1",
  "*3"); each turn the model gives the running value as \\boxed{N}. A right value earns 1 and
  goes on to the next step, a wrong one ends the episode; the outcome is 1 when every step was
  right. The multi-turn task of `mrlx bench credit`. Prompts: "Chain: 2 +3 +1 +2".

Observations of `nim` and `chain` are as short as the demo's "What is 2 + 3?": its tiny models
read them ("Nim: 7 stones. Take 1 to 3.", then "They took 2. 5 stones left."; "Start at 2. Now
+3.", then "Now +1."). The answer format (\\boxed{N}) and the goal are not spelled out: a tiny
model learns the format in its warm-start and the goal from the rewards; give a real model the
rules in its agent's `system_prompt`. Kuhn poker, for real models, states its rules in full.

Each built-in game is a `Game`, so it has every method of the protocol (the defaults where it
needs no other); this module does not import the system, which re-exports `Game`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

S = TypeVar("S")  # a game's states
M = TypeVar("M")  # a game's moves

# `mrlx.game.options` as a game is given them: the YAML's values, which the game checks.
GameOptions = Mapping[str, object]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (no nested braces), or None."""
    found = _BOXED.findall(text)
    return found[-1] if found else None


def boxed_move(text: str, legal: list[M]) -> M | None:
    """The legal move the last `\\boxed{...}` of `text` names (surrounding spaces ignored), or
    None. A move spelled exactly is that move; otherwise case is ignored, but only where that
    leaves one legal move: in chess `Bxa6` (a bishop) and `bxa6` (a pawn) can both be legal, and
    an answer that could be either is no move."""
    answer = boxed(text)
    if answer is None:
        return None
    answer = answer.strip()
    for move in legal:
        if str(move).strip() == answer:
            return move
    folded = [move for move in legal if str(move).strip().lower() == answer.lower()]
    return folded[0] if len(folded) == 1 else None


def game_options(game: str, options: GameOptions, defaults: dict[str, int]) -> dict[str, int]:
    """`mrlx.game.options` for `game`: known keys only, each a positive integer, defaults filled in."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        known = ", ".join(defaults) or "none"
        raise ValueError(
            f"mrlx.game.options: {', '.join(map(repr, unknown))} is no option of {game} (its options: "
            f"{known})"
        )
    out: dict[str, int] = {}
    for key, value in {**defaults, **options}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mrlx.game.options.{key}: got {value!r}; expected an integer of 1 or more")
        out[key] = value
    return out


# --- the rules every game gives ---------------------------------------------------------


class Game(Generic[S, M]):
    """The rules of a turn-based game: what the game system calls, one method per question.

    States (`S`) and moves (`M`) are the game's own values (a frozen dataclass reads best for a
    state); the system never looks inside one, never changes one, and keeps the state each move
    was made from. Seats are indices into `seats`. Every method is called in the rollout process's
    event loop: keep them quick.
    """

    #: The names of the seats, in seat order (also each seat's role in its transcript).
    seats: tuple[str, ...] = ()
    #: The scripted players the game provides (`script:NAME` seats); `random` always.
    scripts: tuple[str, ...] = ("random",)
    #: Whether every seat always knows the whole state (no hidden cards, no unseen moves). Tree
    #: sampling scores a candidate by playing on from the state; a game that hides information
    #: must give `resample` instead, or tree sampling is refused for it (docs/credit.md).
    perfect_information: bool = False

    def start(self, problem: str, label: object, rng: random.Random, options: GameOptions) -> S:
        """The initial state for one episode, from the input sample's prompt text and label.

        `rng` is the episode's own (drawn from its id, so a rerun deals the same); use it for
        anything the prompt does not fix. `options` is `mrlx.game.options`. Raise ValueError,
        naming the option or the prompt, for a game that cannot start.
        """
        raise NotImplementedError

    def to_move(self, state: S) -> int | None:
        """The seat to move, or None when the game is over."""
        raise NotImplementedError

    def observation(self, state: S, seat: int) -> str:
        """What `seat` is shown before its move, as plain text: only what it may know (hidden
        information stays hidden) and how to answer (e.g. "answer with \\boxed{N}"). Text the game
        did not write (from the prompt, a seat's free-text move) goes in through `quote` when the
        observation lays out sections of its own, so that text cannot open one."""
        raise NotImplementedError

    def legal_moves(self, state: S, seat: int) -> list[M]:
        """The legal moves of `seat` (used by the default `parse_move` and `script:random`)."""
        raise NotImplementedError

    def parse_move(self, state: S, seat: int, text: str) -> M | None:
        """The legality check: the move an answer makes, or None when it makes no legal move.

        `text` is the model's answer without its reasoning. The default reads the last
        `\\boxed{...}` and matches it against `legal_moves`: exactly, or ignoring case where that
        leaves one move (`boxed_move`)."""
        return boxed_move(text, self.legal_moves(state, seat))

    def play(self, state: S, seat: int, move: M) -> S:
        """The state after `seat` makes the legal `move` (a new state; `state` is left as it was)."""
        raise NotImplementedError

    def move_reward(self, state: S, seat: int, move: M, next_state: S) -> float:
        """The move's own reward for `seat` (its turn reward under `credit: turn`); default 0. A
        finite number: NaN or infinity ends the episode ABORTED, the error naming this game."""
        return 0.0

    def outcome(self, state: S) -> list[float]:
        """Each seat's result, in seat order, once the game is over (e.g. +1 win / -1 loss); finite
        numbers, as `move_reward`'s."""
        raise NotImplementedError

    def max_moves(self, options: GameOptions) -> dict[int, int]:
        """The most moves each seat can make in one game with these options: an exact upper
        bound (the fixed number of samples per episode is built on it). `start` must refuse a
        prompt that would exceed it."""
        raise NotImplementedError

    def scripted_move(self, state: S, seat: int, script: str, rng: random.Random) -> M:
        """The move of scripted player `script` (one of `scripts`); `random` is a uniformly
        random legal move."""
        if script == "random":
            return rng.choice(self.legal_moves(state, seat))
        raise ValueError(f"no scripted player {script!r} (this game has: {', '.join(self.scripts)})")

    def describe_move(self, state: S, seat: int, move: M) -> str:
        """How the other seats are told of `seat`'s `move` (made from `state`), as plain text
        (a move that is text the seat wrote: through `quote`, as in `observation`)."""
        return f"{self.seats[seat]} plays {move}."

    def resample(self, start: S, moves: Sequence[tuple[int, M]], seat: int, rng: random.Random) -> S:
        """For a game that hides information: a start state `seat` cannot tell from `start` after
        `moves` (the (seat, move) pairs made since, in order), drawn with `rng` as the game's chance
        would deal it among those. Replaying `moves` on it must be legal at every step and show
        `seat` exactly what it was shown; only what the seat never saw may differ. Tree sampling
        plays its candidates on from such a state, so that no score uses what the seat cannot
        know. Optional: the default is that the game cannot."""
        raise NotImplementedError

    def information_state(self, state: S, seat: int) -> str | None:
        """What `seat` knows when it is to move, as a string: two states with the same string
        must be indistinguishable to the seat (OpenSpiel's information state). Per-turn credit
        compares a turn with the turns of the prompt group that saw the same (docs/credit.md);
        None (the default) compares it with the turns of the same index."""
        return None

    def episode_facts(self, state: S) -> dict[str, object]:
        """The game's own facts about the episode that ended at `state` (its last state, the
        game over or cut short), added to the episode's facts; default none."""
        return {}


# A game of whatever state and move types (a registered game, a library's): the game system holds
# its states and moves without reading them, and passes them back to it.
SomeGame = Game[Any, Any]


# --- nim ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NimState:
    stones: int
    max_take: int
    moves: int = 0  # moves made; the seat to move is moves % 2


class Nim(Game[NimState, int]):
    """One pile of stones; take 1 to `max_take`; who takes the last stone wins (+1, the other -1)."""

    seats = ("first", "second")
    scripts = ("random", "optimal")
    perfect_information = True
    option_defaults: ClassVar[dict[str, int]] = {"max_take": 3, "max_stones": 9}

    def start(self, problem: str, label: object, rng: random.Random, options: GameOptions) -> NimState:
        o = game_options("nim", options, self.option_defaults)
        found = re.search(r"(\d+)\s+stones?\b", problem)
        if found is None:
            raise ValueError(
                f"nim: the prompt {problem[:80]!r} gives no number of stones; write prompts like "
                "'Nim: 7 stones' (mrlx_plugin.local.trainer.tasks.nim_prompts)"
            )
        stones = int(found.group(1))
        if not 1 <= stones <= o["max_stones"]:
            raise ValueError(
                f"nim: the prompt {problem[:80]!r} has {stones} stones; mrlx.game.options.max_stones "
                f"is {o['max_stones']} (it bounds the moves per seat, so the samples per episode): "
                "raise it, or use prompts with 1 to max_stones stones"
            )
        return NimState(stones, o["max_take"])

    def to_move(self, state: NimState) -> int | None:
        return None if state.stones == 0 else state.moves % 2

    def observation(self, state: NimState, seat: int) -> str:
        if state.moves < 2:  # this seat's first move
            return f"Nim: {state.stones} stones. Take 1 to {state.max_take}."
        return f"{state.stones} stones left."

    def legal_moves(self, state: NimState, seat: int) -> list[int]:
        return list(range(1, min(state.max_take, state.stones) + 1))

    def parse_move(self, state: NimState, seat: int, text: str) -> int | None:
        return boxed_move(text, self.legal_moves(state, seat))

    def play(self, state: NimState, seat: int, move: int) -> NimState:
        return NimState(state.stones - move, state.max_take, state.moves + 1)

    def move_reward(self, state: NimState, seat: int, move: int, next_state: NimState) -> float:
        return 0.0

    def outcome(self, state: NimState) -> list[float]:
        last = (state.moves - 1) % 2  # who took the last stone
        return [1.0 if seat == last else -1.0 for seat in (0, 1)]

    def max_moves(self, options: GameOptions) -> dict[int, int]:
        n = game_options("nim", options, self.option_defaults)["max_stones"]
        return {0: (n + 1) // 2, 1: n // 2}  # one stone per move, first seat first

    def scripted_move(self, state: NimState, seat: int, script: str, rng: random.Random) -> int:
        winning = state.stones % (state.max_take + 1)  # leaves a multiple of max_take + 1
        if script == "optimal" and winning:
            return winning
        return rng.choice(self.legal_moves(state, seat))  # random, or optimal in a lost position

    def describe_move(self, state: NimState, seat: int, move: int) -> str:
        return f"They took {move}."

    def information_state(self, state: NimState, seat: int) -> str:
        """The pile and the take limit decide the game; the moves that led there do not."""
        return f"{self.seats[seat]}: {state.stones} stones, take 1 to {state.max_take}"


# --- kuhn poker -----------------------------------------------------------------------------

CARDS = "JQK"
_VERBS = {"check": "checks", "bet": "bets", "call": "calls", "fold": "folds"}
# A Nash equilibrium of Kuhn poker (Kuhn, 1950): the first player bluffs J with probability
# ALPHA, any ALPHA in [0, 1/3]; its expected result is -1/18 chip per hand whatever ALPHA is.
ALPHA = 1 / 6


@dataclass(frozen=True)
class KuhnState:
    cards: tuple[str, str]  # the first seat's card, the second's
    history: tuple[str, ...] = ()  # the actions so far: check, bet, call, fold


def kuhn_over(history: tuple[str, ...]) -> bool:
    return len(history) >= 2 and history != ("check", "bet")


def kuhn_equilibrium(card: str, history: tuple[str, ...]) -> dict[str, float]:
    """The equilibrium strategy's probability of each legal action, for the seat to act."""
    if history == ():
        bet = {"J": ALPHA, "Q": 0.0, "K": 3 * ALPHA}[card]
        return {"bet": bet, "check": 1 - bet}
    if history == ("check",):
        bet = {"J": 1 / 3, "Q": 0.0, "K": 1.0}[card]
        return {"bet": bet, "check": 1 - bet}
    if history == ("bet",):
        call = {"J": 0.0, "Q": 1 / 3, "K": 1.0}[card]
        return {"call": call, "fold": 1 - call}
    call = {"J": 0.0, "Q": ALPHA + 1 / 3, "K": 1.0}[card]  # ("check", "bet")
    return {"call": call, "fold": 1 - call}


class KuhnPoker(Game[KuhnState, str]):
    """Kuhn poker for two seats; the outcome is each seat's chips won (+) or lost (-)."""

    seats = ("first", "second")
    scripts = ("random", "optimal")

    def start(self, problem: str, label: object, rng: random.Random, options: GameOptions) -> KuhnState:
        game_options("kuhn_poker", options, {})
        deal = re.search(r"\b([JQK])\s+vs\.?\s+([JQK])\b", problem)
        if deal is None:
            first, second = rng.sample(CARDS, 2)
            return KuhnState((first, second))
        if deal.group(1) == deal.group(2):
            raise ValueError(
                f"kuhn_poker: the prompt {problem[:80]!r} deals one card twice; the deck has one each "
                "of J, Q and K"
            )
        return KuhnState((deal.group(1), deal.group(2)))

    def to_move(self, state: KuhnState) -> int | None:
        return None if kuhn_over(state.history) else len(state.history) % 2

    def legal_moves(self, state: KuhnState, seat: int) -> list[str]:
        return ["call", "fold"] if state.history[-1:] == ("bet",) else ["check", "bet"]

    def parse_move(self, state: KuhnState, seat: int, text: str) -> str | None:
        return boxed_move(text, self.legal_moves(state, seat))

    def observation(self, state: KuhnState, seat: int) -> str:
        moves = self.legal_moves(state, seat)
        question = "Check or bet 1 chip?" if moves[0] == "check" else "Call (1 chip) or fold?"
        answer = f"Answer \\boxed{{{moves[0]}}} or \\boxed{{{moves[1]}}}."
        if len(state.history) >= 2:  # the first seat's second move: it has read the rules
            return f"{question} {answer}"
        return (
            "Kuhn poker: the deck is J, Q and K (K is highest); each player antes 1 chip and gets one card. "
            f"You are the {self.seats[seat]} player. Your card: {state.cards[seat]}. {question} {answer}"
        )

    def play(self, state: KuhnState, seat: int, move: str) -> KuhnState:
        return KuhnState(state.cards, state.history + (move,))

    def move_reward(self, state: KuhnState, seat: int, move: str, next_state: KuhnState) -> float:
        return 0.0

    def outcome(self, state: KuhnState) -> list[float]:
        h = state.history
        if h[-1] == "fold":  # the other seat takes the antes
            winner, chips = len(h) % 2, 1.0
        else:  # showdown: the antes, and the bet if one was called
            winner = 0 if CARDS.index(state.cards[0]) > CARDS.index(state.cards[1]) else 1
            chips = 2.0 if "bet" in h else 1.0
        return [chips if seat == winner else -chips for seat in (0, 1)]

    def max_moves(self, options: GameOptions) -> dict[int, int]:
        return {0: 2, 1: 1}  # check, (bet), call or fold

    def scripted_move(self, state: KuhnState, seat: int, script: str, rng: random.Random) -> str:
        if script == "optimal":
            strategy = kuhn_equilibrium(state.cards[seat], state.history)
            return rng.choices(list(strategy), weights=list(strategy.values()))[0]
        return rng.choice(self.legal_moves(state, seat))

    def describe_move(self, state: KuhnState, seat: int, move: str) -> str:
        return f"Your opponent {_VERBS[move]}."

    def resample(
        self, start: KuhnState, moves: Sequence[tuple[int, str]], seat: int, rng: random.Random
    ) -> KuhnState:
        """The seat keeps its card; the other is dealt again from the two left (the actions are
        public, so every such deal shows the seat the same game)."""
        mine = start.cards[seat]
        other = rng.choice([c for c in CARDS if c != mine])
        return KuhnState((mine, other) if seat == 0 else (other, mine))

    def information_state(self, state: KuhnState, seat: int) -> str:
        """The seat's own card and every action so far (the other card stays hidden): one string
        per information set, 12 in all, as OpenSpiel's kuhn_poker has."""
        return f"{self.seats[seat]} holds {state.cards[seat]}; actions: {' '.join(state.history) or 'none'}"


# --- chain ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainState:
    value: int  # the running value after the steps answered
    steps: tuple[str, ...]  # the operations: "+2", "-1", "*3"
    done: int = 0  # steps answered right
    failed: bool = False


def apply_step(value: int, step: str) -> int:
    n = int(step[1:])
    return value + n if step[0] == "+" else value - n if step[0] == "-" else value * n


class Chain(Game[ChainState, int]):
    """A chain of arithmetic steps, one model turn each; a wrong running value ends the episode."""

    seats = ("solver",)
    scripts = ("random", "optimal")
    perfect_information = True
    option_defaults: ClassVar[dict[str, int]] = {"max_steps": 3}

    def start(self, problem: str, label: object, rng: random.Random, options: GameOptions) -> ChainState:
        o = game_options("chain", options, self.option_defaults)
        parts = re.findall(r"[-+*]?\d+", problem.partition(":")[2] if ":" in problem else problem)
        if len(parts) < 2 or not parts[0].isdigit() or any(p[0] not in "+-*" for p in parts[1:]):
            raise ValueError(
                f"chain: the prompt {problem[:80]!r} is no chain; write prompts like 'Chain: 2 +3 -1' "
                "(a start value, then operations; mrlx_plugin.local.trainer.tasks.chain_prompts)"
            )
        steps = tuple(parts[1:])
        if len(steps) > o["max_steps"]:
            raise ValueError(
                f"chain: the prompt {problem[:80]!r} has {len(steps)} steps; mrlx.game.options.max_steps "
                f"is {o['max_steps']} (it bounds the turns, so the samples per episode): raise it"
            )
        return ChainState(int(parts[0]), steps)

    def to_move(self, state: ChainState) -> int | None:
        return None if state.failed or state.done == len(state.steps) else 0

    def observation(self, state: ChainState, seat: int) -> str:
        step = state.steps[state.done]
        if state.done == 0:
            return f"Start at {state.value}. Now {step}."
        return f"Now {step}."

    def right_value(self, state: ChainState) -> int:
        return apply_step(state.value, state.steps[state.done])

    def legal_moves(self, state: ChainState, seat: int) -> list[int]:
        """Any integer is legal; these are the ones `script:random` draws from (the right one and
        the nine either side of it)."""
        right = self.right_value(state)
        return list(range(right - 9, right + 10))

    def parse_move(self, state: ChainState, seat: int, text: str) -> int | None:
        answer = boxed(text)
        try:
            return int(answer.strip()) if answer is not None else None
        except ValueError:
            return None

    def play(self, state: ChainState, seat: int, move: int) -> ChainState:
        right = self.right_value(state)
        if move != right:
            return ChainState(state.value, state.steps, state.done, failed=True)
        return ChainState(right, state.steps, state.done + 1)

    def move_reward(self, state: ChainState, seat: int, move: int, next_state: ChainState) -> float:
        return 0.0 if next_state.failed else 1.0

    def outcome(self, state: ChainState) -> list[float]:
        return [1.0 if state.done == len(state.steps) else 0.0]

    def max_moves(self, options: GameOptions) -> dict[int, int]:
        return {0: game_options("chain", options, self.option_defaults)["max_steps"]}

    def scripted_move(self, state: ChainState, seat: int, script: str, rng: random.Random) -> int:
        if script == "optimal":
            return self.right_value(state)
        return rng.choice(self.legal_moves(state, seat))

    def describe_move(self, state: ChainState, seat: int, move: int) -> str:
        return f"\\boxed{{{move}}}"

    def information_state(self, state: ChainState, seat: int) -> str:
        """The step asked for, the running value and the operation shown: all the right answer
        depends on (the solver is never told how many steps remain)."""
        return f"step {state.done + 1}: value {state.value}, now {state.steps[state.done]}"


BUILT_IN_GAMES: dict[str, SomeGame] = {"nim": Nim(), "kuhn_poker": KuhnPoker(), "chain": Chain()}
