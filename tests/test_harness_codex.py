"""The unmodified Codex CLI against an agent's endpoint (the Responses API), end to end: `codex
exec` in a fresh home and folder, its model a stub engine scripted to call Codex's own shell tool
(`exec_command`, in the Hermes form) and then answer; Codex runs the command, sends its output
back, and prints the answer. The episode trains one sample: the engine's exact ids for both turns,
Codex's instructions, tools and command output masked."""

from __future__ import annotations

import json
import shutil

import pytest
from _responses_systems import CODEX_FILE, SEEN, codex_bin
from test_agent_responses import assert_exact, episode

from mrlx_plugin.core.tokenizer import load_tokenizer

pytestmark = [
    pytest.mark.skipif(
        codex_bin() is None, reason="the codex CLI is not installed (npm install @openai/codex)"
    ),
    pytest.mark.skipif(
        shutil.which("node") is None, reason="node is not installed (the codex CLI runs on it)"
    ),
]

COMMAND = f"printf 'hello from codex' > {CODEX_FILE}"
CODEX_CALL = (
    "I will write the file.\n<tool_call>\n"
    + json.dumps({"name": "exec_command", "arguments": {"cmd": COMMAND}})
    + "\n</tool_call>"
)
CODEX_DONE = "Done: the file is written."
# Codex's instructions and tools are tens of thousands of characters: the tiny model's 4,096
# positions would refuse them (the endpoint answers context_length_exceeded), so the host is told
# of a longer one.
POSITIONS = 65536


def test_codex_exec_runs_its_shell_tool_and_trains_one_exact_sample(engine_for, tiny_model_dir):
    proxy = engine_for(CODEX_CALL, CODEX_DONE, tokens=120)
    samples = episode(
        proxy,
        tiny_model_dir,
        None,
        system="codex",
        agent="coder",
        prompt="Write 'hello from codex' into out.txt.",
        max_position_embeddings=POSITIONS,
    )
    [s] = [s for s in samples if not s.remove_sample] or samples
    meta = s.metadata["mrlx"]
    seen = SEEN[meta["episode_id"]]
    result = seen["result"]
    stats = meta["episode"]["agent_code"]["coder"]
    shown = (
        f"{stats['requests']} requests ({stats['refused']} refused), {len(proxy.calls)} engine calls "
        f"(prompts of {[len(c['input_ids']) for c in proxy.calls]} tokens), {sum(s.loss_mask)} trained "
        f"tokens; codex exited {result.returncode}; "
        f"stdout: {result.stdout[-2000:]!r}; stderr: {result.stderr[-3000:]!r}"
    )
    assert seen["written"] == "hello from codex", shown
    assert s.reward == 1.0 and "file is written" in result.stdout, shown
    assert stats["requests"] == 2 and stats["refused"] == 0 and stats["tool_calls"] == 1, shown
    assert len(proxy.calls) == 2, shown
    between = assert_exact(samples, proxy.calls)
    tok = load_tokenizer(str(tiny_model_dir))
    prompt = tok.decode(proxy.calls[0]["input_ids"])
    assert "Codex CLI" in prompt and "exec_command(" in prompt, prompt[:2000]
    assert "Write 'hello from codex' into out.txt." in prompt
    assert "Process exited with code 0" in tok.decode(between), tok.decode(between)
