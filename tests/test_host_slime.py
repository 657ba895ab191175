"""The plugin driven through a host-shaped fake of slime (`tests/hosts/slime`), end to end.

Each test runs the fake's `train.py` (or `train_async.py`, slime's asynchronous loop) as its own
process (slime's rollout manager, default or fully-async rollout or the plugin's rollout
functions, logging and data-parallel split, with the plugin's four flags) against stub engines
over real sockets, and reads what the driver reports: per step the samples, their statuses,
rollout ids, prompt groups and birth steps, and the per-rank sizes of the split; errors with
their type; what reached the host's logger (`FAKE_HOST_LOG`). Multi-model tests run a job per
agent and a real coordinator.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from _host import batch_flags, engine_faults, engine_stats

from mrlx_plugin.core.retry import wait_until

REPO = Path(__file__).resolve().parent.parent
HOSTS = REPO / "tests" / "hosts"
DRIVER = HOSTS / "slime" / "train.py"
PROMPTS = [{"prompt": "What is 40 + 2?", "label": "42"}, {"prompt": "What is 6 * 7?", "label": "42"}]
PIPELINE = {
    "run_id": "slime-fake",
    "system": "pipeline",
    "pipeline": {"num_parallel": 2},
    "agents": {"solver": {"url": "self"}, "rewriter": {"url": "self"}, "selector": {"url": "self"}},
}
FAN_OUT = 5  # 2 solvers, 2 rewriters, 1 selector
FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


def _host_port(url: str) -> tuple[str, str]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, port


class Run:
    """One run of the fake slime's train.py and what it reported."""

    def __init__(self, proc: subprocess.CompletedProcess, result: dict[str, Any], log: list[dict[str, Any]]):
        self.proc = proc
        self.result = result
        self.log = log  # the lines logging_utils.log wrote

    @property
    def errors(self) -> list[dict[str, Any]]:
        return self.result.get("errors", [])

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.result.get("steps", [])

    def explain(self) -> str:
        errors = "; ".join(f"{e['type']}: {e['message']}" for e in self.errors)
        tail = self.proc.stdout[-4000:]
        return f"rc={self.proc.returncode} errors=[{errors}]\n--- driver output (tail) ---\n{tail}"


def slime_command(
    tmp_path: Path,
    tokenizer: Path,
    router_url: str,
    mrlx: dict[str, Any],
    *flags: str,
    driver: Path = DRIVER,
    name: str = "",
):
    """Write the YAML and prompt files; the driver's argv and env with the plugin's flags plus `flags`
    (`name` tells apart the files of several jobs in one directory)."""
    config = tmp_path / f"mrlx{name}.yaml"
    config.write_text(yaml.safe_dump({"mrlx": mrlx}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    result_file, log_file = tmp_path / f"result{name}.json", tmp_path / f"host_log{name}.jsonl"
    result_file.unlink(missing_ok=True)
    log_file.unlink(missing_ok=True)
    ip, port = _host_port(router_url)
    argv = [
        sys.executable,
        str(driver),
        "--hf-checkpoint",
        str(tokenizer),
        "--sglang-router-ip",
        ip,
        "--sglang-router-port",
        port,
        "--prompt-data",
        str(prompts),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rollout-max-response-len",
        "512",
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        "2",
        "--fake-dp-size",
        "2",
        "--custom-generate-function-path",
        "mrlx_plugin.rollout.generate",
        "--custom-reward-post-process-path",
        "mrlx_plugin.rollout.normalize",
        "--custom-rollout-log-function-path",
        "mrlx_plugin.rollout.log_rollout",
        "--custom-config-path",
        str(config),
        "--fake-result",
        str(result_file),
        *flags,
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HOSTS / "slime"), str(HOSTS), str(REPO)]),
        FAKE_HOST_LOG=str(log_file),
        PYTHONUNBUFFERED="1",
    )
    return argv, env, result_file, log_file


def run_slime(
    tmp_path: Path,
    tokenizer: Path,
    router_url: str,
    mrlx: dict[str, Any],
    *flags: str,
    timeout: float = 120,
    driver: Path = DRIVER,
) -> Run:
    """Run the driver to its end and read what it reported."""
    argv, env, result_file, log_file = slime_command(
        tmp_path, tokenizer, router_url, mrlx, *flags, driver=driver
    )
    try:
        proc = subprocess.run(
            argv,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the fake slime did not finish within {timeout:.0f} s:\n{(exc.stdout or '')[-4000:]}")
    assert result_file.exists(), f"the driver wrote no result (rc={proc.returncode}):\n{proc.stdout[-4000:]}"
    result = json.loads(result_file.read_text())
    log = [json.loads(line) for line in log_file.read_text().splitlines()] if log_file.exists() else []
    return Run(proc, result, log)


def _by_rollout(step: dict[str, Any]) -> dict[Any, list[str]]:
    out: dict[Any, list[str]] = defaultdict(list)
    for rid, status in zip(step["rollout_ids"], step["statuses"]):
        out[rid].append(status)
    return out


def test_aborted_episode_keeps_its_samples_per_episode_and_the_step_splits(
    tmp_path, tiny_model_dir, stub_engine
):
    """4 pipeline episodes per step, one failed by the engine: 20 samples (5 ABORTED), split 10/10."""
    engine_faults(stub_engine.url, "http500", 1)
    mrlx = {**PIPELINE, "engine": {"max_retries": 0}}
    run = run_slime(
        tmp_path,
        tiny_model_dir,
        stub_engine.url,
        mrlx,
        *batch_flags(num_rollout=1),
    )
    assert engine_stats(stub_engine.url)["faults_served"] == 1
    assert not run.errors and run.proc.returncode == 0, run.explain()
    (step,) = run.steps
    assert step["num_samples"] == 4 * FAN_OUT, step
    assert step["rank_sizes"] == [10, 10]
    groups = _by_rollout(step)
    assert sorted(len(s) for s in groups.values()) == [FAN_OUT] * 4, groups
    aborted = [rid for rid, statuses in groups.items() if set(statuses) == {"aborted"}]
    assert len(aborted) == 1, f"expected one whole ABORTED episode: {groups}"
    assert all(set(s) == {"completed"} for rid, s in groups.items() if rid != aborted[0]), groups
    masks = [m for rid, m in zip(step["rollout_ids"], step["loss_mask_sums"]) if rid == aborted[0]]
    assert masks == [0] * FAN_OUT  # nothing of the failed episode is trained


@pytest.mark.slow
def test_unsplittable_batch_settings_are_refused_at_start_up(tmp_path, tiny_model_dir, stub_engine):
    """Fan-out 5, one episode per step, fixed micro-batches of 1, dp 2: no step can ever split."""
    flags = batch_flags(1, 1, 1, 1, num_rollout=1)
    run = run_slime(tmp_path, tiny_model_dir, stub_engine.url, PIPELINE, *flags)
    assert run.proc.returncode != 0 and not run.steps, run.explain()
    assert len(run.errors) == 1, run.explain()
    error = run.errors[0]
    assert error["type"] == "mrlx_plugin.core.config.ConfigError", run.explain()
    assert "--micro-batch-size" in error["message"] and "--use-dynamic-batch-size" in error["message"], error
    assert engine_stats(stub_engine.url)["generate"] == 0, "refused only after episodes had run"

    run = run_slime(
        tmp_path,
        tiny_model_dir,
        stub_engine.url,
        PIPELINE,
        *flags,
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        "4096",
    )
    assert not run.errors and run.proc.returncode == 0, run.explain()
    (step,) = run.steps
    assert step["num_samples"] == FAN_OUT and sum(step["rank_sizes"]) == FAN_OUT, step
    assert min(step["rank_sizes"]) > 0, step  # the dynamic path splits bins until every rank has one


@pytest.mark.slow
def test_eval_and_rollout_metrics_reach_the_hosts_logger_under_its_step_keys(
    tmp_path, tiny_model_dir, stub_engine
):
    eval_prompts = tmp_path / "eval.jsonl"
    eval_prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    run = run_slime(
        tmp_path,
        tiny_model_dir,
        stub_engine.url,
        PIPELINE,
        *batch_flags(num_rollout=1),
        "--eval-interval",
        "1",
        "--eval-prompt-data",
        "arith",
        str(eval_prompts),
        "--custom-eval-rollout-log-function-path",
        "mrlx_plugin.rollout.log_eval_rollout",
    )
    assert not run.errors and run.proc.returncode == 0, run.explain()
    assert [e["rollout_id"] for e in run.result["evals"]] == [0, 0]  # before training, and after step 0
    assert {line["step_key"] for line in run.log} <= {"eval/step", "rollout/step"}, (
        "metrics logged under a step key slime does not plot: "
        f"{sorted({line['step_key'] for line in run.log})}"
    )

    evals = [
        line["metrics"]
        for line in run.log
        if line["step_key"] == "eval/step"
        and any(k.startswith("eval/arith/multi_agent/") for k in line["metrics"])
    ]
    assert len(evals) == 2, run.log
    for metrics in evals:
        assert metrics["eval/step"] == 0
        assert metrics["eval/arith/multi_agent/episodes"] == len(PROMPTS)
        assert "eval/arith/multi_agent/team_reward" in metrics

    rollouts = [line["metrics"] for line in run.log if line["step_key"] == "rollout/step"]
    assert len(rollouts) == 1, run.log
    assert rollouts[0]["rollout/step"] == 0
    assert rollouts[0]["multi_agent/episodes"] == 4  # the plugin's metrics, merged into the host's own line
    assert "rollout/response_len/mean" in rollouts[0] and "reward/solver/mean" in rollouts[0]


@pytest.mark.slow
def test_no_turn_starts_after_the_host_aborts_the_rollout(tmp_path, tiny_model_dir, logs_dir):
    """slime's default rollout keeps the first 2 of 6 over-sampled dialogues and aborts the rest.

    Two rollout slots (`--sglang-server-concurrency 2`): the next two dialogues start when the
    first two end, on a turn of a peer engine that slime's abort does not reach. When that turn
    comes back the rollout is over: no further /generate request may be sent (at most the
    requests already on their way when the flag was set reach the engines afterwards).
    """
    from mrlx_lab.stub_engine import start_stub_engine

    slow = ["--latency", "0.3", "--response-tokens", "16"]
    own = start_stub_engine(log_dir=logs_dir, name="slime-fake-own", extra=slow)
    peer = start_stub_engine(log_dir=logs_dir, name="slime-fake-peer", extra=slow)
    try:
        mrlx = {
            "run_id": "slime-fake",
            "system": "dialogue",
            "agents": {"doctor": {"url": "self"}, "patient": {"url": peer.url, "trainable": False}},
            "dialogue": {"first": "patient", "max_turns": 4},
        }
        run = run_slime(
            tmp_path,
            tiny_model_dir,
            own.url,
            mrlx,
            *batch_flags(2, 1, 2, 1, num_rollout=2),
            "--over-sampling-batch-size",
            "6",
            "--sglang-server-concurrency",
            "2",
            "--fake-probe-url",
            own.url,
            "--fake-probe-url",
            peer.url,
        )
    finally:
        own.stop()
        peer.stop()
    assert not run.errors and run.proc.returncode == 0, run.explain()
    assert len(run.steps) == 2 and len(run.result["aborts"]) == 2, run.result
    for step, abort in zip(run.steps, run.result["aborts"]):
        assert step["statuses"] == ["completed", "completed"], step  # the flag was reset for the next rollout
        assert abort["groups_pending"] >= 1 and abort["generate_calls_in_flight"] >= 1, abort
        late = step["requests_after_step"] - abort["requests_at_abort"]
        assert late <= abort["generate_calls_in_flight"], (
            f"rollout {step['rollout_id']}: {late} /generate requests reached the engines after the host set "
            f"GenerateState.aborted, with {abort['generate_calls_in_flight']} episode(s) in flight"
        )


def _refused(run: Run, stub_url: str, *words: str) -> None:
    """The job stopped at its first plugin call with one ConfigError naming `words`, before any episode."""
    assert run.proc.returncode != 0 and not run.steps, run.explain()
    assert [e["type"] for e in run.errors] == ["mrlx_plugin.core.config.ConfigError"], run.explain()
    for word in words:
        assert word in run.errors[0]["message"], run.errors[0]
    assert engine_stats(stub_url)["generate"] == 0, "refused only after episodes had run"


@pytest.mark.slow
def test_fully_async_rollout_is_refused_by_name(tmp_path, tiny_model_dir, stub_engine):
    """slime's fully asynchronous rollout orders finished groups by `getattr(item, 'index')`, which
    for a group of lists (a generate function returning several samples) is `list.index`: a
    TypeError at every step (THUDM/slime#2344). Every mrlx episode returns a list, so the plugin
    refuses the mode at its first call, before any engine call, naming its own asynchronous
    rollout (`mrlx_plugin.rollout.async_rollout`) as the way to run one. That call runs in slime's
    background worker, which logs a failed task and goes on waiting (it never ends the job), so
    the refusal shows in the job's log, once per prompt group it tries."""
    from mrlx_plugin.core import processes

    argv, env, _, _ = slime_command(
        tmp_path,
        tiny_model_dir,
        stub_engine.url,
        PIPELINE,
        "--rollout-function-path",
        FULLY_ASYNC,
        "--sglang-server-concurrency",
        "4",
        *batch_flags(num_rollout=1),
    )
    log_path = tmp_path / "driver.log"
    with open(log_path, "wb") as out:
        proc = processes.start(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

        def refused() -> bool:
            text = log_path.read_text(errors="replace")
            assert "slime#2344" in text or proc.poll() is None, text[-4000:]  # the job died without it
            return "slime#2344" in text

        try:
            wait_until(
                refused,
                90,
                what="the refusal in the job's log",
                details=lambda: log_path.read_text(errors="replace")[-4000:],
            )
        finally:
            proc.kill()
            proc.wait(10)
    text = log_path.read_text(errors="replace")
    assert "ConfigError" in text and "--rollout-function-path" in text and "fully asynchronous" in text
    assert "--rollout-function-path mrlx_plugin.rollout.async_rollout" in text, text[-4000:]
    assert engine_stats(stub_engine.url)["generate"] == 0, "episodes ran before the refusal"


@pytest.mark.slow
def test_top_p_training_path_is_refused_by_name(tmp_path, tiny_model_dir, stub_engine):
    """With --rollout-top-p below 1 slime's train-data conversion asserts that every sample carries
    its sampled top-p token sets, which mrlx episodes do not record."""
    run = run_slime(
        tmp_path,
        tiny_model_dir,
        stub_engine.url,
        PIPELINE,
        "--rollout-top-p",
        "0.9",
        *batch_flags(num_rollout=1),
    )
    _refused(run, stub_engine.url, "--rollout-top-p 0.9", "rollout_top_p_token_ids")


@pytest.mark.slow
def test_training_an_agent_served_as_a_lora_adapter_is_refused_by_name(tmp_path, tiny_model_dir, stub_engine):
    """slime's Megatron trainer updates whole models: a shared-model job whose trained agent is
    served as a LoRA adapter would train the base model while its rollouts sample the adapter.
    Refused at start-up, naming the agent, its adapter and the key, before any engine call."""
    mrlx = {
        **PIPELINE,
        "agents": {**PIPELINE["agents"], "rewriter": {"url": "self", "adapter": "rewriter-lora"}},
    }
    run = run_slime(tmp_path, tiny_model_dir, stub_engine.url, mrlx, *batch_flags(num_rollout=1))
    _refused(
        run,
        stub_engine.url,
        ": mrlx.agents.rewriter.adapter: this slime job trains agent 'rewriter', served as LoRA adapter "
        "'rewriter-lora', but slime has no LoRA training path",
        "trainable: false",
    )
    assert "mrlx.agents.solver" not in run.errors[0]["message"], run.errors[0]  # only the adapter is blamed


@pytest.mark.slow
def test_a_frozen_agent_served_as_a_lora_adapter_runs_a_step(tmp_path, tiny_model_dir, logs_dir):
    """A frozen agent on another engine, served there as a LoRA adapter, is no trained adapter: the
    job runs its step, every one of the patient's requests names its adapter and the doctor's
    (trained, the base model of this job's engine) name none."""
    from mrlx_lab.stub_engine import start_stub_engine

    own = start_stub_engine(log_dir=logs_dir, name="slime-lora-own")
    peer = start_stub_engine(log_dir=logs_dir, name="slime-lora-peer", extra=["--lora-names", "patient-lora"])
    try:
        mrlx = {
            "run_id": "slime-lora",
            "system": "dialogue",
            "agents": {
                "doctor": {"url": "self"},
                "patient": {"url": peer.url, "trainable": False, "adapter": "patient-lora"},
            },
            "dialogue": {"first": "doctor", "max_turns": 2},
        }
        run = run_slime(tmp_path, tiny_model_dir, own.url, mrlx, *batch_flags(num_rollout=1))
        own_stats, peer_stats = engine_stats(own.url), engine_stats(peer.url)
    finally:
        own.stop()
        peer.stop()
    assert not run.errors and run.proc.returncode == 0, run.explain()
    (step,) = run.steps
    assert step["num_samples"] == 4 and step["statuses"] == ["completed"] * 4, step  # the doctor's only
    assert step["rank_sizes"] == [2, 2], step
    # one turn each in each of the 4 dialogues
    assert peer_stats["generate"] == 4 and peer_stats["lora_paths"] == {"patient-lora": 4}, peer_stats
    assert own_stats["generate"] == 4 and own_stats["lora_paths"] == {"": 4}, own_stats


def _initiator_step(tmp_path, tiny_model_dir, logs_dir, start_coordinator, run_id: str, **sections):
    """Job A of a two-model dialogue run (a, b) through slime's loop for one step: its rollout
    function is the initiator's, B's engine a stub of its own, the coordinator real. Returns
    (the run, B's queue as the coordinator reports it, B's engine's generate calls)."""
    import json as _json

    from _coord_procs import TOKEN_ENV
    from _twojobs import two_job_config

    from mrlx_lab.stub_engine import start_stub_engine

    engine_a = start_stub_engine(log_dir=logs_dir, name=f"stub-{run_id}-a")
    engine_b = start_stub_engine(log_dir=logs_dir, name=f"stub-{run_id}-b")
    coord = start_coordinator(run_id=run_id, agents=("a", "b"))
    try:
        mrlx = two_job_config(
            "a",
            run_id=run_id,
            urls={"b": engine_b.url},
            coordinator=coord.url,
            coordinator_settings={"max_staleness": 1},
            **sections,
        )
        os.environ[TOKEN_ENV] = coord.token
        try:
            run = run_slime(
                tmp_path,
                tiny_model_dir,
                engine_a.url,
                mrlx,
                "--rollout-function-path",
                "mrlx_plugin.rollout.initiator_rollout",
                *batch_flags(num_rollout=1),
            )
        finally:
            os.environ.pop(TOKEN_ENV, None)
        status, _, body = coord.http("GET", f"/v1/runs/{run_id}/queues/b")
        assert status == 200, body
        return run, _json.loads(body), engine_stats(engine_b.url)["generate"]
    finally:
        coord.stop()
        engine_a.stop()
        engine_b.stop()


@pytest.mark.slow
def test_initiator_rollout_runs_slimes_default_rollout_and_hands_b_its_groups(
    tmp_path, tiny_model_dir, logs_dir, start_coordinator
):
    """A multi-model job A in slime's synchronous loop: its rollout function wraps slime's default
    rollout; A's step (one sample per dialogue episode) splits, and B's samples of the groups A
    kept reach a real coordinator, one group per prompt group, whole."""
    run, queue, b_calls = _initiator_step(
        tmp_path,
        tiny_model_dir,
        logs_dir,
        start_coordinator,
        "slime-mm",
        dialogue={"first": "a", "max_turns": 2},
    )
    assert not run.errors and run.proc.returncode == 0, run.explain()
    (step,) = run.steps
    assert step["num_samples"] == 4 and step["rank_sizes"] == [2, 2], step
    assert queue["queued_items"] == 4 and queue["ready_groups"] == 2, (
        queue
    )  # two prompt groups of two episodes
    assert b_calls == 4  # B spoke once in each of the 4 episodes


@pytest.mark.slow
def test_per_turn_samples_and_tree_candidates_keep_the_step_splittable(tmp_path, tiny_model_dir, stub_engine):
    """Per-turn credit with two candidates per turn, through slime's rollout manager: each dialogue
    episode (two agents, two turns each) returns 2 x 2 x 2 samples under its input's rollout id,
    an episode stopped after its first round its fillers too, and the step splits evenly."""
    mrlx = {
        "run_id": "slime-credit",
        "system": "dialogue",
        "agents": {"a": {"url": "self"}, "b": {"url": "self"}},
        "dialogue": {"max_turns": 4, "stop_patterns": {"b": "Judgment"}},
        "rewards": {"credit": "turn", "branch": 2, "gamma": 0.9},
        "plugins": ["examples.multi_agent.turn_format_reward"],  # what the candidates are compared by
        "engine": {"sampling_seed": 3},
    }
    run = run_slime(
        tmp_path,
        tiny_model_dir,
        stub_engine.url,
        mrlx,
        *batch_flags(num_rollout=1),
    )
    assert not run.errors and run.proc.returncode == 0, run.explain()
    (step,) = run.steps
    assert step["num_samples"] == 4 * 8 and step["rank_sizes"] == [16, 16], step
    groups = _by_rollout(step)
    assert sorted(len(s) for s in groups.values()) == [8] * 4, groups
    for statuses in groups.values():  # b stops after one round: two turns (x 2 candidates) reached
        assert sorted(statuses).count("aborted") == 4, statuses
    assert (
        engine_stats(stub_engine.url)["generate"] == 4 * 2 * 2
    )  # two turns per episode, two candidates each


@pytest.mark.slow
def test_per_turn_samples_of_a_peer_agent_reach_its_queue_whole(
    tmp_path, tiny_model_dir, logs_dir, start_coordinator
):
    """Per-turn credit in a multi-model run: job A's step holds A's two turns of each episode, and
    B's two turns per episode go to B's queue, each prompt group whole (the responder expects the
    same fan-out x turns)."""
    run, queue, b_calls = _initiator_step(
        tmp_path,
        tiny_model_dir,
        logs_dir,
        start_coordinator,
        "slime-credit-mm",
        dialogue={"first": "a", "max_turns": 4},
        rewards={"credit": "turn", "gamma": 0.5},
    )
    assert not run.errors and run.proc.returncode == 0, run.explain()
    (step,) = run.steps
    assert step["num_samples"] == 8 and step["rank_sizes"] == [4, 4], step
    assert queue["queued_items"] == 8 and queue["ready_groups"] == 2, queue  # 2 turns x 4 episodes
    assert b_calls == 8


# --------------------------------------------------------------------------------------------
# The plugin's fully asynchronous rollout (`--rollout-function-path mrlx_plugin.rollout.async_rollout`)

ASYNC_ROLLOUT = "mrlx_plugin.rollout.async_rollout"
ASYNC_DRIVER = HOSTS / "slime" / "train_async.py"


def _step_groups(step: dict[str, Any]) -> list[dict[str, Any]]:
    """A step's groups as slime trains them, in order: each run of samples of one prompt group."""
    groups: list[dict[str, Any]] = []
    fields = ("group_indices", "indices", "statuses", "born", "episode_ids", "loss_mask_sums")
    for gi, index, status, born, episode, mask in zip(*(step[f] for f in fields)):
        if not groups or groups[-1]["group_index"] != gi:
            groups.append({"group_index": gi, "first_index": index, "samples": []})
        groups[-1]["samples"].append({"status": status, "born": born, "episode": episode, "mask": mask})
    return groups


def _rollout_lines(run: Run) -> list[dict[str, Any]]:
    return [line["metrics"] for line in run.log if line["step_key"] == "rollout/step"]


def _assert_async_steps(run: Run, steps: int, bound: int) -> list[list[dict[str, Any]]]:
    """Every step is full (2 groups of 2 pipeline episodes, 5 samples each), split evenly, its
    groups whole and ordered by their first sample's index, none older than `bound` steps, and no
    episode is trained twice. Returns each step's groups."""
    assert not run.errors and run.proc.returncode == 0, run.explain()
    assert [s["rollout_id"] for s in run.steps] == list(range(steps)), run.steps
    per_step = []
    for step in run.steps:
        k = step["rollout_id"]
        assert step["num_samples"] == 2 * 2 * FAN_OUT and step["rank_sizes"] == [10, 10], step
        groups = _step_groups(step)
        assert [len(g["samples"]) for g in groups] == [2 * FAN_OUT] * 2, groups  # whole groups
        firsts = [g["first_index"] for g in groups]
        assert firsts == sorted(firsts), f"step {k}: groups not ordered by their first sample: {firsts}"
        for g in groups:
            assert {s["born"] for s in g["samples"]} <= set(range(max(0, k - bound), k + 1)), (k, g)
        per_step.append(groups)
    episodes = [e for step in run.steps for e in step["episode_ids"]]
    assert len(episodes) == steps * 2 * 2 * FAN_OUT and all(episodes), episodes
    assert len(set(episodes)) == steps * 2 * 2, "an episode was trained twice"
    return per_step


@pytest.mark.slow
@pytest.mark.parametrize("driver", [DRIVER, ASYNC_DRIVER], ids=["train", "train_async"])
def test_async_rollout_trains_whole_groups_across_steps_within_the_staleness_bound(
    tmp_path, tiny_model_dir, stub_engine, driver
):
    """slime's loop (and its asynchronous loop) with the plugin's fully asynchronous rollout: groups
    keep generating between rollout calls, so a step trains groups born a step earlier; each step
    is the full batch in slime's order; a group holding an ABORTED episode (its fillers train
    nothing) is trained as it is, not generated again; the staleness reaches the host's log."""
    steps = 4
    engine_faults(stub_engine.url, "http500", 1)  # one episode fails: its group trains its fillers
    # Turns on this job's own engines are asked again after a fault under async_rollout, unless an
    # agent says no: here they do, so the fault ends its episode.
    no_retry = {name: {"url": "self", "retry_on_abort": False} for name in PIPELINE["agents"]}
    mrlx = {
        **PIPELINE,
        "agents": no_retry,
        "engine": {"max_retries": 0},
        "async_rollout": {"max_staleness": 2},
    }
    run = run_slime(
        tmp_path,
        tiny_model_dir,
        stub_engine.url,
        mrlx,
        "--rollout-function-path",
        ASYNC_ROLLOUT,
        *batch_flags(num_rollout=steps),
        driver=driver,
    )
    per_step = _assert_async_steps(run, steps, bound=2)

    carried = [
        (k, g["group_index"])
        for k, groups in enumerate(per_step)
        for g in groups
        if k > 0 and all(s["born"] == k - 1 for s in g["samples"])
    ]
    assert carried, f"no group trained at step k+1 was born at step k: {per_step}"

    aborted = [
        g for groups in per_step for g in groups if any(s["status"] == "aborted" for s in g["samples"])
    ]
    assert len(aborted) == 1, aborted  # the failed episode's group, trained once, fillers and all
    statuses = [s["status"] for s in aborted[0]["samples"]]
    assert statuses.count("aborted") == FAN_OUT and statuses.count("completed") == FAN_OUT, statuses
    assert [s["mask"] for s in aborted[0]["samples"] if s["status"] == "aborted"] == [0] * FAN_OUT

    lines = _rollout_lines(run)
    assert [m["rollout/step"] for m in lines] == list(range(steps)), lines
    for m in lines:
        assert m["multi_agent/staleness_max"] <= 2 and m["multi_agent/stale_groups"] == 0, m
    assert max(m["multi_agent/staleness_max"] for m in lines) >= 1, lines  # the carried groups
    assert all(m["multi_agent/staleness"] >= 0 and m["multi_agent/empty_groups"] == 0 for m in lines)


@pytest.mark.slow
def test_async_rollout_gives_groups_beyond_the_staleness_bound_back_to_be_generated_again(
    tmp_path, tiny_model_dir, stub_engine
):
    """`async_rollout.max_staleness: 0`: a group born in an earlier step goes back to slime's data
    source and is generated again (counted in `multi_agent/stale_groups`); no step trains a
    sample born before it, and no episode is trained twice."""
    steps = 4
    mrlx = {**PIPELINE, "async_rollout": {"max_staleness": 0}}
    run = run_slime(
        tmp_path,
        tiny_model_dir,
        stub_engine.url,
        mrlx,
        "--rollout-function-path",
        ASYNC_ROLLOUT,
        *batch_flags(num_rollout=steps),
    )
    per_step = _assert_async_steps(run, steps, bound=0)
    lines = _rollout_lines(run)
    assert sum(m["multi_agent/stale_groups"] for m in lines) >= 1, lines
    assert all(m["multi_agent/staleness_max"] == 0 for m in lines), lines
    # Each group the log names as too old was generated again and trained later, born anew.
    stale = [
        (int(k), int(g)) for g, k in re.findall(r"group (\d+) is not trained at step (\d+)", run.proc.stdout)
    ]
    assert stale, run.proc.stdout[-4000:]
    trained = {g["group_index"]: k for k, groups in enumerate(per_step) for g in groups}
    again = [(k, g) for k, g in stale if trained.get(g, -1) >= k]
    assert again, f"no group given back was trained later: stale {stale}, trained {trained}"


class SlimeJob:
    """One fake slime job running in its own process in the background (`slime_command`'s argv),
    its output in `driver<name>.log`."""

    def __init__(
        self,
        tmp_path: Path,
        tokenizer: Path,
        router_url: str,
        mrlx: dict[str, Any],
        *flags: str,
        name: str,
        env: dict[str, str],
    ):
        from mrlx_plugin.core import processes

        argv, job_env, self.result_file, self.log_file = slime_command(
            tmp_path, tokenizer, router_url, mrlx, *flags, name=name
        )
        self.name = name
        self.hold_file = Path(str(self.result_file) + ".hold")
        self.hold_file.unlink(missing_ok=True)
        self.output = tmp_path / f"driver{name}.log"
        with open(self.output, "ab") as out:
            self.proc = processes.start(
                argv, cwd=REPO, env={**job_env, **env}, stdout=out, stderr=subprocess.STDOUT
            )

    def text(self) -> str:
        return self.output.read_text(errors="replace")[-6000:]

    def result(self) -> dict[str, Any]:
        return json.loads(self.result_file.read_text()) if self.result_file.exists() else {}

    def alive(self) -> None:
        """Fail a wait at once, with the job's output, when the job has exited."""
        if self.proc.poll() is not None:
            raise AssertionError(f"job {self.name} exited ({self.proc.returncode}):\n{self.text()}")

    def log_lines(self) -> list[dict[str, Any]]:
        """The metrics lines the job's logger has written so far."""
        text = self.log_file.read_text() if self.log_file.exists() else ""
        return [json.loads(x)["metrics"] for x in text.splitlines() if x.strip()]

    def wait(self, timeout: float = 240) -> Run:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"job {self.name} did not finish within {timeout:.0f} s:\n{self.text()}")
        proc = subprocess.CompletedProcess(self.proc.args, code, self.text(), None)
        log = (
            [json.loads(x) for x in self.log_file.read_text().splitlines()] if self.log_file.exists() else []
        )
        return Run(proc, self.result(), log)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _by_episode(step: dict[str, Any]) -> dict[str, int]:
    """Episode id -> its prompt group, for one step's samples."""
    return dict(zip(step["episode_ids"], step["group_indices"]))


class TwoSlimeJobs:
    """A two-model dialogue run (agents a and b, both trained) under the fake slime: job A runs
    the episodes with the plugin's asynchronous rollout, job B trains b's samples through
    `responder_rollout`; a real coordinator between them, a stub engine per agent."""

    def __init__(self, tmp_path, tokenizer, logs_dir, start_coordinator, run_id: str, steps: int):
        from _coord_procs import TOKEN_ENV

        from mrlx_lab.stub_engine import start_stub_engine

        self.tmp_path, self.tokenizer, self.run_id, self.steps = tmp_path, tokenizer, run_id, steps
        self.engines = [start_stub_engine(log_dir=logs_dir, name=f"stub-{run_id}-{x}") for x in "ab"]
        self.coord = start_coordinator(run_id=run_id, agents=("a", "b"))
        self.env = {TOKEN_ENV: self.coord.token}
        self.jobs: list[SlimeJob] = []

    def mrlx(self, me: str) -> dict[str, Any]:
        from _twojobs import two_job_config

        other = "b" if me == "a" else "a"
        return two_job_config(
            me,
            run_id=self.run_id,
            urls={other: self.engines["ab".index(other)].url},
            coordinator=self.coord.url,
            coordinator_settings={"max_staleness": 1, "wait_deadline_s": 120},
            dialogue={"first": "a", "max_turns": 2},
        )

    def start(self, me: str, *flags: str, mrlx: dict[str, Any] | None = None) -> SlimeJob:
        """Start agent `me`'s job (its settings with `mrlx`'s sections added)."""
        fn = ASYNC_ROLLOUT if me == "a" else "mrlx_plugin.rollout.responder_rollout"
        job = SlimeJob(
            self.tmp_path,
            self.tokenizer,
            self.engines["ab".index(me)].url,
            {**self.mrlx(me), **(mrlx or {})},
            "--rollout-function-path",
            fn,
            *batch_flags(num_rollout=self.steps),
            *flags,
            name=f"-{me}",
            env=self.env,
        )
        self.jobs.append(job)
        return job

    def b_generates(self) -> int:
        return engine_stats(self.engines[1].url)["generate"]

    def stop(self) -> None:
        for job in self.jobs:
            job.kill()
        for engine in self.engines:
            engine.stop()

    @staticmethod
    def assert_full_steps(run: Run, steps: int) -> None:
        """Each step: 2 whole prompt groups of 2 episodes, one sample of this job's agent each."""
        assert not run.errors and run.proc.returncode == 0, run.explain()
        assert [s["rollout_id"] for s in run.steps] == list(range(steps)), run.explain()
        for step in run.steps:
            assert step["num_samples"] == 4 and step["rank_sizes"] == [2, 2], step
            assert step["statuses"] == ["completed"] * 4, step  # no filler stands in for a missing group
            groups = _by_episode(step)
            assert len(groups) == 4 and sorted(Counter(groups.values()).values()) == [2, 2], step


@pytest.mark.slow
def test_async_initiator_hands_the_responder_each_step_the_groups_it_trained(
    tmp_path, tiny_model_dir, logs_dir, start_coordinator
):
    """A multi-model job A under slime with the plugin's asynchronous rollout, its peer B's job
    with `responder_rollout`: B's step k trains exactly the prompt groups A trained at its step k,
    each whole and once, though A's groups keep generating across its steps."""
    steps = 4
    run = TwoSlimeJobs(tmp_path, tiny_model_dir, logs_dir, start_coordinator, "slime-async-mm", steps)
    try:
        b = run.start("b")
        a = run.start("a")
        run_a, run_b = a.wait(), b.wait()
    finally:
        run.stop()
    for job_run in (run_a, run_b):
        TwoSlimeJobs.assert_full_steps(job_run, steps)
    for step_a, step_b in zip(run_a.steps, run_b.steps):
        assert _by_episode(step_b) == _by_episode(step_a), (step_a, step_b)
    carried = [s for s in run_a.steps for born in s["born"] if born is not None and born < s["rollout_id"]]
    assert carried, f"no group of A's crossed a step boundary: {run_a.steps}"
    lines = _rollout_lines(run_a)
    assert [m["rollout/step"] for m in lines] == list(range(steps))
    for m in lines:
        assert m["multi_agent/staleness_max/b"] <= 2 and m["coordinator/groups_sent"] == 2, m


@pytest.mark.slow
def test_async_initiator_killed_with_groups_queued_resumes_and_the_responder_trains_each_item_once(
    tmp_path, tiny_model_dir, logs_dir, start_coordinator
):
    """Job A (asynchronous rollout, `--save`) is SIGKILLed while it trains step K: step K's groups
    are committed, finished groups wait in its producer's queue (their b samples not committed)
    and step K is not saved. A resumed from its saved data source (`--load`, `--start-rollout-id
    K`) trains steps K.. again while B runs on: B trains every step full and no item twice."""
    steps, hold = 5, 2
    run = TwoSlimeJobs(tmp_path, tiny_model_dir, logs_dir, start_coordinator, "slime-async-kill", steps)
    save = tmp_path / "save-a"
    queue = {"async_rollout": {"max_in_flight_groups": 2, "queue_groups": 4}}
    try:
        b = run.start("b")
        a = run.start("a", "--save", str(save), "--fake-train-hold", str(hold), mrlx=queue)
        wait_until(
            lambda: (a.alive(), b.alive(), a.hold_file.exists())[-1],
            120,
            what="A training step K",
            details=lambda: a.text() + "\n---\n" + b.text(),
        )
        # Every group A's producer generated through step K (trained, or too old and given back)
        # and the 4 it may then hold: when B's engine has answered all their b turns (one per
        # episode), the producer is full and its queue holds finished groups.
        lines = [m for m in a.log_lines() if m.get("rollout/step") is not None]
        taken = (hold + 1) * 2 + sum(m["multi_agent/stale_groups"] for m in lines)
        wait_until(
            lambda: (a.alive(), run.b_generates() >= 2 * (taken + 4))[-1],
            60,
            what="A's producer holding a full queue",
            details=lambda: f"{run.b_generates()}\n{a.text()}",
        )
        before = a.result()
        a.kill()
        assert [s["rollout_id"] for s in before["steps"]] == list(range(hold + 1)), before
        assert (save / f"rollout/global_dataset_state_dict_{hold - 1}.json").exists()
        assert not (save / f"rollout/global_dataset_state_dict_{hold}.json").exists()
        a = run.start(
            "a", "--save", str(save), "--load", str(save), "--start-rollout-id", str(hold), mrlx=queue
        )
        run_a, run_b = a.wait(), b.wait()
    finally:
        run.stop()
    TwoSlimeJobs.assert_full_steps(run_b, steps)
    keys = [e for s in run_b.steps for e in s["episode_ids"]]
    assert len(keys) == len(set(keys)), (
        f"B trained an item twice: {sorted(k for k, n in Counter(keys).items() if n > 1)}"
    )
    assert not run_a.errors and run_a.proc.returncode == 0, run_a.explain()
    assert [s["rollout_id"] for s in run_a.steps] == list(range(hold, steps)), run_a.explain()
    a_steps = {s["rollout_id"]: s for s in [*before["steps"][:hold], *run_a.steps]}
    for step_b in run_b.steps:
        k = step_b["rollout_id"]
        # Step K is the killed process's: its training of A's side died with it, and the resumed
        # process's commits of step K (other groups, the same places) add nothing.
        step_a = before["steps"][hold] if k == hold else a_steps[k]
        assert _by_episode(step_b) == _by_episode(step_a), (k, step_b, step_a)
    resumed = _rollout_lines(run_a)
    assert [m["rollout/step"] for m in resumed] == list(range(hold, steps)), resumed
    first = resumed[0]
    assert first["coordinator/samples_sent"] == 0 and first["coordinator/duplicates"] == 4, first
    assert all(m["coordinator/samples_sent"] == 4 for m in resumed[1:]), resumed


@pytest.mark.slow
@pytest.mark.parametrize("driver", [DRIVER, ASYNC_DRIVER], ids=["train", "train_async"])
def test_async_rollout_asks_again_the_turns_a_weight_push_aborted(
    tmp_path, tiny_model_dir, stubs_with, driver
):
    """slime pauses its engines for a weight push with SGLang's default mode, which aborts every
    request in flight; under async_rollout episodes outlive steps, so pushes land mid-episode. Those
    turns are asked again once the engine is back: every episode ends complete, none is cut short
    by a push, and every step is full."""
    engine = stubs_with("--latency", "0.2")
    steps = 4
    mrlx = {**PIPELINE, "engine": {"abort_retry_wait_s": 0.05}, "async_rollout": {"max_staleness": 2}}
    run = run_slime(
        tmp_path,
        tiny_model_dir,
        engine.url,
        mrlx,
        "--rollout-function-path",
        ASYNC_ROLLOUT,
        "--fake-weight-push",
        engine.url,
        *batch_flags(num_rollout=steps),
        driver=driver,
    )
    _assert_async_steps(run, steps, bound=2)
    pushed = [step.get("aborted_by_weight_push") for step in run.steps]
    assert sum(p or 0 for p in pushed) > 0, f"no push found a request in flight: {pushed}"
    statuses = [status for step in run.steps for status in step["statuses"]]
    reasons = {r for step in run.steps for r in step["abort_reasons"] if r}
    assert set(statuses) == {"completed"} and not reasons, reasons
