"""Agent systems that talk to the endpoint's Messages API (Anthropic's): `anthropic_script`, whose
user function is the running test's own (`SCRIPT`), driving the official `anthropic` SDK; and
`claude_code`, which runs the unmodified Claude Code CLI (`claude -p ... --output-format json`) on
the task, pointed at its agent's endpoint from a fresh home and working folder. What the code saw
is kept in `SEEN` (by episode id) for the tests to read."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic

from mrlx_plugin import hookimpl
from mrlx_plugin.agents import agent_code
from mrlx_plugin.agents.harness import claude_code_env, run_harness

SCRIPT: list[Callable[[Any, dict], Awaitable[Any]]] = []
SEEN: dict[str, dict[str, Any]] = {}
CLAUDE_TIMEOUT_S = 150.0
CLAUDE_FILE = "hello.txt"  # what the scripted model's Bash call writes, in Claude Code's working folder
CLAUDE_TEXT = "hi-there"  # and what it writes there


def claude_bin() -> str | None:
    """The Claude Code CLI to run: $MRLX_CLAUDE_BIN, else `claude` on PATH."""
    return os.environ.get("MRLX_CLAUDE_BIN") or shutil.which("claude")


def client(endpoint, **kw) -> anthropic.AsyncAnthropic:
    """The official client on an agent's endpoint: its base URL without `/v1` (the SDK adds it)."""
    kw.setdefault("max_retries", 0)
    return anthropic.AsyncAnthropic(
        base_url=endpoint.base_url.removesuffix("/v1"), api_key=endpoint.api_key, **kw
    )


async def claude_code(task, endpoints):
    """`claude -p` on the task's problem in a fresh folder and home, allowed its Bash tool (it asks
    for permission otherwise, which nobody gives in print mode); graded on the file its Bash call
    wrote and the final text of the JSON result it printed."""
    ep = endpoints["coder"]
    binary = claude_bin()
    assert binary is not None, "the claude CLI is not installed (npm install @anthropic-ai/claude-code)"
    with tempfile.TemporaryDirectory(prefix="mrlx-claude-") as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        home.mkdir()
        work.mkdir()
        env = claude_code_env(ep, home)
        # Nothing it may reach but the endpoint: no feature flags, no title or quota probes.
        argv = [binary, "-p", task.problem, "--output-format", "json", "--allowedTools", "Bash"]
        result = await run_harness(argv, cwd=work, env=env, timeout_s=CLAUDE_TIMEOUT_S)
        target = work / CLAUDE_FILE
        written = target.read_text() if target.exists() else None
    try:
        printed = json.loads(result.stdout)
    except ValueError:
        printed = None
    SEEN[task.episode_id] = {"result": result, "written": written, "printed": printed}
    final = printed.get("result", "") if isinstance(printed, dict) else ""
    return {"coder": 1.0 if written == CLAUDE_TEXT and "file is written" in final else 0.0}


async def _scripted(task, endpoints):
    return await SCRIPT[-1](task, endpoints)


@hookimpl
def mrlx_register_systems():
    return {
        "anthropic_script": agent_code(_scripted, samples={"solver": 2}, turns={"solver": 3}),
        # Claude Code sends one request per model turn (in print mode, with its nonessential
        # traffic off): the Bash call, then the final answer.
        "claude_code": agent_code(claude_code, samples={"coder": 1}, turns={"coder": 2}),
    }
