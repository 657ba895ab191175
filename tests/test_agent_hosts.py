"""Agent code runs everywhere the built-in systems run: slime's and Miles' stand-in hosts (their
default rollouts, data-parallel split and abort), a two-model run of two trainer jobs through the
coordinator, per-turn credit through a host, and `mrlx rollout --local`.

The systems are in `tests/_agent_host_systems.py` (imported by the host processes as
`tests._agent_host_systems`). A stub engine answers every turn with a scripted text holding an
answer and a tool call; a recording proxy in front of it keeps every `/generate`, so each trained
span of a sample the host trained is checked against the ids and log-probs the engine returned,
and each span between them (the tool's output) against the loss mask's zeros.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from _agent_host_systems import (
    ENGINE_TEXT,
    EPISODES_ENV,
    MODULE,
    STEP_SAMPLES_ENV,
    TOOL_OUTPUT,
    TURN_REWARDS,
)
from _host import batch_flags
from _recorder import RecordingProxy
from _twojobs import TwoJobs, write_config
from test_host_miles import CLASS_BASED, run_miles
from test_host_slime import PROMPTS as SLIME_PROMPTS
from test_host_slime import _by_rollout, run_slime

from mrlx_lab.stub_engine import start_stub_engine
from mrlx_plugin.core.tokenizer import load_tokenizer
from mrlx_plugin.local.model import ensure_model

REPO = Path(__file__).resolve().parent.parent
LOG_STEP = ["--custom-rollout-log-function-path", f"{MODULE}.log_step"]
FAN_OUT = 2  # `lookup`: two conversations of the solver per episode
EPISODES = 4  # batch_flags(): 2 prompts x 2 samples per step


def mrlx(system: str, **sections: Any) -> dict[str, Any]:
    return {
        "run_id": f"agent-hosts-{system}",
        "plugins": [MODULE],
        "system": system,
        "agents": {"solver": {"url": "self"}},
        "engine": {"max_retries": 0},
        **sections,
    }


@pytest.fixture
def scripted(logs_dir, request, tiny_model_dir):
    """`scripted(*flags)`: a stub engine answering ENGINE_TEXT in the tiny model's ids, behind a
    recording proxy (the proxy is what the host is given as its router)."""
    started: list = []

    def start(*flags: str) -> RecordingProxy:
        extra = ["--tokenizer", str(tiny_model_dir), "--text", ENGINE_TEXT, "--response-tokens", "96", *flags]
        stub = start_stub_engine(log_dir=logs_dir, name=f"hosts-{request.node.name[:30]}", extra=extra)
        proxy = RecordingProxy(stub.url).start()
        started.append((stub, proxy))
        return proxy

    yield start
    for stub, proxy in started:
        proxy.stop()
        stub.stop()


def pythonpath() -> str:
    """PYTHONPATH for a job or command that imports MODULE (the repository, before what was set)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines an observer of `_agent_host_systems` wrote (none: it was never called)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """The loss mask as (value, start, end) runs."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


def assert_engine_spans(row: dict[str, Any], calls: list[dict[str, Any]], tok, turns: int) -> None:
    """Every trained span of the sample is one engine call's answer to exactly the tokens before it
    (its log-probs those the engine gave), every span between two is the tool's output (masked,
    log-prob 0), and the sample ends with its last turn's answer."""
    by_key = {(tuple(c["input_ids"]), tuple(c["ids"])): c for c in calls}
    tokens, mask, logprobs = row["tokens"], row["loss_mask"], row["rollout_log_probs"]
    start = len(tokens) - row["response_length"]
    assert len(mask) == row["response_length"] == len(logprobs), row["episode_id"]
    runs = _runs(mask)
    assert [m for m, _, _ in runs] == [1, 0] * (turns - 1) + [1], runs
    for m, i, j in runs:
        if m:
            call = by_key.get((tuple(tokens[: start + i]), tuple(tokens[start + i : start + j])))
            assert call is not None, f"a trained span no engine call returned ({row['episode_id']})"
            assert logprobs[i:j] == pytest.approx(call["logprobs"], abs=1e-6)
        else:
            assert logprobs[i:j] == [0.0] * (j - i)
            assert TOOL_OUTPUT in tok.decode(tokens[start + i : start + j], skip_special_tokens=False)


def assert_lookup_step(step_rows: list[dict[str, Any]], calls, tok) -> None:
    """One host step of `lookup`: 4 episodes of 2 trained conversations, each under one rollout id."""
    assert len(step_rows) == EPISODES * FAN_OUT
    by_rollout: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in step_rows:
        by_rollout[r["rollout_id"]].append(r)
    assert None not in by_rollout and sorted(len(v) for v in by_rollout.values()) == [FAN_OUT] * EPISODES
    for episode in by_rollout.values():
        assert len({r["episode_id"] for r in episode}) == 1  # one episode per rollout id
        for r in episode:
            assert r["status"] == "completed" and r["agent"] == "solver" and r["reward"] == 1.0, r["status"]
            assert r["agent_code"]["solver"]["threads"] == FAN_OUT
            assert r["agent_code"]["solver"]["tool_calls"] == FAN_OUT * 2
            assert_engine_spans(r, calls, tok, turns=2)


# --- 1. slime ------------------------------------------------------------------------------------


def test_slime_default_rollout_trains_agent_code_with_its_tool_output_masked(
    tmp_path, tiny_model_dir, scripted, monkeypatch
):
    """Two steps of `lookup` through slime's default rollout, and an evaluation before the first
    and after the second (the team's answer graded by the plugin's grader)."""
    proxy = scripted()
    samples = tmp_path / "step_samples.jsonl"
    monkeypatch.setenv(STEP_SAMPLES_ENV, str(samples))
    eval_prompts = tmp_path / "eval.jsonl"
    eval_prompts.write_text("".join(json.dumps(p) + "\n" for p in SLIME_PROMPTS))
    evaluation = ["--eval-interval", "2", "--eval-prompt-data", "arith", str(eval_prompts)]
    evaluation += ["--custom-eval-rollout-log-function-path", "mrlx_plugin.rollout.log_eval_rollout"]
    flags = [*batch_flags(num_rollout=2), *LOG_STEP, *evaluation]
    run = run_slime(tmp_path, tiny_model_dir, proxy.url, mrlx("lookup"), *flags)
    assert not run.errors and run.proc.returncode == 0, run.explain()
    assert len(run.steps) == 2
    for step in run.steps:
        assert step["num_samples"] == EPISODES * FAN_OUT and step["rank_sizes"] == [4, 4], step
        assert sorted(len(s) for s in _by_rollout(step).values()) == [FAN_OUT] * EPISODES, step
        assert set(step["statuses"]) == {"completed"}, step
    # (two steps x 4 episodes + two evaluations x 2 episodes) x 2 conversations x 2 turns, one call each
    assert len(proxy.calls) == (2 * EPISODES + 2 * len(SLIME_PROMPTS)) * FAN_OUT * 2
    tok = load_tokenizer(str(tiny_model_dir))
    logged = rows(samples)
    for step in (0, 1):
        assert_lookup_step([r for r in logged if r["step"] == step], proxy.calls, tok)
    metrics = [line["metrics"] for line in run.log]
    assert [m["agents/tool_calls"] for m in metrics if "agents/tool_calls" in m] == [FAN_OUT * 2] * 2
    assert [e["rollout_id"] for e in run.result["evals"]] == [0, 1]
    evals = [m for m in metrics if "eval/arith/multi_agent/team_reward" in m]
    assert [
        (m["eval/arith/multi_agent/episodes"], m["eval/arith/multi_agent/team_reward"]) for m in evals
    ] == [(len(SLIME_PROMPTS), 1.0)] * 2


# --- 2. Miles ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_miles_class_based_rollout_trains_agent_code_with_its_tool_output_masked(
    tmp_path, tiny_model_dir, scripted
):
    """Two steps of `lookup` through Miles' default (class-based) rollout."""
    proxy = scripted()
    samples = tmp_path / "step_samples.jsonl"
    run = run_miles(
        tmp_path,
        proxy.url,
        tiny_model_dir,
        mrlx("lookup"),
        *batch_flags(),
        "--rollout-max-response-len",
        "512",  # room for two turns and the tool's output
        *LOG_STEP,
        num_rollout=2,
        env={STEP_SAMPLES_ENV: str(samples)},
    )
    run.assert_ok()
    assert run.result["args"]["rollout_function_path"] == CLASS_BASED
    assert len(run.steps) == 2
    for step in run.steps:
        assert step["samples"] == EPISODES * FAN_OUT and step["rank_sizes"] == [4, 4], step
        assert step["samples_per_rollout"] == [FAN_OUT] * EPISODES and step["statuses"] == {"completed": 8}
    tok = load_tokenizer(str(tiny_model_dir))
    logged = rows(samples)
    for step in (0, 1):
        assert_lookup_step([r for r in logged if r["step"] == step], proxy.calls, tok)


LATENCY_S = 0.2


@pytest.mark.slow
def test_miles_abort_stops_agent_code_between_turns(tmp_path, tiny_model_dir, logs_dir):
    """As test_abort_stops_dialogues_between_turns, with agent code: 4 groups of 2 drawn for 2, all
    8 episodes at once; those on prompts 0 and 2 talk two turns, those on 1 and 3 six, so those
    are mid-conversation when the first two groups fill the step and Miles aborts. No request may
    reach the engine after the flag beyond one per generate call then running; the episodes it cut
    come back whole (their one ABORTED sample, nothing trained), and nothing raises."""
    slow = start_stub_engine(log_dir=logs_dir, name="hosts-abort", extra=["--latency", str(LATENCY_S)])
    episodes = tmp_path / "episodes.jsonl"
    config = mrlx("long_talk", engine={"max_retries": 0, "abort_retry_wait_s": 0.1})
    config["agents"]["solver"]["sampling"] = {"max_new_tokens": 8}
    flags = "--rollout-batch-size 2 --n-samples-per-prompt 2 --over-sampling-batch-size 4"
    flags += " --global-batch-size 4 --sglang-server-concurrency 8 --rollout-max-response-len 1024"
    try:
        run = run_miles(
            tmp_path,
            slow.url,
            tiny_model_dir,
            config,
            *flags.split(),
            dp=1,
            stub_stats=True,
            env={EPISODES_ENV: str(episodes)},
        )
    finally:
        slow.stop()
    run.assert_ok()
    assert "Task exception was never retrieved" not in run.output, run.output[-4000:]
    [step] = run.steps
    assert step["samples"] == 4 and step["samples_per_rollout"] == [1] * 4, step
    assert step["statuses"] == {"truncated": 4}, step  # whole episodes, each turn at its 8-token cap
    aborted, drained = step["abort"]
    running = aborted["generate_calls_running"]
    assert aborted["pending_groups"] == 2 and running == 4, aborted  # the four long episodes
    new_requests = drained["generate"] - aborted["generate"]
    assert new_requests <= running, f"{new_requests} /generate requests after the abort ({running} running)"
    assert drained["t"] - aborted["t"] < 0.1 + 2 * LATENCY_S, "abort() did not return promptly"

    ended = rows(episodes)
    assert len(ended) == 8, ended
    cut = [e for e in ended if e["aborted"]]
    assert len(cut) == 4, [e["abort_reason"] for e in ended]
    for e in cut:
        [s] = e["samples"]  # the fan-out, kept
        # the engine aborted its turn (Miles aborts what its engines hold), or the flag ended it first
        reason = e["abort_reason"]
        assert reason == "the host ended the rollout" or reason.endswith("aborted the turn"), reason
        assert s["status"] == "aborted" and sum(s["loss_mask"]) == 0 and s["remove_sample"], s["status"]
        # cut after a turn had come back, before the sixth
        assert 2 <= s["agent_code"]["solver"]["requests"] < 6, s["agent_code"]
    for e in ended:
        if not e["aborted"]:
            assert e["samples"][0]["agent_code"]["solver"]["requests"] == 2


# --- 3. two models, two jobs, one coordinator --------------------------------------------------


class AgentCodeJobs(TwoJobs):
    """The two-job run of `_twojobs`, its episodes the agent code `ask_peer`; A reaches B's engine
    through a recording proxy."""

    proxy_b: RecordingProxy | None = None

    def yaml(self, me: str) -> Path:
        path = super().yaml(me)
        config = yaml.safe_load(path.read_text())["mrlx"]
        config.pop("dialogue")
        config.update(system="ask_peer", plugins=[MODULE])
        if me == "a":
            config["agents"]["b"]["url"] = self.proxy_b.url
        return write_config(path, config)


@pytest.mark.slow
def test_two_models_in_agent_code_each_train_in_their_own_job(tmp_path, monkeypatch):
    """Agent `a` (job A, which runs every episode) asks agent `b` (another model, job B): both are
    trained; each of B's samples reaches job B through the coordinator exactly once, holding the
    ids B's engine returned."""
    root = tmp_path / "models"
    model_a = ensure_model(root / "a", preset="tiny", seed=1)
    model_b = ensure_model(root / "b", preset="tiny", seed=2, vocab_size=384)
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    jobs = AgentCodeJobs(tmp_path, model_a, model_b, steps=2)
    try:
        jobs.start_services()
        jobs.proxy_b = RecordingProxy(jobs.engine_b.url).start()
        room = ("--rollout-max-response-len", "96")  # a's two turns and b's reply between them
        jobs.start_job("b", *room)
        jobs.start_job("a", *room)
        assert jobs.wait("a") == 0, jobs.logs()
        assert jobs.wait("b") == 0, jobs.logs()
    finally:
        jobs.stop()
        if jobs.proxy_b is not None:
            jobs.proxy_b.stop()
    for me in ("a", "b"):  # both jobs trained a step on their own agent's tokens, twice
        trained = [(m["step"], m["train/tokens"] > 0) for m in jobs.rows(me, "metrics.jsonl")]
        assert trained == [(0, True), (1, True)], (me, trained)
    jobs.assert_b_trained_every_episode_once()
    jobs.assert_b_steps_are_a_steps()
    episodes = jobs.steps * jobs.groups * jobs.per_prompt

    a_rows, b_rows = jobs.rows("a", "samples.jsonl"), jobs.b_trained()
    assert len(a_rows) == len(b_rows) == episodes
    assert {r["metadata"]["mrlx"]["agent"] for r in a_rows} == {"a"}
    assert {r["metadata"]["mrlx"]["agent"] for r in b_rows} == {"b"}
    for r in a_rows:
        assert r["status"] in ("completed", "truncated") and r["reward"] == 1.0
        assert [m for m, _, _ in _runs(r["loss_mask"])] == [1, 0, 1]  # a's two turns, b's report between
    calls = jobs.proxy_b.calls
    assert len(calls) == episodes  # one turn of b per episode, none retried or sent twice
    by_key = {(tuple(c["input_ids"]), tuple(c["ids"])): c for c in calls}
    for r in b_rows:
        assert r["status"] in ("completed", "truncated") and r["reward"] == 0.5
        prompt, answer = r["tokens"][: -r["response_length"]], r["tokens"][-r["response_length"] :]
        call = by_key.get((tuple(prompt), tuple(answer)))
        assert call is not None, "a sample of b's that b's engine never returned"
        assert r["loss_mask"] == [1] * len(answer)
        assert r["rollout_log_probs"] == pytest.approx(call["logprobs"], abs=1e-6)
        assert max(r["tokens"]) < 384  # b's vocabulary


# --- 4. mrlx rollout --local ---------------------------------------------------------------------


@pytest.mark.slow
def test_mrlx_rollout_local_runs_agent_code_from_a_plugin(tmp_path, tiny_model_dir):
    """`lookup` on the embedded engine's tiny model: it writes no tool call, so each conversation
    goes on with a user message; the command prints and writes what it does for a built-in."""
    config = mrlx("lookup")
    config["agents"]["solver"]["sampling"] = {"max_new_tokens": 12}  # two turns and a message fit
    path = write_config(tmp_path / "agents.yaml", config)
    out = tmp_path / "samples.jsonl"
    argv = ["rollout", "--local", "--config", str(path), "--model-dir", str(tiny_model_dir)]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "96"]
    argv += ["--output", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "mrlx_plugin.cli", *argv],
        cwd=tmp_path,  # its runs/ folder (the engine's log) goes there
        env=dict(os.environ, PYTHONPATH=pythonpath()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"4 episodes, {4 * FAN_OUT} samples -> {out}" in r.stdout, r.stdout
    table = dict(line.strip().rsplit(None, 1) for line in r.stdout.splitlines() if line.startswith("  "))
    # per episode: two conversations of two turns, each turn one engine call
    assert float(table["agents/requests"]) == FAN_OUT * 2 and table["engine calls"] == "16", r.stdout
    assert float(table["samples/solver"]) == 4 * FAN_OUT, r.stdout
    logged = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(logged) == 4 * FAN_OUT
    assert Counter(row["rollout_id"] for row in logged) == Counter({i: FAN_OUT for i in range(4)})
    for row in logged:
        assert row["metadata"]["mrlx"]["agent"] == "solver" and row["status"] in ("completed", "truncated")
        assert len(row["loss_mask"]) == row["response_length"] == len(row["rollout_log_probs"])
        assert isinstance(row["reward"], float) and isinstance(row["advantage"], float)
        assert [m for m, _, _ in _runs(row["loss_mask"])] == [1, 0, 1]  # two turns, the message between


# --- 5. per-turn credit ---------------------------------------------------------------------------


@pytest.mark.slow
def test_per_turn_credit_gives_agent_code_a_fixed_step_through_slime(
    tmp_path, tiny_model_dir, scripted, monkeypatch
):
    """`lookup_turns` declares three turns and takes three on "40 + 2", two on "6 * 7": each episode
    returns three samples (one per turn; a filler for the turn not taken), the step splits."""
    proxy = scripted()
    samples = tmp_path / "step_samples.jsonl"
    monkeypatch.setenv(STEP_SAMPLES_ENV, str(samples))
    config = mrlx("lookup_turns", rewards={"credit": "turn", "gamma": 1.0})
    run = run_slime(tmp_path, tiny_model_dir, proxy.url, config, *batch_flags(num_rollout=1), *LOG_STEP)
    assert not run.errors and run.proc.returncode == 0, run.explain()
    [step] = run.steps
    assert step["num_samples"] == EPISODES * 3 and step["rank_sizes"] == [6, 6], step
    assert sorted(len(s) for s in _by_rollout(step).values()) == [3] * EPISODES, step
    assert len(proxy.calls) == 2 * 3 + 2 * 2

    by_key = {(tuple(c["input_ids"]), tuple(c["ids"])): c for c in proxy.calls}
    tok = load_tokenizer(str(tiny_model_dir))
    episodes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows(samples):
        episodes[r["episode_id"]].append(r)
    assert len(episodes) == EPISODES
    taken_by_prompt = Counter()
    for episode in episodes.values():
        assert len(episode) == 3 and len({r["rollout_id"] for r in episode}) == 1
        turns = sorted((r for r in episode if r["turn"] is not None), key=lambda r: r["turn"])
        fillers = [r for r in episode if r["turn"] is None]
        taken = 3 if "40 + 2" in tok.decode(turns[0]["tokens"]) else 2
        taken_by_prompt[taken] += 1
        assert [r["turn"] for r in turns] == list(range(taken)) and len(fillers) == 3 - taken
        returns = [1.0 + sum(TURN_REWARDS[i:taken]) for i in range(taken)]  # gamma 1, outcome 1.0
        for r, expected in zip(turns, returns):
            assert r["status"] == "completed" and r["reward"] == pytest.approx(expected)
            answer = r["tokens"][-r["response_length"] :]
            call = by_key.get((tuple(r["tokens"][: -r["response_length"]]), tuple(answer)))
            assert call is not None and r["loss_mask"] == [1] * len(answer)  # this turn alone is trained
        for r in fillers:
            assert r["status"] == "aborted" and sum(r["loss_mask"]) == 0 and r["reward"] == 0.0, r["status"]
    assert taken_by_prompt == {3: 2, 2: 2}  # two episodes of each prompt
