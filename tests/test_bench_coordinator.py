"""`mrlx bench coordinator` in a seconds-long configuration: the producer, coordinator, consumer
and baseline processes run for real, every sample of every step arrives intact (checksums) on
both paths, the barrier wake-ups are measured, and the report is written where asked. Timings
are reported by the benchmark, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # runs the coordinator benchmark end to end


def test_a_small_coordinator_bench_moves_every_sample_intact_on_both_paths(tmp_path):
    out = tmp_path / "coordinator.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mrlx_plugin.cli",
            "bench",
            "coordinator",
            "--samples",
            "64",
            "--tokens",
            "256",
            "--steps",
            "2",
            "--step-gap-s",
            "0",
            "--wake-trials",
            "5",
            "--workdir",
            str(tmp_path),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "speed-up vs baseline" in done.stdout and str(out) in done.stdout
    report = json.loads(out.read_text())
    for path in ("coordinator_steps", "baseline_steps"):
        assert len(report[path]) == 2
        for step in report[path]:
            assert step["received"] == 64 and step["checksum_ok"] is True, (path, step)
    assert (
        report["wake_up_ms"]["trials"] == 5 and report["wake_up_ms"]["p99"] >= report["wake_up_ms"]["p50"] > 0
    )
    assert report["speedup_vs_baseline"] > 0
