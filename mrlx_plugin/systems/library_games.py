"""Games from OpenSpiel and TextArena as games of the game system: `openspiel:NAME`, `textarena:ENV_ID`.

Both libraries are optional extras (`pip install 'mrlx-plugin[openspiel]'`, `[textarena]`) and are
imported only when a game of theirs is named. A name with one of the two prefixes that no plugin
registers is built here, once per name and `mrlx.game.options` (`library_game`); the game
system's lookups (`check_game`, `the_game`, `game_turns`) ask for it by name.

- `openspiel:NAME`: any sequential (turn-based) OpenSpiel game; `mrlx.game.options` are the
  game's parameters (`pyspiel.load_game(NAME, options)`). Seats `player0`, `player1`, ... A seat
  is shown OpenSpiel's observation string for it (its information state string when the game has
  none) and the legal action strings, and answers `\\boxed{ACTION}` (`boxed_move`: exactly,
  else with case ignored where that leaves one move). Chance nodes are resolved here, from a
  seed drawn at `start` from the episode's generator and kept in the state, so that `play` is a
  function of the state and the move alone; a game that draws chance from a generator of its
  own (sampled-stochastic) is refused. The outcome is OpenSpiel's returns. Before a game is
  built here it is tried with its options in a child process under time, memory and size
  bounds, one random game played through the adapter (`_tried`): OpenSpiel checks few options
  itself, and some games cannot be played through their action strings. `resample` draws a
  start consistent with what a seat knows (tree sampling's rollouts in imperfect-information
  games), where `resamples` is True.
- `textarena:ENV_ID`: any TextArena env, through the adapter of `systems.textarena_game`.

`kuhn_exploitability` scores a policy of the built-in `kuhn_poker` with OpenSpiel's
exploitability, for benchmarks.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrlx_plugin.core import processes
from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.systems.games import CARDS, Game, GameOptions, KuhnPoker, KuhnState, boxed_move
from mrlx_plugin.systems.libraries import OPENSPIEL, TEXTARENA, import_library, unknown_game
from mrlx_plugin.systems.quoting import quote
from mrlx_plugin.systems.textarena_game import TextArenaGame

_BUILT: dict[tuple[str, str], OpenSpielGame | TextArenaGame] = {}

# A pyspiel object (a game, a state): OpenSpiel's bindings carry no type hints.
SpielObject = Any


def library_game(name: str, options: GameOptions) -> OpenSpielGame | TextArenaGame:
    """The game `name` (`openspiel:NAME` or `textarena:ENV_ID`) with `options`, built once per
    name and options: the adapter holds the loaded game, which every episode shares.

    Raises LibraryMissing (`systems.libraries`: the extra to install) or ValueError (the name or
    an option, and how to find the valid ones)."""
    key = (name, json.dumps(dict(options), sort_keys=True, default=repr))
    game = _BUILT.get(key)
    if game is None:
        if name.startswith(OPENSPIEL):
            game = OpenSpielGame(name[len(OPENSPIEL) :], dict(options))
        elif name.startswith(TEXTARENA):
            game = TextArenaGame(name[len(TEXTARENA) :], dict(options))
        else:
            raise ValueError(
                f"mrlx.game.name: {name!r} is no library game; library games are named "
                f"{OPENSPIEL}NAME or {TEXTARENA}ENV_ID"
            )
        _BUILT[key] = game
    return game


# --- OpenSpiel ------------------------------------------------------------------------------

# The trial of an OpenSpiel game with the user's options, once per process before it is built
# here (`_tried`): OpenSpiel checks few options itself, and one it does not (a board of 10^5
# rows, 10^6 dice) builds a game that fails, hangs or exhausts memory at its first position.
# The trial builds the game, settles its first position and plays TRIAL_MOVES random moves in a
# child process, killed past TRIAL_S seconds and held to TRIAL_MEMORY bytes more than its
# imports took; each position's text must stay within the size bounds below (the longest of the
# library's games at their default options, for scale: an observation string of about 2,200
# characters (twixt), 362 legal moves (go), 11,000 characters of legal move strings (battleship)).
# It then plays that random game on to its end, or to TRIAL_GAME_MOVES moves or TRIAL_GAME_S
# seconds (a quarter of its time bound at most), so that a game whose moves cannot be named past
# its opening (morpion_solitaire's action strings repeat) or whose positions cannot be replayed
# from their history is refused at start-up, not in the middle of a run.
TRIAL_S = 10.0
TRIAL_MOVES = 8
TRIAL_GAME_MOVES = 5_000
TRIAL_GAME_S = 2.0
TRIAL_MEMORY = 4 << 30
MAX_VIEW_CHARS = 20_000  # an observation or information state string
MAX_MOVES = 1_000  # legal moves at one position
MAX_MOVE_CHARS = 50_000  # the legal moves' strings together
_TRIAL_IMPORT_S = 60.0  # the trial process's start and imports, before its own bound applies
_UNSEEDED_CHANCE = ("SAMPLED_STOCHASTIC",)  # chance modes whose outcomes are no actions of the history
RESAMPLE_TRY_MOVES = 40  # `resamples` is tried along one random game of at most these moves,
RESAMPLE_TRY_S = 1.0  # and stops trying past these seconds (bridge deals for a second a try)
_VERDICTS: dict[str, str | None] = {}  # (name, parameters) -> the refusal, or None: tried once per process


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _refusal(name: str, spec: Mapping[str, object], params: Mapping[str, object], cause: str) -> str:
    """The start-up error for OpenSpiel's `name` with `params` that cannot be played: the option
    it names (the one given, or the one the cause mentions), every option given, the cause and
    what to do."""
    named = [k for k in params if k in cause or k.replace("_", " ") in cause]
    if len(named) != 1:
        named = list(params)
    given = ", ".join(f"{k}={v!r}" for k, v in params.items())
    if len(named) == 1:
        where = f"mrlx.game.options.{named[0]}"
        fix = f"give {named[0]} a value the game supports (its default: {spec[named[0]]!r})"
    elif params:
        where = "mrlx.game.options"
        defaults = ", ".join(f"{k}={spec[k]!r}" for k in params)
        fix = f"give them values the game supports (their defaults: {defaults})"
    else:
        where, fix = "mrlx.game.name", "pick another game"
    return f"{where}: OpenSpiel's {name}{f' with {given}' if params else ''} cannot be played: {cause}; {fix}"


def _tried(name: str, spec: Mapping[str, object], params: dict[str, object]) -> None:
    """Raise ConfigError when OpenSpiel's `name` with `params` fails its trial (above); the
    verdict is kept for the process, so a valid game is tried once."""
    key = json.dumps([name, params], sort_keys=True, default=repr)
    if key not in _VERDICTS:
        _VERDICTS[key] = _run_trial(name, spec, params)
    refusal = _VERDICTS[key]
    if refusal is not None:
        raise ConfigError(refusal)


def _run_trial(name: str, spec: Mapping[str, object], params: dict[str, object]) -> str | None:
    """The trial in a child process (`_trial_main`): None, or the refusal's message."""
    code = "from mrlx_plugin.systems.library_games import _trial_main; _trial_main()"
    root = str(Path(__file__).resolve().parents[2])  # this package, importable in the child as here
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    proc = processes.start(
        [sys.executable, "-c", code, name, json.dumps(params), repr(TRIAL_S)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env={**os.environ, "PYTHONPATH": path},
    )
    slow = f"it did not build its first position and {TRIAL_MOVES} random moves within {TRIAL_S:g} s"
    try:
        out, err = proc.communicate(timeout=TRIAL_S + _TRIAL_IMPORT_S)
    except subprocess.TimeoutExpired:
        processes.stop(proc, timeout=1.0)
        proc.communicate()
        return _refusal(name, spec, params, slow)
    if hasattr(signal, "SIGALRM") and proc.returncode == -signal.SIGALRM:  # its own bound (`_bound_trial`)
        return _refusal(name, spec, params, slow)
    lines = out.strip().splitlines()
    try:
        verdict = json.loads(lines[-1]) if lines else None
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict):
        rc = proc.returncode
        how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        said = (err.strip().splitlines() or ["nothing on stderr"])[-1][:500]
        return _refusal(name, spec, params, f"its trial process ended with {how} ({said})")
    if verdict.get("message") is not None:
        return str(verdict["message"])
    return None if verdict.get("cause") is None else _refusal(name, spec, params, str(verdict["cause"]))


def _bound_trial(seconds: float) -> None:
    """The trial process's bounds: killed by SIGALRM (its default action) `seconds` from now,
    whatever it runs (a loop in OpenSpiel's C++ included), and TRIAL_MEMORY bytes of address
    space beyond what it holds now (an allocation past it raises MemoryError)."""
    if hasattr(signal, "setitimer"):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        import resource

        held = os.sysconf("SC_PAGE_SIZE") * int(Path("/proc/self/statm").read_text().split()[0])
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (held + TRIAL_MEMORY, hard))
    except (ImportError, OSError, ValueError):
        pass  # no such limit here: the time bound remains


def _trial_main() -> None:
    """The trial's process: `NAME PARAMETERS_JSON SECONDS` in argv; one JSON line on stdout,
    `{"cause": null}` for a game that passed, else its cause or the adapter's own message."""
    name, params, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
    pyspiel = importlib.import_module("pyspiel")
    _bound_trial(seconds)
    verdict: dict[str, str | None]
    try:
        verdict = {"cause": _trial(name, params, seconds)}
    except ConfigError as exc:  # the adapter's own checks (a simultaneous-move game, ...)
        verdict = {"message": str(exc)}
    except pyspiel.SpielError as exc:
        verdict = {"cause": f"OpenSpiel refused it ({_one_line(exc)})"}
    except MemoryError:
        verdict = {"cause": f"it ran out of memory (the trial allows {TRIAL_MEMORY >> 30} GiB)"}
    except UnicodeDecodeError as exc:
        verdict = {"cause": f"OpenSpiel gave a string that is not valid UTF-8 ({exc.reason})"}
    except Exception as exc:
        verdict = {"cause": f"it failed ({type(exc).__name__}: {_one_line(exc)[:500]})"}
    print(json.dumps(verdict), flush=True)


def _trial(name: str, params: dict[str, object], seconds: float = TRIAL_S) -> str | None:
    """Why OpenSpiel's `name` with `params` cannot be played, or None: built by the adapter, its
    first position settled and one random game played through the adapter (its first TRIAL_MOVES
    moves in any case, then on to its end within TRIAL_GAME_MOVES and the time left for it), each
    position within the size bounds, its legal action strings the same when asked again, each
    move made as a seat makes it (`parse_move` of the boxed string, then `play`), and each
    position the same when its history is replayed on a fresh initial state. Runs in the
    trial's process (`seconds`: its time bound); the adapter's own errors propagate."""
    began = time.monotonic()
    play_s = min(TRIAL_GAME_S, seconds / 4)
    game = OpenSpielGame(name, params, in_trial=True)
    rng = random.Random(0)
    state = game.start("", None, rng, {})
    if game.to_move(state) is None:
        return "its initial state is already terminal: the game is over before any move"
    made = 0
    while (seat := game.to_move(state)) is not None:
        where = "its first position" if made == 0 else f"the position after {made} random move(s)"
        legal = len(state.state.legal_actions(seat))
        if legal > MAX_MOVES:
            return f"it has {legal} legal moves at {where}, over the {MAX_MOVES} limit"
        for what, text in (
            (game.view, game.view_string(state, seat)),
            ("information state", game.information_state(state, seat)),
        ):
            if len(text) > MAX_VIEW_CHARS:
                return (
                    f"its {what} string at {where} is {len(text)} characters, over the {MAX_VIEW_CHARS} limit"
                )
        moves = game.legal_moves(state, seat)
        size = sum(len(m) + 2 for m in moves)  # as listed: "a, b, c"
        if size > MAX_MOVE_CHARS:
            return f"its legal moves at {where} are {size} characters, over the {MAX_MOVE_CHARS} limit"
        changed = (
            f"its legal action strings at {where} change from one call to the next, so no answer "
            "can name a move"
        )
        if game.legal_moves(state, seat) != moves:
            return changed
        game.observation(state, seat)
        # Replayed at the first position and then while the game's time lasts: a replay costs
        # what the moves so far cost (bridge's deal alone takes about a second).
        replayed = made == 0 or time.monotonic() - began <= play_s
        differs = _replay_difference(game, state) if replayed else None
        if differs is not None:
            again = f"replaying its history on a fresh initial state does not give {where} again"
            return f"{again} ({differs}){_UNREPLAYABLE}"
        if made >= TRIAL_MOVES and (made >= TRIAL_GAME_MOVES or time.monotonic() - began > play_s):
            return None  # a long game, sound so far: its opening was checked within the bound
        move = rng.choice(moves)
        if game.parse_move(state, seat, f"\\boxed{{{move}}}") != move:
            if game.legal_moves(state, seat) != moves:
                return changed
            answer = f"\\boxed{{{move}}}"
            return f"the answer {answer} at {where} does not make the move {move!r}: no seat can make it"
        state = game.play(state, seat, move)
        made += 1
    return None


_UNREPLAYABLE = (
    ": its chance outcomes do not all come from its history, so an episode cannot be reproduced "
    "nor a position replayed"
)


def _replay_difference(game: OpenSpielGame, state: SpielState) -> str | None:
    """What differs between `state` and its history replayed on a fresh initial state (whose
    turn, every seat's observation and information state, the legal actions), or None."""
    replay = game.game.new_initial_state()
    try:
        for action in state.history:
            replay.apply_action(action)
    except Exception as exc:  # an action the replayed position does not allow
        return f"its actions cannot be applied again: {_one_line(exc)[:300]}"
    again = SpielState(state.history, state.seed, replay, state.forced)
    if (replay.is_terminal(), game.to_move(again)) != (state.state.is_terminal(), game.to_move(state)):
        return "whose turn it is differs"
    for seat, name in enumerate(game.seats):
        if game.view_string(again, seat) != game.view_string(state, seat):
            return f"{name}'s {game.view} differs"
        if game.information_state(again, seat) != game.information_state(state, seat):
            return f"{name}'s information state differs"
    seat = game.to_move(state)
    if seat is not None and replay.legal_actions(seat) != state.state.legal_actions(seat):
        return "the legal actions differ"
    return None


@dataclass(frozen=True)
class SpielState:
    """A position of an OpenSpiel game: its action history (chance outcomes included) and the
    seed its chance nodes are drawn from. `state` is the pyspiel state itself, never changed:
    `play` applies a move to a clone. `forced` is a history whose chance outcomes come before
    the seed's: a chance node reached along it takes its outcome there (a start drawn by
    `resample`, whose replay must deal what the resampler dealt); () for an episode's own."""

    history: tuple[int, ...]
    seed: int
    state: SpielObject = field(compare=False, repr=False)
    forced: tuple[int, ...] = ()


def _spiel_options(name: str, spec: Mapping[str, object], options: GameOptions) -> dict[str, object]:
    """`options` as OpenSpiel parameters of `name`: known names only, each of its default's type
    (an integer where a float is expected is taken as that float)."""
    unknown = sorted(set(options) - set(spec))
    if unknown:
        known = ", ".join(f"{k} (default {v!r})" for k, v in sorted(spec.items())) or "none"
        raise ValueError(
            f"mrlx.game.options: {', '.join(map(repr, unknown))} is no parameter of OpenSpiel's {name} "
            f"(its parameters: {known})"
        )
    out: dict[str, object] = {}
    for key, value in options.items():
        default = spec[key]
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default):
            raise ValueError(
                f"mrlx.game.options.{key}: got {value!r}; OpenSpiel's {name} expects a "
                f"{type(default).__name__} (default {default!r})"
            )
        out[key] = value
    return out


class OpenSpielGame(Game[SpielState, str]):
    """A sequential OpenSpiel game through the game protocol (see the module's docstring)."""

    scripts = ("random",)

    def __init__(self, name: str, options: GameOptions, *, in_trial: bool = False):
        """Raises ConfigError for a game or options that cannot be played: the game is tried
        first with these options, in a child process with bounds (`_tried`), unless this is
        that trial (`in_trial`)."""
        pyspiel = import_library("pyspiel", "OpenSpiel", "openspiel", f"mrlx.game.name {OPENSPIEL + name!r}")
        types = {t.short_name: t for t in pyspiel.registered_games()}
        if name not in types:
            how = "python -c 'import pyspiel; print(pyspiel.registered_names())'"
            raise unknown_game("OpenSpiel", name, sorted(types), how)
        spec = types[name].parameter_specification
        params = _spiel_options(name, spec, options)
        if not in_trial:
            _tried(name, spec, params)
        try:
            self.game = pyspiel.load_game(name, params)
        except pyspiel.SpielError as exc:
            raise ConfigError(
                _refusal(name, spec, params, f"OpenSpiel refused it ({_one_line(exc)})")
            ) from exc
        kind = self.game.get_type()
        if kind.dynamics != pyspiel.GameType.Dynamics.SEQUENTIAL:
            dynamics = {"SIMULTANEOUS": "simultaneous-move", "MEAN_FIELD": "mean-field"}
            raise ConfigError(
                f"mrlx.game.name: OpenSpiel's {name} is a "
                f"{dynamics.get(kind.dynamics.name, kind.dynamics.name.lower())} game; the game system "
                "plays sequential (turn-based) games only: pick one whose players move in turn"
            )
        if not (kind.provides_observation_string or kind.provides_information_state_string):
            raise ConfigError(
                f"mrlx.game.name: OpenSpiel's {name} gives no observation or information state string, "
                "so a seat cannot be shown its position as text; pick another game"
            )
        if kind.chance_mode.name in _UNSEEDED_CHANCE:
            raise ConfigError(
                f"mrlx.game.name: OpenSpiel's {name} draws its chance outcomes from a random generator "
                "of its own (its chance mode is sampled-stochastic), not from its history: replaying "
                "its history does not give the same state, so an episode cannot be reproduced nor a "
                "position replayed; pick a game whose chance outcomes are actions of its history "
                "(explicit-stochastic, e.g. kuhn_poker, leduc_poker) or a deterministic one"
            )
        self.name = name
        self.spiel_error = pyspiel.SpielError
        self.seats = tuple(f"player{i}" for i in range(self.game.num_players()))
        self.perfect_information = kind.information == pyspiel.GameType.Information.PERFECT_INFORMATION
        self.view = "observation" if kind.provides_observation_string else "information state"
        self.knows = "information state" if kind.provides_information_state_string else "observation"
        # Whether `resample` works here: tried once, along one seeded random game (`_try_resample`).
        self.resamples = False if in_trial else self._try_resample()

    def _try_resample(self) -> bool:
        """`resample` for the seat to move at each position of a seeded random game, up to
        RESAMPLE_TRY_MOVES moves and RESAMPLE_TRY_S seconds (one try at least): False when
        OpenSpiel does not implement it for this game (SpielError) or its resampler changes what
        it may not (ValueError; hearts' does only once the cards are passed, past move 12). A
        perfect-information game is tried at its start only: its resampler can only return the
        position it is given."""
        began = time.monotonic()
        bound = 0 if self.perfect_information else RESAMPLE_TRY_MOVES
        rng = random.Random(0)
        start = state = self.start("", None, rng, {})
        moves: list[tuple[int, str]] = []
        while (seat := self.to_move(state)) is not None and len(moves) <= bound:
            try:
                self.resample(start, moves, seat, rng)
            except (self.spiel_error, ValueError):
                return False
            if time.monotonic() - began > RESAMPLE_TRY_S:
                break
            move = rng.choice(self.legal_moves(state, seat))
            moves.append((seat, move))
            state = self.play(state, seat, move)
        return True

    def _settle(self, state: SpielObject, seed: int, forced: tuple[int, ...] = ()) -> SpielState:
        """`state` (a fresh one, owned here) with its chance nodes resolved: the outcome `forced`
        has there while the history follows it, else drawn from the seed and the history so far:
        the same position always draws the same outcome."""
        while state.is_chance_node():
            history = state.history()
            actions, weights = zip(*state.chance_outcomes())
            at = len(history)
            if at < len(forced) and forced[at] in actions and tuple(history) == forced[:at]:
                state.apply_action(forced[at])
                continue
            draw = random.Random(f"{seed}:{state.history_str()}")
            state.apply_action(draw.choices(actions, weights=weights)[0])
        return SpielState(tuple(state.history()), seed, state, forced)

    def start(self, problem: str, label: object, rng: random.Random, options: GameOptions) -> SpielState:
        return self._settle(self.game.new_initial_state(), rng.randrange(2**62))

    def to_move(self, state: SpielState) -> int | None:
        return None if state.state.is_terminal() else state.state.current_player()

    def _actions(self, state: SpielState, seat: int) -> dict[str, int]:
        s = state.state
        actions = {s.action_to_string(seat, a): a for a in s.legal_actions(seat)}
        if len(actions) != len(s.legal_actions(seat)):
            raise ValueError(
                f"{OPENSPIEL}{self.name}: two legal actions share one action string at {s.history_str()!r}; "
                "a seat could not name its move: this game cannot be played through its action strings"
            )
        return actions

    def legal_moves(self, state: SpielState, seat: int) -> list[str]:
        return list(self._actions(state, seat))

    def parse_move(self, state: SpielState, seat: int, text: str) -> str | None:
        return boxed_move(text, self.legal_moves(state, seat))

    def view_string(self, state: SpielState, seat: int) -> str:
        """What `seat` is shown of the position: its observation string (its information state
        string where the game has none)."""
        s = state.state
        return s.observation_string(seat) if self.view == "observation" else s.information_state_string(seat)

    def observation(self, state: SpielState, seat: int) -> str:
        view = self.view_string(state, seat)
        moves = self.legal_moves(state, seat)
        return (
            f"OpenSpiel {self.name}; you are {self.seats[seat]}. Your {self.view}:\n{quote(view)}\n"
            f"Legal moves: {', '.join(moves)}. Answer with one of them as \\boxed{{MOVE}}, "
            f"e.g. \\boxed{{{moves[0]}}}."
        )

    def information_state(self, state: SpielState, seat: int) -> str:
        """OpenSpiel's information state string (its observation string when it has none)."""
        if self.knows == "information state":
            return state.state.information_state_string(seat)
        return state.state.observation_string(seat)

    def play(self, state: SpielState, seat: int, move: str) -> SpielState:
        actions = self._actions(state, seat)
        if move not in actions:
            raise ValueError(f"{OPENSPIEL}{self.name}: {move!r} is no legal move of {self.seats[seat]}")
        after = state.state.clone()
        after.apply_action(actions[move])
        return self._settle(after, state.seed, state.forced)

    def resample(
        self, start: SpielState, moves: Sequence[tuple[int, str]], seat: int, rng: random.Random
    ) -> SpielState:
        """A start state drawn consistently with what `seat` knows after `moves` (the (seat,
        action string) moves made since `start`, the episode's start, in order): OpenSpiel's
        `resample_from_infostate` at the position they reach, its sampler and the new start's seed
        drawn from `rng`. Replaying `moves` from it is legal at every step and shows `seat` the
        same information state all along; its chance nodes along the replay deal what the
        resampler dealt (`SpielState.forced`), those after it draw from its seed.

        Raises OpenSpiel's SpielError where the game does not implement resampling (`resamples`
        is False then), ValueError where its resampler changes other seats' moves."""
        path = [start]
        for who, move in moves:
            path.append(self.play(path[-1], who, move))
        sampler = random.Random(rng.randrange(2**62))
        drawn = path[-1].state.resample_from_infostate(seat, sampler.random)
        made = [(a.player, a.action) for a in path[-1].state.full_history() if a.player >= 0]
        if [(a.player, a.action) for a in drawn.full_history() if a.player >= 0] != made:
            raise ValueError(
                f"{OPENSPIEL}{self.name}: its resampler changes other seats' moves; tree sampling's "
                "rollouts cannot start from it"
            )
        forced = tuple(drawn.history())
        new = self._settle(self.game.new_initial_state(), rng.randrange(2**62), forced)
        state, why = new, None
        for (who, move), was in zip(moves, path, strict=False):
            if self.information_state(state, seat) != self.information_state(was, seat):
                why = f"{self.seats[seat]}'s information state differs"
                break
            if move not in self._actions(state, who):
                why = f"{move!r} of {self.seats[who]} is no legal move there"
                break
            state = self.play(state, who, move)
        else:
            if self.information_state(state, seat) != self.information_state(path[-1], seat):
                why = f"{self.seats[seat]}'s information state differs"
            elif state.history != forced:
                why = "its chance outcomes differ"
        if why is not None:
            raise ValueError(
                f"{OPENSPIEL}{self.name}: its resampled position does not replay the moves made ({why}); "
                "tree sampling's rollouts cannot start from it"
            )
        return new

    def move_reward(self, state: SpielState, seat: int, move: str, next_state: SpielState) -> float:
        return 0.0

    def outcome(self, state: SpielState) -> list[float]:
        return list(state.state.returns())

    def max_moves(self, options: GameOptions) -> dict[int, int]:
        """OpenSpiel's `max_game_length` for every seat: no seat moves more often than the game is long."""
        return {seat: self.game.max_game_length() for seat in range(len(self.seats))}

    def scripted_move(self, state: SpielState, seat: int, script: str, rng: random.Random) -> str:
        if script == "random":
            return rng.choice(self.legal_moves(state, seat))
        raise ValueError(f"no scripted player {script!r} (this game has: {', '.join(self.scripts)})")

    def describe_move(self, state: SpielState, seat: int, move: str) -> str:
        """The move itself in a perfect-information game; else only that it was made (the seats'
        observations say what each may know of it)."""
        if self.perfect_information:
            return f"{self.seats[seat]} plays {move}."
        return f"{self.seats[seat]} has moved."


# --- Kuhn poker against OpenSpiel -----------------------------------------------------------


def kuhn_state_from_openspiel(state: SpielObject) -> tuple[KuhnState, int | None]:
    """The built-in kuhn_poker's state for an OpenSpiel kuhn_poker state (both cards dealt), and
    the seat to move (None at the end). OpenSpiel's Pass is check or fold, its Bet bet or call,
    by whether a bet is open."""
    dealt, actions = state.history()[:2], state.history()[2:]
    history: list[str] = []
    for a in actions:
        open_bet = history[-1:] == ["bet"]
        history.append(("fold" if open_bet else "check") if a == 0 else ("call" if open_bet else "bet"))
    kuhn = KuhnState((CARDS[dealt[0]], CARDS[dealt[1]]), tuple(history))
    return kuhn, KuhnPoker().to_move(kuhn)


def kuhn_information_states() -> list[str]:
    """The built-in kuhn_poker's 12 information states (`information_state` of the seat to move)."""
    game, found = KuhnPoker(), []
    for first in CARDS:
        for second in CARDS.replace(first, ""):
            stack = [KuhnState((first, second))]
            while stack:
                s = stack.pop()
                seat = game.to_move(s)
                if seat is not None:
                    found.append(game.information_state(s, seat))
                    stack.extend(game.play(s, seat, m) for m in game.legal_moves(s, seat))
    return sorted(set(found))


def kuhn_exploitability(policy: Mapping[str, Mapping[str, float]]) -> float:
    """OpenSpiel's exploitability (NashConv / 2) of a policy of the built-in kuhn_poker, both seats
    playing it: 0 at a Nash equilibrium, 0.4583 for uniform random play.

    `policy` maps each of the 12 information states (`KuhnPoker.information_state`, listed by
    `kuhn_information_states`) to {action name: probability} over that state's legal moves."""
    wanted = "kuhn_exploitability"
    pyspiel = import_library("pyspiel", "OpenSpiel", "openspiel", wanted)
    spiel_policy = import_library("open_spiel.python.policy", "OpenSpiel", "openspiel", wanted)
    exploitability = import_library(
        "open_spiel.python.algorithms.exploitability", "OpenSpiel", "openspiel", wanted
    )
    game, kuhn = pyspiel.load_game("kuhn_poker"), KuhnPoker()
    missing = [s for s in kuhn_information_states() if s not in policy]
    if missing:
        raise ValueError(
            f"{wanted}: the policy has no probabilities for {len(missing)} information state(s), e.g. "
            f"{missing[0]!r}; give all 12 (kuhn_information_states())"
        )

    class Tabled(spiel_policy.Policy):
        def action_probabilities(self, state: SpielObject, player_id: int | None = None) -> dict[int, float]:
            ours, seat = kuhn_state_from_openspiel(state)
            assert seat is not None
            key, legal = kuhn.information_state(ours, seat), kuhn.legal_moves(ours, seat)
            probs = dict(policy[key])
            total = sum(probs.values())
            if set(probs) - set(legal) or abs(total - 1.0) > 1e-6 or min(probs.values(), default=-1) < 0:
                raise ValueError(
                    f"{wanted}: the policy at {key!r} is {probs}; expected probabilities of "
                    f"{' and '.join(legal)} (the legal moves there), each 0 or more, summing to 1"
                )
            return {0 if m in ("check", "fold") else 1: probs.get(m, 0.0) for m in legal}

    return float(exploitability.exploitability(game, Tabled(game, [0, 1])))
