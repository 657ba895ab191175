"""Rewards of the solver/verifier pair.

The solver is graded by the package's math grader (it returns None here to defer to it). The
verifier earns 1.0 when its last verdict is the truth about the solution it last saw: "correct"
for a right answer, "incorrect" for a wrong one; a missing verdict earns 0.0.
"""

from __future__ import annotations

import re

from mrlx_plugin import hookimpl
from mrlx_plugin.rewards.grading import quick_grade

_VERDICT = re.compile(r"VERDICT:\s*(correct|incorrect)", re.IGNORECASE)


@hookimpl
def mrlx_grade(agent, transcript, episode):
    if agent != "verifier":
        return None
    verdicts = _VERDICT.findall(transcript.answer_text)
    if not verdicts:
        return 0.0
    solver = episode.final_transcript
    right = solver is not None and quick_grade(solver.answer_text, episode.label) == 1.0
    said_right = verdicts[-1].lower() == "correct"
    return 1.0 if said_right == right else 0.0
