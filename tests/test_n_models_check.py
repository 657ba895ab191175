"""`mrlx check` on the jobs of a run of N models: three trained agents, a slime job each, and a
frozen judge (its own model behind its own URL, no job), against real stub engines (each job's
router and the judge's) and a real coordinator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _coord_procs import CoordinatorProcess

from mrlx_lab.stub_engine import start_stub_engine
from mrlx_plugin.core.netutil import free_port

REPO = Path(__file__).resolve().parent.parent
TRAINED = ("a", "b", "c")
RUN = "n-models"
TOKEN = "n-models-token"


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    """Each trained agent's router and the judge's (stub engines), and the run's coordinator."""
    root = tmp_path_factory.mktemp("n-models")
    (root / "token").write_text(TOKEN)
    coordinator = CoordinatorProcess(root / "coordinator", run_id=RUN, agents=TRAINED, token=TOKEN).start()
    stubs = {}
    try:
        for name in (*TRAINED, "judge"):
            stubs[name] = start_stub_engine(log_dir=root, name=f"n-models-{name}")
        yield {
            "root": root,
            "coordinator": coordinator.url,
            "urls": {n: s.url for n, s in stubs.items()},
            "tokenizer": str(tiny_model_dir),
        }
    finally:
        for s in stubs.values():
            s.stop()
        coordinator.stop()


def job(run: dict, path: Path, me: str, **changes: dict) -> Path:
    """The YAML of `me`'s job: its agent at `self`, every other at its router; `changes` edits
    one agent's settings (agent=dict of keys)."""
    agents = {}
    for name in (*TRAINED, "judge"):
        if name == me:
            agents[name] = {"url": "self"}
        else:
            agents[name] = {
                "url": run["urls"][name],
                "tokenizer": run["tokenizer"],
                "trainable": name != "judge",
            }
        if me == "judge" and name == "judge":
            agents[name]["trainable"] = False
        agents[name].update(changes.get(name, {}))
    mrlx = {
        "run_id": RUN,
        "system": "dialogue",
        "self": me,
        "agents": agents,
        "coordinator": {"url": run["coordinator"], "token_file": str(run["root"] / "token")},
    }
    path.write_text(yaml.safe_dump({"mrlx": mrlx}))
    return path


def check(run: dict, jobs: list[tuple[Path, str, str]], *extra: str) -> subprocess.CompletedProcess:
    """`mrlx check` over (config, role, router) triples."""
    argv = [sys.executable, "-m", "mrlx_plugin.cli", "check", "--skip-tokenizers", "--timeout", "5", *extra]
    for config, role, router in jobs:
        argv += ["--config", str(config), "--role", role, "--router-url", router]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def three_jobs(run: dict, tmp_path: Path, **changes_by_job: dict) -> list[tuple[Path, str, str]]:
    return [
        (
            job(run, tmp_path / f"{me}.yaml", me, **changes_by_job.get(me, {})),
            "initiator" if me == "a" else "responder",
            run["urls"][me],
        )
        for me in TRAINED
    ]


def test_three_consistent_jobs_and_a_reachable_frozen_judge_pass(run, tmp_path):
    r = check(run, three_jobs(run, tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 configs agree" in r.stdout and "all good" in r.stdout
    assert f"agent 'judge' at {run['urls']['judge']} answers" in r.stdout
    assert f"agent 'c' at {run['urls']['c']} answers" in r.stdout  # c's own router, `self` in c.yaml
    assert "coordinator accepts this job's token" in r.stdout
    # the gate of a frozen agent's servers: only its URL is reached
    gate = subprocess.run(
        [
            sys.executable,
            "-m",
            "mrlx_plugin.cli",
            "check",
            "--config",
            str(tmp_path / "a.yaml"),
            "--agent",
            "judge",
            "--skip-tokenizers",
            "--wait",
            "30",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert "agent 'judge'" in gate.stdout and "agent 'b'" not in gate.stdout


def test_a_job_for_the_frozen_judge_is_refused(run, tmp_path):
    jobs = three_jobs(run, tmp_path) + [
        (job(run, tmp_path / "judge.yaml", "judge"), "responder", run["urls"]["judge"])
    ]
    r = check(run, jobs)
    assert r.returncode == 1
    assert (
        f"{tmp_path / 'judge.yaml'}: mrlx.self is 'judge', a frozen agent (trainable: false in every "
        "config); "
        "a frozen agent has no slime job"
    ) in r.stdout
    assert "mrlx check: 1 problem(s)" in r.stdout


def test_two_initiators_are_refused(run, tmp_path):
    jobs = three_jobs(run, tmp_path)
    jobs[1] = (jobs[1][0], "initiator", jobs[1][2])
    r = check(run, jobs)
    assert r.returncode == 1
    assert (
        f"2 jobs run the episodes (--role initiator: {tmp_path / 'a.yaml'}, {tmp_path / 'b.yaml'}); "
        "exactly one job is the initiator"
    ) in r.stdout
    assert "mrlx check: 1 problem(s)" in r.stdout


def test_mismatched_agent_settings_are_named_one_message_each(run, tmp_path):
    other_tokenizer = tmp_path / "elsewhere"
    jobs = three_jobs(
        run,
        tmp_path,
        b={"a": {"tokenizer": str(other_tokenizer)}},
        c={"judge": {"url": run["urls"]["b"]}, "b": {"trainable": False}},
    )
    r = check(run, jobs)
    assert r.returncode == 1, r.stdout
    a, b, c = (tmp_path / f"{n}.yaml" for n in TRAINED)
    judge, router_b = run["urls"]["judge"], run["urls"]["b"]
    assert (
        f"mrlx.agents.judge.url differs between configs ({judge} in {a}, {judge} in {b}, {router_b} in {c}); "
        "every job must reach 'judge' at the same router"
    ) in r.stdout
    assert (
        f"mrlx.agents.b.trainable differs between configs (true in {a}, true in {b}, false in {c}); "
        "every job must agree whether 'b' is trained"
    ) in r.stdout
    # a.yaml serves `a` (url: self, its own --hf-checkpoint): the others' tokenizers are compared
    assert (
        f"mrlx.agents.a.tokenizer differs between configs ({other_tokenizer} in {b}, {run['tokenizer']} in "
        f"{c})" in r.stdout
    )
    assert "mrlx check: 3 problem(s)" in r.stdout


def test_an_unreachable_frozen_judge_is_named_with_how_to_start_it(run, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    jobs = three_jobs(run, tmp_path, **{me: {"judge": {"url": dead}} for me in TRAINED})
    r = check(run, jobs)
    assert r.returncode == 1
    assert f"agent 'judge' at {dead} is unreachable" in r.stdout
    assert "start its SGLang servers and router first (launch/serve_frozen.sh)" in r.stdout


def test_a_job_with_the_wrong_coordinator_token_is_named(run, tmp_path):
    (tmp_path / "wrong-token").write_text("not-the-token")
    jobs = three_jobs(run, tmp_path)
    c = yaml.safe_load(jobs[2][0].read_text())
    c["mrlx"]["coordinator"]["token_file"] = str(tmp_path / "wrong-token")
    jobs[2][0].write_text(yaml.safe_dump(c))
    r = check(run, jobs)
    assert r.returncode == 1
    assert f"{jobs[2][0]}: the coordinator refused the token" in r.stdout
    assert "mrlx check: 1 problem(s)" in r.stdout


def test_jobs_that_count_an_episodes_samples_differently_are_refused(run, tmp_path):
    jobs = three_jobs(run, tmp_path)
    c = tmp_path / "c.yaml"
    data = yaml.safe_load(c.read_text())
    data["mrlx"]["rewards"] = {"credit": "turn"}  # c alone counts one sample per turn
    c.write_text(yaml.safe_dump(data))
    r = check(run, jobs)
    assert r.returncode == 1, r.stdout
    a = tmp_path / "a.yaml"
    # dialogue of four agents, max_turns 8: two turns each under per-turn credit
    for agent in ("a", "b", "c"):
        assert (
            f"{c}: an episode gives agent '{agent}' 2 sample(s) here but 1 in {a}; use the same "
            "mrlx.rewards (credit, branch) and system settings in every job"
        ) in r.stdout
