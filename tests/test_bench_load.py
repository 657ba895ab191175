"""`mrlx bench load` in a seconds-long configuration: every process it starts (stub engine,
coordinator, consumer, rollout) runs for real on 127.0.0.1, the report it writes has its full
structure, what it checks holds (every episode in flight at once, the queue never deeper than
its limit, every committed item acked exactly once), and no process outlives it, also when the
benchmark is interrupted. Timings are reported by the benchmark, never asserted here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _procs import processes_naming

pytestmark = pytest.mark.slow  # runs the load benchmark end to end (about a minute)

EPISODES, PER_PROMPT, MAX_DEPTH = 64, 4, 16


def tiny_run(workdir: Path, out: Path, soak_minutes: float = 0.1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mrlx_plugin.cli",
        "bench",
        "load",
        "--episodes",
        str(EPISODES),
        "--n-samples-per-prompt",
        str(PER_PROMPT),
        "--warmup-episodes",
        "8",
        "--soak-episodes",
        "32",
        "--soak-minutes",
        str(soak_minutes),
        "--latency",
        "1.0",
        "--prompt-tokens",
        "64",
        "--response-tokens",
        "16",
        "--max-depth",
        str(MAX_DEPTH),
        "--consumer-rate",
        "100",
        "--lease-groups",
        "2",
        "--sample-interval",
        "1",
        "--metrics-interval",
        "0.2",
        "--warmup-s",
        "1",
        "--window-s",
        "2",
        "--workdir",
        str(workdir),
        "--out",
        str(out),
        "--quiet",
    ]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-load")  # the tokenizer is built once, for both tests


def test_tiny_load_run_writes_a_complete_report(workdir: Path):
    out = workdir / "load.json"
    proc = subprocess.run(tiny_run(workdir, out), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mrlx bench load" in proc.stdout and "checks:" in proc.stdout
    r = json.loads(out.read_text())

    assert set(r) >= {
        "machine",
        "config",
        "load",
        "coordinator",
        "soak",
        "rounds",
        "statuses",
        "checks",
        "ok",
    }
    assert r["config"]["episodes"] == EPISODES and r["config"]["max_depth"] == MAX_DEPTH

    load = r["load"]
    assert load["episodes"] == EPISODES
    assert load["max_in_flight"] == EPISODES  # the rollout semaphore let every episode run at once
    assert load["peak_rss_mib"] >= load["rss_before_mib"] > 0
    assert load["statuses"] and "aborted" not in load["statuses"]

    c = r["coordinator"]
    assert c["max_depth_limit"] == MAX_DEPTH
    assert 0 < c["max_depth_observed"] <= MAX_DEPTH and c["depth_bounded"] is True
    assert c["commits_429_total"] > 0  # 64 items at once against a 16-item queue: producers were pushed back
    assert c["duplicates"] == 0 and c["consumer"]["bad_groups"] == 0
    # every b-sample the rollout sent reached the consumer exactly once
    assert (
        c["items_sent_by_rollout"]
        == c["items_enqueued_total"]
        == c["items_acked_total"]
        == c["consumer"]["items"]
    )
    assert c["items_sent_by_rollout"] >= EPISODES
    assert len(c["depth_samples"][0]) == len(c["depth_samples_columns"])
    assert all(row[1] <= MAX_DEPTH for row in c["depth_samples"])
    for part in ("load_round", "soak", "whole_run"):
        assert {"items_per_s", "acked_per_s", "commits_ok", "commits_429"} <= set(c[part])

    rounds = r["rounds"]
    assert [x["phase"] for x in rounds[:2]] == ["warmup", "load"]
    assert all(x["phase"] == "soak" for x in rounds[2:]) and r["soak"]["rounds"] == len(rounds) - 2 >= 1
    assert [x["round"] for x in rounds] == list(range(len(rounds)))
    assert sum(r["statuses"].values()) == sum(x["episodes"] for x in rounds)  # one sample of a per episode

    soak = r["soak"]
    assert soak["samples"], "no RSS/fd sample was taken during the soak"
    for sample in soak["samples"]:
        assert {"t_s", "rollout_rss_mib", "rollout_fds", "coordinator_rss_mib", "coordinator_fds"} <= set(
            sample
        )
    for name in ("rollout_rss_mib", "rollout_fds", "coordinator_rss_mib", "coordinator_fds"):
        trend = soak["trends"][name]
        assert {"first", "last", "max", "growth", "growth_pct", "flagged"} <= set(trend)
        assert trend["max"] >= max(trend["first"], trend["last"]) > 0
        assert isinstance(trend["flagged"], bool)

    assert all(isinstance(v, bool) for v in r["checks"].values())
    assert r["ok"] == all(r["checks"].values())
    for check in (
        "all_episodes_in_flight",
        "depth_bounded",
        "backpressure_engaged",
        "no_aborted_samples",
        "every_item_acked_once",
    ):
        assert r["checks"][check] is True, check
    assert not processes_naming(r["config"]["run_dir"])


def test_an_interrupted_run_leaves_no_process_behind(workdir: Path, tmp_path: Path):
    runs = tmp_path / "runs"
    runs.mkdir()
    os.symlink(workdir / "tokenizer-8k", runs / "tokenizer-8k")  # the module's tokenizer: no build here
    # Plain Popen, as a shell starts it (see test_teardown.start): the test watches its own clean-up.
    proc = subprocess.Popen(
        tiny_run(runs, tmp_path / "never.json", soak_minutes=5),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        events = None
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(runs.glob("load-*/events.jsonl"))
            if found and '"phase": "load"' in found[0].read_text():
                events = found[0]
                break
            time.sleep(0.2)
        assert events is not None, (proc.stdout.read() if proc.poll() is not None else b"").decode()[-3000:]
        run_dir = str(events.parent)
        assert processes_naming(run_dir), "the benchmark's processes should be running mid-soak"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not (tmp_path / "never.json").exists()
    leftover = processes_naming(run_dir)
    assert not leftover, leftover
