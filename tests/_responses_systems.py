"""Agent systems that talk to the endpoint's Responses API: `responses_script`, whose user function
is the running test's own (`SCRIPT`), and `codex`, which runs the unmodified Codex CLI
(`codex exec`) on the task, pointed at its agent's endpoint through a fresh `CODEX_HOME`. What the
code saw is kept in `SEEN` (by episode id) for the tests to read."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mrlx_plugin import hookimpl
from mrlx_plugin.agents import agent_code
from mrlx_plugin.agents.harness import codex_home, run_harness

SCRIPT: list[Callable[[Any, dict], Awaitable[Any]]] = []
SEEN: dict[str, dict[str, Any]] = {}
CODEX_TIMEOUT_S = 120.0
CODEX_FILE = "out.txt"  # what the scripted model's shell call writes, in Codex's working folder


def codex_bin() -> str | None:
    """The Codex CLI to run: $MRLX_CODEX_BIN, else `codex` on PATH."""
    return os.environ.get("MRLX_CODEX_BIN") or shutil.which("codex")


async def codex(task, endpoints):
    """`codex exec` on the task's problem, in a fresh folder and home; graded on the file its
    shell call wrote and its final message."""
    ep = endpoints["coder"]
    binary = codex_bin()
    assert binary is not None, "the codex CLI is not installed (npm install @openai/codex)"
    with tempfile.TemporaryDirectory(prefix="mrlx-codex-") as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        home.mkdir()
        work.mkdir()
        # No sandbox: the shell command is the test's own, in a fresh folder, and Codex's sandbox
        # (bubblewrap, user namespaces) is not available in every CI container.
        env = codex_home(ep, home, sandbox_mode="danger-full-access")
        argv = [binary, "exec", "--skip-git-repo-check", task.problem]
        result = await run_harness(argv, cwd=work, env=env, timeout_s=CODEX_TIMEOUT_S)
        written = (work / CODEX_FILE).read_text() if (work / CODEX_FILE).exists() else None
    SEEN[task.episode_id] = {"result": result, "written": written}
    done = written == "hello from codex" and "file is written" in result.stdout
    return {"coder": 1.0 if done else 0.0}


async def _scripted(task, endpoints):
    return await SCRIPT[-1](task, endpoints)


@hookimpl
def mrlx_register_systems():
    return {
        "responses_script": agent_code(_scripted, samples={"solver": 3}, turns={"solver": 3}),
        # Codex sends one request per model turn: the shell call, then the final answer.
        "codex": agent_code(codex, samples={"coder": 1}, turns={"coder": 2}),
    }
