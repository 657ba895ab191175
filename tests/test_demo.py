"""`mrlx demo`, shortened: the whole two-model loop on the CPU, and resuming it."""

from __future__ import annotations

import json

import pytest
from _demo import demo

pytestmark = pytest.mark.slow  # the demo's whole two-model loop, twice


def test_short_demo_runs_the_two_model_loop_and_resumes(tmp_path):
    out = tmp_path / "demo"
    first = demo(out, "--steps", "3")
    assert first.returncode == 0, first.stderr[-4000:]
    assert "mrlx demo finished" in first.stdout and "format-only steps" in first.stdout

    report = json.loads((out / "metrics.json").read_text())
    a_rows = [r for r in report["metrics"]["proposer"] if r["step"] >= 0]
    b_rows = [r for r in report["metrics"]["decider"] if r["step"] >= 0]
    assert [r["step"] for r in a_rows] == [0, 1, 2] and [r["step"] for r in b_rows] == [0, 1, 2]
    # the warm-start is in the logs, as such
    for name in ("proposer", "decider"):
        warm = [r for r in report["metrics"][name] if r["step"] == -1]
        assert warm and warm[0]["warm_start/steps"] == 2
    # both agents' samples went through the coordinator: A sent B's groups, B leased them
    assert all(r["coordinator/samples_sent"] == 4 and r["coordinator/groups_sent"] == 2 for r in a_rows)
    assert all(r["coordinator/groups"] == 2 and r["samples"] == 4 for r in b_rows)
    # both engines took new weights every step
    for rows in (a_rows, b_rows):
        assert [r["engine/weight_versions"] for r in rows] == [[str(s + 1)] for s in range(3)]
    assert (out / "rewards.png").stat().st_size > 5000 and (out / "rewards.png").read_bytes()[
        :4
    ] == b"\x89PNG"
    summary = report["summary"]
    assert summary["steps"] == 3 and summary["agents"]["proposer"]["samples_trained"] == 12
    assert summary["peak_memory_mib"] > 0
    assert sorted(p.name for p in (out / "proposer" / "checkpoints").iterdir())[-1] == "step_00002"

    second = demo(out, "--steps", "5", "--resume")
    assert second.returncode == 0, second.stderr[-4000:]
    report = json.loads((out / "metrics.json").read_text())
    a_rows = [r for r in report["metrics"]["proposer"] if r["step"] >= 0]
    b_rows = [r for r in report["metrics"]["decider"] if r["step"] >= 0]
    assert [r["step"] for r in a_rows] == [0, 1, 2, 3, 4] and [r["step"] for r in b_rows] == [0, 1, 2, 3, 4]
    assert a_rows[3]["resumed_from"].endswith("step_00002") and b_rows[3]["resumed_from"].endswith(
        "step_00002"
    )
    assert [r["engine/weight_versions"] for r in a_rows[3:]] == [["4"], ["5"]]
    # resuming trained nothing twice: B got exactly A's two new steps of groups
    assert all(r["coordinator/groups"] == 2 for r in b_rows[3:])


def test_short_adapter_demo_trains_each_agents_adapter_on_one_engine_and_resumes(tmp_path):
    out = tmp_path / "adapters"
    first = demo(out, "--adapters", "--lora-rank", "4", "--steps", "3")
    assert first.returncode == 0, first.stderr[-4000:]
    assert "two LoRA adapters on one base" in first.stdout
    report = json.loads((out / "metrics.json").read_text())
    summary = report["summary"]
    assert summary["adapters"] is True and summary["base_warm_start"]["warm_start/steps"] == 4
    # one engine (and one router) for both agents, serving the base and both adapters
    engines = sorted(p.name for p in (out / "logs").glob("engine-*.log"))
    assert engines == ["engine-proposer-decider.log"], engines
    for name in ("proposer", "decider"):
        rows = [r for r in report["metrics"][name] if r["step"] >= 0]
        assert [r["step"] for r in rows] == [0, 1, 2]
        # each trainer pushed its own adapter every step; the engine reports that adapter's version
        assert [r["engine/weight_versions"] for r in rows] == [[str(s + 1)] for s in range(3)]
        # the adapters start from the warm-started base: no warm-start of their own
        assert not [r for r in report["metrics"][name] if r["step"] == -1]
        latest = sorted((out / name / "checkpoints").iterdir())[-1]
        files = {p.name for p in latest.iterdir()}
        assert "adapter_model.safetensors" in files and "model.safetensors" not in files, files
        assert f"adapter: {name}" in (out / f"{name}.yaml").read_text()
    a_rows = [r for r in report["metrics"]["proposer"] if r["step"] >= 0]
    assert all(r["coordinator/samples_sent"] == 4 for r in a_rows)

    second = demo(out, "--adapters", "--lora-rank", "4", "--steps", "5", "--resume")
    assert second.returncode == 0, second.stderr[-4000:]
    report = json.loads((out / "metrics.json").read_text())
    for name in ("proposer", "decider"):
        rows = [r for r in report["metrics"][name] if r["step"] >= 0]
        assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
        assert rows[3]["resumed_from"].endswith("step_00002")
        assert [r["engine/weight_versions"] for r in rows[3:]] == [["4"], ["5"]]
