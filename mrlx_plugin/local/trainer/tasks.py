"""Built-in tasks for the embedded default: prompts and labels made from a seed, no dataset needed."""

from __future__ import annotations

import json
import random
from pathlib import Path


def arithmetic_prompts(n: int, seed: int = 0, max_operand: int = 50) -> list[tuple[str, str]]:
    """`n` (prompt, label) pairs like ("What is 23 + 45?", "68"), reproducible from `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if rng.random() < 0.5:
            out.append((f"What is {a} + {b}?", str(a + b)))
        else:
            a, b = max(a, b), min(a, b)
            out.append((f"What is {a} - {b}?", str(a - b)))
    return out


def addition_prompts(n: int, seed: int = 0, max_operand: int = 4) -> list[tuple[str, str]]:
    """`n` questions "What is a + b?" with 0 <= a, b <= max_operand, every sum equally often.

    The demo's task: small enough for a model built from scratch to learn on two CPU cores in
    minutes. Each sum is drawn uniformly and then a pair that makes it, so no single answer is
    right more often than 1 in (2 * max_operand + 1): a model has to read the question to beat
    chance, which keeps RL from settling on one favourite number.
    """
    rng = random.Random(seed)
    by_sum: dict[int, list[tuple[int, int]]] = {}
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            by_sum.setdefault(a + b, []).append((a, b))
    out = []
    for _ in range(n):
        a, b = rng.choice(by_sum[rng.randint(0, 2 * max_operand)])
        out.append((f"What is {a} + {b}?", str(a + b)))
    return out


def format_examples(
    path: str | Path, prompts: list[tuple[str, str]], n: int, seed: int = 0, context: bool = False
) -> Path:
    """A warm-start file teaching the output FORMAT only: "\\boxed{N}" with N drawn at random.

    Labels are never used, so the warm-started model knows how to answer but not what: its
    first rewards are chance level. With `context`, each example also shows a teammate's
    message (a random boxed number), as the second agent of the demo sees one.
    """
    rng = random.Random(seed)
    top = max(int(label) for _, label in prompts)
    with Path(path).open("w") as f:
        for _ in range(n):
            prompt, _ = rng.choice(prompts)
            messages = [{"role": "user", "content": prompt}]
            if context:
                messages.append({"role": "user", "content": f"\\boxed{{{rng.randint(0, top)}}}"})
            messages.append({"role": "assistant", "content": f"\\boxed{{{rng.randint(0, top)}}}"})
            f.write(json.dumps({"messages": messages}) + "\n")
    return Path(path)


def nim_prompts(
    n: int, seed: int = 0, low: int = 3, high: int = 9, max_take: int = 3
) -> list[tuple[str, str]]:
    """`n` Nim games "Nim: 7 stones" with `low` to `high` stones (the game system's `nim`; its
    `max_stones` option must be at least `high`). The label is the winning first move for
    `max_take` ("0": the first seat cannot force a win)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        stones = rng.randint(low, high)
        out.append((f"Nim: {stones} stones", str(stones % (max_take + 1))))
    return out


def kuhn_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` Kuhn poker deals "Kuhn poker: K vs J" (the first seat's card first), each of the six
    deals equally likely; the label is the seat holding the higher card."""
    rng = random.Random(seed)
    deals = [(a, b) for a in "JQK" for b in "JQK" if a != b]
    out = []
    for _ in range(n):
        a, b = rng.choice(deals)
        out.append((f"Kuhn poker: {a} vs {b}", "first" if "JQK".index(a) > "JQK".index(b) else "second"))
    return out


def chain_prompts(
    n: int, seed: int = 0, steps: int = 3, max_start: int = 4, max_step: int = 3, ops: str = "+"
) -> list[tuple[str, str]]:
    """`n` chains "Chain: 2 +3 +1 +2": a start value from 0 to `max_start`, then `steps`
    operations (signs from `ops`, numbers from 1 to `max_step`; a subtraction never goes below
    0). The label is the final value. The game system's `chain` (its `max_steps` option must be
    at least `steps`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        value = rng.randint(0, max_start)
        parts = [str(value)]
        for _ in range(steps):
            sign, k = rng.choice(ops), rng.randint(1, max_step)
            if sign == "-" and k > value:
                sign = "+"
            value = value + k if sign == "+" else value - k if sign == "-" else value * k
            parts.append(f"{sign}{k}")
        out.append(("Chain: " + " ".join(parts), str(value)))
    return out


TASKS = {
    "arithmetic": arithmetic_prompts,
    "addition": addition_prompts,
    "nim": nim_prompts,
    "kuhn_poker": kuhn_prompts,
    "chain": chain_prompts,
}


def task_prompts(name: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """The built-in task `name`'s prompts and labels."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}")
    return TASKS[name](n, seed=seed)
