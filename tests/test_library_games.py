"""Games from OpenSpiel and TextArena, and the built-in games checked against OpenSpiel's.

The built-in kuhn_poker and nim are walked move for move beside OpenSpiel's kuhn_poker and
(normal-play, one pile) nim over every deal and history; the adapters are played through the
game protocol; `mrlx rollout --local` runs one game of each library end to end.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mrlx_plugin.core import processes
from mrlx_plugin.core.config import ConfigError, parse_settings
from mrlx_plugin.core.values import RewardError
from mrlx_plugin.plugins import collect_games, make_plugin_manager
from mrlx_plugin.settings import job_sections
from mrlx_plugin.systems import library_games
from mrlx_plugin.systems.game import GAME, check_game, game_outcome
from mrlx_plugin.systems.games import CARDS, Chain, KuhnPoker, KuhnState, Nim, kuhn_equilibrium
from mrlx_plugin.systems.library_games import (
    kuhn_exploitability,
    kuhn_information_states,
    kuhn_state_from_openspiel,
    library_game,
)

REPO = Path(__file__).resolve().parent.parent
KUHN, NIM = KuhnPoker(), Nim()
needs_openspiel = pytest.mark.skipif(
    importlib.util.find_spec("pyspiel") is None, reason="OpenSpiel is not installed (the openspiel extra)"
)
needs_textarena = pytest.mark.skipif(
    importlib.util.find_spec("textarena") is None, reason="TextArena is not installed (the textarena extra)"
)
# OpenSpiel's kuhn_poker has two actions: Pass (check, or fold a bet) and Bet (bet, or call one).
SPIEL_KUHN_ACTION = {"check": 0, "fold": 0, "bet": 1, "call": 1}


def game_settings(game: dict, agents: tuple[str, ...] = ("p",)):
    return parse_settings(
        {"system": "game", "agents": {a: {"url": "self"} for a in agents}, "game": game},
        sections=job_sections(),
    )


# --- kuhn poker against OpenSpiel -----------------------------------------------------------


def kuhn_walk():
    """Every decision and terminal position of both games side by side: (built-in state, OpenSpiel
    state), over the six deals and every history, each reached by the same actions."""
    import pyspiel

    game = pyspiel.load_game("kuhn_poker")
    for first in CARDS:
        for second in CARDS.replace(first, ""):
            spiel = game.new_initial_state()
            spiel.apply_action(CARDS.index(first))
            spiel.apply_action(CARDS.index(second))
            stack = [(KuhnState((first, second)), spiel)]
            while stack:
                ours, theirs = stack.pop()
                yield ours, theirs
                seat = KUHN.to_move(ours)
                for move in KUHN.legal_moves(ours, seat) if seat is not None else []:
                    child = theirs.clone()
                    child.apply_action(SPIEL_KUHN_ACTION[move])
                    stack.append((KUHN.play(ours, seat, move), child))


@needs_openspiel
def test_kuhn_has_openspiels_legal_moves_turns_and_outcomes_over_every_deal_and_history():
    positions = terminal = 0
    for ours, theirs in kuhn_walk():
        positions += 1
        seat = KUHN.to_move(ours)
        if theirs.is_terminal():
            terminal += 1
            assert seat is None and KUHN.outcome(ours) == theirs.returns(), ours
            continue
        assert seat == theirs.current_player(), ours
        legal = KUHN.legal_moves(ours, seat)
        assert sorted(SPIEL_KUHN_ACTION[m] for m in legal) == theirs.legal_actions(), ours
        assert kuhn_state_from_openspiel(theirs) == (ours, seat)
    assert (positions, terminal) == (6 * 9, 6 * 5)  # per deal: 4 decision positions, 5 ends


@needs_openspiel
def test_kuhn_information_states_partition_the_histories_as_openspiels_do():
    ours_to_theirs: dict[str, set[str]] = {}
    theirs_to_ours: dict[str, set[str]] = {}
    for ours, theirs in kuhn_walk():
        seat = KUHN.to_move(ours)
        if seat is None:
            continue
        mine, spiel = KUHN.information_state(ours, seat), theirs.information_state_string(seat)
        ours_to_theirs.setdefault(mine, set()).add(spiel)
        theirs_to_ours.setdefault(spiel, set()).add(mine)
    assert len(ours_to_theirs) == len(theirs_to_ours) == 12
    assert all(len(v) == 1 for v in [*ours_to_theirs.values(), *theirs_to_ours.values()])
    assert sorted(ours_to_theirs) == kuhn_information_states()


def equilibrium_policy() -> dict[str, dict[str, float]]:
    """`script:optimal`'s strategy (`kuhn_equilibrium`) at each built-in information state."""
    policy = {}
    for ours, _ in kuhn_walk():
        seat = KUHN.to_move(ours)
        if seat is not None:
            policy[KUHN.information_state(ours, seat)] = kuhn_equilibrium(ours.cards[seat], ours.history)
    return policy


@needs_openspiel
def test_the_optimal_kuhn_script_is_unexploitable_by_openspiels_measure():
    assert kuhn_exploitability(equilibrium_policy()) == pytest.approx(0.0, abs=1e-9)
    uniform = {
        s: {"check": 0.5, "bet": 0.5} if s.endswith(("none", "check")) else {"call": 0.5, "fold": 0.5}
        for s in kuhn_information_states()
    }
    assert kuhn_exploitability(uniform) == pytest.approx(11 / 24)  # 0.4583
    always_bet = {s: {m: 1.0 if m in ("bet", "call") else 0.0 for m in p} for s, p in uniform.items()}
    assert kuhn_exploitability(always_bet) == pytest.approx(1 / 3)


@needs_openspiel
def test_kuhn_exploitability_names_a_policy_it_cannot_score():
    policy = equilibrium_policy()
    gone = dict(policy)
    del gone["second holds Q; actions: bet"]
    with pytest.raises(ValueError, match="no probabilities for 1 information state.*'second holds Q; act"):
        kuhn_exploitability(gone)
    wrong = {**policy, "first holds K; actions: none": {"call": 1.0}}
    with pytest.raises(ValueError, match="expected probabilities of check and bet"):
        kuhn_exploitability(wrong)


def test_kuhn_exploitability_without_openspiel_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyspiel", None)  # `import pyspiel` raises ImportError
    with pytest.raises(ImportError, match=r"kuhn_exploitability needs OpenSpiel.*mrlx-plugin\[openspiel\]"):
        kuhn_exploitability({})


# --- nim against OpenSpiel ------------------------------------------------------------------


@needs_openspiel
@pytest.mark.parametrize("stones", range(1, 10))
def test_nim_with_a_take_limit_of_the_pile_is_openspiels_normal_play_nim(stones):
    import pyspiel

    spiel_game = pyspiel.load_game("nim", {"pile_sizes": str(stones), "is_misere": False})
    for max_take in sorted({stones, 9}):
        start = NIM.start(f"Nim: {stones} stones", None, random.Random(0), {"max_take": max_take})
        stack = [(start, spiel_game.new_initial_state())]
        ends = 0
        while stack:
            ours, theirs = stack.pop()
            seat = NIM.to_move(ours)
            if theirs.is_terminal():
                ends += 1
                assert seat is None and NIM.outcome(ours) == theirs.returns()
                continue
            assert seat == theirs.current_player()
            takes = {theirs.action_to_string(a): a for a in theirs.legal_actions()}
            assert sorted(takes) == sorted(f"pile:1, take:{k};" for k in NIM.legal_moves(ours, seat))
            for k in NIM.legal_moves(ours, seat):
                child = theirs.clone()
                child.apply_action(takes[f"pile:1, take:{k};"])
                stack.append((NIM.play(ours, seat, k), child))
        assert ends == 2 ** (stones - 1)  # every way to take the pile apart


def lines_of(state, optimal_seat: int, rng: random.Random):
    """Every end the optimal player reaches in `optimal_seat` against every line of the other seat."""
    seat = NIM.to_move(state)
    if seat is None:
        yield state
    elif seat == optimal_seat:
        move = NIM.scripted_move(state, seat, "optimal", rng)
        yield from lines_of(NIM.play(state, seat, move), optimal_seat, rng)
    else:
        for k in NIM.legal_moves(state, seat):
            yield from lines_of(NIM.play(state, seat, k), optimal_seat, rng)


def test_the_optimal_nim_script_wins_every_winning_position_against_every_line():
    rng, options = random.Random(0), {"max_take": 3, "max_stones": 20}
    for stones in range(1, 21):
        start = NIM.start(f"Nim: {stones} stones", None, rng, options)
        winner = 0 if stones % 4 else 1  # the first seat wins unless the pile is a multiple of 4
        ends = list(lines_of(start, winner, rng))
        assert ends and all(NIM.outcome(end)[winner] == 1.0 for end in ends), stones


def test_nim_and_chain_information_states_are_what_decides_the_move():
    a = NIM.play(NIM.start("Nim: 7 stones", None, random.Random(0), {}), 0, 2)  # 5 left, second to move
    b = NIM.play(NIM.start("Nim: 6 stones", None, random.Random(0), {}), 0, 1)  # 5 left, second to move
    assert NIM.information_state(a, 1) == NIM.information_state(b, 1) == "second: 5 stones, take 1 to 3"
    assert NIM.information_state(NIM.play(a, 1, 1), 0) == "first: 4 stones, take 1 to 3"
    chain = Chain()
    s = chain.start("Chain: 2 +3 +1", None, random.Random(0), {})
    assert chain.information_state(s, 0) == "step 1: value 2, now +3"
    assert chain.information_state(chain.play(s, 0, 5), 0) == "step 2: value 5, now +1"


# --- the OpenSpiel adapter ------------------------------------------------------------------


@needs_openspiel
def test_openspiel_tic_tac_toe_through_the_protocol():
    import pyspiel

    game = library_game("openspiel:tic_tac_toe", {})
    assert game.seats == ("player0", "player1") and game.scripts == ("random",)
    assert game.max_moves({}) == {0: 9, 1: 9}
    s = game.start("any prompt", None, random.Random(0), {})
    assert game.to_move(s) == 0 and len(game.legal_moves(s, 0)) == 9
    shown = game.observation(s, 0)
    assert "x(1,1)" in shown and "\\boxed{" in shown and "..." in shown
    assert game.parse_move(s, 0, "I take the centre: \\boxed{X(1,1)}") == "x(1,1)"
    assert game.parse_move(s, 0, "\\boxed{(1,1)}") is None and game.parse_move(s, 0, "x(1,1)") is None
    after = game.play(s, 0, "x(1,1)")
    assert s.history == () and str(s.state) == "...\n...\n..."  # the state played from is unchanged
    assert game.to_move(after) == 1 and "x(1,1)" not in game.legal_moves(after, 1)
    assert game.describe_move(s, 0, "x(1,1)") == "player0 plays x(1,1)."
    assert game.information_state(after, 1) == after.state.information_state_string(1)
    with pytest.raises(ValueError, match="'x\\(1,1\\)' is no legal move of player1"):
        game.play(after, 1, "x(1,1)")
    rng = random.Random(4)
    for _ in range(20):  # random playouts end, zero-sum, as a replay in OpenSpiel scores them
        s = game.start("", None, rng, {})
        while (seat := game.to_move(s)) is not None:
            s = game.play(s, seat, game.scripted_move(s, seat, "random", rng))
        replay = pyspiel.load_game("tic_tac_toe").new_initial_state()
        for action in s.history:
            replay.apply_action(action)
        assert replay.is_terminal() and game.outcome(s) == replay.returns() and sum(game.outcome(s)) == 0


@needs_openspiel
def test_openspiel_kuhn_poker_deals_from_the_seed_and_keeps_the_cards_hidden():
    game = library_game("openspiel:kuhn_poker", {})
    deals = {game.start("", None, random.Random(i), {}).history for i in range(100)}
    assert deals == {(a, b) for a in range(3) for b in range(3) if a != b}  # chance resolved at start
    s = game.start("", None, random.Random(7), {})
    assert s == game.start("", None, random.Random(7), {})
    assert game.legal_moves(s, 0) == ["Pass", "Bet"]
    assert game.describe_move(s, 0, "Bet") == "player0 has moved."  # not which: hidden information
    assert game.information_state(s, 0) == s.state.information_state_string(0)
    assert game.play(s, 0, "Bet") == game.play(s, 0, "Bet")  # a function of the state and the move
    rng = random.Random(2)
    for _ in range(50):
        s = game.start("", None, rng, {})
        while (seat := game.to_move(s)) is not None:
            s = game.play(s, seat, game.scripted_move(s, seat, "random", rng))
        ours, _ = kuhn_state_from_openspiel(s.state)
        assert game.outcome(s) == KUHN.outcome(ours)
    assert library_game("openspiel:kuhn_poker", {"players": 3}).seats == ("player0", "player1", "player2")


@needs_openspiel
def test_an_openspiel_game_with_chance_after_the_start_resolves_it_in_play():
    game = library_game("openspiel:pig", {"winscore": 10})
    rng = random.Random(1)
    s = game.start("", None, rng, {})
    while (seat := game.to_move(s)) is not None:
        move = game.scripted_move(s, seat, "random", rng)
        assert game.play(s, seat, move) == game.play(s, seat, move)
        s = game.play(s, seat, move)
    assert sorted(game.outcome(s)) == [-1.0, 1.0]


@needs_openspiel
@pytest.mark.parametrize(
    "name,options,message",
    [
        ("openspiel:tic_tac_to", {}, "OpenSpiel has no game 'tic_tac_to' (did you mean tic_tac_toe"),
        ("openspiel:nope", {}, "pyspiel.registered_names()"),
        ("openspiel:matrix_rps", {}, "is a simultaneous-move game; the game system plays sequential"),
        ("openspiel:nim", {"piles": "3"}, "'piles' is no parameter of OpenSpiel's nim (its parameters: "),
        ("openspiel:nim", {"pile_sizes": 5}, "options.pile_sizes: got 5; OpenSpiel's nim expects a str"),
    ],
)
def test_a_bad_openspiel_name_or_option_is_one_clear_error(name, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        library_game(name, options)


@needs_openspiel
@pytest.mark.parametrize(
    "name,options,message",
    [
        ("go", {"board_size": 10**6}, "supports board size up to 19. Provided: 1000000"),
        ("go", {"board_size": -3}, "unsupported board size"),
        ("breakthrough", {"rows": -5}, "rows_ > 1"),
        ("breakthrough", {"rows": 10**5}, "not valid UTF-8"),
        ("dots_and_boxes", {"num_rows": 10**5}, "legal moves at its first position, over the 1000 limit"),
        ("oware", {"num_seeds_per_house": -5}, "its initial state is already terminal"),
        ("hex", {"board_size": 10**5}, "it ran out of memory (the trial allows 4 GiB)"),
    ],
)
def test_openspiel_options_the_game_cannot_be_played_with_are_one_start_up_error(name, options, message):
    settings = game_settings({"name": f"openspiel:{name}", "seats": ["p", "p"], "options": options})
    (problem,) = check_game(settings, collect_games(make_plugin_manager([])))
    ((key, value),) = options.items()
    assert problem.startswith(f"mrlx.game.options.{key}: OpenSpiel's {name} with {key}={value} ")
    assert message in problem and "a value the game supports (its default: " in problem, problem
    with pytest.raises(ConfigError) as raised:  # the same verdict, not built again
        library_game(f"openspiel:{name}", options)
    assert str(raised.value) == problem


@needs_openspiel
def test_an_openspiel_game_that_does_not_start_within_the_bound_is_refused(monkeypatch):
    monkeypatch.setattr(library_games, "TRIAL_S", 1.0, raising=False)
    settings = game_settings(
        {"name": "openspiel:liars_dice", "seats": ["p", "p"], "options": {"numdice": 10**6}}
    )
    (problem,) = check_game(settings, collect_games(make_plugin_manager([])))
    assert problem.startswith("mrlx.game.options.numdice: OpenSpiel's liars_dice with numdice=1000000 ")
    assert "did not build its first position and 8 random moves within 1 s" in problem, problem


@needs_openspiel
def test_a_valid_openspiel_game_is_tried_once_per_process(monkeypatch):
    monkeypatch.setattr(library_games, "_BUILT", {})
    monkeypatch.setattr(library_games, "_VERDICTS", {}, raising=False)
    started = []
    real = processes.start

    def counting(argv, **kwargs):
        started.append(argv)
        return real(argv, **kwargs)

    monkeypatch.setattr(processes, "start", counting)
    settings = game_settings({"name": "openspiel:tic_tac_toe", "seats": ["p", "p"]})
    games = collect_games(make_plugin_manager([]))
    assert check_game(settings, games) == [] and check_game(settings, games) == []
    library_games._BUILT.clear()  # built again (another settings object): the verdict is kept
    assert library_game("openspiel:tic_tac_toe", {}).seats == ("player0", "player1")
    assert len(started) == 1


def test_a_library_game_without_its_library_names_the_extra(monkeypatch):
    monkeypatch.setattr(library_games, "_BUILT", {})
    monkeypatch.setitem(sys.modules, "pyspiel", None)
    monkeypatch.setitem(sys.modules, "textarena", None)
    settings = game_settings({"name": "openspiel:tic_tac_toe", "seats": ["p", "p"]})
    (problem,) = check_game(settings, collect_games(make_plugin_manager([])))
    assert "mrlx.game.name 'openspiel:tic_tac_toe' needs OpenSpiel (module pyspiel)" in problem
    assert "pip install 'mrlx-plugin[openspiel]'" in problem
    settings = game_settings({"name": "textarena:TicTacToe-v0", "options": {"max_moves": 9}})
    (problem,) = check_game(settings, collect_games(make_plugin_manager([])))
    assert "pip install 'mrlx-plugin[textarena]'" in problem


@needs_openspiel
def test_the_game_system_finds_a_library_game_by_name_and_counts_its_turns():
    games = collect_games(make_plugin_manager([]))
    settings = game_settings({"name": "openspiel:tic_tac_toe", "seats": ["p", "p"], "max_turns": 12})
    assert check_game(settings, games) == []
    assert GAME.turns(settings) == {"p": 9} and GAME.fan_out(settings) == {"p": 2}
    settings = game_settings({"name": "openspiel:tic_tac_toe", "seats": ["p", "script:optimal"]})
    (problem,) = check_game(settings, games)
    assert "game 'openspiel:tic_tac_toe' has no scripted player 'script:optimal'" in problem
    settings = game_settings({"name": "openspiel:tic_tac_toe", "seats": ["p"]})
    assert "has 2 seat(s) (player0, player1)" in check_game(settings, games)[0]
    settings = game_settings({"name": "chess", "seats": ["p", "p"]})
    assert "or name a library game: openspiel:NAME or textarena:ENV_ID" in check_game(settings, games)[0]
    assert library_game("openspiel:tic_tac_toe", {}) is library_game("openspiel:tic_tac_toe", {})


# --- the TextArena adapter ------------------------------------------------------------------


@needs_textarena
def test_textarena_tictactoe_played_to_the_end_through_the_protocol():
    game = library_game("textarena:TicTacToe-v0", {"max_moves": 10})
    assert game.seats == ("player0", "player1") and game.scripts == ()
    assert game.max_moves({"max_moves": 10}) == {0: 10, 1: 10}
    s = game.start("any prompt", None, random.Random(0), {})
    assert game.to_move(s) == 0 and "You are Player 0 in Tic Tac Toe" in game.observation(s, 0)
    assert game.observation(s, 0).count("```") == 2  # the env's text, quoted
    states = [s]
    for move in ["I play [0]", "[3]", "[1]", "[4]", "[2]"]:  # the first seat completes the top row
        seat = game.to_move(states[-1])
        before = dataclasses.replace(states[-1])
        states.append(game.play(states[-1], seat, game.parse_move(states[-1], seat, f"  {move} ")))
        assert states[-2] == before  # play leaves the state it was given as it was
    end = states[-1]
    assert game.to_move(end) is None and game.outcome(end) == [1, -1]
    assert "[Player 0] I play [0]" in game.observation(states[1], 1)  # the other seat's text, as written
    # The same game replayed from its seed and moves (no live env kept for it) ends the same.
    again = game.play(states[-2], 0, "[2]")
    assert again == end
    assert game.information_state(states[2], 0) is None  # free text: its turns are grouped by index


@needs_textarena
def test_textarena_judges_an_invalid_move_by_its_own_rules():
    game = library_game("textarena:TicTacToe-v0", {"max_moves": 10})
    s = game.start("", None, random.Random(1), {})
    warned = game.play(s, 0, "the middle")
    assert game.to_move(warned) == 0 and "attempted an invalid move" in game.observation(warned, 0)
    lost = game.play(warned, 0, "still no")
    assert game.to_move(lost) is None and game.outcome(lost) == [-1, 1]
    settled = game.play(game.play(s, 0, "[9]"), 0, "[4]")  # out of range, warned, then a valid mark
    assert game.to_move(settled) == 1


@needs_textarena
def test_a_textarena_game_that_reaches_max_moves_is_a_draw_and_bad_rewards_are_refused():
    game = library_game("textarena:TicTacToe-v0", {"max_moves": 1})
    s = game.start("", None, random.Random(1), {})
    s = game.play(game.play(s, 0, "[0]"), 1, "[4]")
    assert game.to_move(s) is None and game.outcome(s) == [0.0, 0.0]
    broken = dataclasses.replace(s, player=None, rewards=(math.nan, 0))
    with pytest.raises(RewardError, match="outcome of seat player0 gave nan"):
        game_outcome(game, broken, "game 'textarena:TicTacToe-v0'")


@needs_textarena
def test_a_textarena_game_with_chance_replays_as_it_was_played():
    # TextArena's KuhnPoker deals new cards every round from the global `random`: a move made
    # from the live env and the same move from a replay (the second `play` of a state) agree.
    game = library_game("textarena:KuhnPoker-v0", {"max_moves": 20})
    rng, ends = random.Random(5), set()
    for _ in range(10):
        s = game.start("", None, rng, {})
        while (seat := game.to_move(s)) is not None:
            move = rng.choice(["[check]", "[bet]", "[call]", "[fold]"])
            s, again = game.play(s, seat, move), game.play(s, seat, move)
            assert s == again
        ends.add(tuple(game.outcome(s)))
    assert ends <= {(1, -1), (-1, 1), (0, 0)}


@needs_textarena
def test_the_game_system_counts_a_textarena_games_turns_and_refuses_scripts():
    games = collect_games(make_plugin_manager([]))
    game = {"name": "textarena:TicTacToe-v0", "seats": ["p", "p"], "options": {"max_moves": 10}}
    settings = game_settings({**game, "max_turns": 18})
    assert check_game(settings, games) == [] and GAME.turns(settings) == {"p": 10}
    settings = game_settings({**game, "seats": ["p", "script:random"]})
    (problem,) = check_game(settings, games)
    assert "has no scripted player 'script:random' (it has: none)" in problem


@needs_textarena
def test_textarena_keeps_a_live_env_for_every_game_in_flight_past_its_first_bound(monkeypatch):
    # Twelve games in flight, moved in turn, with room for 8 live envs at first: the bound grows
    # as soon as a game in flight needs its evicted env, so only the games evicted before that
    # are replayed, once each, and every later move steps a live env.
    monkeypatch.setattr(library_games, "_BUILT", {})
    monkeypatch.setattr(library_games.TextArenaGame, "LIVE", 8)
    game = library_game("textarena:TicTacToe-v0", {"max_moves": 10})
    states = [game.start("", None, random.Random(i), {}) for i in range(12)]
    replayed = []
    real = game._replay

    def counting(*args):
        replayed.append(args)
        return real(*args)

    monkeypatch.setattr(game, "_replay", counting)  # from here on, every call replays a game
    per_round = []
    for cell in range(4):  # each game: player0 and player1 take cells in turn
        before = len(replayed)
        states = [game.play(s, game.to_move(s), f"[{cell}]") for s in states]
        per_round.append(len(replayed) - before)
    assert all(game.to_move(s) is not None for s in states)
    assert per_round == [12 - 8, 0, 0, 0] and game.live_bound == 16, per_round
    assert game.replays == sum(per_round)
    assert sum(game.episode_facts(s)["replays"] for s in states) == sum(per_round)


def test_the_replays_of_library_games_are_a_rollout_metric():
    from mrlx_plugin.core.host import Sample
    from mrlx_plugin.core.metrics import compute_metrics

    def sample(i: int, replays: int | None) -> Sample:
        episode = {"game": "textarena:TicTacToe-v0", "seats": ["player0", "player1"], "outcome": [0, 0]}
        episode.update({} if replays is None else {"replays": replays})
        s = Sample(index=i, prompt="", label=None, reward=0.0)
        s.metadata = {"mrlx": {"agent": "p", "episode_id": f"e{i}", "episode": episode}}
        return s

    assert compute_metrics([sample(0, 2), sample(1, 0), sample(2, 3)])["game/replays"] == 5.0
    assert "game/replays" not in compute_metrics([sample(0, None)])  # no TextArena game: not reported


@needs_textarena
def test_textarena_leaves_the_process_random_state_alone():
    game = library_game("textarena:TicTacToe-v0", {"max_moves": 10})
    random.seed(5)
    expected = [random.random() for _ in range(3)]
    random.seed(5)
    game.play(game.start("", None, random.Random(3), {}), 0, "[4]")  # TextArena reseeds `random` on reset
    assert [random.random() for _ in range(3)] == expected


@needs_textarena
@pytest.mark.parametrize(
    "env_id,options,message",
    [
        ("TicTacToe-v9", {"max_moves": 9}, "TextArena has no game 'TicTacToe-v9' (did you mean TicTacToe-v0"),
        ("TicTacToe-v0", {}, "mrlx.game.options.max_moves: textarena:TicTacToe-v0 needs it"),
        ("TicTacToe-v0", {"max_moves": 0}, "mrlx.game.options.max_moves: got 0; expected an integer of 1"),
        ("TicTacToe-v0", {"max_moves": 9, "seed": 1}, "'seed' is no option of textarena:TicTacToe-v0"),
        ("TicTacToe-v0", {"max_moves": 9, "num_players": 3}, "TicTacToe-v0 did not start with 3 players"),
    ],
)
def test_a_bad_textarena_name_or_option_is_one_clear_error(env_id, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        library_game("textarena:" + env_id, options)


# --- mrlx rollout --local -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,needs",
    [("openspiel_tic_tac_toe.yaml", "pyspiel"), ("textarena_tictactoe.yaml", "textarena")],
)
def test_mrlx_rollout_local_plays_a_library_game(config, needs, tiny_model_dir, tmp_path):
    pytest.importorskip(needs)
    out = tmp_path / "samples.jsonl"
    argv = ["rollout", "--local", "--config", str(REPO / "examples" / "games" / config)]
    argv += ["--model-dir", str(tiny_model_dir), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
    argv += ["--rollout-max-response-len", "1024", "--output", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "mrlx_plugin.cli", *argv],
        cwd=tmp_path,  # the engine's logs go under its runs/
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "4 episodes, 8 samples" in r.stdout and "game/episodes" in r.stdout, r.stdout
    assert ("game/replays" in r.stdout) == (needs == "textarena"), r.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8
    for row in rows:
        facts = row["metadata"]["mrlx"]["episode"]
        assert facts["game"] == ("openspiel:tic_tac_toe" if needs == "pyspiel" else "textarena:TicTacToe-v0")
        # An untrained model's answer is no move: the game ends at an illegal move (the system's
        # check, OpenSpiel) or as TextArena scores invalid moves; either way it reached an end.
        assert facts.get("stopped_by") is None and facts["moves"] >= 1
        ended = facts.get("illegal_move") is not None or facts["winner"] is not None
        assert ended or facts["outcome"] == [0, 0]  # a draw
        assert all(math.isfinite(x) for x in facts["outcome"]) and math.isfinite(row["reward"])
        assert row["status"] in ("completed", "truncated", "aborted")  # aborted: a seat that never moved
        if needs == "textarena" and row["status"] != "aborted":
            assert facts["replays"] == 0  # every move stepped the game's live env
    assert {row["metadata"]["mrlx"]["role"] for row in rows if row["status"] != "aborted"} >= {"player0"}
