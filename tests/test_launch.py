"""The launch scripts: a real coordinator from start_coordinator.sh, and the slime command lines
run_agent.sh builds (printed with MRLX_DRY_RUN=1, since slime and GPUs are not here)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from mrlx_plugin.core.netutil import free_port

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    e = dict(os.environ, PYTHON=sys.executable, MRLX_RUN_DIR=str(tmp_path / "run"),
             MRLX_COORDINATOR_PORT=str(free_port()), MRLX_REPO=str(REPO))
    e.update(extra)
    return e


def test_start_coordinator_starts_a_token_protected_coordinator(tmp_path):
    e = env(tmp_path)
    r = subprocess.run(["bash", str(LAUNCH / "start_coordinator.sh")], env=e, capture_output=True, text=True, timeout=120)
    pid = int((tmp_path / "run" / "coordinator.pid").read_text())
    try:
        assert r.returncode == 0, r.stderr
        url = f"http://127.0.0.1:{e['MRLX_COORDINATOR_PORT']}"
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=5).read())
        assert health["run_id"] == "doctor-patient-001"
        token_file = tmp_path / "run" / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token_file.read_text().strip()) >= 32
        try:
            urllib.request.urlopen(url + "/metrics", timeout=5)
            raise AssertionError("metrics answered without the token")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        req = urllib.request.Request(url + "/metrics", headers={"Authorization": "Bearer " + token_file.read_text().strip()})
        assert b"mrlx" in urllib.request.urlopen(req, timeout=5).read()
        assert token_file.read_text().strip() not in (tmp_path / "run" / "coordinator.log").read_text()
        again = subprocess.run(["bash", str(LAUNCH / "start_coordinator.sh")], env=e, capture_output=True, text=True)
        assert again.returncode == 0 and "already running" in again.stdout
    finally:
        os.kill(pid, signal.SIGTERM)


def dry_run(role: str, tmp_path: Path) -> str:
    r = subprocess.run(["bash", str(LAUNCH / "run_agent.sh"), role], env=env(tmp_path, MRLX_DRY_RUN="1"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_run_agent_builds_one_slime_job_per_agent(tmp_path):
    a, b = dry_run("A", tmp_path), dry_run("B", tmp_path)
    for out, fn, config, port in ((a, "initiator_rollout", "doctor.yaml", "30000"),
                                  (b, "responder_rollout", "patient.yaml", "31000")):
        assert f"--rollout-function-path mrlx_plugin.rollout.{fn}" in out
        assert "--custom-generate-function-path mrlx_plugin.rollout.generate" in out
        assert "--custom-reward-post-process-path mrlx_plugin.rollout.normalize" in out
        assert re.search(rf"--custom-config-path \S*{config}", out)
        assert f"--sglang-router-ip 127.0.0.1 --sglang-router-port {port}" in out  # engines register there
        assert f"sglang_router.launch_router --host 127.0.0.1 --port {port}" in out
        assert "ray start --head" in out and "ray job submit" in out
        assert "mrlx_plugin.cli check --offline" in out
    assert "--responder" in b and "--responder" not in a
    # B's engines answer A's episodes while B trains: never offloaded by colocation.
    assert "--colocate" in a and "--colocate" not in b and "--rollout-num-gpus 4" in b
    assert "ray start --head --node-ip-address 127.0.0.1 --port 6479 --num-gpus 8" in b
    assert "--rollout-batch-size 32 --n-samples-per-prompt 8" in a and "--rollout-batch-size 32 --n-samples-per-prompt 8" in b
    submit = shlex.split(next(line for line in a.splitlines() if line.startswith("ray job submit")))
    job_env = json.loads(submit[submit.index("--runtime-env-json") + 1])
    assert job_env["env_vars"]["MRLX_COORDINATOR_URL"].startswith("http://127.0.0.1:")
    assert "MRLX_TOKEN" not in job_env["env_vars"]


def test_the_two_jobs_example_configs_agree(tmp_path):
    script = f"source {LAUNCH / 'mrlx.env'} && {sys.executable} -m mrlx_plugin.cli check --offline " \
             "--config $AGENT_A_CONFIG --config $AGENT_B_CONFIG"
    r = subprocess.run(["bash", "-c", script], env=env(tmp_path), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 configs agree" in r.stdout


def test_no_address_or_path_is_written_outside_the_env_file():
    import yaml

    for path in [*(REPO / "examples" / "multi_agent" / "doctor_patient").glob("*.yaml"),
                 *(REPO / "examples" / "multi_agent" / "solver_verifier").glob("*.yaml")]:
        mrlx = yaml.safe_load(path.read_text())["mrlx"]
        for name, agent in mrlx["agents"].items():
            assert agent["url"] == "self" or agent["url"].startswith("${"), (path, name)
            assert "tokenizer" not in agent or agent["tokenizer"].startswith("${"), (path, name)
        for key in ("url", "token_file"):
            assert mrlx["coordinator"][key].startswith("${"), (path, key)
        assert mrlx["run_id"].startswith("${")
    for path in (*(REPO / "examples" / "debate").glob("*.yaml"),):
        mrlx = yaml.safe_load(path.read_text())["mrlx"]
        for name, agent in mrlx["agents"].items():
            assert agent["url"] == "self" or agent["url"].startswith("${"), (path, name)
            assert "tokenizer" not in agent or agent["tokenizer"].startswith("${"), (path, name)
        assert mrlx["coordinator"]["url"].startswith("${") and mrlx["run_id"].startswith("${")
    scripts = sorted(LAUNCH.glob("*.sh"))
    assert {"run_agent.sh", "run_agents.sh", "run_two_agents.sh", "serve_frozen.sh", "start_coordinator.sh"} <= {
        p.name for p in scripts}
    for path in scripts:
        text = path.read_text()
        assert not re.search(r"https?://[0-9a-z.-]+:\d+", text), path
        assert "/root/" not in text, path


def dry_launch(script: str, tmp_path: Path, *args: str, **extra: str) -> list[list[str]]:
    """The commands a launch script would run, in order (MRLX_DRY_RUN=1), each as its argv."""
    r = subprocess.run(["bash", str(LAUNCH / script), *args], env=env(tmp_path, MRLX_DRY_RUN="1", **extra),
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


def _describe(argv: list[str]) -> str:
    """A command in a few words: what it starts, and for whom."""
    def after(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    if argv[:2] == ["ray", "start"]:
        return f"ray head :{after('--port')}"
    if argv[:3] == ["ray", "job", "submit"]:
        return f"slime job {after('--rollout-function-path').rsplit('.', 1)[1]} {Path(after('--custom-config-path')).name}"
    module = argv[argv.index("-m") + 1]
    if module == "mrlx_plugin.cli" and argv[argv.index("-m") + 2] == "check":
        configs = [Path(argv[i + 1]).name for i, a in enumerate(argv) if a == "--config"]
        kind = "offline" if "--offline" in argv else ("wait" if "--wait" in argv else "reach")
        who = f" --agent {after('--agent')}" if "--agent" in argv else ""
        return f"check {kind} {','.join(configs)}{who}"
    if module == "mrlx_plugin.cli":
        return f"coordinator {after('--agents')}"
    if module == "sglang.launch_server":
        return f"sglang server :{after('--port')}"
    if module == "sglang_router.launch_router":
        return f"router :{after('--port')}"
    raise AssertionError(f"unexpected command {argv}")


def test_run_agents_starts_two_trained_jobs_and_a_frozen_judge_in_order(tmp_path):
    commands = dry_launch("run_agents.sh", tmp_path, str(LAUNCH / "debate.env"))
    assert [_describe(c) for c in commands] == [
        "check offline debate_judge.yaml,debater_b.yaml",
        "coordinator debater_a,debater_b",  # the trained agents only: the judge has no trainer
        # the frozen judge: its SGLang servers, its router in front of them, then a wait for them
        "sglang server :32001", "sglang server :32002", "router :32000",
        "check wait debate_judge.yaml --agent judge",
        # debater_b (responder): its job, then a wait for its router
        "check offline debate_judge.yaml,debater_b.yaml", "check reach debater_b.yaml", "ray head :6479",
        "router :31000", "slime job responder_rollout debater_b.yaml", "check wait debater_b.yaml",
        # debater_a (initiator) last: its check reaches debater_b's and the judge's routers
        "check offline debate_judge.yaml,debater_b.yaml", "check reach debate_judge.yaml", "ray head :6379",
        "router :30000", "slime job initiator_rollout debate_judge.yaml",
    ]
    offline = commands[0]
    assert offline[offline.index("--offline") + 1:] == [
        "--config", str(REPO / "examples/debate/debate_judge.yaml"), "--role", "initiator",
        "--config", str(REPO / "examples/debate/debater_b.yaml"), "--role", "responder"]
    servers = [c for c in commands if "sglang.launch_server" in c]
    for i, server in enumerate(servers):
        assert server[server.index("--model-path") + 1] == "/root/Qwen3-32B"
        assert server[server.index("--tp-size") + 1] == "4" and server[server.index("--base-gpu-id") + 1] == str(4 * i)
        assert server[-2:] == ["--mem-fraction-static", "0.85"]
    router = commands[4]
    urls = router[router.index("--worker-urls") + 1:router.index("--worker-startup-timeout-secs")]
    assert urls == ["http://127.0.0.1:32001", "http://127.0.0.1:32002"]
    responder_job, initiator_job = [c for c in commands if c[:3] == ["ray", "job", "submit"]]
    assert "--no-wait" in responder_job and "--no-wait" not in initiator_job
    assert "--colocate" in initiator_job and "--colocate" not in responder_job
    assert responder_job[responder_job.index("--rollout-num-gpus") + 1] == "4"
    gate = commands[11]
    assert gate[gate.index("--router-url") + 1] == "http://127.0.0.1:31000" and "--responder" in gate
    job_env = json.loads(initiator_job[initiator_job.index("--runtime-env-json") + 1])["env_vars"]
    assert job_env["MRLX_URL_JUDGE"] == "http://127.0.0.1:32000" and job_env["AGENT_JUDGE_HF"] == "/root/Qwen3-32B"


def test_run_two_agents_is_the_same_launch_for_two_agents(tmp_path):
    described = [_describe(c) for c in dry_launch("run_two_agents.sh", tmp_path)]
    assert described == [
        "check offline doctor.yaml,patient.yaml", "coordinator doctor,patient",
        "check offline doctor.yaml,patient.yaml", "check reach patient.yaml", "ray head :6479", "router :31000",
        "slime job responder_rollout patient.yaml", "check wait patient.yaml",
        "check offline doctor.yaml,patient.yaml", "check reach doctor.yaml", "ray head :6379", "router :30000",
        "slime job initiator_rollout doctor.yaml",
    ]


def test_one_trained_job_and_a_frozen_judge_need_no_coordinator(tmp_path):
    described = [_describe(c) for c in dry_launch("run_agents.sh", tmp_path, str(LAUNCH / "debate.env"),
                                                  MRLX_AGENTS="debater_a judge")]
    assert not [d for d in described if d.startswith("coordinator")]
    assert described[:4] == ["check offline debate_judge.yaml", "sglang server :32001", "sglang server :32002",
                             "router :32000"]
    assert described[-1] == "slime job initiator_rollout debate_judge.yaml"


@pytest.mark.parametrize("script, args, extra, message", [
    ("run_agent.sh", ["judge"], {}, "'judge' is frozen (no slime job); start its servers with serve_frozen.sh judge"),
    ("serve_frozen.sh", ["debater_b"], {}, "'debater_b' is not a frozen agent (AGENT_DEBATER_B_ROLE is 'responder')"),
    ("run_agents.sh", [], {"AGENT_DEBATER_B_ROLE": "initiator"}, "has 2 initiators; exactly one agent's job runs"),
    ("run_agents.sh", [], {"AGENT_JUDGE_ROLE": "judge"}, "AGENT_JUDGE_ROLE is 'judge'; expected initiator, responder"),
])
def test_an_env_file_that_cannot_make_a_run_is_refused(script, args, extra, message, tmp_path):
    r = subprocess.run(["bash", str(LAUNCH / script), *args, str(LAUNCH / "debate.env")],
                       env=env(tmp_path, MRLX_DRY_RUN="1", **extra), capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not r.stdout  # nothing was started (or printed as started)


def test_the_debate_example_configs_agree(tmp_path):
    script = f"source {LAUNCH / 'debate.env'} && {sys.executable} -m mrlx_plugin.cli check --offline " \
             "--config $AGENT_DEBATER_A_CONFIG --role initiator --config $AGENT_DEBATER_B_CONFIG --role responder"
    r = subprocess.run(["bash", "-c", script], env=env(tmp_path), capture_output=True, text=True, cwd=REPO, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 configs agree" in r.stdout
