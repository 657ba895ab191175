"""`run_harness`: a harness process per episode, ended however the episode ends, its output kept,
nothing of its process group left running (real processes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mrlx_plugin.agents.harness import run_harness
from mrlx_plugin.core.retry import async_wait_until


def gone(pid: int) -> bool:
    """The process is gone, or a zombie waiting for its parent (it runs nothing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def test_a_harness_that_exits_leaves_nothing_running_and_its_output_is_kept(tmp_path):
    script = "echo out; echo err >&2; sleep 300 & echo $! > bg.pid; exit 3"
    result = asyncio.run(run_harness(["bash", "-c", script], cwd=tmp_path, env={}, timeout_s=60))
    assert (result.returncode, result.stdout, result.stderr, result.timed_out) == (3, "out\n", "err\n", False)
    assert gone(int((tmp_path / "bg.pid").read_text()))  # the server a tool left running is killed


def test_a_harness_past_its_deadline_is_ended_even_if_it_ignores_sigterm(tmp_path):
    script = "trap '' TERM; echo $$ > me.pid; echo started; sleep 300"
    result = asyncio.run(run_harness(["bash", "-c", script], cwd=tmp_path, env={}, timeout_s=1))
    assert result.timed_out and result.returncode is None and result.stdout == "started\n"
    assert gone(int((tmp_path / "me.pid").read_text()))


def test_a_cancelled_episode_ends_its_harness(tmp_path):
    async def go():
        task = asyncio.ensure_future(
            run_harness(["bash", "-c", "echo $$ > me.pid; sleep 300"], cwd=tmp_path, env={}, timeout_s=600)
        )
        pid_file = tmp_path / "me.pid"
        started = lambda: pid_file.exists() and pid_file.read_text().strip()  # noqa: E731
        await async_wait_until(started, 30, what="the harness to start")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return int(pid_file.read_text())

    assert gone(asyncio.run(go()))


def test_the_environment_is_exactly_the_one_given(tmp_path, monkeypatch):
    monkeypatch.setenv("MRLX_SECRET_OF_THE_HOST", "leak")
    result = asyncio.run(run_harness(["bash", "-c", "env"], cwd=tmp_path, env={"ONLY": "this"}, timeout_s=30))
    assert "ONLY=this" in result.stdout and "MRLX_SECRET_OF_THE_HOST" not in result.stdout
