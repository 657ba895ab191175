"""Prompts of the example math team: what each role is asked.

Plain functions from the problem (and the team's earlier answers) to a user message, handed to
`mrlx_plugin.systems.pipeline.make_pipeline` in agent_system.py. Change the wording here; the pipeline
takes care of tokenising, context limits and rewards.
"""

from __future__ import annotations


def solver(problem: str) -> str:
    return f"{problem}\n\nThink it through, then give only the final result in \\boxed{{}} on the last line."


def _candidates(solutions: list[str]) -> str:
    return "\n\n".join(f"Candidate {i}:\n{s}" for i, s in enumerate(solutions, 1))


def rewriter(problem: str, solutions: list[str]) -> str:
    return (
        f"{problem}\n\n"
        f"{len(solutions)} teammates answered this problem. Read their work, keep what is right, "
        "fix what is wrong, and write your own complete solution with the final result in \\boxed{}.\n\n"
        f"{_candidates(solutions)}"
    )


def selector(problem: str, solutions: list[str]) -> str:
    return (
        f"{problem}\n\n"
        f"Pick the best of these {len(solutions)} candidate solutions. Verify each final result; "
        f"end with the line 'Judgment: N' where N is between 1 and {len(solutions)}.\n\n"
        f"{_candidates(solutions)}"
    )
