"""The plugin driven through a host-shaped fake of Miles (`tests/hosts/miles`), end to end.

Each test runs the fake's `train.py` as its own process (argument parsing with `add_arguments`
and `--custom-config-path`, the rollout manager, Miles' class-based, legacy or fully-async
rollout, its abort, logging, reward post-processing and data-parallel split, with the plugin's
flags) against stub engines over real sockets, and reads what the driver reports: per step the
samples, their statuses and rollout ids, the per-rank sizes of the split and the stub's counters
around `abort()`; errors with their type; what reached Miles' tracking logger (`FAKE_HOST_LOG`).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _host import batch_flags, engine_faults, engine_stats

REPO = Path(__file__).resolve().parent.parent
HOSTS = REPO / "tests" / "hosts"
DRIVER = HOSTS / "miles" / "train.py"
PROMPTS = [{"prompt": f"What is {a} + {42 - a}?", "label": "42"} for a in range(8)]
PIPELINE = {
    "run_id": "miles-fake",
    "system": "pipeline",
    "pipeline": {"num_parallel": 2},
    "agents": {"solver": {"url": "self"}, "rewriter": {"url": "self"}, "selector": {"url": "self"}},
}
FAN_OUT = 5  # 2 solvers, 2 rewriters, 1 selector
CLASS_BASED = "miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn"
LEGACY = "miles.rollout.sglang_rollout.generate_rollout"
FULLY_ASYNC = "miles.rollout.fully_async_rollout.FullyAsyncRolloutFn"
STEP_TIMEOUT_S = 60  # the driver reports a phase that runs longer (a hang) as StepTimeout


class Run:
    """One run of the fake Miles' train.py and what it reported."""

    def __init__(
        self, proc: subprocess.CompletedProcess, result: dict[str, Any] | None, log: list[dict[str, Any]]
    ):
        self.proc = proc
        self.result = result or {}
        self.log = log  # the lines tracking.log wrote

    @property
    def error(self) -> dict[str, Any] | None:
        return self.result.get("error")

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.result.get("steps", [])

    def explain(self) -> str:
        error = self.error or {}
        return (
            f"exit {self.proc.returncode}; {error.get('phase')}: {error.get('type')}: "
            f"{error.get('message')}\n"
            f"{error.get('traceback', '')}\n--- driver output (tail) ---\n{self.output[-4000:]}"
        )

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def assert_ok(self) -> None:
        assert self.proc.returncode == 0 and self.error is None, self.explain()

    def logged(self, step_key: str) -> list[dict[str, Any]]:
        return [line["metrics"] for line in self.log if line["step_key"] == step_key]


def run_miles(
    tmp_path: Path,
    engine_url: str,
    tokenizer: Path,
    config: dict[str, Any] | str,
    *flags: str,
    num_rollout: int = 1,
    dp: int = 2,
    env: dict[str, str] | None = None,
    stub_stats: bool = False,
    timeout: float = 150,
) -> Run:
    """Run the driver with the plugin's flags, `config` (the `mrlx:` mapping, written to a YAML
    file, or a ready `--custom-config-path` value) and `flags`."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    if isinstance(config, dict):
        path = tmp_path / "mrlx.yaml"
        path.write_text(yaml.safe_dump({"mrlx": config}))
        config = str(path)
    result, log = tmp_path / "result.json", tmp_path / "tracking.jsonl"
    host, port = engine_url.removeprefix("http://").rsplit(":", 1)
    argv = [sys.executable, str(DRIVER), "--hf-checkpoint", str(tokenizer)]
    argv += ["--sglang-router-ip", host, "--sglang-router-port", port]
    argv += ["--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label"]
    argv += ["--custom-generate-function-path", "mrlx_plugin.rollout.generate"]
    argv += ["--custom-reward-post-process-path", "mrlx_plugin.rollout.normalize"]
    argv += ["--custom-rollout-log-function-path", "mrlx_plugin.rollout.log_rollout"]
    argv += ["--custom-config-path", config, "--rollout-max-response-len", "64"]
    argv += ["--num-rollout", str(num_rollout), "--fake-dp-size", str(dp), "--fake-result", str(result)]
    argv += ["--fake-step-timeout", str(STEP_TIMEOUT_S)]
    if stub_stats:
        argv += ["--fake-stub-stats-url", engine_url + "/_stub/stats"]
    argv += flags
    penv = {k: v for k, v in os.environ.items() if k != "MILES_USE_LEGACY_ROLLOUT_V1"}
    penv.update(
        PYTHONPATH=os.pathsep.join([str(HOSTS / "miles"), str(HOSTS), str(REPO)]),
        FAKE_HOST_LOG=str(log),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        **(env or {}),
    )
    proc = subprocess.run(
        argv, check=False, env=penv, capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )
    report = json.loads(result.read_text()) if result.exists() else None
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return Run(proc, report, lines)


BATCH = batch_flags()


def _assert_pipeline_steps(run: Run, steps: int) -> None:
    """Every step: 4 episodes (2 prompts x 2 samples) of 5 samples each, split evenly on 2 ranks."""
    assert len(run.steps) == steps, run.explain()
    for step in run.steps:
        assert step["samples"] == 4 * FAN_OUT, step
        assert step["rollouts"] == 4 and step["samples_per_rollout"] == [FAN_OUT] * 4, step
        assert step["rank_sizes"] == [2 * FAN_OUT, 2 * FAN_OUT], step


# --- 1. --custom-config-path base64:<payload> ------------------------------------------------------


@pytest.mark.slow
def test_inline_base64_custom_config(tmp_path, stub_engine, tiny_model_dir):
    """Miles accepts the YAML inline as `base64:<payload>` and sets its keys on args; the plugin
    must not treat that value as a file name (a long one made Path.is_file() raise ENAMETOOLONG)."""
    config = {
        **PIPELINE,
        "pipeline": {"num_parallel": 2, "correct_weight": 1.2, "incorrect_weight": 0.8},
        "engine": {"request_timeout_s": 120, "max_retries": 2},
    }
    payload = base64.b64encode(yaml.safe_dump({"mrlx": config}).encode()).decode()
    assert len(payload) > 255  # longer than a file name may be
    run = run_miles(tmp_path, stub_engine.url, tiny_model_dir, "base64:" + payload, *BATCH)
    run.assert_ok()
    assert run.result["args"]["custom_config_keys"] == ["mrlx"]
    _assert_pipeline_steps(run, 1)


# --- 2. the eval log function ------------------------------------------------------------------


@pytest.mark.slow
def test_eval_log_function_reaches_tracking(tmp_path, stub_engine, tiny_model_dir):
    """With `--custom-eval-rollout-log-function-path`, Miles passes the eval data and
    `extra_metrics=None` (its own rollouts return no eval metrics); the plugin's per-dataset
    metrics must reach Miles' tracking logger on `eval/step` (Miles' logging_utils has no `log`)."""
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:3]))
    eval_flags = ["--custom-eval-rollout-log-function-path", "mrlx_plugin.rollout.log_eval_rollout"]
    eval_flags += ["--eval-prompt-data", "arith", str(prompts), "--eval-interval", "1"]
    run = run_miles(tmp_path, stub_engine.url, tiny_model_dir, PIPELINE, *BATCH, *eval_flags)
    run.assert_ok()
    assert "AttributeError" not in run.output, run.explain()
    assert [e["rollout_id"] for e in run.result["evals"]] == [0, 0]  # before training, and after step 0
    assert all(e["datasets"]["arith"]["samples"] == 3 for e in run.result["evals"])
    eval_lines = run.logged("eval/step")
    plugin = [m for m in eval_lines if "eval/arith/multi_agent/episodes" in m]
    assert len(plugin) == 2, eval_lines
    assert all(m["eval/arith/multi_agent/episodes"] == 3 and m["eval/step"] == 0 for m in plugin), plugin
    assert sum("eval/arith" in m for m in eval_lines) == 2, eval_lines  # Miles' own eval metrics still logged
    _assert_pipeline_steps(run, 1)


# --- 3. abort between turns ----------------------------------------------------------------------

LATENCY_S = 0.2
RETRY_WAIT_S = 0.1


@pytest.fixture
def slow_engine(logs_dir, request):
    """A stub engine that answers each /generate after LATENCY_S seconds."""
    from mrlx_lab.stub_engine import start_stub_engine

    proc = start_stub_engine(
        log_dir=logs_dir, name=f"slow-{request.node.name[:40]}", extra=["--latency", str(LATENCY_S)]
    )
    yield proc
    proc.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("retry_on_abort", "legacy"),
    [(False, False), (True, False), (True, True)],
    ids=["plain", "retry_on_abort", "retry_on_abort-legacy_v1"],
)
def test_abort_stops_dialogues_between_turns(tmp_path, slow_engine, tiny_model_dir, retry_on_abort, legacy):
    """Over-sampling: 4 groups of 2 six-turn dialogues are drawn for 2, at most 4 run at a time
    (`--sglang-server-concurrency 4`), so when the first 2 groups are done the other 2 are
    mid-episode. `abort()` sets the rollout state's `aborted`, aborts what the engine holds and
    waits for every generate call: no new /generate may follow the flag (beyond one turn per
    generate call then running), and abort() must return promptly. With `retry_on_abort` the
    aborted turns are retried unless the episode reads the host's flag, so those variants see a
    plugin that misses it (class-based: a GenerateState per rollout; legacy v1: the singleton).
    """
    sampling = {"max_new_tokens": 8}
    agent = {"url": "self", "sampling": sampling, **({"retry_on_abort": True} if retry_on_abort else {})}
    config = {
        "run_id": "miles-abort",
        "system": "dialogue",
        "agents": {"doctor": agent, "patient": dict(agent)},
        "dialogue": {"max_turns": 6},
        "engine": {"abort_retry_wait_s": RETRY_WAIT_S},
    }
    batch = (
        "--rollout-batch-size 2 --n-samples-per-prompt 2 --over-sampling-batch-size 4 --global-batch-size 4"
    )
    concurrency = "--sglang-server-concurrency 4 --rollout-max-response-len 1024"
    legacy_env = {"MILES_USE_LEGACY_ROLLOUT_V1": "1"} if legacy else None
    run = run_miles(
        tmp_path,
        slow_engine.url,
        tiny_model_dir,
        config,
        *batch.split(),
        *concurrency.split(),
        dp=1,
        stub_stats=True,
        env=legacy_env,
    )
    run.assert_ok()
    [step] = run.steps
    assert step["samples"] == 8 and step["samples_per_rollout"] == [2] * 4, step  # doctor + patient
    aborted, drained = step["abort"]
    assert (aborted["stage"], drained["stage"]) == ("aborted", "drained"), step["abort"]
    running = aborted["generate_calls_running"]
    assert aborted["pending_groups"] == 2 and running >= 1, aborted  # dialogues under way at the abort
    new_requests = drained["generate"] - aborted["generate"]
    assert new_requests <= running, (
        f"{new_requests} /generate requests after state.aborted was set ({running} generate calls were "
        "running, "
        f"{aborted['pending']} requests in flight)"
    )
    seconds = drained["t"] - aborted["t"]
    assert seconds < RETRY_WAIT_S + 2 * LATENCY_S, f"abort() took {seconds:.2f} s to return"


# --- 4. the data-parallel split of a step with an aborted episode ---------------------------------


@pytest.mark.slow
def test_aborted_episode_keeps_samples_per_episode_and_dp_split(tmp_path, stub_engine, tiny_model_dir):
    """One episode of 4 aborted by an engine fault (no retries): the step still holds 4 x 5
    samples, so static micro-batches of 1 split evenly over 2 ranks (Miles' schedule asserts that
    the micro-batch count is a multiple of dp_size)."""
    engine_faults(stub_engine.url, "http500", 1)
    config = {**PIPELINE, "engine": {"max_retries": 0}}
    run = run_miles(tmp_path, stub_engine.url, tiny_model_dir, config, *BATCH)
    run.assert_ok()
    assert engine_stats(stub_engine.url)["faults_served"] == 1
    _assert_pipeline_steps(run, 1)
    assert run.steps[0]["statuses"].get("aborted") == FAN_OUT, run.steps[0]


# --- 5. the rollout modes -----------------------------------------------------------------------


@pytest.mark.slow
def test_class_based_default_rollout(tmp_path, stub_engine, tiny_model_dir):
    """Miles' default rollout (class-based InferenceRolloutFn) runs the shared-model pipeline; the
    plugin's rollout metrics are merged into Miles' rollout log; its add_arguments was called."""
    run = run_miles(tmp_path, stub_engine.url, tiny_model_dir, PIPELINE, *BATCH, num_rollout=2)
    run.assert_ok()
    assert run.result["args"]["rollout_function_path"] == CLASS_BASED
    assert run.result["args"]["has_mrlx_config_flag"]  # Miles called generate.add_arguments(parser)
    _assert_pipeline_steps(run, 2)
    logged = run.logged("rollout/step")
    assert [m["rollout/step"] for m in logged] == [0, 1], logged
    assert all(m["multi_agent/episodes"] == 4 and "rollout/response_len/mean" in m for m in logged), logged


def test_legacy_v1_rollout(tmp_path, stub_engine, tiny_model_dir):
    """`MILES_USE_LEGACY_ROLLOUT_V1=1`: the function-based rollout (a GenerateState singleton)."""
    legacy_env = {"MILES_USE_LEGACY_ROLLOUT_V1": "1"}
    run = run_miles(
        tmp_path, stub_engine.url, tiny_model_dir, PIPELINE, *BATCH, num_rollout=2, env=legacy_env
    )
    run.assert_ok()
    assert run.result["args"]["rollout_function_path"] == LEGACY
    assert not run.result["args"]["has_mrlx_config_flag"]  # Miles calls no add_arguments on this path
    _assert_pipeline_steps(run, 2)
    assert [m["multi_agent/episodes"] for m in run.logged("rollout/step")] == [4, 4]


@pytest.mark.slow
def test_fully_async_rollout(tmp_path, stub_engine, tiny_model_dir):
    """`--fully-async`: generation runs on across steps; each step drains finished groups."""
    run = run_miles(
        tmp_path, stub_engine.url, tiny_model_dir, PIPELINE, *BATCH, "--fully-async", num_rollout=2
    )
    run.assert_ok()
    assert run.result["args"]["rollout_function_path"] == FULLY_ASYNC
    _assert_pipeline_steps(run, 2)


@pytest.mark.slow
def test_multi_model_refuses_fully_async(tmp_path, stub_engine, tiny_model_dir):
    """A job whose agent `b` is trained by another job (its samples go through a coordinator) cannot
    run Miles' fully-async rollout; it is refused at start-up, by name, before any engine call."""
    config = {
        "run_id": "miles-mm",
        "system": "dialogue",
        "self": "a",
        "agents": {"a": {"url": "self"}, "b": {"url": "http://127.0.0.1:9", "trainable": True}},
        "coordinator": {"url": "http://127.0.0.1:9"},
        "dialogue": {"max_turns": 2},
    }
    token_env = {"MRLX_TOKEN": "test-token"}
    run = run_miles(tmp_path, stub_engine.url, tiny_model_dir, config, *BATCH, "--fully-async", env=token_env)
    assert run.proc.returncode != 0 and run.error is not None, run.explain()
    assert run.error["type"] == "ConfigError", run.explain()
    assert "--fully-async" in run.error["message"], run.explain()
    assert run.steps == []
    assert engine_stats(stub_engine.url)["generate"] == 0


LORA_JOBS = {
    # a shared-model job: every url-self agent is trained here; the frozen selector is not blamed
    "shared-model": (
        {
            **PIPELINE,
            "agents": {
                **PIPELINE["agents"],
                "solver": {"url": "self", "adapter": "solver-lora"},
                "selector": {"url": "http://127.0.0.1:9", "trainable": False, "adapter": "selector-lora"},
            },
        },
        [],
        ("solver", "solver-lora"),
        "selector",
    ),
    # job A of a multi-model run trains mrlx.self only: b (trained by its own job) is not blamed here
    "multi-model": (
        {
            "run_id": "miles-mm-lora",
            "system": "dialogue",
            "self": "a",
            "agents": {
                "a": {"url": "self", "adapter": "a-lora"},
                "b": {"url": "http://127.0.0.1:9", "trainable": True, "adapter": "b-lora"},
            },
            "coordinator": {"url": "http://127.0.0.1:9"},
            "dialogue": {"max_turns": 2},
        },
        ["--rollout-function-path", "mrlx_plugin.rollout.initiator_rollout"],
        ("a", "a-lora"),
        "b-lora",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(LORA_JOBS))
def test_training_an_agent_served_as_a_lora_adapter_is_refused_by_name(
    tmp_path, stub_engine, tiny_model_dir, job
):
    """Miles trains LoRA adapters only through its own drivers (one fixed adapter per job, or its
    multi-LoRA driver without a rollout function): a job whose trained agent (shared-model: the
    url-self agents; multi-model: mrlx.self) is served as an adapter is refused at start-up, naming
    the agent, its adapter and the key, before any engine call; an agent this job does not train
    is not blamed."""
    config, flags, (agent, adapter), innocent = LORA_JOBS[job]
    run = run_miles(
        tmp_path, stub_engine.url, tiny_model_dir, config, *BATCH, *flags, env={"MRLX_TOKEN": "test-token"}
    )
    assert run.proc.returncode != 0 and run.error is not None, run.explain()
    assert run.error["type"] == "ConfigError", run.explain()
    message = run.error["message"]
    assert (
        f": mrlx.agents.{agent}.adapter: this Miles job trains agent '{agent}', served as LoRA adapter "
        f"'{adapter}', but Miles trains LoRA adapters through its own drivers only" in message
    ), message
    assert innocent not in message, message
    assert run.steps == []
    assert engine_stats(stub_engine.url)["generate"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [False, True], ids=["class-based", "legacy-v1"])
def test_initiator_rollout_runs_miles_default_rollout_and_hands_b_its_groups(
    tmp_path, tiny_model_dir, logs_dir, start_coordinator, legacy
):
    """A multi-model job A on Miles: `initiator_rollout` (behind Miles' legacy rollout adapter) runs
    Miles' current default rollout (class-based InferenceRolloutFn, or the v1 function under
    MILES_USE_LEGACY_ROLLOUT_V1=1); A's step splits, and B's samples of the groups A kept reach a
    real coordinator, one whole group per prompt group."""
    from _twojobs import two_job_config

    from mrlx_lab.stub_engine import start_stub_engine

    engine_a = start_stub_engine(log_dir=logs_dir, name="stub-miles-a")
    engine_b = start_stub_engine(log_dir=logs_dir, name="stub-miles-b")
    coord = start_coordinator(run_id="miles-mm", agents=("a", "b"))
    try:
        config = two_job_config(
            "a",
            run_id="miles-mm",
            urls={"b": engine_b.url},
            coordinator=coord.url,
            coordinator_settings={"max_staleness": 1},
            dialogue={"first": "a", "max_turns": 2},
        )
        env = {**coord.env, **({"MILES_USE_LEGACY_ROLLOUT_V1": "1"} if legacy else {})}
        run = run_miles(
            tmp_path,
            engine_a.url,
            tiny_model_dir,
            config,
            *BATCH,
            "--rollout-function-path",
            "mrlx_plugin.rollout.initiator_rollout",
            "--rollout-max-response-len",
            "512",
            env=env,
        )  # room for B's turn after A's
        run.assert_ok()
        (step,) = run.steps
        assert step["samples"] == 4 and step["rank_sizes"] == [2, 2], step
        assert (engine_stats(engine_a.url)["generate"], engine_stats(engine_b.url)["generate"]) == (4, 4), (
            step,
            run.explain(),
        )
        status, _, body = coord.http("GET", "/v1/runs/miles-mm/queues/b")
        queue = json.loads(body)
        assert status == 200 and queue["queued_items"] == 4 and queue["ready_groups"] == 2, queue
    finally:
        coord.stop()
        engine_a.stop()
        engine_b.stop()


@pytest.mark.slow
def test_per_turn_credit_with_tree_sampling_through_miles(tmp_path, stub_engine, tiny_model_dir):
    """Miles' class-based default rollout with per-turn credit and two candidates per turn: each
    dialogue episode (two agents, two turns each) returns 8 samples, every step splits evenly over
    two ranks, and the branch metric reaches Miles' rollout log."""
    config = {
        "run_id": "miles-credit",
        "system": "dialogue",
        "agents": {"a": {"url": "self"}, "b": {"url": "self"}},
        "dialogue": {"max_turns": 4},
        "rewards": {"credit": "turn", "branch": 2},
        "plugins": ["examples.multi_agent.turn_format_reward"],  # what the candidates are compared by
        "engine": {"sampling_seed": 5},
    }
    run = run_miles(tmp_path, stub_engine.url, tiny_model_dir, config, *BATCH)
    run.assert_ok()
    (step,) = run.steps
    assert step["samples"] == 4 * 8 and step["samples_per_rollout"] == [8] * 4, step
    assert step["rank_sizes"] == [16, 16], step
    (logged,) = run.logged("rollout/step")
    # one candidate not taken per turn taken (the 64-token response cap may end a dialogue early)
    assert logged["multi_agent/episodes"] == 4 and logged["multi_agent/avg_turns"] >= 1, logged
    assert logged.get("credit/branch_candidates") == logged["multi_agent/avg_turns"], logged
