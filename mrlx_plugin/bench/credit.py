"""`mrlx bench credit`: episode credit, per-turn credit and tree sampling on a multi-turn task, and
two games learnt by self-play, on the CPU with small models built here, over several seeds.

Every seed builds its own model and draws its own prompts, warm-start data and sampling. Every arm
of a seed starts from its one format-only warm-start (random answers, random legal moves, never
the right answer; every part's data together), is given its part's reward, and trains until it
has spent its part's engine calls: the embedded trainer's `--engine-call-budget` stops it after
the step that reaches the budget (an arm spends at most one step's calls more; the calls
actually spent are reported).

1. `chain` (a start value, then 3 steps of + or - 1 or 2; each turn the model gives the running
   value as \\boxed{N}; a right value earns 1 and goes on, a wrong one ends the episode; the
   outcome is 1 when every step was right). Arms: `episode` (one sample per episode, trained on
   the outcome plus its steps' rewards: the reward the turn arms share out), `turn` (a sample per
   turn, discount --gamma), `tree` (K candidates per turn, each scored by playing the chain on
   from it, the episode going on from the best, every candidate trained on its score),
   `tree-random` (the same, going on from a candidate drawn uniformly: the policy's own
   continuation with the same sibling-group credit, so `tree` against it separates best-of-K
   continuation from the credit) and `tree-old` (the estimator before: going on from the best,
   the taken candidate trained on its realised return, the others on what they settle at once).
   Evaluated on held-out chains, none seen in training and none whose start value and first step
   open any training chain: success (every step right) and steps right.
2. `nim` (one pile, take 1 to 3, who takes the last stone wins): self-play with per-turn credit
   (`nim`), and with tree sampling too (`nim-tree`). Trained on starting piles 3, 4, 6, 8 and 9;
   evaluated against `script:random` and `script:optimal` in both seat orders, on those piles and
   on the held-out starting piles 5 and 7 apart; and probed: the share of optimal moves from
   winning positions.
3. `kuhn` (Kuhn poker): self-play with per-turn credit; the learned policy is probed at its 12
   information states and scored by its exploitability (OpenSpiel; uniform play: 0.458).

A probe asks the arm's engine for N answers (temperature 1) to each position, rendered as the game
system renders it for that seat (its observations, its own earlier moves, the other seat's moves
told through `describe_move`). An answer that makes no legal move is counted as illegal; the
policy is the legal answers' shares, renormalised over the legal moves (uniform where no answer
was legal).

Units (a seed's warm-start, then each part of it) run --jobs at a time, each a process of its own
with one thread per engine and trainer; a part runs its arms one after another, each arm one
embedded engine and one embedded trainer (`python -m mrlx_plugin.local.trainer`, calling the
plugin's rollout functions as slime does).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from mrlx_plugin.bench.report import interval, write_report
from mrlx_plugin.local.trainer import read_rows

AGENT = "player"
PARTS = ("chain", "nim", "kuhn")
ARMS = {  # arm -> its part, in the order of the tables
    "episode": "chain",
    "turn": "chain",
    "tree": "chain",
    "tree-random": "chain",
    "tree-old": "chain",
    "nim": "nim",
    "nim-tree": "nim",
    "kuhn": "kuhn",
}
SEATS = ("first", "second")
OPPONENTS = ("random", "optimal")
NIM_TRAIN, NIM_HELD_OUT = (3, 4, 6, 8, 9), (5, 7)
NIM_TAKE = 3
# Settings that are not options: the demo's (docs/local.md), with a constant learning rate after
# the warm-up: arms stop at different steps when their budget is spent, and a decaying schedule
# would treat them differently.
TRAINER = {
    "lr_warmup_steps": 5,
    "lr_decay_style": "constant",
    "kl_coef": 0.1,
    "adam_eps": 1.0e-5,
    "warmup_sft_lr": 1.0e-3,
    "micro_batch_size": 64,
}
GAME_STEP = {False: (4, 4), True: (2, 4)}  # the games' (prompts, episodes per prompt) per step; --quick
MAX_NEW_TOKENS = {"chain": 10, "nim": 10, "kuhn": 16}  # per turn: "\\boxed{check}" and the end
# An illegal move must cost more than the worst legal result (nim: a loss, -1; kuhn: a called
# bet lost, -2), or a seat that has lost anyway loses nothing by it, and self-play learns to answer
# anything there (kuhn facing a bet with a weak card: folding costs 1 chip, so would the default -1).
ILLEGAL_PENALTY = {"nim": -2.0, "kuhn": -3.0}
WARMUP_EXAMPLES = 1000  # warm-start conversations per part
MAX_RESPONSE = 256  # per transcript: every turn of a seat and the messages between them


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrlx bench credit", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default="runs/bench-credit", help="the folder: credit.json, credit.png and every run"
    )
    p.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 (at least 2 for intervals)")
    p.add_argument("--only", choices=PARTS, default=None, help="run one part")
    p.add_argument("--arms", default=None, help=f"comma-separated arms (default: all: {', '.join(ARMS)})")
    p.add_argument(
        "--jobs", type=int, default=2, help="units (one part of one seed) run at once; one thread each"
    )
    p.add_argument(
        "--budget", type=int, default=None, help="engine calls of each chain arm (default 6000; --quick 24)"
    )
    p.add_argument(
        "--nim-budget", type=int, default=None, help="engine calls of each nim arm (default 8000; --quick 40)"
    )
    p.add_argument(
        "--kuhn-budget",
        type=int,
        default=None,
        help="engine calls of the kuhn arm (default 5000; --quick 32)",
    )
    p.add_argument(
        "--prompts-per-step", type=int, default=None, help="--rollout-batch-size (default 8; --quick 2)"
    )
    p.add_argument(
        "--samples-per-prompt",
        type=int,
        default=None,
        help="--n-samples-per-prompt (default 8; --quick 4); the tree-sampling arms run this / --branch",
    )
    p.add_argument(
        "--branch", type=int, default=None, help="candidates per turn of the tree arms (default 4)"
    )
    p.add_argument("--gamma", type=float, default=0.9, help="rewards.gamma of the chain's per-turn arms")
    p.add_argument("--chain-length", type=int, default=3, help="steps of each chain (turns per episode)")
    p.add_argument("--chain-max-start", type=int, default=5, help="chains start at 0 to this")
    p.add_argument("--chain-max-step", type=int, default=2, help="each step adds (or takes) 1 to this")
    p.add_argument("--chain-ops", default="+-", help="the operations of the steps, from + - *")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out chains (default 100; --quick 4)")
    p.add_argument(
        "--eval-samples",
        type=int,
        default=None,
        help="evaluation episodes per held-out prompt (default 2 per chain, 8 per nim pile and seat "
        "order; --quick 1)",
    )
    p.add_argument(
        "--eval-interval", type=int, default=None, help="evaluate every N steps (default 10; --quick 1)"
    )
    p.add_argument(
        "--probe-samples", type=int, default=None, help="answers per probed position (default 32; --quick 2)"
    )
    p.add_argument(
        "--probe-positions",
        type=int,
        default=None,
        help="nim positions probed per starting pile (default 5; --quick 1)",
    )
    p.add_argument(
        "--preset", default=None, help="model size (mrlx_plugin.local.model presets; default tiny)"
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="format-only supervised steps, every part's together (default 800; --quick 2)",
    )
    p.add_argument("--ppo-epochs", type=int, default=2, help="mrlx.trainer.ppo_epochs")
    p.add_argument("--quick", action="store_true", help="tiny settings (the test's smoke run)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--table",
        metavar="FILE.json",
        default=None,
        help="print the docs' tables from a saved report, and stop",
    )
    p.add_argument("--unit", default=None, help=argparse.SUPPRESS)  # SEED:PART, run for the parent
    p.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    return p


def settle(ns: argparse.Namespace) -> argparse.Namespace:
    """Fill in the defaults that depend on --quick, and check the options."""
    from mrlx_plugin.core.config import ConfigError

    defaults = {
        "budget": (6000, 24),
        "nim_budget": (8000, 40),
        "kuhn_budget": (5000, 32),
        "prompts_per_step": (8, 2),
        "samples_per_prompt": (8, 4),
        "branch": (4, 2),
        "eval_prompts": (100, 4),
        "eval_interval": (10, 2),
        "probe_samples": (32, 2),
        "probe_positions": (5, 1),
        "preset": ("tiny", "tiny"),
        "warmup_steps": (800, 2),
    }
    for key, (full, quick) in defaults.items():
        if getattr(ns, key) is None:
            setattr(ns, key, quick if ns.quick else full)
    for key in (*defaults, "seeds", "jobs", "chain_length", "chain_max_step"):
        least = 0 if key == "warmup_steps" else 1
        if key != "preset" and getattr(ns, key) < least:
            raise ConfigError(f"--{key.replace('_', '-')}: got {getattr(ns, key)}; expected at least {least}")
    if ns.eval_samples is not None and ns.eval_samples < 1:
        raise ConfigError(f"--eval-samples: got {ns.eval_samples}; expected at least 1")
    if ns.branch < 2:
        raise ConfigError(f"--branch: got {ns.branch}; the tree arms need at least 2 candidates per turn")
    bad = set(ns.chain_ops) - set("+-*")
    if bad or not ns.chain_ops:
        raise ConfigError(f"--chain-ops: got {ns.chain_ops!r}; expected some of + - *")
    ns.arms = [a.strip() for a in ns.arms.split(",") if a.strip()] if ns.arms else list(ARMS)
    for arm in ns.arms:
        if arm not in ARMS:
            raise ConfigError(f"--arms: no arm {arm!r}; the arms are {', '.join(ARMS)}")
    chosen = [a for a in ARMS if a in ns.arms and ns.only in (None, ARMS[a])]
    if not chosen and not ns.table:
        raise ConfigError(f"--arms {','.join(ns.arms)} and --only {ns.only}: no arm is left to run")
    if ns.samples_per_prompt % ns.branch and {"tree", "tree-random", "tree-old"} & set(chosen):
        raise ConfigError(
            f"--samples-per-prompt {ns.samples_per_prompt}: the tree arms run {ns.branch} times fewer "
            f"episodes per prompt (each turn costs {ns.branch} calls); make it a multiple of --branch"
        )
    if GAME_STEP[ns.quick][1] % ns.branch and "nim-tree" in chosen:
        raise ConfigError(
            f"--branch {ns.branch}: nim-tree runs {GAME_STEP[ns.quick][1]} episodes per prompt without tree "
            "sampling and that / --branch with it; use a --branch that divides it, or leave out nim-tree"
        )
    ns.arms = chosen
    return ns


def arm_settings(arm: str, ns: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arm's `mrlx.rewards` and its `mrlx.game` additions."""
    tree = {"credit": "turn", "gamma": ns.gamma if ARMS[arm] == "chain" else 1.0, "branch": ns.branch}
    return {
        "episode": ({"credit": "episode"}, {}),
        "turn": ({"credit": "turn", "gamma": ns.gamma}, {}),
        "tree": ({**tree, "branch_pick": "best", "branch_target": "score"}, {"branch_score": "rollout"}),
        "tree-random": (
            {**tree, "branch_pick": "random", "branch_target": "score"},
            {"branch_score": "rollout"},
        ),
        "tree-old": (
            {**tree, "branch_pick": "best", "branch_target": "taken_return"},
            {"branch_score": "settle"},
        ),
        # A zero-sum game's outcome is its only reward: undiscounted, every move shares it.
        "nim": ({"credit": "turn", "gamma": 1.0}, {}),
        "nim-tree": ({**tree, "branch_pick": "best", "branch_target": "score"}, {"branch_score": "rollout"}),
        "kuhn": ({"credit": "turn", "gamma": 1.0}, {}),
    }[arm]


# ----------------------------------------------------------------------------------------------
# The tasks: prompts, held-out sets, rendering and format-only warm-start data
# ----------------------------------------------------------------------------------------------


def chain_space(ns: argparse.Namespace) -> dict[str, str]:
    """Every chain of the task (prompt -> final value), as `chain_prompts` writes them: a step
    never takes more than the running value."""
    from mrlx_plugin.systems.games import apply_step

    out: dict[str, str] = {}

    def walk(value: int, ops: list[str]) -> None:
        if len(ops) == ns.chain_length:
            out["Chain: " + " ".join([str(start), *ops])] = str(value)
            return
        for sign in ns.chain_ops:
            for k in range(1, ns.chain_max_step + 1):
                if sign != "-" or k <= value:
                    walk(apply_step(value, f"{sign}{k}"), [*ops, f"{sign}{k}"])

    for start in range(ns.chain_max_start + 1):
        walk(start, [])
    return out


def first_step(prompt: str) -> tuple[int, str]:
    """A chain's first context: its start value and first operation."""
    value, op = prompt.split(":")[1].split()[:2]
    return int(value), op


def later_steps(prompt: str) -> set[tuple[int, str]]:
    """(running value, operation) of each step after the first."""
    from mrlx_plugin.systems.games import apply_step

    value, *ops = prompt.split(":")[1].split()
    v, out = apply_step(int(value), ops[0]), set()
    for op in ops[1:]:
        out.add((v, op))
        v = apply_step(v, op)
    return out


def chain_sets(ns: argparse.Namespace, seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Training chains and `--eval-prompts` held-out chains. Whole first contexts (start value and
    first operation) are held out: no held-out chain is trained on, and none opens as a training
    chain does. A first context is held out only while it stays a later step of some training
    chain (that value, that operation): the held-out chains ask for no sum the training never
    does, only in a context it never opens with."""
    space = chain_space(ns)
    firsts = sorted({first_step(p) for p in space})
    random.Random(seed).shuffle(firsts)
    held: list[tuple[int, str]] = []
    for candidate in firsts:
        if sum(first_step(p) in held for p in space) >= ns.eval_prompts:
            break
        trial = [*held, candidate]
        taught = set().union(*(later_steps(p) for p in space if first_step(p) not in trial))
        if all(f in taught for f in trial):
            held = trial
    out = sorted(p for p in space if first_step(p) in held)
    if len(out) < ns.eval_prompts:
        raise RuntimeError(
            f"the chains ({len(space)} of them) give {len(out)} held-out chains whose first steps are "
            f"still taught; --eval-prompts is {ns.eval_prompts}: allow more chains (--chain-length, "
            "--chain-max-start, --chain-max-step, --chain-ops)"
        )
    chosen = sorted(random.Random(seed + 1).sample(out, ns.eval_prompts))
    train = sorted(p for p in space if first_step(p) not in held)
    return [(p, space[p]) for p in train], [(p, space[p]) for p in chosen]


def conversation(game: Any, state: Any, moves: list[Any], seat: int) -> tuple[list[dict[str, str]], Any]:
    """`seat`'s conversation after `moves` (every seat's, in order) from `state`, as the game
    system renders it: the other seats' moves told (`describe_move`) before its observation, in
    one user message per own turn, its own moves as \\boxed{move}; and the state reached, with
    `seat` to move."""
    messages: list[dict[str, str]] = []
    unread: list[str] = []
    for move in moves:
        mover = game.to_move(state)
        if mover == seat:
            messages += [
                {"role": "user", "content": " ".join([*unread, game.observation(state, seat)])},
                {"role": "assistant", "content": f"\\boxed{{{move}}}"},
            ]
            unread = []
        else:
            unread.append(game.describe_move(state, mover, move))
        state = game.play(state, mover, move)
    messages.append({"role": "user", "content": " ".join([*unread, game.observation(state, seat)])})
    return messages, state


def warmup_data(path: Path, part: str, prompts: list[tuple[str, str]], n: int, seed: int) -> Path:
    """Format-only warm-start conversations of `part`'s game, as its transcripts render them, the
    turn to learn answered with a RANDOM move: a random number for the chain (its earlier turns
    answered right: a chain only goes on after a right value), a random legal move for a game (its
    earlier moves, every seat's, random legal ones too). The format, never the right answer."""
    from mrlx_plugin.systems.games import BUILT_IN_GAMES

    game, rng = BUILT_IN_GAMES[GAME_OF[part]], random.Random(seed)
    options = game_options(part, prompts)
    top = max((int(label) for _, label in prompts), default=0) if part == "chain" else 0
    with path.open("w") as f:
        for _ in range(n):
            prompt, label = rng.choice(prompts)
            start = game.start(prompt, label, rng, options)
            seat = rng.randrange(len(game.seats))
            moves, decisions, state = [], [], start
            while (mover := game.to_move(state)) is not None:
                if mover == seat:
                    decisions.append(len(moves))
                if part == "chain":
                    move = game.right_value(state)
                else:
                    move = rng.choice(game.legal_moves(state, mover))
                moves.append(move)
                state = game.play(state, mover, move)
            if not decisions:
                continue
            cut = rng.choice(decisions)
            messages, _ = conversation(game, start, moves[:cut], seat)
            answer = rng.randint(0, top) if part == "chain" else moves[cut]
            messages.append({"role": "assistant", "content": f"\\boxed{{{answer}}}"})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


GAME_OF = {"chain": "chain", "nim": "nim", "kuhn": "kuhn_poker"}


def game_options(part: str, prompts: list[tuple[str, str]]) -> dict[str, Any]:
    if part == "chain":
        return {"max_steps": max(len(p.split()) - 2 for p, _ in prompts)}
    if part == "nim":
        return {"max_take": NIM_TAKE, "max_stones": max((*NIM_TRAIN, *NIM_HELD_OUT))}
    return {}


def write_prompts(path: Path, prompts: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "label": lab}) + "\n" for p, lab in prompts))
    return path


def nim_prompt(stones: int) -> tuple[str, str]:
    return f"Nim: {stones} stones", str(stones % (NIM_TAKE + 1))


# ----------------------------------------------------------------------------------------------
# Probes: a policy read off the engine, position by position
# ----------------------------------------------------------------------------------------------


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
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


def read_moves(game: Any, state: Any, seat: int, answers: list[str]) -> dict[str, int]:
    """How often each legal move was answered, and `illegal` for the rest."""
    from mrlx_plugin.core.transcript import strip_reasoning

    counts: dict[str, int] = {str(m): 0 for m in game.legal_moves(state, seat)}
    counts["illegal"] = 0
    for text in answers:
        move = game.parse_move(state, seat, strip_reasoning(text))
        counts["illegal" if move is None else str(move)] += 1
    return counts


def kuhn_positions() -> list[tuple[str, int, Any, list[dict[str, str]]]]:
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


def kuhn_probe(url: str, model: Path, ns: argparse.Namespace, seed: int) -> dict[str, Any]:
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


def winning_decisions(game: Any, state: Any) -> list[tuple[int, list[int]]]:
    """(seat, moves so far) of every position of a nim game from `state`, any moves made, where
    the seat to move can win (a pile that is no multiple of max_take + 1)."""
    seat = game.to_move(state)
    if seat is None:
        return []
    found = [(seat, [])] if state.stones % (NIM_TAKE + 1) else []
    for m in game.legal_moves(state, seat):
        found += [(s, [m, *rest]) for s, rest in winning_decisions(game, game.play(state, seat, m))]
    return found


def nim_positions(ns: argparse.Namespace, seed: int) -> list[tuple[int, int, Any, list[dict[str, str]]]]:
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


def nim_probe(url: str, model: Path, ns: argparse.Namespace, seed: int) -> dict[str, Any]:
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
    out: dict[str, Any] = {
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


# ----------------------------------------------------------------------------------------------
# One arm: its engine, its config, its trainer
# ----------------------------------------------------------------------------------------------


def job_config(
    path: Path,
    run_id: str,
    model: Path,
    game: dict[str, Any],
    rewards: dict[str, Any],
    ns: argparse.Namespace,
    seed: int,
    part: str,
) -> Path:
    doc = {
        "mrlx": {
            "run_id": run_id,
            "system": "game",
            "agents": {
                AGENT: {
                    "url": "self",
                    "tokenizer": str(model),
                    "sampling": {"max_new_tokens": MAX_NEW_TOKENS[part], "temperature": 1.0},
                }
            },
            "game": game,
            "rewards": rewards,
            "engine": {"request_timeout_s": 300, "sampling_seed": seed},
            "trainer": {
                **TRAINER,
                "threads": ns.threads,
                "lr": ns.lr,
                "lr_min": ns.lr,
                "warmup_sft_steps": ns.warmup_steps,
                "ppo_epochs": ns.ppo_epochs,
            },
        }
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_trainer(
    argv: list[str], log_path: Path, out: Path, label: str, ns: argparse.Namespace, show: Any = None
) -> list[dict[str, Any]]:
    """Run one embedded trainer to its end, printing a line per evaluation; its metrics rows."""
    from mrlx_plugin.core import processes

    job = None
    try:
        with open(log_path, "ab") as log:
            job = processes.start(
                [sys.executable, "-m", "mrlx_plugin.local.trainer", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        shown, t0 = 0, time.monotonic()
        while True:
            done = job.poll() is not None
            rows = read_rows(out / "metrics.jsonl")
            if show is not None and not ns.quiet:
                for row in rows[shown:]:
                    line = show(row)
                    if line:
                        print(f"  {label:<22} {line}  ({time.monotonic() - t0:.0f} s)", flush=True)
                shown = len(rows)
            if done:
                break
            time.sleep(1.0)
    finally:
        if job is not None:
            processes.stop(job, timeout=20)
    if job.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the trainer of {label} failed (exit {job.returncode}); {log_path}:\n{tail}")
    return read_rows(out / "metrics.jsonl")


def train_prompts(part: str, ns: argparse.Namespace, seed: int) -> list[tuple[str, str]]:
    """The prompts `part`'s arms train on, for `seed`."""
    from mrlx_plugin.local.tasks import kuhn_prompts

    if part == "chain":
        return chain_sets(ns, seed)[0]
    if part == "nim":  # the trained starting piles only
        rng = random.Random(seed)
        return [nim_prompt(rng.choice(NIM_TRAIN)) for _ in range(256)]
    return kuhn_prompts(256, seed=seed)


def warm_unit(ns: argparse.Namespace, work: Path, base: Path) -> dict[str, Any]:
    """The seed's format-only warm-start, once for every part it runs: supervised steps on the
    parts' warm-start conversations, mixed (WARMUP_EXAMPLES of each). Every arm starts from it."""
    import shutil

    seed = ns.unit_seed
    parts = [p for p in PARTS if any(ARMS[a] == p for a in ns.arms)]
    lines: list[str] = []
    for part in parts:
        prompts = train_prompts(part, ns, seed)
        data = warmup_data(work / f"warmup-{part}.jsonl", part, prompts, WARMUP_EXAMPLES, seed)
        lines += data.read_text().splitlines()
    random.Random(seed).shuffle(lines)
    data = work / "warmup.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    game = {"name": "nim", "seats": [AGENT, AGENT]}  # any: the warm-start plays no game
    config = job_config(work / "warm.yaml", f"bench-credit-warm-{seed}", base, game, {}, ns, seed, "nim")
    out = work / "warm_start"
    shutil.rmtree(out, ignore_errors=True)  # a measurement starts from scratch
    out.mkdir(parents=True)
    argv = [
        *("--config", str(config), "--model", str(base), "--router-url", "http://127.0.0.1:9"),
        *("--num-rollout", "0", "--warmup-data", str(data), "--out", str(out), "--seed", str(seed)),
    ]
    if not ns.quiet:
        what = f"{ns.warmup_steps} format-only steps ({', '.join(parts)})"
        print(f"  seed {seed} {'warm-start':<17} {what}", flush=True)
    started = time.monotonic()
    rows = run_trainer(argv, work / "logs" / "trainer-warm-start.log", out, f"seed {seed} warm-start", ns)
    model = out / "warm_start" if (out / "warm_start" / "config.json").exists() else base  # --warmup-steps 0
    loss = next((r for r in rows if "warm_start/steps" in r), {})
    return {
        "model": str(model),
        "parts": parts,
        "examples": len(lines),
        "steps": loss.get("warm_start/steps", 0),
        "loss_first": loss.get("warm_start/loss_first"),
        "loss_last": loss.get("warm_start/loss_last"),
        "wall_time_s": time.monotonic() - started,
    }


def warm_model(ns: argparse.Namespace) -> Path:
    """The seed's warm-started model (its `warm` unit ran first)."""
    done = Path(ns.out) / f"seed_{ns.unit_seed}" / "warm" / "result.json"
    return Path(json.loads(done.read_text())["model"])


def run_arm(
    arm: str,
    work: Path,
    model: Path,
    config: Path,
    *,
    prompts: Path,
    eval_args: list[str],
    budget: int,
    episodes_per_step: tuple[int, int],
    ns: argparse.Namespace,
    show: Any,
    probe: Any = None,
) -> dict[str, Any]:
    """One arm from `model`: its engine and its trainer, until `budget` engine calls are spent;
    the probe (if any) of the engine before and after training. Its metrics rows and more."""
    import shutil

    from mrlx_plugin.core.processes import stop_all
    from mrlx_plugin.local.processes import start_engine

    shutil.rmtree(work, ignore_errors=True)  # a measurement starts from scratch
    logs = work / "logs"
    logs.mkdir(parents=True)
    seed, (per_step, per_prompt) = ns.unit_seed, episodes_per_step
    started = time.monotonic()
    out: dict[str, Any] = {}
    with ExitStack() as stack:
        engine = start_engine(
            model,
            log_dir=logs,
            name="engine",
            threads=ns.threads,
            extra=["--seed", str(seed), "--max-batch", "256"],
        )
        stack.callback(lambda: stop_all([engine.proc], timeout=10))
        if probe is not None:
            out["probe_before"] = probe(engine.url, model, ns, seed)
        # Every episode costs at least one call: the most steps the budget can take (a cap; the
        # trainer stops when the budget is spent).
        most_steps = math.ceil(budget / per_step) + 1
        argv = [
            "--config",
            str(config),
            "--model",
            str(model),
            "--engine-url",
            engine.url,
            "--router-url",
            engine.url,
            "--num-rollout",
            str(most_steps),
            "--engine-call-budget",
            str(budget),
            "--prompt-data",
            str(prompts),
            "--rollout-batch-size",
            str(per_step // per_prompt),
            "--n-samples-per-prompt",
            str(per_prompt),
            "--rollout-max-response-len",
            str(MAX_RESPONSE),
            "--out",
            str(work / "trainer"),
            "--seed",
            str(seed),
            *eval_args,
        ]
        rows = run_trainer(argv, logs / "trainer.log", work / "trainer", f"seed {seed} {arm}", ns, show)
        if probe is not None:
            out["probe_after"] = probe(engine.url, model, ns, seed)
    out["wall_time_s"] = time.monotonic() - started
    return out | {"rows": rows}


def arm_record(
    arm: str, run: dict[str, Any], value: Any, ns: argparse.Namespace, **extra: Any
) -> dict[str, Any]:
    """What one arm of one seed reports: calls, counts, the evaluation curve (`value(row)` per
    evaluation row), probes, times."""
    rows = run.pop("rows")
    steps = [r for r in rows if r.get("step", -1) >= 0]
    curve, calls = [], 0.0
    for row in rows:
        if row.get("step", -1) >= 0:
            calls += row.get("engine_calls") or 0.0
        if any(k.startswith("eval/") and k.endswith("/episodes") for k in row):
            curve.append({"after_steps": row["step"] + 1, "engine_calls": calls, **value(row)})
    rewards, game = arm_settings(arm, ns)
    return {
        "arm": arm,
        "seed": ns.unit_seed,
        "rewards": rewards,
        "game": game,
        "steps": len(steps),
        "engine_calls": sum(r.get("engine_calls") or 0.0 for r in steps),
        "engine_calls_per_step": [r.get("engine_calls") for r in steps],
        "episodes": sum(r.get("multi_agent/episodes") or 0 for r in steps),
        "samples_all": sum(r.get("samples", 0) for r in steps),
        "samples_trained": sum(r.get("samples_trained", 0) for r in steps),
        "tokens_trained": sum(r.get("tokens_trained", 0) for r in steps),
        "branch_candidates_per_episode": [r.get("credit/branch_candidates") for r in steps],
        "curve": curve,
        "before": curve[0] if curve and curve[0]["after_steps"] == 0 else None,
        "after": curve[-1] if curve else None,
        "rollout_s": sum(r.get("rollout_s", 0.0) for r in steps),
        "train_s": sum(r.get("train_s", 0.0) for r in steps),
        "eval_s": sum(
            v for r in rows for k, v in r.items() if k.startswith("eval/") and k.endswith("/seconds")
        ),
        **extra,
        **run,
    }


# ----------------------------------------------------------------------------------------------
# The parts of one seed
# ----------------------------------------------------------------------------------------------


def sizes(arm: str, ns: argparse.Namespace) -> tuple[int, int]:
    """(episodes per step, episodes per prompt): the options' for the chain, GAME_STEP for the
    games (a game's episode is many calls: fewer episodes, more steps). A tree arm spends `branch`
    calls on a turn, so it runs `branch` times fewer episodes per prompt, for about the calls per
    step of the others."""
    prompts, per_prompt = (
        (ns.prompts_per_step, ns.samples_per_prompt) if ARMS[arm] == "chain" else GAME_STEP[ns.quick]
    )
    if arm_settings(arm, ns)[0].get("branch", 1) > 1:
        per_prompt //= ns.branch
    return prompts * per_prompt, per_prompt


def run_arms(
    part: str,
    ns: argparse.Namespace,
    work: Path,
    run_id: str,
    warm: Path,
    game: dict[str, Any],
    prompts: Path,
    eval_args: list[str],
    *,
    budget: int,
    show: Any,
    value: Any,
    probe: Any = None,
    done: Any = None,
) -> dict[str, Any]:
    """Every arm of `part`, one after another from the seed's warm-started model: its config (the
    part's game with the arm's settings), its run until `budget` engine calls, its record.
    `done(arm, run)` is told of each finished run."""
    arms = {}
    for arm in (a for a in ns.arms if ARMS[a] == part):
        rewards, extra = arm_settings(arm, ns)
        config = job_config(
            work / f"{arm}.yaml", run_id, warm, {**game, **extra}, rewards, ns, ns.unit_seed, part
        )
        per_step = sizes(arm, ns)
        run = run_arm(
            arm,
            work / arm,
            warm,
            config,
            prompts=prompts,
            eval_args=eval_args,
            budget=budget,
            episodes_per_step=per_step,
            ns=ns,
            show=show,
            probe=probe,
        )
        if done is not None:
            done(arm, run)
        arms[arm] = arm_record(arm, run, value, ns, budget=budget, episodes_per_step=per_step[0])
    return arms


def chain_unit(ns: argparse.Namespace, work: Path, base: Path) -> dict[str, Any]:
    seed = ns.unit_seed
    train, held = chain_sets(ns, seed)
    prompts = write_prompts(work / "prompts.jsonl", train)
    held_out = write_prompts(work / "heldout.jsonl", held)
    # Beside the held-out chains, as many training chains: what was learnt where it was taught,
    # when the held-out chains (new first contexts) show little.
    seen = write_prompts(
        work / "trained-eval.jsonl", random.Random(seed).sample(train, min(len(train), len(held)))
    )
    game = {
        "name": "chain",
        "seats": [AGENT],
        "max_turns": ns.chain_length,
        "options": game_options("chain", train),
    }
    run_id = f"bench-credit-chain-{seed}"  # one per seed: the arms draw the same sampling seeds
    warm = warm_model(ns)
    length = ns.chain_length

    def value(row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, prefix in (("held-out", ""), ("trained", "seen_")):
            success = row.get(f"eval/eval/{name}/game/win_rate/solver")
            turns = row.get(f"eval/eval/{name}/multi_agent/avg_turns")
            # An episode ends at its first wrong step: (turns - 1) right, or all of them.
            right = None if success is None or turns is None else (turns - 1 + success) / length
            out |= {f"{prefix}success": success, f"{prefix}steps_right": right}
        return out

    def show(row: dict[str, Any]) -> str | None:
        if "eval/eval/held-out/episodes" not in row:
            return None
        v = {k: x or 0.0 for k, x in value(row).items()}
        return (
            f"after {row['step'] + 1:>3} steps: held-out success {v['success']:.3f}, steps right "
            f"{v['steps_right']:.3f} (trained chains {v['seen_success']:.3f}, {v['seen_steps_right']:.3f})"
        )

    eval_args = [
        "--eval-interval",
        str(ns.eval_interval),
        "--eval-prompt-data",
        *("held-out", str(held_out), "trained", str(seen)),
        "--n-samples-per-eval-prompt",
        str(ns.eval_samples or 2),
    ]
    arms = run_arms(
        "chain", ns, work, run_id, warm, game, prompts, eval_args, budget=ns.budget, show=show, value=value
    )
    first_held = sorted({first_step(p) for p, _ in held})
    return {
        "task": (
            f"chains of {length} steps (game `chain`): start 0 to {ns.chain_max_start}, steps "
            f"{' '.join(ns.chain_ops)} 1 to {ns.chain_max_step}; success = every step right"
        ),
        "train_prompts": len(train),
        "held_out_prompts": len(held),
        "held_out_first_steps": [f"{v} {op}" for v, op in first_held],
        "held_out_first_steps_in_training": sum(first_step(p) in first_held for p, _ in train),
        "arms": arms,
    }


def nim_unit(ns: argparse.Namespace, work: Path, base: Path) -> dict[str, Any]:
    seed = ns.unit_seed
    train = train_prompts("nim", ns, seed)
    piles = {
        "trained": write_prompts(work / "trained.jsonl", [nim_prompt(p) for p in NIM_TRAIN]),
        "held-out": write_prompts(work / "held-out.jsonl", [nim_prompt(p) for p in NIM_HELD_OUT]),
    }
    prompts = write_prompts(work / "prompts.jsonl", train)
    game = {
        "name": "nim",
        "options": game_options("nim", train),
        "seats": [AGENT, AGENT],
        "illegal_penalty": ILLEGAL_PENALTY["nim"],
    }
    run_id = f"bench-credit-nim-{seed}"
    warm = warm_model(ns)
    # Evaluation: the trained model against each scripted player, in each seat order, on the
    # trained and the held-out starting piles.
    eval_args = [
        "--eval-interval",
        str(ns.eval_interval),
        "--n-samples-per-eval-prompt",
        str(ns.eval_samples or 8),
    ]
    for opp in OPPONENTS:
        for i, seat in enumerate(SEATS):
            seats = [AGENT, f"script:{opp}"] if i == 0 else [f"script:{opp}", AGENT]
            path = job_config(
                work / f"eval-{opp}-{seat}.yaml", run_id, warm, {**game, "seats": seats}, {}, ns, seed, "nim"
            )
            eval_args += ["--eval-config", f"{opp}-{seat}={path}"]
    eval_args += ["--eval-prompt-data", *(x for name, path in piles.items() for x in (name, str(path)))]

    def value(row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for opp in OPPONENTS:
            for pos in ("trained", "held-out"):
                key = f"{opp}_{pos.replace('-', '_')}"
                rates = [row.get(f"eval/{opp}-{s}/{pos}/game/win_rate/vs/script:{opp}") for s in SEATS]
                for s, r in zip(SEATS, rates):
                    out[f"{key}_{s}"] = r
                out[key] = None if None in rates else sum(rates) / len(rates)
                bad = [row.get(f"eval/{opp}-{s}/{pos}/game/illegal_rate") for s in SEATS]
                out[f"illegal_{key}"] = None if None in bad else sum(bad) / len(bad)
        return out

    def show(row: dict[str, Any]) -> str | None:
        if "eval/random-first/trained/episodes" not in row:
            return None
        v = value(row)
        return (
            f"after {row['step'] + 1:>3} steps: win rate vs random {v['random_trained'] or 0:.3f} "
            f"(held-out piles {v['random_held_out'] or 0:.3f}), vs optimal {v['optimal_trained'] or 0:.3f}"
        )

    arms = run_arms(
        "nim",
        ns,
        work,
        run_id,
        warm,
        game,
        prompts,
        eval_args,
        budget=ns.nim_budget,
        show=show,
        value=value,
        probe=nim_probe,
    )
    return {
        "task": f"nim, take 1 to {NIM_TAKE}, who takes the last stone wins; self-play",
        "train_piles": list(NIM_TRAIN),
        "held_out_piles": list(NIM_HELD_OUT),
        "reference": nim_reference(),
        "arms": arms,
    }


def kuhn_unit(ns: argparse.Namespace, work: Path, base: Path) -> dict[str, Any]:
    seed = ns.unit_seed
    train = train_prompts("kuhn", ns, seed)
    prompts = write_prompts(work / "prompts.jsonl", train)
    game = {
        "name": "kuhn_poker",
        "seats": [AGENT, AGENT],
        "max_turns": 3,
        "illegal_penalty": ILLEGAL_PENALTY["kuhn"],
    }
    run_id = f"bench-credit-kuhn-{seed}"
    warm = warm_model(ns)

    def shown(arm: str, run: dict[str, Any]) -> None:  # no evaluation rows: the probes are the result
        if not ns.quiet:
            before, after = run["probe_before"]["exploitability"], run["probe_after"]["exploitability"]
            print(f"  seed {seed} {arm:<17} exploitability {before:.3f} -> {after:.3f}", flush=True)

    arms = run_arms(
        "kuhn",
        ns,
        work,
        run_id,
        warm,
        game,
        prompts,
        [],
        budget=ns.kuhn_budget,
        show=None,
        value=lambda r: {},
        probe=kuhn_probe,
        done=shown,
    )
    return {
        "task": "Kuhn poker, self-play; exploitability of the probed policy (OpenSpiel)",
        "reference": {"uniform_exploitability": uniform_exploitability()},
        "arms": arms,
    }


def uniform_exploitability() -> float:
    """The exploitability of uniform play, through the same helper the probes use (0.458)."""
    from mrlx_plugin.systems.games import BUILT_IN_GAMES
    from mrlx_plugin.systems.library_games import kuhn_exploitability

    game = BUILT_IN_GAMES["kuhn_poker"]
    return kuhn_exploitability(
        {
            key: {m: 1 / len(game.legal_moves(state, seat)) for m in game.legal_moves(state, seat)}
            for key, seat, state, _ in kuhn_positions()
        }
    )


UNITS = {"warm": warm_unit, "chain": chain_unit, "nim": nim_unit, "kuhn": kuhn_unit}


# ----------------------------------------------------------------------------------------------
# Over the seeds: measures, intervals, tables, plot
# ----------------------------------------------------------------------------------------------

# (key, label, format) per part: the lines of the tables, each a measure of every seed's run.
LINES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "chain": (
        ("success_before", "held-out success, before RL", "{:.3f}"),
        ("success_after", "held-out success, after RL", "{:.3f}"),
        ("steps_right_before", "held-out steps right (share), before RL", "{:.3f}"),
        ("steps_right_after", "held-out steps right (share), after RL", "{:.3f}"),
        ("seen_success_after", "trained chains: success, after RL", "{:.3f}"),
        ("seen_steps_right_before", "trained chains: steps right (share), before RL", "{:.3f}"),
        ("seen_steps_right_after", "trained chains: steps right (share), after RL", "{:.3f}"),
    ),
    "nim": (
        ("random_trained_before", "win rate vs script:random, trained piles, before", "{:.3f}"),
        ("random_trained_after", "win rate vs script:random, trained piles, after", "{:.3f}"),
        (
            "random_trained_first_after",
            "win rate vs script:random, trained piles, first seat, after",
            "{:.3f}",
        ),
        (
            "random_trained_second_after",
            "win rate vs script:random, trained piles, second seat, after",
            "{:.3f}",
        ),
        ("random_held_out_before", "win rate vs script:random, held-out piles, before", "{:.3f}"),
        ("random_held_out_after", "win rate vs script:random, held-out piles, after", "{:.3f}"),
        ("optimal_trained_after", "win rate vs script:optimal, trained piles, after", "{:.3f}"),
        ("optimal_held_out_after", "win rate vs script:optimal, held-out piles, after", "{:.3f}"),
        (
            "optimal_moves_trained_before",
            "optimal moves from winning positions, trained piles, before",
            "{:.3f}",
        ),
        (
            "optimal_moves_trained_after",
            "optimal moves from winning positions, trained piles, after",
            "{:.3f}",
        ),
        (
            "optimal_moves_held_out_after",
            "optimal moves from winning positions, held-out piles, after",
            "{:.3f}",
        ),
        ("illegal_after", "illegal answers (probe), after", "{:.3f}"),
    ),
    "kuhn": (
        ("exploitability_before", "exploitability, before RL", "{:.3f}"),
        ("exploitability_after", "exploitability, after RL", "{:.3f}"),
        ("illegal_before", "illegal answers (probe), before", "{:.3f}"),
        ("illegal_after", "illegal answers (probe), after", "{:.3f}"),
    ),
}
COMMON = (
    ("engine_calls", "engine calls spent in training", "{:,.0f}"),
    ("steps", "training steps", "{:.0f}"),
    ("samples_trained", "samples trained (no fillers)", "{:,.0f}"),
    ("tokens_trained", "tokens trained", "{:,.0f}"),
    ("samples_all", "samples returned, fillers included", "{:,.0f}"),
    ("wall_s", "wall time (s)", "{:.0f}"),
)
# The measures shown seed by seed under each table.
PER_SEED = {
    "chain": ("steps_right_after", "seen_steps_right_after"),
    "nim": ("random_trained_after",),
    "kuhn": ("exploitability_after",),
}


def measures(part: str, rec: dict[str, Any]) -> dict[str, float | None]:
    """The values one arm of one seed contributes to the tables."""
    out: dict[str, float | None] = {
        "engine_calls": rec["engine_calls"],
        "steps": rec["steps"],
        "samples_trained": rec["samples_trained"],
        "tokens_trained": rec["tokens_trained"],
        "samples_all": rec["samples_all"],
        "wall_s": rec["wall_time_s"],
    }
    for when in ("before", "after"):
        for key, value in (rec.get(when) or {}).items():
            if key not in ("after_steps", "engine_calls"):
                out[f"{key}_{when}"] = value
        probe = rec.get(f"probe_{when}") or {}
        if part == "nim" and probe:
            out[f"optimal_moves_trained_{when}"] = probe["optimal_trained"]
            out[f"optimal_moves_held_out_{when}"] = probe["optimal_held_out"]
            out[f"illegal_{when}"] = probe["illegal"]
        if part == "kuhn" and probe:
            out[f"exploitability_{when}"] = probe["exploitability"]
            out[f"illegal_{when}"] = probe["illegal"]
    return out


def summarise(values: list[float | None]) -> dict[str, Any] | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    mean, low, high = interval(known)
    return {"mean": mean, "low": low, "high": high, "values": values}


def reference(part: str, key: str, ref: dict[str, float]) -> str:
    """What a known player scores on the measure `key`, for scale."""
    if part == "kuhn" and key.startswith("exploitability"):
        return f"uniform {ref['uniform_exploitability']:.3f}, equilibrium 0"
    if part != "nim" or "_first" in key or "_second" in key:
        return ""
    if key.startswith("optimal_moves"):
        return "optimal 1"
    if key.startswith(OPPONENTS):
        opp, piles = key.split("_")[0], "held_out" if "held_out" in key else "trained"
        return f"optimal {ref[f'optimal_vs_{opp}_{piles}']:.3f}, random {ref[f'random_vs_{opp}_{piles}']:.3f}"
    return ""


def _cell(s: dict[str, Any] | None, fmt: str) -> str:
    if s is None:
        return "-"
    if s["high"] == s["low"]:
        return fmt.format(s["mean"])
    return f"{fmt.format(s['mean'])} [{fmt.format(s['low'])}, {fmt.format(s['high'])}]"


def markdown(report: dict[str, Any]) -> str:
    """The docs' tables: per part, a line per measure, a column per arm (mean [95% interval] over
    the seeds), the reference players' values; then the main measure seed by seed."""
    lines: list[str] = []
    seeds = report["seeds"]
    for part in PARTS:
        p = report.get(part)
        if not p:
            continue
        arms = list(p["arms"])
        ref = p.get("reference") or {}
        lines += [
            "",
            f"| {part}: {p['task']} | " + " | ".join(arms) + " | reference |",
            "|---|" + "---|" * (len(arms) + 1),
        ]
        for key, label, fmt in (*LINES[part], *COMMON):
            cells = [_cell(p["arms"][a]["summary"].get(key), fmt) for a in arms]
            if all(c == "-" for c in cells):
                continue
            lines.append(f"| {label.strip()} | " + " | ".join(cells) + f" | {reference(part, key, ref)} |")
        for key in PER_SEED[part]:
            label = next(lab for k, lab, _ in LINES[part] if k == key)
            fmt = next(f for k, _, f in LINES[part] if k == key)
            per = "; ".join(
                f"{a} " + " / ".join("-" if v is None else fmt.format(v) for v in s["values"])
                for a in arms
                if (s := p["arms"][a]["summary"].get(key))
            )
            lines += ["", f"{label}, seeds {' / '.join(map(str, seeds))}: {per}"]
    return "\n".join(lines[1:])


def aggregate(ns: argparse.Namespace, units: dict[tuple[int, str], dict[str, Any]]) -> dict[str, Any]:
    """Per part: the units' facts, each arm's runs (one per seed) and their summary."""
    out: dict[str, Any] = {}
    for part in PARTS:
        found = [(seed, units[(seed, part)]) for seed in range(ns.seeds) if (seed, part) in units]
        if not found:
            continue
        first = found[0][1]
        arms: dict[str, Any] = {}
        for arm in (a for a in ns.arms if ARMS[a] == part):
            runs = [u["arms"][arm] for _, u in found]
            per_seed = [measures(part, r) for r in runs]
            keys = dict.fromkeys(k for m in per_seed for k in m)
            arms[arm] = {
                "summary": {k: s for k in keys if (s := summarise([m.get(k) for m in per_seed])) is not None},
                "runs": runs,
            }
        out[part] = {
            "task": first["task"],
            "reference": first.get("reference"),
            "units": [{"seed": seed, **{k: v for k, v in u.items() if k != "arms"}} for seed, u in found],
            "arms": arms,
        }
    return out


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Steps right on the trained and held-out chains, and nim's win rate against `script:random`,
    against the engine calls spent, a line per arm and seed; kuhn's exploitability before and
    after, per arm."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PARTS if report.get(p)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), dpi=120, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, part in zip(axes[0], panels):
        arms = report[part]["arms"]
        if part == "kuhn":
            names = list(arms)
            for j, when in enumerate(("before", "after")):
                s = [arms[a]["summary"].get(f"exploitability_{when}") for a in names]
                xs = [i + (j - 0.5) * 0.35 for i in range(len(names))]
                means = [x["mean"] if x else 0.0 for x in s]
                errs = [x["mean"] - x["low"] if x else 0.0 for x in s]
                ax.bar(xs, means, width=0.35, yerr=errs, capsize=4, label=when)
            ax.axhline(report["kuhn"]["reference"]["uniform_exploitability"], color="grey", lw=0.8, ls="--")
            ax.set_xticks(range(len(names)), names)
            ax.set_title("kuhn poker: exploitability (uniform: dashed)")
            ax.set_ylabel("exploitability")
            ax.legend(loc="upper right")
            continue
        # chain: steps right on the trained chains (solid) and the held-out ones (dashed); nim: the
        # win rate against script:random on the trained piles.
        keys = (
            (("seen_steps_right", "-"), ("steps_right", "--"))
            if part == "chain"
            else (("random_trained", "-"),)
        )
        for i, (name, arm) in enumerate(arms.items()):
            for j, run in enumerate(arm["runs"]):
                for k, (key, style) in enumerate(keys):
                    points = [p for p in run["curve"] if p.get(key) is not None]
                    ax.plot(
                        [p["engine_calls"] for p in points],
                        [p[key] for p in points],
                        color=colours[i % len(colours)],
                        ls=style,
                        lw=1,
                        alpha=0.6,
                        label=name if j == k == 0 else None,
                    )
        ax.set_title(
            "chain: steps right, trained (solid) and held-out (dashed)"
            if part == "chain"
            else "nim: win rate vs script:random, trained piles"
        )
        ax.set_xlabel("engine calls spent in training")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# Main: the units in parallel processes, then the report
# ----------------------------------------------------------------------------------------------


def unit_main(ns: argparse.Namespace) -> int:
    """One part of one seed, or its warm-start (a process of its own): its result.json."""
    from mrlx_plugin.local.model import ensure_model

    seed, part = ns.unit.split(":")
    ns.unit_seed = int(seed)
    root = Path(ns.out)
    work = root / f"seed_{seed}" / part
    (work / "logs").mkdir(parents=True, exist_ok=True)
    base = ensure_model(root / "models" / f"{ns.preset}-seed{seed}", preset=ns.preset, seed=int(seed))
    try:
        result = UNITS[part](ns, work, base)
    except RuntimeError as exc:
        print(f"mrlx bench credit: seed {seed} {part}: {exc}", file=sys.stderr)
        return 1
    (work / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    from mrlx_plugin.core import processes
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.model import ensure_model

    argv = list(sys.argv[1:] if argv is None else argv)
    ns = settle(build_parser().parse_args(argv))
    if ns.table:
        try:
            saved = json.loads(Path(ns.table).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--table {ns.table}: cannot read a saved report ({exc})") from None
        print(markdown(saved))
        return 0
    if ns.unit:
        return unit_main(ns)
    root = Path(ns.out)
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for seed in range(ns.seeds):  # built here once, not by two units at once
        try:
            ensure_model(root / "models" / f"{ns.preset}-seed{seed}", preset=ns.preset, seed=seed)
        except (ValueError, FileExistsError) as exc:
            raise ConfigError(f"--out {root}: {exc}") from None
    # Each seed's warm-start first (its parts start from it), then the longest units, so that
    # the last ones to start are short.
    parts = [p for p in PARTS if any(ARMS[a] == p for a in ns.arms)]
    pending = [(seed, "warm") for seed in range(ns.seeds)]
    pending += [(seed, part) for part in parts for seed in range(ns.seeds)]
    threads = max(1, (os.cpu_count() or 2) // ns.jobs)
    running: dict[tuple[int, str], Any] = {}
    done: set[tuple[int, str]] = set()
    failed = None
    try:
        while (pending or running) and failed is None:
            ready = [u for u in pending if u[1] == "warm" or (u[0], "warm") in done]
            while ready and len(running) < ns.jobs:
                unit = ready.pop(0)
                pending.remove(unit)
                argv_unit = [*argv, "--unit", f"{unit[0]}:{unit[1]}", "--threads", str(threads)]
                command = [sys.executable, "-m", "mrlx_plugin.bench.credit", *argv_unit]
                running[unit] = processes.start(command)
            for unit, proc in list(running.items()):
                if proc.poll() is not None:
                    del running[unit]
                    if proc.returncode != 0:
                        failed = failed or unit
                    done.add(unit)
            time.sleep(0.5)
    finally:  # a failed unit, or the bench stopped: the others are stopped too
        processes.stop_all(list(running.values()), timeout=20)
    if failed is not None:
        print(f"mrlx bench credit: seed {failed[0]} {failed[1]} failed (its error is above)", file=sys.stderr)
        return 1

    def result(seed: int, unit: str) -> dict[str, Any]:
        return json.loads((root / f"seed_{seed}" / unit / "result.json").read_text())

    units = {(seed, part): result(seed, part) for part in parts for seed in range(ns.seeds)}
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "config": {k: v for k, v in vars(ns).items() if k not in ("unit", "table")},
        "seeds": list(range(ns.seeds)),
        "warm_start": [{"seed": seed, **result(seed, "warm")} for seed in range(ns.seeds)],
        **aggregate(ns, units),
    }
    report["wall_time_s"] = time.monotonic() - started
    picture = plot(report, root / "credit.png")
    report["plot"] = str(picture) if picture else None
    print(markdown(report))
    print(f"\n  total wall time {report['wall_time_s']:.0f} s; plot: {report['plot']}")
    write_report(root / "credit.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
