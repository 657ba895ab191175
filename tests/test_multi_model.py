"""Two models co-training through the coordinator: two agent jobs as separate processes.

Each job is the embedded trainer (`python -m mrlx_plugin.local.trainer`), which calls the
plugin's rollout functions exactly as slime's loop does: rollout, train, push the new weights
to its own engine (bumping its weight version). Job A runs every episode (initiator_rollout);
job B trains on B's turns (responder_rollout). Two engines with different models and
tokenizers, a coordinator, and a recording proxy in front of B's engine, all on real sockets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _coord_procs import TOKEN_ENV
from _recorder import RecordingProxy
from _twojobs import ENV, TOKEN, two_job_config, write_config

from mrlx_plugin.core import processes
from mrlx_plugin.core.retry import wait_until
from mrlx_plugin.local.model import ensure_model
from mrlx_plugin.local.services import start_engine, start_service

pytestmark = pytest.mark.slow  # two trainer jobs, or a rollout of each job's, end to end

STEPS, GROUPS, PER_PROMPT, STALENESS = 3, 2, 2, 1


def job_yaml(
    path: Path, *, me: str, a_url: str, b_url: str, a_tok: Path, b_tok: Path, coordinator: str
) -> Path:
    return write_config(
        path,
        two_job_config(
            me,
            run_id="mm-test",
            urls={"a": a_url, "b": b_url},
            coordinator=coordinator,
            tokenizers={"a": a_tok, "b": b_tok},
            max_new_tokens=6,
            system_prompts={"a": "You answer.", "b": "You check."},
            coordinator_settings={"max_staleness": STALENESS, "wait_deadline_s": 120, "lease_s": 30},
            dialogue={"first": "a", "max_turns": 4},
            engine={
                "abort_retry_wait_s": 0.2,
                "peer_deadline_s": 90,
                "request_timeout_s": 10,
                "max_retries": 1,
                "backoff_s": 0.05,
            },
            trainer={"lr": 0.001},
        ),
    )


def trainer(
    config: Path, model: Path, engine: str, rollout_fn: str, out: Path, log: Path
) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "mrlx_plugin.local.trainer",
        "--config",
        str(config),
        "--model",
        str(model),
        "--engine-url",
        engine,
        "--router-url",
        engine,
        "--rollout-function",
        rollout_fn,
        "--num-rollout",
        str(STEPS),
        "--rollout-batch-size",
        str(GROUPS),
        "--n-samples-per-prompt",
        str(PER_PROMPT),
        "--rollout-max-response-len",
        "24",
        "--out",
        str(out),
        "--save-samples",
    ]
    env = dict(os.environ, **ENV)
    return processes.start(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("two-models")
    # Different weights and different vocabularies: each agent has its own token space.
    return ensure_model(root / "a", preset="tiny", seed=1), ensure_model(
        root / "b", preset="tiny", seed=2, vocab_size=384
    )


def test_two_jobs_co_train_through_the_coordinator(two_models, tmp_path, logs_dir, start_coordinator):
    model_a, model_b = two_models
    coordinator = start_coordinator(run_id="mm-test", agents=("a", "b"), token=TOKEN)
    engine_a = start_engine(model_a, log_dir=tmp_path, name="engine-a", threads=1)
    engine_b = start_engine(model_b, log_dir=tmp_path, name="engine-b", threads=1)
    proxy = RecordingProxy(engine_b.url).start()
    procs: list = [coordinator, engine_a, engine_b]
    jobs: list[subprocess.Popen] = []
    try:
        cfg_a = job_yaml(
            tmp_path / "a.yaml",
            me="a",
            a_url=engine_a.url,
            b_url=proxy.url,
            a_tok=model_a,
            b_tok=model_b,
            coordinator=coordinator.url,
        )
        cfg_b = job_yaml(
            tmp_path / "b.yaml",
            me="b",
            a_url=engine_a.url,
            b_url=proxy.url,
            a_tok=model_a,
            b_tok=model_b,
            coordinator=coordinator.url,
        )
        # B's engine goes down before the run and comes back while A's first rollout is under way:
        # A's turns for B must be retried, never filled with anything but what B's engine sampled.
        port_b = engine_b.port
        engine_b.kill()
        jobs.append(
            trainer(
                cfg_b,
                model_b,
                engine_b.url,
                "mrlx_plugin.rollout.responder_rollout",
                tmp_path / "out_b",
                tmp_path / "job_b.log",
            )
        )
        jobs.append(
            trainer(
                cfg_a,
                model_a,
                engine_a.url,
                "mrlx_plugin.rollout.initiator_rollout",
                tmp_path / "out_a",
                tmp_path / "job_a.log",
            )
        )

        # Restart it once A has sent B a turn and found the engine down (not after a fixed time:
        # on a loaded machine A's first turn may come much later).
        def a_turn_for_b_failed() -> bool:
            for job, name in zip(jobs, ("b", "a")):
                if job.poll() is not None:
                    raise AssertionError(
                        f"job {name} exited ({job.returncode}) before A sent B a turn:\n"
                        + (tmp_path / f"job_{name}.log").read_text()[-4000:]
                    )
            return proxy.failed > 0

        wait_until(
            a_turn_for_b_failed,
            deadline=180,
            every=0.1,
            what="a turn of A's for B failing at B's dead engine",
        )
        restarted = start_service(
            "engine-b2",
            [
                sys.executable,
                "-m",
                "mrlx_plugin.local.engine",
                "--model",
                str(model_b),
                "--port",
                str(port_b),
                "--threads",
                "1",
            ],
            log_dir=tmp_path,
            port=port_b,
        )
        procs.append(restarted)
        for job, name in zip(jobs, ("b", "a")):
            code = job.wait(timeout=240)
            assert code == 0, (tmp_path / f"job_{name}.log").read_text()[-4000:]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
        proxy.stop()
        for p in procs:
            p.stop()

    a_samples, b_samples = (
        rows(tmp_path / "out_a" / "samples.jsonl"),
        rows(tmp_path / "out_b" / "samples.jsonl"),
    )
    a_metrics, b_metrics = (
        rows(tmp_path / "out_a" / "metrics.jsonl"),
        rows(tmp_path / "out_b" / "metrics.jsonl"),
    )
    episodes = STEPS * GROUPS * PER_PROMPT

    # Every B sample of A's episodes reached B's trainer, exactly once.
    a_ids = [s["metadata"]["mrlx"]["episode_id"] for s in a_samples]
    b_ids = [s["metadata"]["mrlx"]["episode_id"] for s in b_samples]
    assert len(a_ids) == len(set(a_ids)) == episodes
    assert sorted(b_ids) == sorted(a_ids)
    assert all(s["metadata"]["mrlx"]["agent"] == "b" for s in b_samples)

    # B's groups are A's prompt groups.
    for step in range(STEPS):
        groups = {s["group_index"] for s in b_samples if s["step"] == step}
        assert len(groups) == GROUPS
        for g in groups:
            assert sum(1 for s in b_samples if s["step"] == step and s["group_index"] == g) == PER_PROMPT

    # B's tokens are B's own: every trained span is exactly what B's engine returned for that prefix.
    by_prefix = {(tuple(c["input_ids"]), tuple(c["ids"])): c for c in proxy.calls}
    for s in b_samples:
        assert s["status"] in ("completed", "truncated")
        assert max(s["tokens"]) < 384  # B's vocabulary, not A's
        start = len(s["tokens"]) - s["response_length"]
        mask = s["loss_mask"]
        i = 0
        spans = 0
        while i < len(mask):
            if mask[i] == 1:
                j = i
                while j < len(mask) and mask[j] == 1:
                    j += 1
                call = by_prefix.get(
                    (tuple(s["tokens"][: start + i]), tuple(s["tokens"][start + i : start + j]))
                )
                assert call is not None, "a trained span B's engine never returned"
                assert s["rollout_log_probs"][i:j] == pytest.approx(call["logprobs"], abs=1e-6)
                spans += 1
                i = j
            else:
                assert s["rollout_log_probs"][i] == 0.0
                i += 1
        assert spans == len(s["weight_versions"]) >= 1

    # The restart cost retries, not episodes.
    assert proxy.failed > 0
    assert sum(m.get("multi_agent/retried_turns", 0) for m in a_metrics) > 0
    assert all(m.get("multi_agent/aborted_episodes", 0) == 0 for m in a_metrics)

    # Staleness stayed within the bound, on both sides.
    assert [m["step"] for m in a_metrics] == list(range(STEPS))
    for m in a_metrics:
        assert 0 <= m["staleness/b"] <= STALENESS
    for m in b_metrics:
        assert m["staleness/b"] <= STALENESS
    # A's engine moved to a new weight version every step, and so did B's.
    assert {s["weight_versions"][0] for s in a_samples if s["step"] == STEPS - 1} == {str(STEPS - 1)}


def _in_process_initiator(engine_url: str, tokenizer: Path, coordinator_url: str):
    from _host import slime_args

    mrlx = two_job_config(
        "a",
        run_id="mm-eval",
        urls={"b": engine_url},
        coordinator=coordinator_url,
        max_new_tokens=4,
        coordinator_settings={"wait_deadline_s": 20},
        dialogue={"max_turns": 2},
    )
    return slime_args(
        engine_url,
        str(tokenizer),
        mrlx,
        rollout_batch_size=1,
        n_samples_per_prompt=2,
        n_samples_per_eval_prompt=1,
    )


def test_evaluation_queues_nothing_and_a_missing_rollout_function_is_named(
    engine, tiny_model_dir, monkeypatch, start_coordinator
):
    import asyncio

    from _host import slime_args

    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.core.host import Sample, run_in_host_loop
    from mrlx_plugin.link.client import CoordinatorClient
    from mrlx_plugin.local.trainer.fake_host import LocalDataSource
    from mrlx_plugin.rollout import generate, initiator_rollout, responder_rollout
    from mrlx_plugin.runtime import runtime_for

    coordinator = start_coordinator(run_id="mm-eval", agents=("a", "b"), token=TOKEN)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    try:
        args = _in_process_initiator(engine.url, tiny_model_dir, coordinator.url)
        # generate() alone, as if --rollout-function-path had not been set: refused, with the fix named
        with pytest.raises(
            ConfigError, match="--rollout-function-path mrlx_plugin.rollout.initiator_rollout"
        ):
            asyncio.run(
                generate(
                    args,
                    Sample(group_index=0, index=0, prompt="What is 1 + 1?", label="2"),
                    {"max_new_tokens": 4},
                )
            )
        source = LocalDataSource(
            [("What is 1 + 1?", "2")], 2, eval_prompts=[("What is 2 + 2?", "4"), ("3 + 3?", "6")]
        )
        out = initiator_rollout(args, 0, source, evaluation=True)
        evaluated = out.data["eval"]["samples"]
        assert len(evaluated) == 2 and all(isinstance(r, float) for r in out.data["eval"]["rewards"])

        async def queue():
            client = CoordinatorClient(coordinator.url, run_id="mm-eval", agent="b", token=TOKEN)
            try:
                return await client.queue_info("b"), await client.get_version("a")
            finally:
                await client.close()

        info, version_a = asyncio.run(queue())
        assert info["queued_items"] == 0 and info["leased_items"] == 0 and info["incomplete_groups"] == 0
        assert version_a is None  # evaluation reports no version and waits on no one

        # The same job in training does queue B's samples: one prompt group of two episodes.
        trained = initiator_rollout(args, 0, source, evaluation=False)
        assert sum(len(g) for g in trained.samples) == 2
        info, version_a = asyncio.run(queue())
        assert info["queued_items"] == 2 and info["ready_groups"] == 1 and version_a == 0
        run_in_host_loop(runtime_for(args).aclose())

        # B's job evaluates too (slime evaluates at rollout 0): whole episodes, nothing queued.
        mrlx_b = two_job_config(
            "b",
            run_id="mm-eval",
            urls={"a": engine.url},
            coordinator=coordinator.url,
            max_new_tokens=4,
            coordinator_settings={"wait_deadline_s": 20},
            dialogue={"max_turns": 2},
        )
        args_b = slime_args(
            engine.url,
            str(tiny_model_dir),
            mrlx_b,
            rollout_batch_size=1,
            n_samples_per_prompt=2,
            n_samples_per_eval_prompt=1,
        )
        out_b = responder_rollout(args_b, 0, source, evaluation=True)
        assert len(out_b.data["eval"]["samples"]) == 2
        assert all(s.status != Sample.Status.ABORTED for s in out_b.data["eval"]["samples"])
        info, _ = asyncio.run(queue())
        assert info["queued_items"] == 2  # unchanged
        run_in_host_loop(runtime_for(args_b).aclose())
    finally:
        coordinator.stop()
