"""`mrlx bench credit --quick`: every arm of the benchmark runs for real (embedded engines, the
embedded trainer, the game system through the plugin's rollout functions), counts its engine
calls, evaluates before and after training, and the report has its full structure. Learning
and timings are the benchmark's to report, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import processes_naming

pytestmark = pytest.mark.slow  # five short training runs and two warm-starts (about 90 s)

REPO = Path(__file__).resolve().parent.parent
STEPS, PROMPTS, PER_PROMPT, BRANCH, LENGTH = 2, 2, 4, 4, 3


def test_quick_run_runs_every_arm_and_counts_its_engine_calls(tmp_path: Path):
    out = tmp_path / "bench" / "credit.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mrlx_plugin.cli",
            "bench",
            "credit",
            "--quick",
            "--out",
            str(out),
            "--quiet",
            "--steps",
            str(STEPS),
            "--nim-steps",
            str(STEPS),
            "--prompts-per-step",
            str(PROMPTS),
            "--samples-per-prompt",
            str(PER_PROMPT),
            "--branch",
            str(BRANCH),
            "--chain-length",
            str(LENGTH),
        ],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for heading in ("chain:", "nim:", "steps to held-out success", "win rate vs script:random, after"):
        assert heading in proc.stdout, heading
    r = json.loads(out.read_text())
    assert set(r) >= {"machine", "config", "chain", "nim", "wall_time_s", "plot"}
    assert r["config"]["quick"] is True and r["config"]["steps"] == STEPS

    chain = r["chain"]
    assert list(chain["arms"]) == ["episode", "turn", "turn+branch"]
    assert str(BRANCH) in chain["budget"]
    for name, arm in chain["arms"].items():
        assert arm["steps"] == STEPS, name
        assert len(arm["engine_calls_per_step"]) == STEPS and all(
            c > 0 for c in arm["engine_calls_per_step"]
        ), name
        assert arm["engine_calls"] == sum(arm["engine_calls_per_step"])
        # the budget: no arm spends more engine calls per step than its episodes' bound
        assert all(c <= arm["engine_calls_per_step_at_most"] for c in arm["engine_calls_per_step"]), name
        assert arm["samples_trained"] > 0
        # evaluated before training and after every step (--quick: --eval-interval 1)
        assert [p["after_steps"] for p in arm["eval"]] == list(range(STEPS + 1)), name
        assert all(0.0 <= p["value"] <= 1.0 for p in arm["eval"])
        assert arm["before"] == arm["eval"][0]["value"] and arm["after"] == arm["eval"][-1]["value"]
        assert arm["steps_to_threshold"] is None or 0 <= arm["steps_to_threshold"] <= STEPS
        assert arm["wall_time_s"] > 0 and arm["held_out_episodes"] > 0
    episode, turn, tree = (chain["arms"][k] for k in ("episode", "turn", "turn+branch"))
    assert episode["rewards"] == {"credit": "episode"} and turn["rewards"]["credit"] == "turn"
    assert tree["rewards"]["branch"] == BRANCH
    # the same budget: tree sampling runs BRANCH times fewer episodes per step, for the same bound
    assert episode["episodes_per_step"] == turn["episodes_per_step"] == PROMPTS * PER_PROMPT
    assert tree["episodes_per_step"] * BRANCH == PROMPTS * PER_PROMPT
    assert len({a["engine_calls_per_step_at_most"] for a in chain["arms"].values()}) == 1
    # tree sampling's extra calls are counted: BRANCH - 1 candidates per turn taken
    assert all(b is not None and b >= BRANCH - 1 for b in tree["branch_candidates_per_episode"])
    assert all(
        b is None for b in episode["branch_candidates_per_episode"] + turn["branch_candidates_per_episode"]
    )
    # every arm starts from the same warm-started model and seed: the same evaluation before training
    assert len({a["before"] for a in chain["arms"].values()}) == 1

    nim = r["nim"]
    assert list(nim["arms"]) == ["self-play", "frozen copy"]
    for name, arm in nim["arms"].items():
        assert arm["steps"] == STEPS and arm["engine_calls"] > 0, name
        assert all(c > 0 for c in arm["engine_calls_per_step"]), name
        for when in ("before_by_seat", "after_by_seat", "before_illegal_rate", "after_illegal_rate"):
            assert set(arm[when]) == {"first", "second"}, (name, when)
            assert all(v is not None and 0.0 <= v <= 1.0 for v in arm[when].values()), (name, when)
        assert arm["evaluation_episodes"] > 0
    assert nim["arms"]["self-play"]["seats"] == ["player", "player"]
    assert nim["arms"]["frozen copy"]["seats"] == ["player", "frozen"]
    assert nim["arms"]["self-play"]["before_by_seat"] == nim["arms"]["frozen copy"]["before_by_seat"]

    if r["plot"] is not None:  # matplotlib installed
        assert Path(r["plot"]).read_bytes()[:4] == b"\x89PNG"
    assert not processes_naming(str(tmp_path))
