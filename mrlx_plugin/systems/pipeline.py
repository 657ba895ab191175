"""The solver -> rewriter -> selector system, on one shared model or on one model per role.

One episode per input sample:
1. `num_parallel` solvers answer the problem independently; each is graded against the label.
2. `num_parallel` rewriters each read every solver's answer and write an improved solution;
   each is graded.
3. One selector reads the rewrites and picks one: the last line of its answer is
   "Judgment: IDX" (1-based). It earns the grade of the rewrite it picked. A last line that is
   no such line, or an out-of-range index, earns 0.0 and leaves the team without a final answer
   (counted as `multi_agent/invalid_selection_rate`).
4. The team is right when its final answer earns a full mark; the system declares team shaping
   (`System.team_shaping`), so the `mrlx_shape_rewards` hook's default weights every sample by the
   team outcome (`mrlx.pipeline.weighting`).

The agents are named `solver`, `rewriter` and `selector` in the config; by default all three
are `url: self`, so one model plays every role and trains on all of them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from mrlx_plugin.core.config import TOP_KEY, Settings, SystemSection, Tokens, bounded
from mrlx_plugin.core.transcript import Transcript
from mrlx_plugin.episodes import Episode, Outcome, System
from mrlx_plugin.systems.quoting import quote

PIPELINE_AGENTS = ("solver", "rewriter", "selector")


class PipelineSettings(SystemSection):
    """The solver -> rewriter -> selector system (agents `solver`, `rewriter`, `selector`)."""

    about = "the solver -> rewriter -> selector system"
    default_agents = PIPELINE_AGENTS

    num_parallel: bounded(
        int,
        ge=1,
        le=256,
        why="each is a solver and a rewriter call per episode, and the "
        "selector reads every one in one prompt",
    ) = Field(5, description="solvers, and rewriters, per episode")
    correct_weight: bounded(float, ge=0) = Field(
        1.2, description="team weight when the selected answer is right"
    )
    incorrect_weight: bounded(float, ge=0) = Field(
        0.8, description="team weight when it is wrong or none was selected"
    )
    weighting: Literal["offset", "multiplicative", "none"] = Field(
        "offset",
        description="how the team weight meets each sample's own reward: `offset` adds weight - 1 "
        "(wrong answers also feel the team outcome), `multiplicative` multiplies, "
        "`none` leaves rewards unweighted",
    )
    max_solution_tokens: Tokens | None = Field(
        None, description="cut each solution quoted to the rewriters and the selector to its last N tokens"
    )

    def problems(self, settings: Settings, path: str) -> list[str]:
        missing = [n for n in PIPELINE_AGENTS if n not in settings.agents]
        if not missing:
            return []
        return [
            f"{TOP_KEY}.agents: the pipeline system needs agents {', '.join(PIPELINE_AGENTS)}; "
            f"missing {', '.join(missing)} (add e.g. `{missing[0]}: {{url: self}}`)"
        ]


# The whole last line, nothing else on it (bold, brackets and a final period allowed): words
# such as "my judgment: 2 of them are wrong" are no choice.
# ASCII digits, a few of them: \d would take other scripts' digits, and int() refuses (raises on)
# a string of more than 4,300 digits, which a model may write.
_JUDGMENT = re.compile(r"\**\s*judgment\s*:\s*\**\s*\[?\s*([0-9]{1,6})\s*\]?\s*\.?\s*\**", re.IGNORECASE)


def solver_prompt(problem: str) -> str:
    return f"{problem}\n\nSolve the problem step by step and put the final answer in \\boxed{{}}."


def _numbered(solutions: list[str]) -> str:
    # Each solution quoted (`quote`): a heading written inside one is a line of it, not a section.
    return "\n\n".join(f"### Solution {i}\n{quote(s)}" for i, s in enumerate(solutions, 1))


def rewriter_prompt(problem: str, solutions: list[str]) -> str:
    return (
        f"Problem:\n{quote(problem)}\n\n"
        f"Below are {len(solutions)} attempted solutions to this problem, each quoted between lines of "
        "backticks. Some may be wrong. Compare them, find the correct reasoning, and write one complete, "
        "correct solution of your own. Put the final answer in \\boxed{}.\n\n"
        f"{_numbered(solutions)}"
    )


def selector_prompt(problem: str, solutions: list[str]) -> str:
    return (
        f"Problem:\n{quote(problem)}\n\n"
        f"Below are {len(solutions)} candidate solutions, each quoted between lines of backticks. Check "
        "each one's reasoning and final answer, decide which solution is correct, and end your reply with "
        f"this line, alone and last:\nJudgment: IDX\nwhere IDX is the number (1 to {len(solutions)}) of the "
        "solution you choose.\n\n"
        f"{_numbered(solutions)}"
    )


@dataclass(frozen=True)
class PipelinePrompts:
    """The user message each role receives. Replace any of them with `make_pipeline(...)`."""

    solver: Callable[[str], str] = solver_prompt
    rewriter: Callable[[str, list[str]], str] = rewriter_prompt
    selector: Callable[[str, list[str]], str] = selector_prompt


def final_line(text: str) -> str | None:
    """The last non-blank line of an answer, stripped; None for a blank answer."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def parse_judgment(text: str, n: int) -> int | None:
    """The 0-based index a selector chose: its answer's last line must be "Judgment: IDX" and
    nothing else, IDX from 1 to n; None otherwise."""
    found = _JUDGMENT.fullmatch(final_line(text) or "")
    if found is None:
        return None
    idx = int(found.group(1)) - 1
    return idx if 0 <= idx < n else None


def fit_solutions(
    episode: Episode, agent: str, build: Callable[[list[str]], str], solutions: list[str], cap: int | None
) -> str:
    """The prompt built from `solutions`, with each solution cut (keeping its end, where the answer
    is) so that the prompt leaves room to answer within the host's context limit."""
    tok = episode.context.tokenizers[agent]
    if cap is not None:
        solutions = [_tail(tok, s, cap) for s in solutions]
    prompt = build(solutions)
    limit = episode.context_limit(agent)
    if limit is None:
        return prompt
    reserve = min(int(episode.base_sampling.get("max_new_tokens") or 1024), limit // 2)
    budget = limit - reserve
    if episode.prompt_tokens(agent, [{"role": "user", "content": prompt}]) <= budget:
        return prompt
    overhead = episode.prompt_tokens(agent, [{"role": "user", "content": build([""] * len(solutions))}])
    n = max(1, len(solutions))
    per_solution = max(16, (budget - overhead) // n)
    encoded = [tok.encode_text(s) for s in solutions]  # once, however many rounds the cutting takes
    while True:
        prompt = build([_cut(tok, s, ids, per_solution) for s, ids in zip(solutions, encoded)])
        over = episode.prompt_tokens(agent, [{"role": "user", "content": prompt}]) - budget
        # A quote's fence is longer than any backtick run in the text it holds, so a text of
        # long runs costs more than its own tokens: cut further, by the excess and at least a
        # tenth each round, until the prompt fits or the solutions are at their floor.
        if over <= 0 or per_solution <= 16:
            return prompt
        per_solution = max(16, per_solution - max(-(-over // n), per_solution // 10))


def _tail(tok, text: str, max_tokens: int) -> str:
    """The end of a quoted solution, at most `max_tokens` tokens of it. A solution is another
    agent's text: it is counted and cut as plain text (a special token's string in it stays the
    characters it is made of, here and in the prompt it is quoted in)."""
    return _cut(tok, text, tok.encode_text(text), max_tokens)


def _cut(tok, text: str, ids: list[int], max_tokens: int) -> str:
    """`_tail` of `text` whose plain-text ids are `ids`."""
    if len(ids) <= max_tokens:
        return text
    return "..." + tok.decode(ids[-max_tokens:], skip_special_tokens=False)


def make_pipeline(prompts: PipelinePrompts = PipelinePrompts()) -> System:
    """A pipeline system with these prompts (register it under your own system name)."""

    async def run(episode: Episode) -> Outcome:
        p = episode.settings.pipeline
        problem = episode.problem

        async def answer(t: Transcript) -> None:
            await episode.generate(t)
            await episode.grade(t)

        solvers = [
            episode.new_transcript(
                "solver", [{"role": "user", "content": prompts.solver(problem)}], f"solver-{i}"
            )
            for i in range(p.num_parallel)
        ]
        await episode.gather(*(answer(t) for t in solvers))
        solutions = [t.answer_text for t in solvers if t.answer_text]
        if not solutions:
            episode.metadata["stopped_at"] = "solver"
            return Outcome(team_reward=0.0)

        rewrite_prompt = fit_solutions(
            episode, "rewriter", lambda s: prompts.rewriter(problem, s), solutions, p.max_solution_tokens
        )
        rewriters = [
            episode.new_transcript("rewriter", [{"role": "user", "content": rewrite_prompt}], f"rewriter-{i}")
            for i in range(p.num_parallel)
        ]
        await episode.gather(*(answer(t) for t in rewriters))
        rewrites = [t for t in rewriters if t.answer_text]
        if not rewrites:
            episode.metadata["stopped_at"] = "rewriter"
            return Outcome(team_reward=0.0)

        select_prompt = fit_solutions(
            episode,
            "selector",
            lambda s: prompts.selector(problem, s),
            [t.answer_text for t in rewrites],
            p.max_solution_tokens,
        )
        selector = episode.new_transcript(
            "selector", [{"role": "user", "content": select_prompt}], "selector"
        )
        await episode.generate(selector)
        choice = parse_judgment(selector.answer_text, len(rewrites))
        if choice is None:
            episode.metadata["invalid_selection"] = True
            selector.raw_reward = selector.reward = 0.0
            return Outcome(team_reward=0.0)
        chosen = rewrites[choice]
        selector.raw_reward = selector.reward = float(chosen.raw_reward or 0.0)
        episode.metadata["selected"] = choice
        return Outcome(final_transcript=chosen, team_reward=float(chosen.raw_reward or 0.0))

    return System(
        run=run,
        fan_out=pipeline_fan_out,
        turns=lambda settings: {"solver": 1, "rewriter": 1, "selector": 1},
        team_shaping=True,  # every sample is weighted by the team outcome
    )


def pipeline_fan_out(settings) -> dict[str, int]:
    """Samples per episode and role: `num_parallel` solvers and rewriters, one selector."""
    n = settings.pipeline.num_parallel
    return {"solver": n, "rewriter": n, "selector": 1}


# The system registered as `pipeline` owns the `mrlx.pipeline` section (its checks and default
# agents); a variant built with `make_pipeline` under another name reads the same section.
PIPELINE = dataclasses.replace(make_pipeline(), settings=PipelineSettings)
