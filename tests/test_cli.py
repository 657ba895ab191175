"""The `mrlx` command as a user runs it: real subprocesses, real engines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mrlx_plugin.core import processes
from mrlx_plugin.core.netutil import free_port
from mrlx_plugin.local.services import router_available

REPO = Path(__file__).resolve().parent.parent


def mrlx(*argv: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mrlx_plugin.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_rollout_local_runs_the_example_team_and_writes_samples(tmp_path, tiny_model_dir):
    out = tmp_path / "samples.jsonl"
    r = mrlx(
        "rollout",
        "--local",
        "--config",
        "examples/multi_agent/local.yaml",
        "--model-dir",
        str(tiny_model_dir),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "16",
        "--output",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 episodes" in r.stdout and "multi_agent/avg_turns" in r.stdout
    if router_available():
        assert "behind sglang-router" in r.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    agents = {row["metadata"]["mrlx"]["agent"] for row in rows}
    assert {"solver"} <= agents <= {"solver", "rewriter", "selector"}
    for row in rows:
        assert row["status"] in ("completed", "truncated")
        assert len(row["loss_mask"]) == row["response_length"] == len(row["rollout_log_probs"])
        assert isinstance(row["reward"], float) and isinstance(row["advantage"], float)
        assert row["rollout_id"] == row["index"]


@pytest.mark.slow
def test_check_passes_on_reachable_agents_and_names_an_unreachable_url(tmp_path, stub_engine, tiny_model_dir):
    dead = f"http://127.0.0.1:{free_port()}"
    good = tmp_path / "good.yaml"
    good.write_text(
        "mrlx:\n  system: pipeline\n  agents:\n"
        f"    solver: {{url: self}}\n    rewriter: {{url: '{stub_engine.url}'}}\n"
        f"    selector: {{url: self, tokenizer: '{tiny_model_dir}'}}\n"
    )
    r = mrlx("check", "--config", str(good), "--router-url", stub_engine.url)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all good" in r.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace(stub_engine.url, dead))
    r = mrlx("check", "--config", str(bad), "--router-url", stub_engine.url)
    assert r.returncode == 1
    assert f"agent 'rewriter' at {dead} is unreachable" in r.stdout


def test_check_names_the_bad_key_and_exits_2(tmp_path):
    cfg = tmp_path / "typo.yaml"
    cfg.write_text("mrlx:\n  pipeline: {num_parallel: 'x'}\n")
    r = mrlx("check", "--config", str(cfg))
    assert r.returncode == 2
    assert "mrlx.pipeline.num_parallel: got str 'x'; expected an integer" in r.stderr


def test_two_jobs_configs_are_checked_against_each_other(tmp_path):
    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    body = (
        "mrlx:\n  run_id: {run}\n  system: dialogue\n  self: {me}\n"
        "  agents: {{doctor: {{url: self}}, patient: {{url: self}}}}\n"
    )
    a.write_text(body.format(run="r1", me="doctor"))
    b.write_text(body.format(run="r2", me="doctor"))
    r = mrlx("check", "--config", str(a), "--config", str(b), "--skip-tokenizers")
    assert r.returncode == 1
    assert "mrlx.run_id 'r2' differs" in r.stdout
    assert "mrlx.self is 'doctor', the same as in" in r.stdout


def test_unknown_command_and_help():
    r = mrlx("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr
    r = mrlx("--help")
    assert r.returncode == 0 and "rollout" in r.stdout and "coordinator" in r.stdout


@pytest.mark.parametrize("argv", [["engine", "--help"], ["stub-engine", "--help"], ["rollout", "--help"]])
def test_subcommand_help(argv):
    r = mrlx(*argv)
    assert r.returncode == 0 and "usage" in r.stdout


def test_check_wait_repeats_the_checks_until_a_late_engine_answers(tmp_path, logs_dir, tiny_model_dir):
    """`mrlx check --wait` gates a launch: it keeps checking (through the one retry helper) and
    passes once the engine that was down comes up."""
    from mrlx_plugin.core.retry import wait_until
    from mrlx_plugin.local.services import start_service

    port = free_port()
    cfg = tmp_path / "late.yaml"
    cfg.write_text(
        "mrlx:\n  system: pipeline\n  agents:\n"
        f"    solver: {{url: self, tokenizer: '{tiny_model_dir}'}}\n"
        f"    rewriter: {{url: self, tokenizer: '{tiny_model_dir}'}}\n"
        f"    selector: {{url: self, tokenizer: '{tiny_model_dir}'}}\n"
    )
    log = tmp_path / "check.log"
    with open(log, "w") as out:
        check = processes.start(
            [
                sys.executable,
                "-m",
                "mrlx_plugin.cli",
                "check",
                "--config",
                str(cfg),
                "--router-url",
                f"http://127.0.0.1:{port}",
                "--timeout",
                "1",
                "--wait",
                "120",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    engine = None
    try:
        # the first round of checks has run (and failed) before the engine exists
        wait_until(
            lambda: check.poll() is not None or "checking again" in log.read_text(),
            deadline=60,
            what="a first, failed round of checks",
        )
        assert check.poll() is None, log.read_text()
        engine = start_service(
            "late-stub",
            [sys.executable, "-m", "mrlx_lab.stub_engine", "--port", str(port)],
            log_dir=logs_dir,
            port=port,
            health_path="/health",
        )
        assert check.wait(timeout=120) == 0, log.read_text()
        assert "all good" in log.read_text()
    finally:
        processes.stop(check)
        if engine is not None:
            engine.stop()


def test_check_wants_one_role_per_config(tmp_path):
    cfg = tmp_path / "a.yaml"
    cfg.write_text("mrlx:\n  system: pipeline\n")
    r = mrlx("check", "--offline", "--config", str(cfg), "--config", str(cfg), "--role", "initiator")
    assert r.returncode == 2 and "give one --role per --config (2 configs, 1 roles)" in r.stderr
    r = mrlx("check", "--offline", "--config", str(cfg), "--role", "judge")
    assert r.returncode == 2 and "invalid choice: 'judge'" in r.stderr
