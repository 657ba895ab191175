"""The lookup task's data: tables of item codes that only the `lookup` tool can read.

A prompt asks "What is the code of item C?". Its table, in the prompt's label, gives each item A-F
a one-digit code, all different within the table; the question never shows it, so the agent has to
call `lookup` with the item's key, read the code the tool answers, and give it as `\\boxed{code}`.

The held-out prompts cannot be answered from anything learned in training but the reading of the
tool. The (item, code) pairs are split in two: each item has two held-out codes, and no training
table ever gives an item one of them; a held-out prompt asks for an item whose code is one of its
held-out codes. So a held-out answer is an (item, code) pair never seen in training, and a
held-out table is never a training table. Everything is made from a seed: the same arguments
give the same prompts, in the same order.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

KEYS = "ABCD"
CODES = "0123456789"
TRAIN, HELD_OUT = "train", "held_out"

# The tool, as the agent's code sends it (OpenAI's function format). Short on purpose: the chat
# template renders it in every prompt.
LOOKUP_TOOL: dict[str, object] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The code of an item.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string"}},
            "required": ["key"],
        },
    },
}
TOOLS = [LOOKUP_TOOL]


def question(key: str) -> str:
    return f"What is the code of item {key}?"


def held_out_pair(key: str, code: str) -> bool:
    """Whether (item, code) is kept out of training: two codes per item, about one item per code."""
    return (KEYS.index(key) + int(code)) % 5 == 0


def _table(rng: random.Random, asked: str, code: str) -> dict[str, str]:
    """A table with `asked` holding `code` and every other item a training pair, codes all different."""
    others = [k for k in KEYS if k != asked]
    while True:  # about one draw in four is accepted
        drawn = rng.sample([c for c in CODES if c != code], len(others))
        if not any(held_out_pair(k, c) for k, c in zip(others, drawn)):
            return {asked: code, **dict(zip(others, drawn))}


def prompts(n: int, seed: int = 0, split: str = TRAIN) -> list[tuple[str, str]]:
    """`n` (question, label) pairs of `split`; the label is the JSON text of {"key", "table"}.

    Each item is asked equally often (in turn, from a seeded start), with a code drawn uniformly
    among those of the split for that item.
    """
    if split not in (TRAIN, HELD_OUT):
        raise ValueError(f"split: got {split!r}; expected {TRAIN!r} or {HELD_OUT!r}")
    rng = random.Random(f"{split}:{seed}")
    start = rng.randrange(len(KEYS))
    out = []
    for i in range(n):
        key = KEYS[(start + i) % len(KEYS)]
        codes = [c for c in CODES if held_out_pair(key, c) == (split == HELD_OUT)]
        table = _table(rng, key, rng.choice(codes))
        out.append((question(key), json.dumps({"key": key, "table": table}, sort_keys=True)))
    return out


def parse_label(label: object) -> tuple[str, dict[str, str]]:
    """(asked key, table) of a prompt's label; ValueError naming what is wrong."""
    try:
        value = json.loads(label) if isinstance(label, str) else label
        key, table = value["key"], value["table"]
    except (ValueError, TypeError, KeyError):
        raise ValueError(
            f'label {label!r}: expected the JSON text of {{"key": ..., "table": {{...}}}} '
            "(prompts made by mrlx_lab.examples.tool_lookup.data.prompts)"
        ) from None
    if key not in table:
        raise ValueError(f"label {label!r}: the asked key {key!r} is not in its table")
    return key, table


def answer(label: object) -> str:
    key, table = parse_label(label)
    return table[key]


def lookup(table: dict[str, str], arguments: str) -> tuple[str, str | None]:
    """Run the tool: (what it answers, the key it was asked for, or None when the arguments are unusable)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: the arguments are not JSON", None
    key = args.get("key") if isinstance(args, dict) else None
    if not isinstance(key, str):
        return 'error: expected {"key": "<item>"}', None
    return table.get(key, f"no item {key}"), key


def call_text(key: str) -> str:
    """A model's call of the tool in the Hermes form (what the `hermes` tool parser reads)."""
    return "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"key": key}}) + "\n</tool_call>"


def warmup_examples(path: str | Path, n: int, seed: int, tools_text: str) -> Path:
    """A warm-start file, as `{"messages": [...]}` rows, from a demonstrator that uses the tool only
    half the time. Half its first turns are a call of `lookup` with the asked item's key; the
    other half skip the tool and guess, `\\boxed{code}` with a random code. After a call and the
    tool's answer it repeats the tool's code, `\\boxed{code}`. Of the rows, one in four ends in a
    call, one in four in a guess, two in four (after a call and a random code from the tool) in
    the answer. No row holds a table, so no code can be learned from them: that the lookup pays
    and the guess does not is left to RL.

    `tools_text` is the system message that renders exactly as the chat template renders the
    tools (the trainer's warm-start passes no tools to the template).
    """
    rng = random.Random(f"warmup:{seed}")
    with Path(path).open("w") as f:
        for i in range(n):
            asked = rng.choice(KEYS)
            messages = [
                {"role": "system", "content": tools_text},
                {"role": "user", "content": question(asked)},
            ]
            code = rng.choice(CODES)
            if i % 4 == 0:
                messages.append({"role": "assistant", "content": call_text(asked)})
            elif i % 4 == 1:
                messages.append({"role": "assistant", "content": f"\\boxed{{{code}}}"})
            else:
                messages += [
                    {"role": "assistant", "content": call_text(asked)},
                    {"role": "tool", "content": code},
                    {"role": "assistant", "content": f"\\boxed{{{code}}}"},
                ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return Path(path)


def write_prompts(path: str | Path, rows: list[tuple[str, str]]) -> Path:
    """The prompts as the host's JSONL (`prompt`, `label`)."""
    Path(path).write_text("".join(json.dumps({"prompt": q, "label": lab}) + "\n" for q, lab in rows))
    return Path(path)
