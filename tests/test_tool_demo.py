"""The tool-using example (`mrlx_lab/examples/tool_lookup`) and its runner (`mrlx demo --tools`): the data and
the chat template with tools, then a short run of the whole loop on the CPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mrlx_lab.demos import tools as tool_demo
from mrlx_lab.demos.kit import refuse_previous_run
from mrlx_lab.examples.tool_lookup import data, hooks
from mrlx_plugin.agents.parsers import hermes
from mrlx_plugin.cli.main import main as cli_main
from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.local.model import CHATML_TEMPLATE, build_tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parent.parent


def test_prompts_are_reproducible_and_the_held_out_answers_never_appear_in_training():
    train = data.prompts(240, seed=3)
    assert train == data.prompts(240, seed=3) and train != data.prompts(240, seed=4)
    held_out = data.prompts(60, seed=3, split=data.HELD_OUT)
    for _, label in train:
        _, table = data.parse_label(label)
        assert len(set(table.values())) == len(data.KEYS)  # a wrong lookup never gives the right code
        assert not any(data.held_out_pair(k, c) for k, c in table.items())
    train_tables = {label for _, label in train}
    for question, label in held_out:
        key, table = data.parse_label(label)
        assert question == data.question(key) and data.held_out_pair(key, table[key])
        assert label not in train_tables
    # every item is asked, and the answers are spread over the codes
    assert {data.parse_label(lab)[0] for _, lab in train} == set(data.KEYS)
    assert len({data.answer(lab) for _, lab in train}) == len(data.CODES)


def test_the_tool_and_the_grading():
    table = {"A": "3", "B": "7"}
    assert data.lookup(table, '{"key": "B"}') == ("7", "B")
    assert data.lookup(table, '{"key": "Z"}') == ("no item Z", "Z")
    assert data.lookup(table, "not json")[1] is None and data.lookup(table, '{"k": 1}')[1] is None
    assert hooks.boxed("so \\boxed{1} or \\boxed{ 7 }") == "7" and hooks.boxed("7") is None
    with pytest.raises(ValueError, match="expected the JSON text"):
        data.parse_label("B")


def test_the_template_renders_tools_as_a_system_block_and_nothing_else_changes(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")
    assert tok.chat_template == CHATML_TEMPLATE
    chat = [
        {"role": "user", "content": "What is the code of item C?"},
        {"role": "assistant", "content": data.call_text("C")},
        {"role": "tool", "content": "7"},
    ]
    plain = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat)
    for tools in (None, []):  # no tools: ChatML exactly as before
        assert tok.apply_chat_template(chat, tools=tools, tokenize=False) == plain
    with_tools = tok.apply_chat_template(chat, tools=data.TOOLS, tokenize=False, add_generation_prompt=True)
    tools = "<|im_start|>system\n# Tools\nlookup(key): The code of an item.<|im_end|>\n"
    assert with_tools == tools + plain + "<|im_start|>assistant\n"
    # a bare function spec, one without parameters or a description: a line each all the same
    bare = [
        {"name": "f"},
        {"type": "function", "function": {"name": "g", "parameters": {"properties": {"a": {}}}}},
    ]
    assert tok.apply_chat_template(chat[:1], tools=bare, tokenize=False).startswith(
        "<|im_start|>system\n# Tools\nf()\ng(a)<|im_end|>\n<|im_start|>user\n"
    )


def test_the_warm_start_shows_the_prompt_an_episode_shows_and_never_an_answer(tmp_path):
    build_tokenizer(tmp_path / "model")
    text = tool_demo.tools_system_text(tmp_path / "model", data.TOOLS)
    tok = load_tokenizer(tmp_path / "model")
    rows = [json.loads(line) for line in data.warmup_examples(tmp_path / "w.jsonl", 800, 0, text).open()]
    assert rows == [
        json.loads(line) for line in data.warmup_examples(tmp_path / "v.jsonl", 800, 0, text).open()
    ]
    firsts = [r["messages"] for r in rows if r["messages"][-2]["role"] == "user"]
    calls = [m for m in firsts if m[-1]["content"].startswith("<tool_call>")]
    guesses = [m for m in firsts if m[-1]["content"].startswith("\\boxed{")]
    answers = [r["messages"] for r in rows if r["messages"][-2]["role"] == "tool"]
    # the demonstrator looks the code up in half its first turns and guesses in the other half
    assert len(calls) == len(guesses) == 200 and len(answers) == 400
    for messages in calls + guesses + answers:  # rendered as the episode's prompt with tools
        user = [m for m in messages if m["role"] != "system"]
        assert tok.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(
            user, tools=data.TOOLS, tokenize=False
        )
    # its calls look the asked item up; its answers repeat the tool's code, which is random: no row
    # holds a table, so no answer can be learned from the warm-start
    for m in calls + answers:
        call = m[2]["content"]
        assert json.loads(call.split("\n")[1])["arguments"]["key"] == m[1]["content"][-2]
    assert all(m[-1]["content"] == f"\\boxed{{{m[-2]['content']}}}" for m in answers)
    assert len({m[-2]["content"] for m in answers}) == len(data.CODES)
    assert len({m[-1]["content"] for m in guesses}) == len(data.CODES)


def test_a_model_whose_template_cannot_show_tools_is_refused(tmp_path):
    tok = build_tokenizer(tmp_path / "model")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(str(tmp_path / "model"))
    with pytest.raises(ConfigError, match="does not render tools as one system block"):
        tool_demo.tools_system_text(tmp_path / "model", data.TOOLS)


def test_a_run_already_in_out_is_refused_unless_overwritten(tmp_path, capsys):
    (tmp_path / "metrics.json").write_text("{}")
    assert cli_main(["demo", "--tools", "--out", str(tmp_path), "--quiet"]) == 2
    refused = capsys.readouterr().err
    assert refused.startswith("mrlx demo: --out")
    assert "already holds a run" in refused and "--overwrite" in refused and "--resume" not in refused
    assert (tmp_path / "metrics.json").exists()
    refuse_previous_run(tmp_path, argparse.Namespace(overwrite=True), tool_demo.RUN_STATE)
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.slow
def test_a_short_run_trains_on_episodes_whose_tool_results_are_context(tmp_path):
    out = tmp_path / "run"
    argv = ["--out", str(out), "--preset", "tiny", "--steps", "2", "--prompts-per-step", "4"]
    # A warm-start long and strong enough for the tiny model to write the call; sampled at 1.0, its
    # first turns are calls and guesses alike.
    argv += ["--samples-per-prompt", "2", "--warmup-steps", "1000", "--warmup-lr", "1e-2"]
    argv += [
        "--temperature",
        "1.0",
        "--eval-prompts",
        "6",
        "--eval-interval",
        "1",
        "--save-samples",
        "--quiet",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "mrlx_lab.demos.tools", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "mrlx demo --tools finished" in run.stdout and "held-out (6), after RL" in run.stdout

    report = json.loads((out / "metrics.json").read_text())
    summary = report["summary"]
    assert summary["steps"] == 2 and summary["warm_start_steps"] == 1000
    assert [p["step"] for p in summary["held_out"]["curve"]] == [0, 1, 2]
    for point in (summary["held_out"]["before"], summary["held_out"]["after"]):
        assert 0.0 <= point["accuracy"] <= 1.0 and 0.0 <= point["well_formed"] <= 1.0
    assert (out / "rewards.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (out / "solver" / "checkpoints").iterdir())[-1] == "step_00001"

    tok = load_tokenizer(out / "models" / "solver")
    samples = [json.loads(line) for line in (out / "solver" / "samples.jsonl").open()]
    assert len(samples) == 16
    with_tool = []
    for s in samples:
        _, table = data.parse_label(s["label"])
        mask, response = s["loss_mask"], s["tokens"][-s["response_length"] :]
        assert len(mask) == len(response)
        if 0 not in mask:
            continue
        # the response: the model's call (trained), the tool's answer (context), the model's answer
        first_zero, last_zero = mask.index(0), len(mask) - 1 - mask[::-1].index(0)
        assert set(mask[first_zero : last_zero + 1]) == {0} and set(mask[:first_zero]) == {1}
        _, calls, _ = hermes(tok.decode(response[:first_zero], skip_special_tokens=True), data.TOOLS)
        result = tok.decode(response[first_zero : last_zero + 1])
        assert calls and f"<|im_start|>tool\n{data.lookup(table, calls[0][1])[0]}<|im_end|>" in result
        assert result.endswith("<|im_start|>assistant\n")
        assert s["metadata"]["mrlx"]["turns"] == 2
        # the sample's reward is the final answer's grade, whatever the call
        right = hooks.boxed(tok.decode(response[last_zero + 1 :], skip_special_tokens=True)) == data.answer(
            s["label"]
        )
        assert s["reward"] == (1.0 if right else 0.0)
        with_tool.append(s)
    assert with_tool, "no episode made a tool call: " + repr([s["response"] for s in samples])
