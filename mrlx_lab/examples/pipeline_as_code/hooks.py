"""The README's shared-model pipeline written as agent code: the same three roles, prompts and
rewards as the built-in `system: pipeline`, as an ordinary async function over the official
`openai` client. Select it with `mrlx.system: pipeline_code` (see pipeline_code.yaml).

    n solvers answer the problem -> n rewriters each read every solution and write their own
    -> one selector picks a rewrite; the team's answer is the rewrite it picked.

Solvers and rewriters are graded by the `mrlx_grade` hook after the episode (they get no reward
here); the selector's reward is the grade of the rewrite it picked. What this version leaves out
of the built-in one: cutting quoted solutions to fit the context (`pipeline.max_solution_tokens`)
and the team weighting of every sample (`pipeline.correct_weight`/`incorrect_weight`).
"""

from __future__ import annotations

import asyncio
import weakref

import openai

from mrlx_plugin import hookimpl
from mrlx_plugin.agents import Outcome, agent_code
from mrlx_plugin.systems.pipeline import parse_judgment, rewriter_prompt, selector_prompt, solver_prompt

NUM_PARALLEL = 5

# One client (and connection pool) per event loop; an episode's calls bring only its own keys.
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def client(endpoint) -> openai.AsyncOpenAI:
    loop = asyncio.get_running_loop()
    base = _clients.get(loop)
    if base is None:
        base = _clients[loop] = openai.AsyncOpenAI(
            base_url=endpoint.base_url,
            api_key=endpoint.api_key,
            max_retries=0,
            http_client=openai.DefaultAioHttpClient(),
        )
    return base.with_options(base_url=endpoint.base_url, api_key=endpoint.api_key)


async def aclose() -> None:
    """Close this loop's client (call it where your process ends its event loop)."""
    base = _clients.pop(asyncio.get_running_loop(), None)
    if base is not None:
        await base.close()


async def ask(endpoint, content: str) -> str:
    """One turn of a fresh conversation; the answer's text without its reasoning."""
    answer = await client(endpoint).chat.completions.create(
        model=endpoint.model, messages=[{"role": "user", "content": content}]
    )
    return answer.choices[0].message.content or ""


async def pipeline(task, endpoints, ask=ask):
    """One episode. `ask(endpoint, content)` is one turn (the benchmark swaps in plain HTTP)."""
    solver, rewriter, selector = endpoints["solver"], endpoints["rewriter"], endpoints["selector"]
    answers = await asyncio.gather(*(ask(solver, solver_prompt(task.problem)) for _ in range(NUM_PARALLEL)))
    solutions = [a for a in answers if a]
    if not solutions:
        return Outcome(team_reward=0.0)
    prompt = rewriter_prompt(task.problem, solutions)
    rewrites = [r for r in await asyncio.gather(*(ask(rewriter, prompt) for _ in range(NUM_PARALLEL))) if r]
    if not rewrites:
        return Outcome(team_reward=0.0)
    choice = parse_judgment(await ask(selector, selector_prompt(task.problem, rewrites)), len(rewrites))
    if choice is None:  # no valid "Judgment: IDX" line
        return Outcome(rewards={"selector": 0.0}, team_reward=0.0)
    grade = await task.grade(rewrites[choice], "rewriter")
    return Outcome(rewards={"selector": grade}, answer=rewrites[choice], team_reward=grade)


PIPELINE_CODE = agent_code(
    pipeline,
    samples={"solver": NUM_PARALLEL, "rewriter": NUM_PARALLEL, "selector": 1},
    turns={"solver": 1, "rewriter": 1, "selector": 1},
)


@hookimpl
def mrlx_register_systems():
    return {"pipeline_code": PIPELINE_CODE}
