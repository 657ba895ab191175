"""Agents as code: a system whose episode is your own async function, talking to each agent through
an OpenAI-compatible endpoint that the rollout process serves (see docs/agents-as-code.md).

    from mrlx_plugin.agents import agent_code

    async def run(task, endpoints):
        solver = endpoints["solver"]
        client = openai.AsyncOpenAI(base_url=solver.base_url, api_key=solver.api_key)
        ...
        return {"solver": 1.0}

    CALC = agent_code(run, samples={"solver": 1}, turns={"solver": 4})
"""

from mrlx_plugin.agents.parsers import ParsedTurn, ToolCall, parse_turn
from mrlx_plugin.agents.system import AgentCodeSettings, Endpoint, Task, agent_code
from mrlx_plugin.episodes.outcome import Outcome

__all__ = [
    "AgentCodeSettings",
    "Endpoint",
    "Outcome",
    "ParsedTurn",
    "Task",
    "ToolCall",
    "agent_code",
    "parse_turn",
]
