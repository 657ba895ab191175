"""Rewards of the doctor/patient role-play, as a user would write them in their own repository.

The doctor earns 1.0 for naming the case's condition after "DIAGNOSIS:". The patient shares the
consultation's outcome, and loses 0.5 for naming the condition itself (it is there to describe
symptoms, not to give the answer away). `rewards.shaping: bilateral` in the YAML then mixes the
two, so each agent also cares about the other's reward.
"""

from __future__ import annotations

import re

from mrlx_plugin import hookimpl

_DIAGNOSIS = re.compile(r"DIAGNOSIS:\s*(.+)", re.IGNORECASE)


def diagnosed_right(text: str, label: str) -> bool:
    found = _DIAGNOSIS.findall(text or "")
    return bool(found) and str(label).strip().lower() in found[-1].strip().lower()


@hookimpl
def mrlx_grade(agent, transcript, episode):
    doctor = episode.final_transcript
    outcome = 1.0 if doctor is not None and diagnosed_right(doctor.answer_text, episode.label) else 0.0
    if agent == "doctor":
        return 1.0 if diagnosed_right(transcript.answer_text, episode.label) else 0.0
    if agent == "patient":
        leaked = any(str(episode.label).lower() in turn.text.lower() for turn in transcript.turns)
        return outcome - (0.5 if leaked else 0.0)
    return None
