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
    for path in (LAUNCH / "run_agent.sh", LAUNCH / "run_two_agents.sh", LAUNCH / "start_coordinator.sh"):
        text = path.read_text()
        assert not re.search(r"https?://[0-9a-z.-]+:\d+", text), path
        assert "/root/" not in text, path
