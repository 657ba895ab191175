"""No sample longer than the host's context comes back, whatever the input makes of a prompt.

The host's trainer pads every sample of a step into its micro-batches: one sample past
`--rollout-max-context-len` (or the model's `max_position_embeddings`) is an out-of-memory error
on the GPU, or positions the model has no embedding for. An input sample with a long prompt, a
long system prompt, or a dialogue whose history outgrows the context must therefore come back
within the limit: what cannot fit is ABORTED (zero loss mask, `remove_sample`) and counted as
`multi_agent/over_context_samples`; a prompt that leaves no room for one token never reaches
the engine. Real stub engine processes, the host's `args` as slime passes them.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from _hookmodule import write_hook_module
from _host import params, slime_args

from mrlx_lab.stub_engine import start_stub_engine
from mrlx_plugin.core.host import Sample, Status
from mrlx_plugin.core.metrics import compute_metrics
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime

CTX = 512
ENGINE = {"max_retries": 0, "request_timeout_s": 10}
# About 2,400 tokens of the tiny tokenizer: far past the context.
LONG = "\n".join(f"Consider the number {i} and its square." for i in range(100))


def _requests(stub) -> int:
    with urllib.request.urlopen(f"{stub.url}/_stub/stats", timeout=10) as resp:
        return int(json.loads(resp.read())["generate"])


def _run(stub, model_dir, mrlx: dict, prompts: list[str], **flags) -> list[list]:
    """One generate call per prompt (one prompt group each), as slime makes them; each call's samples."""
    flags = {"rollout_max_context_len": CTX, "eval_max_context_len": CTX, **flags}

    async def run():
        args = slime_args(stub.url, str(model_dir), mrlx, **flags)
        samples = [Sample(group_index=i, index=i, prompt=p, label="42") for i, p in enumerate(prompts)]
        try:
            return [await generate(args, s, params(args)) for s in samples]
        finally:
            await (await get_runtime(args)).aclose()

    return asyncio.run(run())


def _check_within(out: list, limit: int = CTX) -> None:
    for s in out:
        assert len(s.tokens) <= limit, (
            f"a {s.status.value} sample of agent {s.metadata['mrlx']['agent']!r} holds {len(s.tokens)} "
            f"tokens, past the context of {limit}"
        )
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length >= 1


def _check_over_context(out: list) -> None:
    for s in out:
        assert s.status == Status.ABORTED and s.remove_sample and not any(s.loss_mask) and s.reward == 0.0
        assert s.metadata["mrlx"]["over_context"] is True


def _dialogue(credit: str) -> dict:
    return {
        "run_id": "ctx",
        "system": "dialogue",
        "agents": {a: {"url": "self"} for a in ("asker", "answerer")},
        "dialogue": {"max_turns": 4},
        "rewards": {"credit": credit},
        "engine": ENGINE,
    }


@pytest.mark.parametrize("credit", ["episode", "turn"])
def test_a_dialogue_whose_prompt_is_past_the_context_is_aborted_before_any_engine_call(
    credit, stub_engine, tiny_model_dir
):
    long_out, short_out = _run(stub_engine, tiny_model_dir, _dialogue(credit), [LONG, "What is 40 + 2?"])
    assert len(long_out) == len(short_out) == (2 if credit == "episode" else 4)  # the step keeps its count
    for out in (long_out, short_out):
        _check_within(out)
    _check_over_context(long_out)
    assert "context" in long_out[0].metadata["mrlx"]["abort_reason"]
    assert all(s.status != Status.ABORTED for s in short_out)  # the episode beside it is untouched
    assert _requests(stub_engine) == 4  # the short episode's four turns; none for the long one
    metrics = compute_metrics(long_out + short_out)
    assert metrics["multi_agent/over_context_samples"] == len(long_out)


@pytest.mark.parametrize("credit", ["episode", "turn"])
def test_a_dialogue_stops_when_its_history_outgrows_the_context(credit, logs_dir, tiny_model_dir, request):
    # The asker's answer is 200 tokens. The answerer's opening (about 400 tokens) fits the context
    # alone, but with the asker's answer after it leaves no room for a turn.
    stub = start_stub_engine(
        log_dir=logs_dir,
        name=f"stub-ctx-{request.node.name[:30]}",
        extra=["--response-tokens", "200", "--text", LONG[:600]],
    )
    try:
        mrlx = _dialogue(credit)
        mrlx["dialogue"]["openings"] = {"answerer": "{problem}\n" + "\n".join(LONG.splitlines()[:17])}
        [out] = _run(stub, tiny_model_dir, mrlx, ["What is 40 + 2?"])
        _check_within(out)
        by_agent = {a: [s for s in out if s.metadata["mrlx"]["agent"] == a] for a in ("asker", "answerer")}
        asker_turn = by_agent["asker"][0]
        # The turn so far stands.
        assert asker_turn.status == Status.COMPLETED and asker_turn.response_length == 200
        assert asker_turn.metadata["mrlx"]["over_context"] is False
        _check_over_context(by_agent["answerer"])  # the answerer could not speak: its samples are counted
        assert asker_turn.metadata["mrlx"]["episode"]["stopped_by"] == "context full (answerer)"
        assert compute_metrics(out)["multi_agent/over_context_samples"] == len(out) - 1
        assert _requests(stub) == 1
    finally:
        stub.stop()


@pytest.mark.parametrize("credit", ["episode", "turn"])
def test_a_pipeline_whose_problem_is_past_the_context_is_aborted(credit, stub_engine, tiny_model_dir):
    mrlx = {
        "run_id": "ctx",
        "system": "pipeline",
        "pipeline": {"num_parallel": 2},
        "rewards": {"credit": credit},
        "engine": ENGINE,
    }
    long_out, short_out = _run(stub_engine, tiny_model_dir, mrlx, [LONG, "What is 40 + 2?"])
    assert len(long_out) == len(short_out) == 5
    for out in (long_out, short_out):
        _check_within(out)
    _check_over_context(long_out)
    assert all(s.status != Status.ABORTED for s in short_out)
    assert _requests(stub_engine) == 5  # the short episode's; none for the long one
    assert compute_metrics(long_out)["multi_agent/over_context_samples"] == 5


@pytest.mark.parametrize("credit", ["episode", "turn"])
def test_a_game_with_a_system_prompt_past_the_context_is_aborted(credit, stub_engine, tiny_model_dir):
    mrlx = {
        "run_id": "ctx",
        "system": "game",
        "agents": {"p": {"url": "self", "system_prompt": LONG}},
        "game": {"name": "nim", "seats": ["p", "p"], "options": {"max_stones": 5}},
        "rewards": {"credit": credit},
        "engine": ENGINE,
    }
    [out] = _run(stub_engine, tiny_model_dir, mrlx, ["Nim: 5 stones"])
    assert len(out) == (2 if credit == "episode" else 6)
    _check_within(out)
    _check_over_context(out)
    assert _requests(stub_engine) == 0
    assert compute_metrics(out)["multi_agent/over_context_samples"] == len(out)


def test_the_models_own_position_limit_bounds_the_samples_too(stub_engine, tiny_model_dir):
    # No --rollout-max-context-len: the model's max_position_embeddings (Megatron's flag) is the limit.
    [out] = _run(
        stub_engine,
        tiny_model_dir,
        _dialogue("episode"),
        [LONG],
        rollout_max_context_len=None,
        eval_max_context_len=None,
        max_position_embeddings=CTX,
    )
    _check_within(out)
    _check_over_context(out)
    assert _requests(stub_engine) == 0


def test_a_turn_that_would_cross_the_context_is_capped_and_truncated(logs_dir, tiny_model_dir, request):
    # The answer would be 400 tokens; the prompt leaves fewer: max_new_tokens is capped to the room.
    stub = start_stub_engine(
        log_dir=logs_dir, name=f"stub-ctx-{request.node.name[:30]}", extra=["--response-tokens", "400"]
    )
    try:
        problem = " ".join(f"Consider the number {i} and its square." for i in range(8))
        mrlx = {"run_id": "ctx", "system": "pipeline", "pipeline": {"num_parallel": 1}, "engine": ENGINE}
        [out] = _run(stub, tiny_model_dir, mrlx, [problem], rollout_max_response_len=1024)
        _check_within(out)
        solver = next(s for s in out if s.metadata["mrlx"]["agent"] == "solver")
        assert solver.status == Status.TRUNCATED and len(solver.tokens) == CTX
    finally:
        stub.stop()


def test_a_sample_a_system_built_past_the_limit_is_replaced_by_a_counted_filler(
    stub_engine, tiny_model_dir, tmp_path, monkeypatch, caplog
):
    # A user's system that opens its own transcript, without the episode's limits.
    module = write_hook_module(
        tmp_path,
        monkeypatch,
        "unbounded_system",
        "from mrlx_plugin import Outcome, System\n"
        "from mrlx_plugin.core.transcript import Transcript\n\n"
        "async def unbounded(episode):\n"
        "    t = Transcript.start('asker', episode.context.tokenizers['asker'],\n"
        "                         [{'role': 'user', 'content': episode.problem}])\n"
        "    episode.transcripts.append(t)\n"
        "    await episode.generate(t)\n"
        "    return Outcome()\n\n"
        "@hookimpl\ndef mrlx_register_systems():\n"
        "    return {'unbounded': System(run=unbounded, fan_out=lambda settings: {'asker': 1})}\n",
    )
    mrlx = {
        "run_id": "ctx",
        "system": "unbounded",
        "plugins": [module],
        "agents": {"asker": {"url": "self"}},
        "engine": ENGINE,
    }
    [out] = _run(stub_engine, tiny_model_dir, mrlx, [LONG])
    _check_within(out)
    _check_over_context(out)
    assert "system 'unbounded' made a sample of agent 'asker'" in caplog.text
    assert compute_metrics(out)["multi_agent/over_context_samples"] == 1
