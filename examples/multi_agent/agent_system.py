"""An example hook module, as it would live in a user's own repository.

List it in the YAML (`mrlx.plugins: [examples.multi_agent.agent_system]`) with its repository on
the rollout process's PYTHONPATH; nothing in mrlx_plugin changes. It registers a `math_team`
system (the solver -> rewriter -> selector pipeline with the prompts of prompts.py) and adds a
format rule to grading.
"""

from __future__ import annotations

from mrlx_plugin import hookimpl
from mrlx_plugin.systems.pipeline import PipelinePrompts, make_pipeline

from . import prompts

FORMAT_PENALTY = -0.1


@hookimpl
def mrlx_register_systems():
    team = make_pipeline(
        PipelinePrompts(solver=prompts.solver, rewriter=prompts.rewriter, selector=prompts.selector)
    )
    return {"math_team": team}


@hookimpl
def mrlx_grade(agent, transcript, episode):
    """An answer without a boxed result costs a little; anything else goes to the math grader."""
    if "\\boxed" not in transcript.answer_text:
        return FORMAT_PENALTY
    return None
