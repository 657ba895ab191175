"""The README's pipeline written as agent code (mrlx_lab/examples/pipeline_as_code) against the built-in
`system: pipeline`, on the same stub engine: the same calls reach the engine, the same samples
come back, graded the same way."""

from __future__ import annotations

import asyncio

from _host import group, params, slime_args
from _recorder import RecordingProxy

from mrlx_lab.examples.pipeline_as_code import hooks
from mrlx_lab.stub_engine import start_stub_engine
from mrlx_plugin.core.host import Status
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime

TEXT = "Adding the two numbers gives 42.\n\nSo the answer is \\boxed{42}.\n\nJudgment: 2"
ROLES = ("solver", "rewriter", "selector")


def _run(url: str, model_dir, mrlx: dict) -> list:
    async def go():
        args = slime_args(url, str(model_dir), mrlx)
        try:
            return await asyncio.gather(*(generate(args, s, params(args)) for s in group(0, 2)))
        finally:
            await (await get_runtime(args)).aclose()
            await hooks.aclose()  # the example's client, where it made one

    return [s for samples in asyncio.run(go()) for s in samples]


def test_the_pipeline_as_agent_code_makes_the_calls_and_samples_of_the_built_in_one(logs_dir, tiny_model_dir):
    stub = start_stub_engine(
        log_dir=logs_dir,
        name="pipeline-code",
        extra=["--response-tokens", "100", "--tokenizer", str(tiny_model_dir), "--text", TEXT],
    )
    try:
        runs = {}
        for system, plugins in (
            ("pipeline", []),
            ("pipeline_code", ["mrlx_lab.examples.pipeline_as_code.hooks"]),
        ):
            proxy = RecordingProxy(stub.url).start()
            mrlx = {
                "run_id": f"side-by-side-{system}",
                "plugins": plugins,
                "system": system,
                "agents": {role: {"url": "self"} for role in ROLES},
                "engine": {"max_retries": 0, "request_timeout_s": 10},
            }
            runs[system] = (_run(proxy.url, tiny_model_dir, mrlx), proxy.calls)
    finally:
        stub.stop()
    (built_in, built_in_calls), (code, code_calls) = runs["pipeline"], runs["pipeline_code"]
    assert len(code_calls) == len(built_in_calls) == 2 * 11
    assert sorted(c["input_ids"] for c in code_calls) == sorted(c["input_ids"] for c in built_in_calls)

    def summary(samples):
        return sorted(
            (
                s.metadata["mrlx"]["agent"],
                tuple(s.tokens),
                tuple(s.loss_mask),
                s.metadata["mrlx"]["raw_reward"],
                s.status,
            )
            for s in samples
        )

    assert summary(code) == summary(built_in)
    assert all(s.status == Status.COMPLETED for s in code)
    # the selector picked solution 2, a right answer: its reward is that rewrite's grade
    assert {s.metadata["mrlx"]["raw_reward"] for s in code if s.metadata["mrlx"]["agent"] == "selector"} == {
        1.0
    }
