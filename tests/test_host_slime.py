"""The plugin driven through a host-shaped fake of slime (`tests/hosts/slime`), end to end.

Each test runs the fake's `train.py` as its own process (slime's rollout manager, default or
fully-async rollout, logging and data-parallel split, with the plugin's four flags) against stub
engines over real sockets, and reads what the driver reports: per step the samples, their
statuses and rollout ids, and the per-rank sizes of the split; errors with their type; what
reached the host's logger (`FAKE_HOST_LOG`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
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


def slime_command(tmp_path: Path, tokenizer: Path, router_url: str, mrlx: dict[str, Any], *flags: str):
    """Write the YAML and prompt files; the driver's argv and env with the plugin's flags plus `flags`."""
    config = tmp_path / "mrlx.yaml"
    config.write_text(yaml.safe_dump({"mrlx": mrlx}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    result_file, log_file = tmp_path / "result.json", tmp_path / "host_log.jsonl"
    result_file.unlink(missing_ok=True)
    log_file.unlink(missing_ok=True)
    ip, port = _host_port(router_url)
    argv = [
        sys.executable,
        str(DRIVER),
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
    tmp_path: Path, tokenizer: Path, router_url: str, mrlx: dict[str, Any], *flags: str, timeout: float = 120
) -> Run:
    """Run the driver to its end and read what it reported."""
    argv, env, result_file, log_file = slime_command(tmp_path, tokenizer, router_url, mrlx, *flags)
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
    refuses the mode at its first call, before any engine call. That call runs in slime's
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
