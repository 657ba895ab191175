"""The research pair's corpus, questions and warm-start data.

The corpus is 120 made-up facts, one document each: "The capital of Bako is Mirenu." A question
asks for one of them ("What is the capital of Bako?"); its label is the capital. The countries
are split in two: TRAIN questions ask about the first 96, HELD_OUT questions about the other 24,
and the documents of held-out countries are searchable in evaluation episodes only
(`documents`), so nothing about a held-out fact is ever seen in training: a held-out answer can
only come from reading what the search returns. The training facts are many on purpose: a team
that learned a handful of them by heart would stop searching, and fail every held-out question.

Names are made-up, capitalised syllables, drawn once from a fixed seed (`FACTS` is the same on
every machine): this project's small tokenizer has no merge across the space before a capital
letter, so a name is the same tokens in a question, a tool call's JSON, a document and a
`\\boxed{}` answer (a model can copy it token for token).

`search` is the tool the agent code runs: a plain keyword match, the documents ranked by how
many of the query's words they hold. Everything here is deterministic from its arguments.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

TRAIN, HELD_OUT = "train", "held_out"
N_FACTS, N_TRAIN = 120, 96


def _made_up_facts(n: int) -> dict[str, str]:
    """`n` countries, each with its capital: two-syllable country names, three-syllable capitals,
    all different."""
    rng = random.Random("research_pair:corpus")
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    names: set[str] = set()

    def draw(k: int) -> str:
        while True:
            name = "".join(rng.choice(syllables) for _ in range(k)).capitalize()
            if name not in names:
                names.add(name)
                return name

    return {draw(2): draw(3) for _ in range(n)}


# Country -> capital. The first N_TRAIN are the training split, the rest the held-out one.
FACTS: dict[str, str] = _made_up_facts(N_FACTS)
COUNTRIES = list(FACTS)
CITIES = list(FACTS.values())
SPLITS = {TRAIN: COUNTRIES[:N_TRAIN], HELD_OUT: COUNTRIES[N_TRAIN:]}

MAX_RESULTS = 2  # documents one search returns, best first
NO_RESULTS = "No results."

# The tool, as the agent code offers it (OpenAI's function format). Bare on purpose: the chat
# template renders it in every prompt of the searcher, about 130 tokens of a small model's
# context as it is.
SEARCH_TOOL: dict[str, object] = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}
TOOLS = [SEARCH_TOOL]


def document(country: str, capital: str) -> str:
    return f"The capital of {country} is {capital}."


def documents(split: str) -> list[str]:
    """The searchable corpus: the training split's documents, or (`HELD_OUT`, used in evaluation
    episodes) every document, so that a search then has the whole corpus to tell apart."""
    if split not in SPLITS:
        raise ValueError(f"split: got {split!r}; expected {TRAIN!r} or {HELD_OUT!r}")
    countries = SPLITS[TRAIN] if split == TRAIN else COUNTRIES
    return [document(c, FACTS[c]) for c in countries]


def question(country: str) -> str:
    return f"What is the capital of {country}?"


def sub_question(country: str) -> str:
    """The planner's delegation, in the form the warm-start shows it."""
    return f"Find the capital of {country}."


def report(text: str) -> str:
    """The searcher's report as the planner reads it (the agent code and the warm-start alike)."""
    return f"Searcher: {text}"


def questions(n: int, seed: int = 0, split: str = TRAIN) -> list[tuple[str, str]]:
    """`n` (question, label) pairs of `split`, each country of the split asked equally often (in
    turn, from a seeded start); the label is the capital."""
    if split not in SPLITS:
        raise ValueError(f"split: got {split!r}; expected {TRAIN!r} or {HELD_OUT!r}")
    countries = SPLITS[split]
    start = random.Random(f"{split}:{seed}").randrange(len(countries))
    return [(question(c), FACTS[c]) for c in (countries[(start + i) % len(countries)] for i in range(n))]


_WORD = re.compile(r"[A-Za-z]+")
_STOP = {"the", "of", "is", "a", "an", "what", "capital", "find"}  # words every document or question has


def keywords(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text)} - _STOP


def search(query: str, corpus: list[str]) -> str:
    """The documents holding most of the query's keywords (at most `MAX_RESULTS`, one a line,
    in corpus order among equals), or `NO_RESULTS`."""
    wanted = keywords(query)
    scored = [(len(wanted & keywords(doc)), i) for i, doc in enumerate(corpus)]
    best = sorted((-score, i) for score, i in scored if score > 0)[:MAX_RESULTS]
    return "\n".join(corpus[i] for _, i in best) if best else NO_RESULTS


def search_query(arguments: str) -> str | None:
    """The query of a `search` call's arguments (JSON text), or None when they hold no usable
    one (not JSON, not an object, no non-empty string `query`)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    query = args.get("query") if isinstance(args, dict) else None
    return query if isinstance(query, str) and query.strip() else None


def call_text(query: str) -> str:
    """A call of `search` as a Hermes-format model writes it (what the `hermes` tool parser reads);
    compact JSON, the fewest tokens for a small model to learn."""
    body = json.dumps({"name": "search", "arguments": {"query": query}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def warmup_examples(path: str | Path, n: int, seed: int, agent: str, tools_text: str = "") -> Path:
    """A warm-start file for agent `agent` ("planner" or "searcher"), as `{"messages": [...]}` rows.
    No document shown is a true fact and no row pairs a country with its capital, so no answer can
    be learned from them.

    planner: half the rows end in a delegation ("Find the capital of X.", X the asked country),
    half (after one and a report) in `\\boxed{city}` repeating the report's city. searcher: a
    demonstrator that searches only half the time. One row in four ends in a call of `search` for
    the delegation's country, one in four in a guessed city with no search, two in four (after a
    call and a result) in the city of the result. That searching pays and guessing does not is
    left to RL. `tools_text`: the system message that renders exactly as the chat template
    renders the tools (the warm-start passes no tools to the template).
    """
    if agent not in ("planner", "searcher"):
        raise ValueError(f"agent: got {agent!r}; expected 'planner' or 'searcher'")
    rng = random.Random(f"warmup:{agent}:{seed}")
    with Path(path).open("w") as f:
        for i in range(n):
            country = rng.choice(COUNTRIES)
            city = rng.choice([c for c in CITIES if c != FACTS[country]])  # never the true capital
            if agent == "planner":
                messages = [
                    {"role": "user", "content": question(country)},
                    {"role": "assistant", "content": sub_question(country)},
                ]
                if i % 2:
                    messages += [
                        {"role": "user", "content": report(city)},
                        {"role": "assistant", "content": f"\\boxed{{{city}}}"},
                    ]
            else:
                messages = [
                    {"role": "system", "content": tools_text},
                    {"role": "user", "content": sub_question(country)},
                ]
                if i % 4 == 1:
                    messages.append({"role": "assistant", "content": city})
                else:
                    messages.append({"role": "assistant", "content": call_text(country)})
                if i % 4 >= 2:
                    messages += [
                        {"role": "tool", "content": document(country, city)},
                        {"role": "assistant", "content": city},
                    ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return Path(path)


def write_questions(path: str | Path, rows: list[tuple[str, str]]) -> Path:
    """The questions as the host's JSONL (`prompt`, `label`)."""
    Path(path).write_text("".join(json.dumps({"prompt": q, "label": lab}) + "\n" for q, lab in rows))
    return Path(path)
