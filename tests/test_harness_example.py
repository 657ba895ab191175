"""The shipped harness example (`mrlx_lab/examples/harness`, its own harness.yaml) run as a
rollout runs it: the stand-in host runs episodes of `claude_code_task` and of `codex_task`, each
starting the unmodified CLI against its agent's endpoint, on a stub engine (behind a recording
proxy) scripted to call the CLI's own shell tool to write an answer to answer.txt, then to say it
is done. The CLI runs the command; the example grades the file against the task's label (42):
the episode whose command wrote 42 gets 1.0, the one that wrote 41 gets 0.0; each trains one
sample of the engine's exact ids.

The CLIs' prompts are long (Claude Code's some 38,000 tokens of the tiny test tokenizer): the
host's model limit is raised for them (`max_position_embeddings`)."""

from __future__ import annotations

import asyncio
import json
import shutil
from importlib import resources

import pytest
import yaml
from _host import group, params, slime_args
from _recorder import RecordingProxy
from test_agent_attacks import assert_trains_only_engine_ids
from test_agent_responses import assert_exact

from mrlx_lab.examples.harness import hooks
from mrlx_lab.stub_engine import start_stub_engine
from mrlx_plugin.core.tokenizer import load_tokenizer
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime

PROBLEM = "What is 40 + 2?"  # the label of the host's sample: 42
FINAL = "Done: the answer is written."
POSITIONS = 131072  # a model limit that holds the CLIs' own prompts
# system -> (the CLI's variable, its name, its package, its shell tool, the tool's arguments for a command)
CLIS = {
    "claude_code_task": (
        "MRLX_CLAUDE_BIN",
        "claude",
        hooks.CLAUDE_PACKAGE,
        "Bash",
        lambda command: {"command": command, "description": "Write the answer"},
    ),
    "codex_task": (
        "MRLX_CODEX_BIN",
        "codex",
        hooks.CODEX_PACKAGE,
        "exec_command",
        lambda command: {"cmd": command},
    ),
}


def writes(system: str, answer: str) -> str:
    """The scripted model's first turn: a Hermes call of the CLI's own shell tool writing `answer`."""
    *_, tool, arguments = CLIS[system]
    call = {"name": tool, "arguments": arguments(f"echo {answer} > {hooks.ANSWER_FILE}")}
    return "I will write the answer.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


def _cli_param(system: str):
    variable, name, package, *_ = CLIS[system]
    marks = [
        pytest.mark.skipif(
            hooks.find_cli(variable, name) is None,
            reason=f"the {name} CLI is not installed (npm install {package}, or set ${variable})",
        ),
        pytest.mark.skipif(
            shutil.which("node") is None, reason=f"node is not installed (the {name} CLI needs it)"
        ),
    ]
    return pytest.param(system, marks=marks, id=system)


def shipped_config(system: str) -> dict:
    """The example's harness.yaml as shipped, switched to `system` as its comments say, with a
    short episode deadline and no engine retries for the test."""
    text = resources.files("mrlx_lab.examples.harness").joinpath("harness.yaml").read_text()
    mrlx = yaml.safe_load(text)["mrlx"]
    section = mrlx.pop("claude_code_task")
    mrlx["system"] = system
    mrlx[system] = {**section, "timeout_s": 200}
    mrlx["engine"] = {"max_retries": 0, "request_timeout_s": 60}
    return mrlx


@pytest.mark.parametrize("system", [_cli_param("claude_code_task"), _cli_param("codex_task")])
def test_the_example_runs_the_cli_and_grades_the_answer_it_wrote(
    system, logs_dir, tiny_model_dir, monkeypatch
):
    if system == "codex_task":
        # Codex's own sandbox needs user namespaces, which not every CI container allows: the
        # command is the test's, in a fresh folder.
        monkeypatch.setenv("MRLX_CODEX_SANDBOX", "danger-full-access")
    texts = [writes(system, "42"), FINAL, writes(system, "41"), FINAL]
    extra = ["--response-tokens", "120", "--tokenizer", str(tiny_model_dir)]
    for text in texts:
        extra += ["--text", text]
    stub = start_stub_engine(log_dir=logs_dir, name=f"example-{system}", extra=extra)
    try:
        proxy = RecordingProxy(stub.url).start()
        mrlx = shipped_config(system)

        async def go():
            args = slime_args(
                proxy.url,
                str(tiny_model_dir),
                mrlx,
                max_position_embeddings=POSITIONS,
                rollout_max_response_len=4096,
            )
            try:
                first = await generate(args, group(0, 1, prompt=PROBLEM)[0], params(args))
                calls = len(proxy.calls)
                second = await generate(args, group(1, 1, prompt=PROBLEM)[0], params(args))
                return first, calls, second
            finally:
                await (await get_runtime(args)).aclose()

        first, split, second = asyncio.run(go())
    finally:
        stub.stop()
    for samples, calls, grade, answer in (
        (first, proxy.calls[:split], 1.0, "42"),
        (second, proxy.calls[split:], 0.0, "41"),
    ):
        real = [s for s in samples if not s.remove_sample]
        ends = [(s.status, s.metadata["mrlx"].get("abort_reason")) for s in samples]
        shown = f"{len(calls)} engine calls; samples: {ends}"
        assert len(samples) == hooks.SAMPLES and len(real) == 1, shown  # the unused conversations: fillers
        [s] = real
        stats = s.metadata["mrlx"]["episode"]["agent_code"]["coder"]
        shown += f"; {stats}"
        # two turns, one conversation: the call of its shell tool (which it ran), then the answer
        assert len(calls) == 2 and stats["requests"] == 2 and stats["refused"] == 0, shown
        assert stats["threads"] == 1 and stats["forks"] == 0 and stats["tool_calls"] == 1, shown
        assert s.reward == grade, shown  # the file its command wrote, graded against the label
        between = assert_exact(samples, calls)  # the engine's exact ids and log-probs, the rest masked
        assert_trains_only_engine_ids(samples, calls)
        tok = load_tokenizer(str(tiny_model_dir))
        prompt = tok.decode(calls[0]["input_ids"])
        assert PROBLEM in prompt and hooks.ANSWER_FILE in prompt, prompt[-2000:]  # the example's prompt
        assert f"echo {answer} > {hooks.ANSWER_FILE}" in tok.decode(calls[0]["ids"])
        assert len(between) > 0 and sum(s.loss_mask) == len(calls[0]["ids"]) + len(calls[1]["ids"])
