"""The built-in games' rules, on their own: legal moves, outcomes, scripted players, prompts."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from mrlx_plugin.local.trainer.tasks import chain_prompts, kuhn_prompts, nim_prompts, task_prompts
from mrlx_plugin.systems.game import Game, boxed, judge_move, winner_of
from mrlx_plugin.systems.games import BUILT_IN_GAMES, Chain, KuhnPoker, KuhnState, Nim, kuhn_equilibrium

NIM, KUHN, CHAIN = Nim(), KuhnPoker(), Chain()
RNG = random.Random(0)


def play_out(game, state, players, rng):
    """Play `state` to the end with scripted `players` (one script name per seat)."""
    while (seat := game.to_move(state)) is not None:
        state = game.play(state, seat, game.scripted_move(state, seat, players[seat], rng))
    return state


def test_the_built_in_games_are_registered_by_name_and_have_every_method_of_the_protocol():
    assert set(BUILT_IN_GAMES) == {"nim", "kuhn_poker", "chain"}
    protocol = [name for name in vars(Game) if not name.startswith("_")]
    assert {
        "seats",
        "scripts",
        "start",
        "to_move",
        "observation",
        "parse_move",
        "play",
        "move_reward",
        "outcome",
        "max_moves",
        "scripted_move",
        "describe_move",
    } <= set(protocol)
    for game in BUILT_IN_GAMES.values():
        assert "random" in game.scripts and game.seats
        missing = [name for name in protocol if not hasattr(game, name)]
        assert not missing, (game, missing)


def test_boxed_reads_the_last_box():
    assert boxed("I take \\boxed{1}, no \\boxed{ 2 }") == " 2 "
    assert boxed("two") is None


# --- nim ------------------------------------------------------------------------------------


def test_nim_legal_moves_and_the_legality_check():
    s = NIM.start("Nim: 2 stones", None, RNG, {})
    assert NIM.legal_moves(s, 0) == [1, 2]
    assert NIM.parse_move(s, 0, "\\boxed{2}") == 2
    assert NIM.parse_move(s, 0, "\\boxed{ 1 }") == 1
    for illegal in ("\\boxed{3}", "\\boxed{0}", "\\boxed{-1}", "2", "\\boxed{two}", ""):
        assert NIM.parse_move(s, 0, illegal) is None, illegal
    big = NIM.start("Nim: 9 stones", None, RNG, {"max_take": 5})
    assert NIM.legal_moves(big, 0) == [1, 2, 3, 4, 5]


def test_nim_whoever_takes_the_last_stone_wins():
    s = NIM.start("Nim: 5 stones", None, RNG, {})
    assert NIM.to_move(s) == 0
    s = NIM.play(s, 0, 3)
    assert NIM.to_move(s) == 1 and s.stones == 2
    s = NIM.play(s, 1, 2)
    assert NIM.to_move(s) is None
    assert NIM.outcome(s) == [-1.0, 1.0]
    assert winner_of(NIM.outcome(s), NIM.seats) == "second"


def test_nim_observations_are_as_short_as_the_demos_questions():
    s = NIM.start("Nim: 7 stones", None, RNG, {})
    assert NIM.observation(s, 0) == "Nim: 7 stones. Take 1 to 3."
    s = NIM.play(NIM.play(s, 0, 1), 1, 2)
    assert NIM.observation(s, 0) == "4 stones left."
    assert NIM.describe_move(s, 1, 2) == "They took 2."


@pytest.mark.parametrize("max_take", [2, 3, 4])
def test_the_optimal_nim_player_never_loses_from_a_winning_position(max_take):
    rng = random.Random(max_take)
    max_stones = 20
    for stones in range(1, max_stones + 1):
        state = NIM.start(
            f"Nim: {stones} stones", None, rng, {"max_take": max_take, "max_stones": max_stones}
        )
        winning = stones % (max_take + 1) != 0
        for opponent in ("random", "optimal"):
            for _ in range(20):
                end = play_out(NIM, state, ["optimal", opponent], rng)
                if winning:
                    assert NIM.outcome(end) == [1.0, -1.0], (stones, opponent)
        if not winning:  # the optimal second player wins every game from a lost first position
            for _ in range(20):
                assert NIM.outcome(play_out(NIM, state, ["random", "optimal"], rng)) == [-1.0, 1.0]


def test_nim_max_moves_bounds_every_game():
    for max_stones in (1, 2, 5, 9):
        bound = NIM.max_moves({"max_stones": max_stones})
        state = NIM.start(f"Nim: {max_stones} stones", None, RNG, {"max_stones": max_stones})
        for _seat in (0, 1):  # taking one stone at a time is the longest game
            s, moves = state, [0, 0]
            while (who := NIM.to_move(s)) is not None:
                moves[who] += 1
                s = NIM.play(s, who, 1)
            assert moves == [bound[0], bound[1]]


def test_nim_refuses_a_prompt_past_max_stones_or_without_stones_and_unknown_options():
    with pytest.raises(ValueError, match="max_stones is 9"):
        NIM.start("Nim: 12 stones", None, RNG, {})
    with pytest.raises(ValueError, match="gives no number of stones"):
        NIM.start("What is 1 + 1?", None, RNG, {})
    with pytest.raises(ValueError, match="'max_takes' is no option of nim"):
        NIM.start("Nim: 3 stones", None, RNG, {"max_takes": 2})
    with pytest.raises(ValueError, match="mrlx.game.options.max_take: got 0"):
        NIM.max_moves({"max_take": 0})


def test_judge_move_scores_the_end_of_the_game_and_illegal_moves():
    s = NIM.start("Nim: 3 stones", None, RNG, {})
    move, after, own, score = judge_move(NIM, s, 0, "\\boxed{3}", -1.0)
    assert (move, after.stones, own, score) == (3, 0, 0.0, 1.0)  # takes the last stone: the outcome, +1
    move, after, own, score = judge_move(NIM, s, 0, "\\boxed{1}", -1.0)
    assert (move, after.stones, own, score) == (1, 2, 0.0, 0.0)  # the game goes on: no reward yet
    assert judge_move(NIM, s, 0, "\\boxed{4}", -2.5) == (None, None, 0.0, -2.5)


# --- kuhn poker -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "history,cards,payoff",
    [
        (("check", "check"), ("K", "J"), [1.0, -1.0]),
        (("check", "check"), ("J", "Q"), [-1.0, 1.0]),
        (("bet", "call"), ("Q", "K"), [-2.0, 2.0]),
        (("bet", "fold"), ("J", "K"), [1.0, -1.0]),
        (("check", "bet", "call"), ("K", "Q"), [2.0, -2.0]),
        (("check", "bet", "fold"), ("K", "Q"), [-1.0, 1.0]),
    ],
)
def test_kuhn_payoffs_are_zero_sum_chips(history, cards, payoff):
    s = KuhnState(cards)
    for action in history:
        seat = KUHN.to_move(s)
        assert action in KUHN.legal_moves(s, seat)
        s = KUHN.play(s, seat, action)
    assert KUHN.to_move(s) is None
    assert KUHN.outcome(s) == payoff and sum(payoff) == 0


def test_kuhn_legal_moves_turns_and_hidden_cards():
    s = KUHN.start("Kuhn poker: Q vs K", None, RNG, {})
    assert s.cards == ("Q", "K") and KUHN.to_move(s) == 0
    assert KUHN.legal_moves(s, 0) == ["check", "bet"]
    assert KUHN.parse_move(s, 0, "I bet: \\boxed{Bet}") == "bet"
    assert KUHN.parse_move(s, 0, "\\boxed{call}") is None  # no bet to call
    first = KUHN.observation(s, 0)
    assert "Your card: Q" in first and "K" not in first.split("Your card")[1]
    s = KUHN.play(s, 0, "check")
    second = KUHN.observation(s, 1)
    assert "Your card: K" in second and "Q." not in second and "second player" in second
    s = KUHN.play(s, 1, "bet")
    assert KUHN.legal_moves(s, 0) == ["call", "fold"]
    assert KUHN.observation(s, 0) == "Call (1 chip) or fold? Answer \\boxed{call} or \\boxed{fold}."
    assert KUHN.describe_move(s, 1, "bet") == "Your opponent bets."
    assert KUHN.max_moves({}) == {0: 2, 1: 1}


def test_kuhn_deals_from_the_episodes_generator_without_a_deal_in_the_prompt():
    deals = {KUHN.start("Kuhn poker", None, random.Random(i), {}).cards for i in range(200)}
    assert deals == {(a, b) for a in "JQK" for b in "JQK" if a != b}
    assert KUHN.start("Kuhn poker", None, random.Random(7), {}) == KUHN.start(
        "Kuhn poker", None, random.Random(7), {}
    )
    with pytest.raises(ValueError, match="deals one card twice"):
        KUHN.start("Kuhn poker: K vs K", None, RNG, {})


def _expected_value(strategy_0, strategy_1) -> Fraction:
    """The first seat's exact expected chips, over the six deals and both strategies' probabilities."""
    total = Fraction(0)
    deals = list(itertools.permutations("JQK", 2))
    stack = [(KuhnState(deal), Fraction(1, len(deals))) for deal in deals]
    while stack:
        state, p = stack.pop()
        seat = KUHN.to_move(state)
        if seat is None:
            total += p * Fraction(KUHN.outcome(state)[0]).limit_denominator()
            continue
        strategy = (strategy_0, strategy_1)[seat](state.cards[seat], state.history)
        for action, q in strategy.items():
            if q:
                stack.append((KUHN.play(state, seat, action), p * Fraction(q).limit_denominator(1000)))
    return total


def test_the_kuhn_equilibrium_is_worth_minus_one_eighteenth_to_the_first_seat():
    assert _expected_value(kuhn_equilibrium, kuhn_equilibrium) == Fraction(-1, 18)
    # and no pure strategy of the first seat does better against it
    for opening in itertools.product(["check", "bet"], repeat=3):
        for answer in itertools.product(["call", "fold"], repeat=3):
            assert _expected_value(_pure(opening, answer), kuhn_equilibrium) <= Fraction(-1, 18)


def _pure(opening, answer):
    """A pure strategy of the first seat: its opening action and its answer to a bet, per card."""
    first, then = dict(zip("JQK", opening)), dict(zip("JQK", answer))
    return lambda card, history: {first[card]: 1.0} if history == () else {then[card]: 1.0}


def test_the_scripted_kuhn_players_move_legally():
    rng = random.Random(1)
    for _ in range(200):
        s = KUHN.start("Kuhn poker", None, rng, {})
        while (seat := KUHN.to_move(s)) is not None:
            move = KUHN.scripted_move(s, seat, rng.choice(["random", "optimal"]), rng)
            assert move in KUHN.legal_moves(s, seat)
            s = KUHN.play(s, seat, move)
        assert len(s.history) <= 3


# --- chain ----------------------------------------------------------------------------------


def test_chain_scores_each_step_and_a_wrong_value_ends_it():
    s = CHAIN.start("Chain: 2 +3 -1 *2", "8", RNG, {})
    assert CHAIN.observation(s, 0) == "Start at 2. Now +3."
    move, s1, own, score = judge_move(CHAIN, s, 0, "\\boxed{5}", -1.0)
    assert (move, own, score) == (5, 1.0, 1.0) and CHAIN.observation(s1, 0) == "Now -1."
    move, s2, own, score = judge_move(CHAIN, s1, 0, "\\boxed{4}", -1.0)
    assert (own, score) == (1.0, 1.0)
    move, end, own, score = judge_move(CHAIN, s2, 0, "\\boxed{8}", -1.0)
    assert (own, score) == (1.0, 2.0)  # the step's 1; its score adds the outcome 1: every step right
    assert CHAIN.to_move(end) is None and CHAIN.outcome(end) == [1.0]
    move, wrong, own, score = judge_move(CHAIN, s1, 0, "\\boxed{7}", -1.0)
    assert (move, own, score) == (7, 0.0, 0.0)  # legal, wrong: the episode ends with outcome 0
    assert CHAIN.to_move(wrong) is None and CHAIN.outcome(wrong) == [0.0]
    assert judge_move(CHAIN, s1, 0, "four", -1.0) == (None, None, 0.0, -1.0)  # no number: illegal
    assert CHAIN.parse_move(s1, 0, "\\boxed{-3}") == -3


def test_chain_bounds_and_scripts():
    with pytest.raises(ValueError, match="has 4 steps; mrlx.game.options.max_steps is 3"):
        CHAIN.start("Chain: 1 +1 +1 +1 +1", None, RNG, {})
    with pytest.raises(ValueError, match="is no chain"):
        CHAIN.start("Chain: +1 2", None, RNG, {})
    assert CHAIN.max_moves({"max_steps": 5}) == {0: 5}
    rng = random.Random(3)
    for prompt, label in chain_prompts(50, seed=1, ops="+-*"):
        end = play_out(CHAIN, CHAIN.start(prompt, label, rng, {}), ["optimal"], rng)
        assert CHAIN.outcome(end) == [1.0] and str(end.value) == label


# --- prompts --------------------------------------------------------------------------------


def test_the_game_prompts_are_reproducible_and_start_their_games():
    for name, game in BUILT_IN_GAMES.items():
        prompts = task_prompts(name, 30, seed=5)
        assert prompts == task_prompts(name, 30, seed=5)
        for prompt, label in prompts:
            game.start(prompt, label, RNG, {})
    for prompt, label in nim_prompts(100, seed=2):
        stones = int(prompt.split()[1])
        assert 3 <= stones <= 9 and label == str(stones % 4)
    for prompt, label in kuhn_prompts(30):
        s = KUHN.start(prompt, label, RNG, {})
        assert label == (
            "first" if KUHN.outcome(KUHN.play(KUHN.play(s, 0, "check"), 1, "check"))[0] > 0 else "second"
        )
    for _prompt, label in chain_prompts(30, ops="+-"):
        assert int(label) >= 0
