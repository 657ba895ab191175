"""`mrlx bench credit`'s probes: a policy read off an arm's engine position by position (kuhn
poker's information states and their exploitability, nim's winning positions), and the exact win
rates of scripted nim players for scale."""

from __future__ import annotations

import argparse
import functools
import json
import random
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from mrlx_lab.bench.credit.settings import MAX_NEW_TOKENS, NIM_HELD_OUT, NIM_TAKE, NIM_TRAIN, OPPONENTS
from mrlx_lab.bench.credit.tasks import conversation
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    from mrlx_plugin.core.tokenizer import AgentTokenizer
    from mrlx_plugin.systems.games import Game, KuhnState, NimState

S = TypeVar("S")  # a game's states
M = TypeVar("M")  # a game's moves


def render(tokenizer: AgentTokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The token ids the game system would send for `messages` (user turns and own answers,
    ending with a user turn): its transcript, built the same way, own answers as the end-of-turn
    terminated ids of their text."""
    from mrlx_plugin.core.transcript import Transcript

    t = Transcript.start("probe", tokenizer, messages[:1])
    for m in messages[1:]:
        if m["role"] == "assistant":
            ids = [*tokenizer.encode_text(m["content"]), tokenizer.eos_token_id]
            t.append_generated(t.turn_from(ids, [0.0] * len(ids), "stop", None))
        else:
            t.append_messages([m])
    return t.tokens


def sample_answers(url: str, prompts: list[list[int]], n: int, max_new: int, seed: int) -> list[list[str]]:
    """`n` answers (temperature 1, seeded) to each prompt, from the engine at `url`."""
    body = {
        "input_ids": [p for p in prompts for _ in range(n)],
        "sampling_params": [
            {"max_new_tokens": max_new, "temperature": 1.0, "sampling_seed": seed * 1_000_003 + i}
            for i in range(len(prompts) * n)
        ],
    }
    request = urllib.request.Request(
        url.rstrip("/") + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=900) as resp:
        answers = [a["text"] for a in json.loads(resp.read())]
    return [answers[i * n : (i + 1) * n] for i in range(len(prompts))]


def read_moves(game: Game[S, M], state: S, seat: int, answers: list[str]) -> dict[str, int]:
    """How often each legal move was answered, and `illegal` for the rest."""
    from mrlx_plugin.core.transcript import strip_reasoning

    counts: dict[str, int] = {str(m): 0 for m in game.legal_moves(state, seat)}
    counts["illegal"] = 0
    for text in answers:
        move = game.parse_move(state, seat, strip_reasoning(text))
        counts["illegal" if move is None else str(move)] += 1
    return counts


def kuhn_positions() -> list[tuple[str, int, KuhnState, list[dict[str, str]]]]:
    """(information state, seat, state, conversation) of each of kuhn poker's 12 information
    states: each card, the first seat to open and facing a bet after its check, the second seat
    after a check and after a bet (the other seat's card never shows: any will do)."""
    from mrlx_plugin.systems.games import BUILT_IN_GAMES, CARDS, KuhnState

    game, out = BUILT_IN_GAMES["kuhn_poker"], []
    for card in CARDS:
        other = next(c for c in CARDS if c != card)
        for seat, history in ((0, []), (1, ["check"]), (1, ["bet"]), (0, ["check", "bet"])):
            start = KuhnState((card, other) if seat == 0 else (other, card))
            messages, state = conversation(game, start, history, seat)
            out.append((game.information_state(state, seat), seat, state, messages))
    return out


def kuhn_probe(url: str, model: Path, ns: argparse.Namespace, seed: int) -> JSONObject:
    """The policy the engine plays at kuhn poker's 12 information states, and its exploitability."""
    from mrlx_plugin.core.tokenizer import load_tokenizer
    from mrlx_plugin.systems.games import BUILT_IN_GAMES
    from mrlx_plugin.systems.library_games import kuhn_exploitability

    game, tokenizer = BUILT_IN_GAMES["kuhn_poker"], load_tokenizer(str(model))
    positions = kuhn_positions()
    answers = sample_answers(
        url, [render(tokenizer, m) for *_, m in positions], ns.probe_samples, MAX_NEW_TOKENS["kuhn"], seed
    )
    policy, counts, illegal = {}, {}, 0
    for (key, seat, state, _), got in zip(positions, answers):
        c = counts[key] = read_moves(game, state, seat, got)
        illegal += c["illegal"]
        legal = {m: k for m, k in c.items() if m != "illegal"}
        total = sum(legal.values())
        policy[key] = {m: (k / total if total else 1 / len(legal)) for m, k in legal.items()}
    return {
        "exploitability": kuhn_exploitability(policy),
        "illegal": illegal / (len(positions) * ns.probe_samples),
        "policy": policy,
        "counts": counts,
    }


def kuhn_opening_of() -> dict[str, str | None]:
    """Each information state's key -> the key of the first seat's opening with the same card when
    it is the first seat facing a bet after its own check (its reach then runs through its check
    there), else None (the opening, and the second seat: no own move on the way)."""
    positions = kuhn_positions()
    opening = {(seat, state.cards[seat]): key for key, seat, state, _ in positions if not state.history}
    return {
        key: opening[(0, state.cards[0])] if seat == 0 and state.history else None
        for key, seat, state, _ in positions
    }


def kuhn_average(policies: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The average policy of `policies` (snapshots weighted alike): at each information state,
    each snapshot's move shares weighted by its own seat's reach of that state (the product of
    its own move probabilities on the way: 1 but for the first seat facing a bet after its check,
    reached through its check), so that it plays as a uniformly drawn snapshot would."""
    out: dict[str, dict[str, float]] = {}
    for key, opening in kuhn_opening_of().items():
        reach = [1.0 if opening is None else pol[opening]["check"] for pol in policies]
        total = sum(reach)
        weights = reach if total > 0 else [1.0] * len(policies)  # never reached: any average will do
        norm = sum(weights)
        out[key] = {
            m: sum(w * pol[key][m] for w, pol in zip(weights, policies)) / norm for m in policies[0][key]
        }
    return out


def winning_decisions(game: Game[NimState, int], state: NimState) -> list[tuple[int, list[int]]]:
    """(seat, moves so far) of every position of a nim game from `state`, any moves made, where
    the seat to move can win (a pile that is no multiple of max_take + 1)."""
    seat = game.to_move(state)
    if seat is None:
        return []
    found = [(seat, [])] if state.stones % (NIM_TAKE + 1) else []
    for m in game.legal_moves(state, seat):
        found += [(s, [m, *rest]) for s, rest in winning_decisions(game, game.play(state, seat, m))]
    return found


def nim_positions(ns: argparse.Namespace, seed: int) -> list[tuple[int, int, NimState, list[dict[str, str]]]]:
    """(starting pile, seat, state, conversation): --probe-positions winning positions per
    starting pile, drawn from all of them."""
    from mrlx_plugin.systems.games import BUILT_IN_GAMES, NimState

    game, rng, out = BUILT_IN_GAMES["nim"], random.Random(seed), []
    for pile in (*NIM_TRAIN, *NIM_HELD_OUT):
        found = winning_decisions(game, NimState(pile, NIM_TAKE))
        for seat, moves in rng.sample(found, min(ns.probe_positions, len(found))):
            messages, state = conversation(game, NimState(pile, NIM_TAKE), moves, seat)
            out.append((pile, seat, state, messages))
    return out


def nim_probe(url: str, model: Path, ns: argparse.Namespace, seed: int) -> JSONObject:
    """The share of optimal answers from winning positions (the pile left a multiple of
    max_take + 1), from the trained and the held-out starting piles apart; and of illegal ones."""
    from mrlx_plugin.core.tokenizer import load_tokenizer
    from mrlx_plugin.systems.games import BUILT_IN_GAMES

    game, tokenizer = BUILT_IN_GAMES["nim"], load_tokenizer(str(model))
    positions = nim_positions(ns, seed)
    answers = sample_answers(
        url, [render(tokenizer, m) for *_, m in positions], ns.probe_samples, MAX_NEW_TOKENS["nim"], seed
    )
    tally = {k: [0, 0, 0] for k in ("trained", "held_out")}  # optimal, illegal, answers
    for (pile, seat, state, _), got in zip(positions, answers):
        c = read_moves(game, state, seat, got)
        t = tally["trained" if pile in NIM_TRAIN else "held_out"]
        t[0] += c[str(state.stones % (NIM_TAKE + 1))]
        t[1] += c["illegal"]
        t[2] += len(got)
    out: JSONObject = {
        "positions": len(positions),
        "illegal": sum(t[1] for t in tally.values()) / sum(t[2] for t in tally.values()),
    }
    for k, (best, bad, n) in tally.items():
        out[f"optimal_{k}"], out[f"illegal_{k}"] = best / n, bad / n
    return out


def nim_reference() -> dict[str, float]:
    """Exact win rates of `script:optimal` and of a uniformly random legal player against each
    scripted opponent, over the evaluation's starting piles and both seat orders: the scale the
    model's win rates are read on."""

    def policy(name: str, stones: int) -> dict[int, float]:
        legal = range(1, min(NIM_TAKE, stones) + 1)
        if name == "optimal" and stones % (NIM_TAKE + 1):
            return {stones % (NIM_TAKE + 1): 1.0}
        return {m: 1 / len(legal) for m in legal}

    def win(me: str, opponent: str, pile: int, seat: int) -> float:
        @functools.cache
        def value(stones: int, mine: bool) -> float:  # P(I win), `mine`: I am to move
            if stones == 0:
                return 0.0 if mine else 1.0  # who took the last stone won
            moves = policy(me if mine else opponent, stones)
            return sum(q * value(stones - m, not mine) for m, q in moves.items())

        return value(pile, seat == 0)

    out = {}
    for me in ("optimal", "random"):
        for opp in OPPONENTS:
            for name, piles in (("trained", NIM_TRAIN), ("held_out", NIM_HELD_OUT)):
                rates = [win(me, opp, p, s) for p in piles for s in (0, 1)]
                out[f"{me}_vs_{opp}_{name}"] = sum(rates) / len(rates)
    return out
