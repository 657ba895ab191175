"""A DeepResearch-style pair as agent code: a planner delegates, a searcher searches and reports.

Two agents, each its own model: the `planner` gets a question whose answer is in the corpus
(`mrlx_lab.examples.research_pair.corpus`: "What is the capital of Laku?"), writes a sub-question for the
`searcher`, reads its report and answers in `\\boxed{}`. The searcher gets only the sub-question;
it may call the `search(query)` tool once (the code runs it: a keyword match over the corpus),
reads the result (a `tool` message: context, never trained on), and reports what it found. The
episode is ordinary code over the official `openai` client, one endpoint per agent:

    planner:  question                     -> sub-question
    searcher: sub-question                 -> <tool_call>{"name":"search","arguments":{...}}</tool_call>
              (tool) the documents found   -> report
    planner:  "Searcher: " + report        -> \\boxed{capital}

Rewards: both agents get 1.0 when the planner's final answer is the capital, else 0.0 (the team
reward is that grade), and nothing else: that searching pays is what the searcher has to learn.
The searcher takes its second turn exactly when its first was a well-formed search call
(exactly one call, of `search`, with a non-empty string `query`), so a run's rate of searches is
its model turns per episode less three.

    mrlx:
      plugins: [mrlx_lab.examples.research_pair.hooks]
      system: research_pair
      agents:
        planner: {url: self, sampling: {max_new_tokens: 16}}
        searcher: {url: "http://...", sampling: {max_new_tokens: 64}}

`mrlx demo --research` trains two small CPU models on it (`mrlx_lab.demos.research`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from mrlx_lab.examples.research_pair import corpus
from mrlx_plugin import hookimpl
from mrlx_plugin.agents import Endpoint, Outcome, Task, agent_code

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageToolCallUnion

PLANNER, SEARCHER = "planner", "searcher"
SYSTEM_NAME = "research_pair"
# Most new tokens per turn: a delegation, a report or a boxed answer is about 10, a search call 50.
SHORT_TOKENS, CALL_TOKENS = 16, 64
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed(text: str | None) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, stripped, or None."""
    found = _BOXED.findall(text or "")
    return found[-1].strip() if found else None


def well_formed_query(tool_calls: list[ChatCompletionMessageToolCallUnion] | None) -> str | None:
    """The query of a turn's tool calls when they are exactly one call of `search` with a usable
    query, else None."""
    if not tool_calls or len(tool_calls) != 1 or tool_calls[0].function.name != "search":
        return None
    return corpus.search_query(tool_calls[0].function.arguments)


async def research(task: Task, endpoints: dict[str, Endpoint]) -> Outcome:
    import openai  # the official client, as any user's agent code would use it

    planner, searcher = endpoints[PLANNER], endpoints[SEARCHER]
    # Evaluation episodes search the whole corpus; training ones never see a held-out document.
    documents = corpus.documents(corpus.HELD_OUT if task.evaluation else corpus.TRAIN)
    asked = [{"role": "user", "content": task.problem}]
    async with (
        openai.AsyncOpenAI(base_url=planner.base_url, api_key=planner.api_key, max_retries=0) as p,
        openai.AsyncOpenAI(base_url=searcher.base_url, api_key=searcher.api_key, max_retries=0) as s,
    ):
        plan = await p.chat.completions.create(model=planner.model, messages=asked, max_tokens=SHORT_TOKENS)
        delegation = plan.choices[0].message

        found = [{"role": "user", "content": delegation.content or ""}]
        first = await s.chat.completions.create(
            model=searcher.model, messages=found, tools=corpus.TOOLS, max_tokens=CALL_TOKENS
        )
        call = first.choices[0].message
        query = well_formed_query(call.tool_calls)
        report = call.content or ""
        if query is not None:
            found += [
                {
                    "role": "assistant",
                    "content": call.content,
                    "tool_calls": [c.model_dump() for c in call.tool_calls],
                },
                {
                    "role": "tool",
                    "tool_call_id": call.tool_calls[0].id,
                    "content": corpus.search(query, documents),
                },
            ]
            second = await s.chat.completions.create(
                model=searcher.model, messages=found, tools=corpus.TOOLS, max_tokens=SHORT_TOKENS
            )
            # A second call instead of a report reports nothing: the searcher has used its turns.
            report = "" if second.choices[0].message.tool_calls else second.choices[0].message.content or ""

        final = await p.chat.completions.create(
            model=planner.model,
            messages=[
                *asked,
                delegation.model_dump(exclude_none=True),
                {"role": "user", "content": corpus.report(report.strip())},
            ],
            max_tokens=SHORT_TOKENS,
        )
    answer = boxed(final.choices[0].message.content)
    right = 1.0 if answer is not None and answer == task.label else 0.0
    return Outcome(
        rewards={PLANNER: right, SEARCHER: right},
        answer=answer,
        team_reward=right,
    )


SYSTEM = agent_code(research, samples={PLANNER: 1, SEARCHER: 1}, turns={PLANNER: 2, SEARCHER: 2})


@hookimpl
def mrlx_register_systems():
    return {SYSTEM_NAME: SYSTEM}
