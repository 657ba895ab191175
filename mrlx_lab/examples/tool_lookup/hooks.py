"""A tool-using task as agent code: look an item's code up with a tool, then answer it.

The agent (`solver`) is asked "What is the code of item C?". The code is in a table that only the
`lookup` tool reads (`mrlx_lab.examples.tool_lookup.data`). The episode is ordinary code against the
agent's OpenAI-compatible endpoint, with the official `openai` client: it offers the tool, runs
the call the model makes, sends the tool's answer back as a `tool` message (context: never
trained on), and reads the final answer, `\\boxed{code}`. Two model turns at most: the lookup,
then the answer (a turn with no call is the answer).

Reward: 1.0 for the right final answer (the code of the asked item), else 0.0, and nothing for
the call itself: that looking the code up pays and guessing it does not is what the agent has
to learn. The team reward (`multi_agent/team_reward`) is the same grade.

    mrlx:
      plugins: [mrlx_lab.examples.tool_lookup.hooks]
      system: tool_lookup
      agents: {solver: {url: self, sampling: {max_new_tokens: 64}}}

`mrlx demo --tools` trains a small CPU model on it (`mrlx_lab.demos.tools`).
"""

from __future__ import annotations

import re

from mrlx_lab.examples.tool_lookup import data
from mrlx_plugin import hookimpl
from mrlx_plugin.agents import Endpoint, Outcome, Task, agent_code

AGENT = "solver"
MAX_TURNS = 2
SYSTEM_NAME = "tool_lookup"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed(text: str | None) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, stripped, or None."""
    found = _BOXED.findall(text or "")
    return found[-1].strip() if found else None


async def solve(task: Task, endpoints: dict[str, Endpoint]) -> Outcome:
    import openai  # the official client, as any user's agent code would use it

    asked, table = data.parse_label(task.label)
    ep = endpoints[AGENT]
    messages: list[dict[str, object]] = [{"role": "user", "content": task.problem}]
    async with openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(model=ep.model, messages=messages, tools=data.TOOLS)
        msg = reply.choices[0].message
        if msg.tool_calls:  # run the tools, send their answers back, and let the model answer
            messages.append(
                {
                    "role": "assistant",
                    "content": msg.content,
                    "tool_calls": [call.model_dump() for call in msg.tool_calls],
                }
            )
            for call in msg.tool_calls:
                result = (
                    data.lookup(table, call.function.arguments)[0]
                    if call.function.name == "lookup"
                    else (f"no tool {call.function.name}")
                )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            reply = await client.chat.completions.create(model=ep.model, messages=messages, tools=data.TOOLS)
            msg = reply.choices[0].message
    # A second turn that calls the tool again gives no answer: the episode has used its turns.
    answer = None if msg.tool_calls else boxed(msg.content)
    right = 1.0 if answer is not None and answer == table[asked] else 0.0
    return Outcome(rewards={AGENT: right}, answer=answer, team_reward=right)


SYSTEM = agent_code(solve, samples={AGENT: 1}, turns={AGENT: MAX_TURNS})


@hookimpl
def mrlx_register_systems():
    return {SYSTEM_NAME: SYSTEM}
