"""`mrlx bench credit`'s tasks: the chains, their held-out set, the games' prompts and options,
each seat's conversation as the game system renders it, and the format-only warm-start data."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from mrlx_lab.bench.credit.settings import NIM_HELD_OUT, NIM_TAKE, NIM_TRAIN
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    from mrlx_plugin.systems.games import Game

S = TypeVar("S")  # a game's states
M = TypeVar("M")  # a game's moves


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


def conversation(game: Game[S, M], state: S, moves: list[M], seat: int) -> tuple[list[dict[str, str]], S]:
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


def game_options(part: str, prompts: list[tuple[str, str]]) -> JSONObject:
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
