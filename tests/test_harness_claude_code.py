"""The unmodified Claude Code CLI as an agent harness: `claude -p ... --output-format json` runs once
per episode against its agent's Messages endpoint (the `claude_code` system of
_anthropic_systems.py), on a stub engine scripted to answer its first turn with a call of Claude
Code's own Bash tool and its second with a text. Claude Code runs the command, sends its output
back, prints the final text; the conversation trains as one sample of the engine's exact ids.

Claude Code's request holds its own system prompt and two dozen tools (some 38,000 tokens in the
tiny test tokenizer): the host's model limit is raised for it (`--max-position-embeddings`)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from _anthropic_systems import CLAUDE_FILE, CLAUDE_TEXT, SEEN, claude_bin
from _host import group, params, slime_args
from _recorder import RecordingProxy

from mrlx_lab.stub_engine import start_stub_engine
from mrlx_plugin.core.host import Status
from mrlx_plugin.core.tokenizer import load_tokenizer
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime

BASH = {"command": f"printf %s {CLAUDE_TEXT} > {CLAUDE_FILE}", "description": "Write the file"}
CALL = "I will write it.\n<tool_call>\n" + json.dumps({"name": "Bash", "arguments": BASH}) + "\n</tool_call>"
FINAL = "Done: the file is written."
TASK = f"Write {CLAUDE_TEXT} to {CLAUDE_FILE}."

pytestmark = [
    pytest.mark.skipif(
        claude_bin() is None, reason="the claude CLI is not installed (npm install @anthropic-ai/claude-code)"
    ),
    pytest.mark.skipif(
        shutil.which("node") is None, reason="node is not installed (the claude CLI needs it)"
    ),
]


@pytest.fixture
def proxy(logs_dir, tiny_model_dir):
    stub = start_stub_engine(
        log_dir=logs_dir,
        name="claude-code",
        extra=[
            "--response-tokens",
            "120",
            "--tokenizer",
            str(tiny_model_dir),
            "--text",
            CALL,
            "--text",
            FINAL,
        ],
    )
    yield RecordingProxy(stub.url).start()
    stub.stop()


def run_claude_code(proxy, model_dir) -> list:
    mrlx = {
        "run_id": "claude-code-test",
        "plugins": ["_anthropic_systems"],
        "system": "claude_code",
        "agents": {"coder": {"url": "self", "tool_parser": "hermes"}},
        "engine": {"max_retries": 0, "request_timeout_s": 60},
        "claude_code": {"timeout_s": 200},
    }

    async def go():
        # Claude Code's prompt is long: a model limit (and a sample's room) that holds it.
        args = slime_args(
            proxy.url, str(model_dir), mrlx, max_position_embeddings=131072, rollout_max_response_len=4096
        )
        try:
            return await generate(args, group(0, 1, prompt=TASK)[0], params(args))
        finally:
            await (await get_runtime(args)).aclose()

    return asyncio.run(go())


def test_claude_code_runs_its_bash_tool_and_trains_one_exact_sample(proxy, tiny_model_dir):
    [s] = run_claude_code(proxy, tiny_model_dir)
    meta = s.metadata["mrlx"]
    seen = SEEN[meta["episode_id"]]
    result = seen["result"]
    stats = meta["episode"]["agent_code"]["coder"]
    trained = sum(s.loss_mask)
    report = (
        f"claude exited {result.returncode} (timed out: {result.timed_out}); {stats['requests']} request(s) "
        f"to /v1/messages, {stats['refused']} refused; {len(proxy.calls)} engine call(s), prompt "
        f"{[len(c['input_ids']) for c in proxy.calls]} tokens, {trained} trained tokens; "
        f"stdout: {result.stdout[-2000:]!r}; stderr: {result.stderr[-2000:]!r}"
    )
    print(report)
    assert result.returncode == 0 and not result.timed_out, report
    # What Claude Code did with the answers: it ran the Bash call, and printed the final text.
    assert seen["written"] == CLAUDE_TEXT, report
    printed = seen["printed"]
    assert printed["type"] == "result" and printed["is_error"] is False, report
    assert printed["result"] == FINAL and printed["num_turns"] == 2, report
    assert s.status == Status.COMPLETED and s.reward == 1.0, report
    # Two requests, both answered: the call and the answer; one conversation, continued.
    assert stats["requests"] == 2 and stats["refused"] == 0 and stats["threads"] == 1, report
    assert stats["forks"] == 0 and stats["tool_calls"] == 1 and stats["malformed_tool_calls"] == 0, report
    one, two = proxy.calls
    n = len(one["input_ids"]) + len(one["ids"])
    assert len(one["input_ids"]) > 20_000, report  # its system prompt and tools
    assert two["input_ids"][:n] == one["input_ids"] + one["ids"], report  # continued after the exact ids
    gap = two["input_ids"][n:]
    assert s.tokens == two["input_ids"] + two["ids"]
    assert s.loss_mask == [1] * len(one["ids"]) + [0] * len(gap) + [1] * len(two["ids"])
    assert s.rollout_log_probs == one["logprobs"] + [0.0] * len(gap) + two["logprobs"]
    assert trained == len(one["ids"]) + len(two["ids"]), report
    # Between the turns: the tool result Claude Code sent back (masked), then the answer's prompt.
    tok = load_tokenizer(str(tiny_model_dir))
    assert "(Bash completed with no output)" in tok.decode(gap), tok.decode(gap)
    prompt = tok.decode(one["input_ids"])
    assert TASK in prompt and "Bash(" in prompt, prompt[:2000]  # its task, its tools
