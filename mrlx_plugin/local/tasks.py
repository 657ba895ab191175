"""Built-in tasks for the embedded default: prompts and labels made from a seed, no dataset needed."""

from __future__ import annotations

import random


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


TASKS = {"arithmetic": arithmetic_prompts}


def task_prompts(name: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """The built-in task `name`'s prompts and labels."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}")
    return TASKS[name](n, seed=seed)
