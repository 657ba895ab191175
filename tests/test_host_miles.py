"""The plugin driven through a host-shaped fake of Miles (`tests/hosts/miles`), end to end.

Each test runs the fake's `train.py` as its own process (argument parsing with `add_arguments`
and `--custom-config-path`, the rollout manager, Miles' class-based, legacy or fully-async
rollout, its abort, logging, reward post-processing and data-parallel split, with the plugin's
flags) against stub engines over real sockets, and reads what the driver reports: per step the
samples, their statuses and rollout ids, the per-rank sizes of the split and the stub's counters
around `abort()`; errors with their type; what reached Miles' tracking logger (`FAKE_HOST_LOG`).
The multi-model tests under `--fully-async` run job A that way, in the background, beside a real
coordinator, and job B's `responder_rollout` in this process, step by step as B's host calls it.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _host import batch_flags, engine_faults, engine_stats

from mrlx_plugin.core import processes

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


def miles_job(
    tmp_path: Path,
    engine_url: str,
    tokenizer: Path,
    config: dict[str, Any] | str,
    *flags: str,
    num_rollout: int = 1,
    dp: int = 2,
    env: dict[str, str] | None = None,
    stub_stats: bool = False,
) -> tuple[list[str], dict[str, str], Path, Path]:
    """The driver's command line and environment for the plugin's flags, `config` (the `mrlx:`
    mapping, written to a YAML file, or a ready `--custom-config-path` value) and `flags`; and the
    paths of its result and tracking log (all under `tmp_path`)."""
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
    return argv, penv, result, log


def read_run(proc: subprocess.CompletedProcess, result: Path, log: Path) -> Run:
    report = json.loads(result.read_text()) if result.exists() else None
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return Run(proc, report, lines)


def run_miles(
    tmp_path: Path,
    engine_url: str,
    tokenizer: Path,
    config: dict[str, Any] | str,
    *flags: str,
    timeout: float = 150,
    **options: Any,
) -> Run:
    """Run the driver to its end (`miles_job` builds the command) and read what it reported."""
    argv, penv, result, log = miles_job(tmp_path, engine_url, tokenizer, config, *flags, **options)
    proc = subprocess.run(
        argv, check=False, env=penv, capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )
    return read_run(proc, result, log)


class Background:
    """The driver run as a background process (`miles_job`'s arguments), its output in a file."""

    def __init__(self, tmp_path: Path, *args: Any, **options: Any):
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.argv, env, self.result, self.log = miles_job(tmp_path, *args, **options)
        self.out = tmp_path / "driver.log"
        with self.out.open("wb") as out:
            self.proc = processes.start(
                self.argv, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT
            )

    def report(self) -> dict[str, Any]:
        """What the driver has reported so far (it rewrites the file whole, atomically)."""
        return json.loads(self.result.read_text()) if self.result.exists() else {}

    def alive(self) -> None:
        """Stop a wait early, with the driver's output, when the driver has exited."""
        if self.proc.poll() is not None:
            raise AssertionError(self.finish().explain())

    def finish(self, timeout: float = 150) -> Run:
        code = self.proc.wait(timeout)
        done = subprocess.CompletedProcess(self.argv, code, self.out.read_text(errors="replace"), "")
        return read_run(done, self.result, self.log)

    def kill(self) -> None:
        """SIGKILL (no shutdown code runs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


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


ASYNC = ["--fully-async", "--custom-async-data-buffer-path", "mrlx_plugin.rollout.AsyncDataBuffer"]


@pytest.mark.slow
def test_fully_async_with_the_plugin_buffer_trains_groups_holding_fillers(
    tmp_path, stub_engine, tiny_model_dir
):
    """`--fully-async` with the plugin's data buffer: generation runs on across steps and each step
    takes finished groups. An engine fault ends one episode early: its samples come back as
    ABORTED fillers, and its group (the other episode trains) is trained all the same, where
    Miles' default buffer would drop every group holding an ABORTED sample. Every step holds the
    full batch of whole episodes, and the buffer's staleness metrics reach Miles' log."""
    engine_faults(stub_engine.url, "http500", 1)
    config = {**PIPELINE, "engine": {"max_retries": 0}}
    run = run_miles(tmp_path, stub_engine.url, tiny_model_dir, config, *BATCH, *ASYNC, num_rollout=3)
    run.assert_ok()
    assert run.result["args"]["rollout_function_path"] == FULLY_ASYNC
    assert engine_stats(stub_engine.url)["faults_served"] == 1
    _assert_pipeline_steps(run, 3)
    assert sum(step["statuses"].get("aborted", 0) for step in run.steps) == FAN_OUT, run.steps
    logged = run.logged("rollout/step")
    assert [m["rollout/step"] for m in logged] == [0, 1, 2], logged
    assert all("multi_agent/staleness" in m and m["multi_agent/stale_groups"] == 0 for m in logged), logged
    # Groups born in one step are trained in the next: generation ran on between the steps.
    assert max(m["multi_agent/staleness_max"] for m in logged) >= 1, logged


@pytest.mark.slow
def test_fully_async_with_miles_default_buffer_is_refused_by_name(tmp_path, stub_engine, tiny_model_dir):
    """Miles' default buffer would drop every group holding an ABORTED filler: the job is refused
    before any engine call, naming the buffer flag and the plugin's buffer."""
    run = run_miles(tmp_path, stub_engine.url, tiny_model_dir, PIPELINE, *BATCH, "--fully-async")
    assert run.proc.returncode != 0 and run.error is not None, run.explain()
    assert run.error["type"] == "ConfigError", run.explain()
    message = run.error["message"]
    assert "--custom-async-data-buffer-path mrlx_plugin.rollout.AsyncDataBuffer" in message, message
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


# --- 6. a multi-model run's initiator under --fully-async ----------------------------------------

MM_RUN = "miles-mm-async"
MM_COORDINATOR = {"max_staleness": 1, "wait_deadline_s": 60, "lease_s": 30}
MM_DIALOGUE = {"first": "a", "max_turns": 2}  # A's turn, then B's: one sample per episode for each


@pytest.fixture
def two_engines(logs_dir, request):
    """Stub engines serving agent a (A's router) and agent b."""
    from mrlx_lab.stub_engine import start_stub_engine

    name = request.node.name[:30]
    engines = [start_stub_engine(log_dir=logs_dir, name=f"{agent}-{name}") for agent in ("a", "b")]
    yield engines
    for engine in engines:
        engine.stop()


def initiator(
    where: Path, engines: list[Any], tokenizer: Path, coord: Any, steps: int, *flags: str
) -> Background:
    """Job A (agent a): the fake Miles under `--fully-async` with the plugin's buffer and generate."""
    from _twojobs import two_job_config

    config = two_job_config(
        "a",
        run_id=MM_RUN,
        urls={"b": engines[1].url},
        coordinator=coord.url,
        coordinator_settings=MM_COORDINATOR,
        dialogue=MM_DIALOGUE,
    )
    # 512 tokens: room for B's turn after A's
    return Background(
        where,
        engines[0].url,
        tokenizer,
        config,
        *BATCH,
        *ASYNC,
        "--rollout-max-response-len",
        "512",
        *flags,
        num_rollout=steps,
        env=coord.env,
    )


def responder_args(engines: list[Any], tokenizer: Path, coord: Any) -> Any:
    """Job B's args (agent b), as its host would pass them to `responder_rollout` (this process)."""
    from _host import slime_args
    from _twojobs import two_job_config

    config = two_job_config(
        "b",
        run_id=MM_RUN,
        urls={"a": engines[0].url},
        coordinator=coord.url,
        coordinator_settings=MM_COORDINATOR,
        dialogue=MM_DIALOGUE,
    )
    return slime_args(engines[1].url, str(tokenizer), config, rollout_batch_size=2, n_samples_per_prompt=2)


def responder_steps(args: Any, steps: range) -> dict[int, list[list[Any]]]:
    """B's steps, each `responder_rollout` as B's host calls it; everything acknowledged after."""
    from mrlx_plugin.core.host import run_in_host_loop
    from mrlx_plugin.rollout import ack_trained_groups, responder_rollout
    from mrlx_plugin.runtime import responder_for

    trained = {}
    try:
        for step in steps:
            trained[step] = responder_rollout(args, step, None).samples
        ack_trained_groups(args, steps[-1])
    finally:
        run_in_host_loop(responder_for(args).aclose())
    return trained


def assert_whole_steps(trained: dict[int, list[list[Any]]]) -> None:
    """Each of B's steps: 2 groups of 2 of A's episodes (B's one sample each), none a filler, and
    no episode of A's twice across the steps."""
    episodes = []
    for step, groups in trained.items():
        assert len(groups) == 2, (step, groups)
        for group in groups:
            assert len(group) == 2 and len({s.group_index for s in group}) == 1, (step, group)
            assert all("dead_letter" not in s.metadata["mrlx"] for s in group), (step, group)
            episodes += [s.metadata["mrlx"]["episode_id"] for s in group]
    assert len(episodes) == len(set(episodes)), f"an episode reached B twice: {sorted(episodes)}"


def group_indices(groups: list[list[Any]]) -> list[int]:
    return sorted({s.group_index for g in groups for s in g})


@pytest.mark.slow
def test_multi_model_initiator_under_fully_async_hands_b_each_step_whole(
    tmp_path, two_engines, tiny_model_dir, start_coordinator, monkeypatch
):
    """Job A of a multi-model run under Miles' `--fully-async` with the plugin's buffer: each of
    A's steps waits for B at its top and commits the peer samples of the groups it takes, so B's
    step k receives exactly the prompt groups A trained at its step k, each whole and once."""
    coord = start_coordinator(run_id=MM_RUN, agents=("a", "b"))
    monkeypatch.setenv(*next(iter(coord.env.items())))
    job_a = initiator(tmp_path / "a", two_engines, tiny_model_dir, coord, 3)
    try:
        trained = responder_steps(responder_args(two_engines, tiny_model_dir, coord), range(3))
        run = job_a.finish()
    finally:
        job_a.kill()
    run.assert_ok()
    assert run.result["args"]["rollout_function_path"] == FULLY_ASYNC
    assert [step["rollout_id"] for step in run.steps] == [0, 1, 2], run.explain()
    assert_whole_steps(trained)
    for step in run.steps:
        assert step["samples"] == 4 and step["rank_sizes"] == [2, 2], step
        assert group_indices(trained[step["rollout_id"]]) == step["groups"], (step, trained)
    logged = run.logged("rollout/step")
    assert all(m["coordinator/groups_sent"] == 2 and "multi_agent/staleness" in m for m in logged), logged
    status, _, body = coord.http("GET", f"/v1/runs/{MM_RUN}/queues/b")
    queue = json.loads(body)
    assert status == 200 and queue["queued_items"] == 0 and queue["leased_items"] == 0, queue


@pytest.mark.slow
def test_multi_model_initiator_killed_with_groups_queued_resumes_exactly_once(
    tmp_path, two_engines, tiny_model_dir, start_coordinator, monkeypatch
):
    """Job A under `--fully-async` is SIGKILLed while it waits for B at the top of its step 2,
    steps 0 and 1 committed (step 1 ran before step 0 was saved, as under train_async) and finished
    groups queued in its buffer; it resumes from its checkpoint of step 0. A resume that does not
    say its step is refused by name; the resumed job commits its step 1 again, which must add
    nothing: B trains every step whole, no episode twice, and nothing committed is left behind."""
    from _coord_procs import waits_in_progress

    from mrlx_plugin.core.retry import wait_until

    coord = start_coordinator(run_id=MM_RUN, agents=("a", "b"))
    monkeypatch.setenv(*next(iter(coord.env.items())))
    checkpoints = tmp_path / "checkpoints"
    save = ["--save", str(checkpoints), "--save-interval", "1"]
    first = initiator(tmp_path / "first", two_engines, tiny_model_dir, coord, 4, *save)
    try:

        def waiting_with_groups_queued() -> bool:
            first.alive()
            steps = [step["rollout_id"] for step in first.report().get("steps", [])]
            return (
                steps == [0]
                and (checkpoints / "latest_checkpointed_iteration.txt").exists()
                and waits_in_progress(coord, "version") >= 1  # A at its step 2's barrier
                # B's turn ends an episode: 4 groups committed and 4 more finished into the buffer
                and engine_stats(two_engines[1].url)["generate"] >= 2 * (4 + 4)
            )

        wait_until(waiting_with_groups_queued, 120, what="job A waiting for B with groups queued")
    finally:
        first.kill()
    status, _, body = coord.http("GET", f"/v1/runs/{MM_RUN}/queues/b")
    assert json.loads(body)["ready_groups"] == 4, body  # A's steps 0 and 1

    load = ["--load", str(checkpoints)]
    calls = engine_stats(two_engines[0].url)["generate"]
    refused = initiator(tmp_path / "refused", two_engines, tiny_model_dir, coord, 4, *load).finish()
    assert refused.error is not None and refused.error["type"] == "ConfigError", refused.explain()
    assert "--start-rollout-id" in refused.error["message"], refused.explain()
    assert engine_stats(two_engines[0].url)["generate"] == calls

    resumed = initiator(
        tmp_path / "resumed", two_engines, tiny_model_dir, coord, 4, *load, *save, "--start-rollout-id", "1"
    )
    try:
        trained = responder_steps(responder_args(two_engines, tiny_model_dir, coord), range(4))
        run = resumed.finish()
    finally:
        resumed.kill()
    run.assert_ok()
    assert [step["rollout_id"] for step in run.steps] == [1, 2, 3], run.explain()
    assert_whole_steps(trained)
    steps = {step["rollout_id"]: step["groups"] for step in [*first.finish().steps, *run.steps]}
    assert group_indices(trained[0]) == steps[0]
    # B's step 1 is the killed job's (its training of A's side died with it); the resumed job's
    # step 1 committed nothing new: every item was already there.
    assert not set(group_indices(trained[1])) & set(steps[1]), (trained[1], steps[1])
    (step_1, *_) = run.logged("rollout/step")
    assert step_1["coordinator/samples_sent"] == 0 and step_1["coordinator/duplicates"] == 4, step_1
    assert [group_indices(trained[k]) for k in (2, 3)] == [steps[2], steps[3]]
    status, _, body = coord.http("GET", f"/v1/runs/{MM_RUN}/queues/b")
    queue = json.loads(body)
    assert queue["queued_items"] == 0 and queue["leased_items"] == 0, queue
