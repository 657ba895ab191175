"""`mrlx demo` into a folder that already holds a run: refused unless told what to do with it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from _demo import demo as short_demo


def demo(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return short_demo(out, "--steps", "1", *extra)


def old_run(out: Path) -> None:
    """What an earlier, longer run leaves: later checkpoints, metrics rows, a coordinator database."""
    for agent in ("proposer", "decider"):
        for step in (3, 4):
            ckpt = out / agent / "checkpoints" / f"step_{step:05d}"
            ckpt.mkdir(parents=True)
            (ckpt / "config.json").write_text("{}")
        (out / agent / "metrics.jsonl").write_text(json.dumps({"step": 4, "samples": 4}) + "\n")
    (out / "coordinator.sqlite").write_text("not the new run's database")


def test_a_demo_into_a_folder_with_a_run_refuses_and_names_resume(tmp_path):
    out = tmp_path / "demo"
    old_run(out)
    r = demo(out)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    message = r.stderr.strip()
    assert message.startswith(f"mrlx demo: --out {out} already holds a run ")
    assert (
        "pass --resume to continue it, --overwrite to delete it and start over, or give another --out"
        in message
    )
    # nothing was started or touched
    assert not (out / "logs").exists() and not (out / "models").exists()
    assert sorted(p.name for p in (out / "proposer" / "checkpoints").iterdir()) == [
        "step_00003",
        "step_00004",
    ]
    assert (out / "coordinator.sqlite").read_text() == "not the new run's database"


@pytest.mark.slow
def test_overwrite_starts_the_run_clean(tmp_path):
    """The old run's later checkpoints once sorted after the new run's `step_00000`, which the
    trainer then pruned as the oldest."""
    out = tmp_path / "demo"
    old_run(out)
    r = demo(out, "--overwrite")
    assert r.returncode == 0, r.stderr[-4000:]
    for agent in ("proposer", "decider"):
        assert sorted(p.name for p in (out / agent / "checkpoints").iterdir()) == ["step_00000"]
    report = json.loads((out / "metrics.json").read_text())
    assert [row["step"] for row in report["metrics"]["proposer"]] == [-1, 0]  # the warm-start, then step 0
    assert report["summary"]["steps"] == 1
