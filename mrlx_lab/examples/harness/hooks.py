"""Claude Code or Codex, unmodified, as the harness of the model being trained.

Each episode starts the CLI once, in a fresh temporary folder (its working folder, beside a home of
its own), pointed at the endpoint of the agent `coder`: Claude Code at its Messages API, Codex at
its Responses API. The CLI is told the task's problem and asked to write its final answer to
`answer.txt` in its working folder; it then works as it always does (its own system prompt and
tools, running the commands the model calls in that folder) until it is done or
`HARNESS_TIMEOUT_S` has passed. The episode is graded on what it left: the content of
`answer.txt` if the CLI wrote one, else the final text the CLI printed, by `task.grade` (the
`mrlx_grade` hook: math-verify against the task's label unless a plugin grades otherwise). Every
conversation the CLI held with the model (its main one, a sub-agent's, a history it rewrote when
it compacted its context) is a sample of the exact ids the engine sampled, and gets that grade.

    claude_code_task:  claude -p PROMPT --output-format json --allowedTools Bash Read Write Edit Glob Grep
    codex_task:        codex exec --skip-git-repo-check --color never -o LAST_MESSAGE PROMPT

Run it with harness.yaml, beside this file (`tool_parser: hermes`: the model writes its calls of
the CLI's tools as Hermes `<tool_call>` blocks, as Qwen models do):

    CONFIG="$(python -c 'import mrlx_lab.examples.harness as h; print(h.__path__[0])')/harness.yaml"
    mrlx rollout --config "$CONFIG" --router-url http://ROUTER:PORT --prompt-data problems.jsonl \\
        --hf-checkpoint MODEL_DIR

What it needs where the rollout runs:

- node 20 or newer and the CLI: `npm install @anthropic-ai/claude-code@2.1.197` (claude_code_task)
  or `npm install @openai/codex@0.171.0` (codex_task), found at $MRLX_CLAUDE_BIN / $MRLX_CODEX_BIN,
  else as `claude` / `codex` on PATH; without it every episode fails, saying how to install it.
- a model whose context holds the CLI's prompt: Claude Code's system prompt and two dozen tools
  are some 38,000 tokens before the task, Codex's some 19,000 (with a Qwen-style template); and
  `--rollout-max-response-len` room, after that prompt, for the conversation's turns and the
  output of its tools.
- a machine the model's commands may run on: they run as this process's user, in the episode's
  folder; Codex in its own sandbox (`CODEX_SANDBOX`), Claude Code's Bash unconfined. Run the
  rollout in a container.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from mrlx_plugin import hookimpl
from mrlx_plugin.agents import Endpoint, Outcome, Task, agent_code
from mrlx_plugin.agents.harness import HarnessResult, claude_code_env, codex_home, run_harness

logger = logging.getLogger(__name__)

AGENT = "coder"
ANSWER_FILE = "answer.txt"
PROMPT = (
    "Task: {problem}\n\n"
    "Work in the current folder. When you have the answer, write it, and nothing else, to the file "
    f"{ANSWER_FILE} in the current folder."
)  # it starts with words of its own: a problem that starts with "-" is not read as a flag
# The CLI's own deadline. The episode's, `mrlx.<system>.timeout_s` (600 s unless the config says
# otherwise), is the hard one: past it the episode is aborted and trains nothing. This one is
# shorter, so a CLI that works too long is ended (its process group with it) and still graded on
# what it left; raise both together.
HARNESS_TIMEOUT_S = 540.0
MAX_ANSWER_BYTES = 64 * 1024  # what is read of answer.txt: an answer, not a file the model filled
# The Claude Code tools the model may use without being asked (print mode asks nobody, so any
# other is refused to it): enough to read, write and run code in its folder.
CLAUDE_TOOLS = ("Bash", "Read", "Write", "Edit", "Glob", "Grep")
# Codex's sandbox for the model's commands: `workspace-write` confines their writes to the folder
# (Codex's own sandbox, which some containers do not allow); `danger-full-access` where it cannot
# run and the container is the sandbox. $MRLX_CODEX_SANDBOX, when set, is used instead.
CODEX_SANDBOX = "workspace-write"
CLAUDE_PACKAGE = "@anthropic-ai/claude-code@2.1.197"
CODEX_PACKAGE = "@openai/codex@0.171.0"
# Claude Code and Codex hold one conversation per task, but may open others of their own: a
# sub-agent (Claude Code's, when its tool is allowed) is a fresh conversation, and a context
# compacted when it grew long is a rewritten history, a new sample. Four conversations of up to
# 40 model turns each is room for a real task; every episode returns 4 samples of `coder` (those
# it did not open are fillers that train nothing), and a request past either limit is refused (429).
SAMPLES = 4
TURNS = 40


def find_cli(variable: str, name: str) -> str | None:
    """The CLI to run: $`variable`, else `name` on PATH, else None."""
    return os.environ.get(variable) or shutil.which(name)


def _cli(variable: str, name: str, package: str) -> str:
    """The CLI to run, or a RuntimeError (it ends the episode, named) saying how to get it."""
    found = find_cli(variable, name)
    how = (
        f"install it with `npm install {package}` (it needs node 20 or newer) and put "
        f"node_modules/.bin on PATH, or set ${variable} to its path"
    )
    if found is None:
        raise RuntimeError(
            f"the {name} CLI was not found: ${variable} is not set and no `{name}` is on PATH; {how}"
        )
    if not os.access(found, os.X_OK):
        raise RuntimeError(f"the {name} CLI at {found} (${variable}) is not an executable file; {how}")
    return found


def _folders(tmp: str) -> tuple[Path, Path]:
    """A fresh home and working folder under `tmp`."""
    home, work = Path(tmp) / "home", Path(tmp) / "work"
    home.mkdir()
    work.mkdir()
    return home, work


def _answer_file(work: Path) -> str | None:
    """The answer the CLI wrote to answer.txt, stripped; None when it wrote none."""
    path = work / ANSWER_FILE
    if not path.is_file():
        return None
    with path.open("rb") as f:
        return f.read(MAX_ANSWER_BYTES).decode(errors="replace").strip()


async def _graded(task: Task, name: str, result: HarnessResult, written: str | None, printed: str) -> Outcome:
    """The grade of what the CLI left: answer.txt, else its printed final text."""
    if result.timed_out:
        logger.warning("episode %s: %s ran past %s s and was ended", task.episode_id, name, HARNESS_TIMEOUT_S)
    elif result.returncode != 0:  # graded all the same: it may have written its answer first
        logger.warning(
            "episode %s: %s exited %s: %s", task.episode_id, name, result.returncode, result.stderr[-2000:]
        )
    answer = written if written is not None else printed.strip()
    grade = await task.grade(answer, AGENT)
    return Outcome(rewards={AGENT: grade}, answer=answer, team_reward=grade)


async def claude_code_task(task: Task, endpoints: dict[str, Endpoint]) -> Outcome:
    """One episode: `claude -p` on the task, in a fresh folder and home; graded on answer.txt, else
    the `result` of the JSON it printed."""
    binary = _cli("MRLX_CLAUDE_BIN", "claude", CLAUDE_PACKAGE)
    with tempfile.TemporaryDirectory(prefix="mrlx-claude-", ignore_cleanup_errors=True) as tmp:
        home, work = _folders(tmp)
        prompt = PROMPT.format(problem=task.problem)
        argv = [binary, "-p", prompt, "--output-format", "json", "--allowedTools", *CLAUDE_TOOLS]
        env = claude_code_env(endpoints[AGENT], home)
        result = await run_harness(argv, cwd=work, env=env, timeout_s=HARNESS_TIMEOUT_S)
        written = _answer_file(work)
    try:
        printed = json.loads(result.stdout)
    except ValueError:  # it was ended, or failed before it printed its result
        printed = None
    final = printed.get("result") if isinstance(printed, dict) else None
    return await _graded(task, "claude", result, written, final if isinstance(final, str) else "")


async def codex_task(task: Task, endpoints: dict[str, Endpoint]) -> Outcome:
    """One episode: `codex exec` on the task, in a fresh folder and `CODEX_HOME`; graded on
    answer.txt, else the last message it wrote (`-o`)."""
    binary = _cli("MRLX_CODEX_BIN", "codex", CODEX_PACKAGE)
    with tempfile.TemporaryDirectory(prefix="mrlx-codex-", ignore_cleanup_errors=True) as tmp:
        home, work = _folders(tmp)
        last = Path(tmp) / "last-message.txt"  # outside its folder: not something it works on
        sandbox = os.environ.get("MRLX_CODEX_SANDBOX") or CODEX_SANDBOX
        env = codex_home(endpoints[AGENT], home, sandbox_mode=sandbox)
        prompt = PROMPT.format(problem=task.problem)
        argv = [binary, "exec", "--skip-git-repo-check", "--color", "never", "-o", str(last), prompt]
        result = await run_harness(argv, cwd=work, env=env, timeout_s=HARNESS_TIMEOUT_S)
        written = _answer_file(work)
        printed = last.read_text(errors="replace") if last.is_file() else result.stdout
    return await _graded(task, "codex", result, written, printed)


@hookimpl
def mrlx_register_systems():
    return {
        "claude_code_task": agent_code(claude_code_task, samples={AGENT: SAMPLES}, turns={AGENT: TURNS}),
        "codex_task": agent_code(codex_task, samples={AGENT: SAMPLES}, turns={AGENT: TURNS}),
    }
