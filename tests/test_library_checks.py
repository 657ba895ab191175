"""The OpenSpiel adapter's checks and its resampling: moves named exactly (chess's `Bxa6` and
`bxa6`), games whose chance does not come from their history refused, games that cannot be
played to their end refused at start-up, and `resample` (a start consistent with what a seat
knows, for tree sampling's rollouts in imperfect-information games).
"""

from __future__ import annotations

import importlib.util
import random
from collections import Counter

import pytest

from mrlx_plugin.core.config import ConfigError, parse_settings
from mrlx_plugin.plugins import collect_games, make_plugin_manager
from mrlx_plugin.settings import job_sections
from mrlx_plugin.systems import library_games
from mrlx_plugin.systems.game import check_game
from mrlx_plugin.systems.games import boxed_move
from mrlx_plugin.systems.library_games import library_game

needs_openspiel = pytest.mark.skipif(
    importlib.util.find_spec("pyspiel") is None, reason="OpenSpiel is not installed (the openspiel extra)"
)


def check(name: str, seats: int = 2) -> list[str]:
    """`check_game`'s problems with OpenSpiel's `name`, one agent in every seat."""
    settings = parse_settings(
        {
            "system": "game",
            "agents": {"p": {"url": "self"}},
            "game": {"name": name, "seats": ["p"] * seats},
        },
        sections=job_sections(),
    )
    return check_game(settings, collect_games(make_plugin_manager([])))


# --- moves matched exactly first ------------------------------------------------------------


def test_a_boxed_move_is_matched_exactly_first_and_by_case_only_where_one_move_fits():
    legal = ["Bxa6", "bxa6", "Nf3", "O-O"]
    assert boxed_move("\\boxed{Bxa6}", legal) == "Bxa6"
    assert boxed_move("I take with the pawn: \\boxed{ bxa6 }", legal) == "bxa6"
    assert boxed_move("\\boxed{BXA6}", legal) is None  # the bishop's or the pawn's: no move
    assert boxed_move("\\boxed{nf3}", legal) == "Nf3" and boxed_move("\\boxed{o-o}", legal) == "O-O"
    assert boxed_move("\\boxed{Nf4}", legal) is None and boxed_move("Nf3", legal) is None
    assert boxed_move("\\boxed{Nf3} no, \\boxed{bxa6}", legal) == "bxa6"  # the last one
    assert boxed_move("\\boxed{ 2 }", [1, 2, 3]) == 2


@needs_openspiel
def test_openspiel_chess_tells_a_bishop_capture_from_a_pawn_capture():
    game = library_game("openspiel:chess", {})
    rng = random.Random(0)
    s, pair = game.start("", None, rng, {}), None
    for _ in range(2000):  # random play until both captures are legal (0.5% of positions)
        seat = game.to_move(s)
        if seat is None:
            s, seat = game.start("", None, rng, {}), 0
        moves = game.legal_moves(s, seat)
        by_case: dict[str, list[str]] = {}
        for m in moves:
            by_case.setdefault(m.lower(), []).append(m)
        pair = next((sorted(v) for v in by_case.values() if len(v) == 2), None)
        if pair is not None:
            break
        s = game.play(s, seat, rng.choice(moves))
    assert pair is not None, "no position with two moves that differ only in case"
    upper, lower = pair  # e.g. Bxa6 (a bishop) and bxa6 (a pawn)
    assert upper != lower and upper.lower() == lower.lower()
    assert game.parse_move(s, seat, f"\\boxed{{{upper}}}") == upper
    assert game.parse_move(s, seat, f"\\boxed{{{lower}}}") == lower
    assert game.parse_move(s, seat, f"\\boxed{{{upper.upper()}}}") is None
    moved = {game.play(s, seat, m).state.to_string() for m in pair}
    assert len(moved) == 2  # two different positions: neither answer plays the other's move


# --- chance from the game's own generator ---------------------------------------------------


@needs_openspiel
@pytest.mark.parametrize("name", ["negotiation", "tarok"])
def test_a_game_whose_chance_is_drawn_from_its_own_generator_is_refused(name):
    (problem,) = check(f"openspiel:{name}")
    assert problem.startswith(f"mrlx.game.name: OpenSpiel's {name} draws its chance outcomes"), problem
    assert "sampled-stochastic" in problem and "replaying its history does not give the same state" in problem
    assert "an episode cannot be reproduced nor a position replayed" in problem and "pick a game" in problem
    with pytest.raises(ConfigError, match=f"OpenSpiel's {name} draws its chance outcomes"):
        library_game(f"openspiel:{name}", {})


@needs_openspiel
def test_the_trial_replays_every_position_from_its_history(monkeypatch):
    # Without the chance-mode check, the trial's replay is what refuses negotiation: its first
    # position replayed on a fresh initial state shows the seats another item pool.
    monkeypatch.setattr(library_games, "_UNSEEDED_CHANCE", ())
    cause = library_games._trial("negotiation", {})
    assert cause is not None and cause.startswith(
        "replaying its history on a fresh initial state does not give its first position again ("
    ), cause
    assert "an episode cannot be reproduced nor a position replayed" in cause
    for name in ("kuhn_poker", "leduc_poker", "tic_tac_toe", "pig"):
        assert library_games._trial(name, {}) is None, name


@needs_openspiel
@pytest.mark.parametrize("name", ["kuhn_poker", "leduc_poker", "tic_tac_toe"])
def test_games_whose_chance_is_in_their_history_still_build(name):
    assert check(f"openspiel:{name}") == []
    game = library_game(f"openspiel:{name}", {})
    assert game.seats == ("player0", "player1")


# --- games that cannot be played --------------------------------------------------------------


def installed_game(name: str) -> None:
    import pyspiel

    if name not in pyspiel.registered_names():
        pytest.skip(f"this OpenSpiel has no {name}")


@needs_openspiel
def test_a_game_whose_moves_cannot_be_named_past_its_opening_is_refused():
    installed_game("morpion_solitaire")
    # Its action strings repeat, change or come out as garbage a few moves in (past the first
    # eight random moves the trial made before): which of these happens first varies.
    (problem,) = check("openspiel:morpion_solitaire", seats=1)
    assert problem.startswith("mrlx.game.name: OpenSpiel's morpion_solitaire cannot be played: "), problem
    assert problem.endswith("; pick another game")
    reasons = (
        "two legal actions share one action string",
        "change from one call to the next",
        "does not make the move",
        "it ran out of memory",
        "its trial process ended with",
    )
    assert any(r in problem for r in reasons), problem


@needs_openspiel
def test_a_game_that_fails_at_its_first_move_is_refused():
    installed_game("crossword")
    (problem,) = check("openspiel:crossword")
    refused = "mrlx.game.name: OpenSpiel's crossword cannot be played: OpenSpiel refused it ("
    assert problem.startswith(refused), problem


@needs_openspiel
def test_the_trial_plays_a_random_game_to_its_end_or_its_bounds(monkeypatch):
    played = []
    real = library_games.OpenSpielGame.play

    def counting(self, state, seat, move):
        played.append(move)
        return real(self, state, seat, move)

    monkeypatch.setattr(library_games.OpenSpielGame, "play", counting)
    assert library_games._trial("tic_tac_toe", {}) is None
    assert 5 <= len(played) <= 9  # to the end: a win takes 5 moves at least, a full board 9
    played.clear()
    monkeypatch.setattr(library_games, "TRIAL_GAME_MOVES", 12)
    assert library_games._trial("chess", {}) is None
    assert len(played) == 12  # a long game: stopped at its move bound, sound so far


# --- perfect_information and resample ---------------------------------------------------------


def replayed(game, start, moves):
    s, path = start, [start]
    for who, move in moves:
        s = game.play(s, who, move)
        path.append(s)
    return path


@needs_openspiel
def test_kuhn_resample_keeps_what_the_seat_knows_and_redeals_the_rest():
    game = library_game("openspiel:kuhn_poker", {})
    assert game.perfect_information is False and game.resamples is True
    start = game.start("", None, random.Random(3), {})
    moves = [(0, "Bet")]
    seen = [game.information_state(s, 1) for s in replayed(game, start, moves)]
    rng, dealt = random.Random(0), Counter()
    for _ in range(400):
        new = game.resample(start, moves, 1, rng)
        assert new.history[1] == start.history[1]  # player1's own card
        assert [game.information_state(s, 1) for s in replayed(game, new, moves)] == seen
        dealt[new.history[0]] += 1
    others = sorted(set(range(3)) - {start.history[1]})
    assert sorted(dealt) == others  # player0's card: either of the two left
    assert all(140 <= dealt[c] <= 260 for c in others), dealt  # each about half (sd 10)


@needs_openspiel
def test_leduc_resample_keeps_the_public_card_the_seat_saw():
    game = library_game("openspiel:leduc_poker", {})
    assert game.perfect_information is False and game.resamples is True
    rng = random.Random(1)
    for _ in range(100):  # a random game that reaches the second round (the public card dealt)
        start = s = game.start("", None, rng, {})
        moves: list[tuple[int, str]] = []
        while (seat := game.to_move(s)) is not None and len(s.history) == len(moves) + 2:
            move = rng.choice(game.legal_moves(s, seat))
            moves.append((seat, move))
            s = game.play(s, seat, move)
        if seat is not None:
            break
    assert seat is not None and len(s.history) == len(moves) + 3, s.history
    at = len(s.history) - 1  # the public card, dealt after the last move
    seen = [game.information_state(x, seat) for x in replayed(game, start, moves)]
    others, draws = Counter(), 400
    for _ in range(draws):
        new = game.resample(start, moves, seat, rng)
        path = replayed(game, new, moves)
        assert [game.information_state(x, seat) for x in path] == seen
        assert path[-1].history[at] == s.history[at]  # the public card
        assert path[-1].history[seat] == s.history[seat]  # the seat's own card
        others[path[-1].history[1 - seat]] += 1
    assert len(others) == 4 and all(60 <= n <= 140 for n in others.values()), others  # 4 cards left


@needs_openspiel
def test_perfect_information_and_a_resampler_that_changes_other_seats_moves():
    assert library_game("openspiel:tic_tac_toe", {}).perfect_information is True
    phantom = library_game("openspiel:phantom_ttt", {})
    assert phantom.perfect_information is False and phantom.resamples is False  # not implemented
    hearts = library_game("openspiel:hearts", {})
    assert hearts.resamples is False
    rng = random.Random(0)
    start = s = hearts.start("", None, rng, {})
    moves: list[tuple[int, str]] = []
    # Its resampler redeals what the other seats hold, and their moves no longer replay.
    changed = "hearts: its resample(r changes other seats' moves|d position does not replay the moves made)"
    with pytest.raises(ValueError, match=changed):
        while (seat := hearts.to_move(s)) is not None:
            hearts.resample(start, moves, seat, rng)  # the passed cards are redrawn, once passed
            move = rng.choice(hearts.legal_moves(s, seat))
            moves.append((seat, move))
            s = hearts.play(s, seat, move)
