"""Two agent jobs of a multi-model run, as real processes: a coordinator, an engine per agent and
the embedded trainer per agent (which calls the plugin's rollout functions as slime's loop does).

Job A runs every episode (initiator_rollout); job B trains on B's turns (responder_rollout).
`two_job_config` is the one builder of such a run's `mrlx` settings, for these jobs and for the
tests that call a job's rollout function in their own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from _coord_procs import TOKEN_ENV, CoordinatorProcess

from mrlx_plugin.core import processes
from mrlx_plugin.link.auth import signed_headers
from mrlx_plugin.local.services import ManagedProcess, start_engine

TOKEN = "two-jobs-test-token"
ENV = {TOKEN_ENV: TOKEN}
AGENTS = ("a", "b")


def two_job_config(
    me: str,
    *,
    run_id: str,
    urls: Mapping[str, str],
    coordinator: str,
    tokenizers: Mapping[str, str | os.PathLike] | None = None,
    max_new_tokens: int | None = None,
    system_prompts: Mapping[str, str] | None = None,
    coordinator_settings: Mapping[str, Any] | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """The `mrlx` settings of agent `me`'s job in a dialogue run of agents a and b, both trained.

    `urls` names the other agent's engine (an agent's own is "self"); `tokenizers`, where given,
    an agent's tokenizer directory (else the host's); `coordinator` is the
    coordinator's URL, its token read from TOKEN_ENV; `sections` are further top-level sections
    (dialogue, engine, trainer, ...)."""
    agents: dict[str, dict[str, Any]] = {}
    for name in AGENTS:
        agent: dict[str, Any] = {"url": "self" if name == me else urls[name], "trainable": True}
        if tokenizers is not None and name in tokenizers:
            agent["tokenizer"] = str(tokenizers[name])
        if system_prompts is not None:
            agent["system_prompt"] = system_prompts[name]
        if max_new_tokens is not None:
            agent["sampling"] = {"max_new_tokens": max_new_tokens}
        agents[name] = agent
    return {
        "run_id": run_id,
        "system": "dialogue",
        "self": me,
        "agents": agents,
        "coordinator": {"url": coordinator, "token_env": TOKEN_ENV, **(coordinator_settings or {})},
        **sections,
    }


def write_config(path: Path, mrlx: Mapping[str, Any]) -> Path:
    """A job's YAML file (`--config`): the settings under `mrlx`."""
    path.write_text(yaml.safe_dump({"mrlx": dict(mrlx)}, sort_keys=False))
    return path


def flow(settings: str) -> dict[str, Any]:
    """'k: v, k2: v2' (a YAML flow mapping's inside) as a dict."""
    return yaml.safe_load("{" + settings + "}") or {}


@dataclass
class TwoJobs:
    root: Path
    model_a: Path
    model_b: Path
    steps: int = 4
    groups: int = 2
    per_prompt: int = 2
    coordinator_settings: str = "max_staleness: 1, wait_deadline_s: 120, lease_s: 30"
    b_trainer_settings: str = "lr: 0.001"
    coordinator_extra: tuple[str, ...] = ()  # more flags of the coordinator (e.g. --max-depth)
    b_groups: int | None = None  # B's --rollout-batch-size when it differs from A's
    procs: list[ManagedProcess] = field(default_factory=list)
    jobs: dict[str, subprocess.Popen] = field(default_factory=dict)
    coordinator: CoordinatorProcess | None = None  # one process across restarts: same database, same port

    @property
    def coord_port(self) -> int:
        assert self.coordinator is not None, "start_services() first"
        return self.coordinator.port

    def start_services(self) -> None:
        self.coordinator = self.start_coordinator()
        self.engine_a = start_engine(self.model_a, log_dir=self.root, name="engine-a", threads=1)
        self.engine_b = start_engine(self.model_b, log_dir=self.root, name="engine-b", threads=1)
        self.procs += [self.engine_a, self.engine_b]

    def start_coordinator(self) -> CoordinatorProcess:
        """The run's coordinator; started again (after a kill) on the same database and port."""
        if self.coordinator is None:
            self.coordinator = CoordinatorProcess(
                self.root / "coordinator",
                run_id="jobs",
                agents=AGENTS,
                token=TOKEN,
                extra=self.coordinator_extra,
            )
            return self.coordinator.start()
        self.coordinator.extra = list(self.coordinator_extra)
        return self.coordinator.start(same_port=True)

    def yaml(self, me: str) -> Path:
        trainer = "lr: 0.001" if me == "a" else self.b_trainer_settings
        mrlx = two_job_config(
            me,
            run_id="jobs",
            urls={"a": self.engine_a.url, "b": self.engine_b.url},
            coordinator=self.coordinator.url,
            tokenizers={"a": self.model_a, "b": self.model_b},
            max_new_tokens=5,
            coordinator_settings=flow(self.coordinator_settings),
            dialogue={"first": "a", "max_turns": 2},
            engine={"abort_retry_wait_s": 0.2, "peer_deadline_s": 60, "request_timeout_s": 10},
            trainer=flow(trainer),
        )
        return write_config(self.root / f"{me}.yaml", mrlx)

    def start_job(self, me: str, *extra: str) -> subprocess.Popen:
        engine = self.engine_a if me == "a" else self.engine_b
        fn = "initiator_rollout" if me == "a" else "responder_rollout"
        groups = self.b_groups if me == "b" and self.b_groups is not None else self.groups
        argv = [
            sys.executable,
            "-m",
            "mrlx_plugin.local.trainer",
            "--config",
            str(self.yaml(me)),
            "--model",
            str(self.model_a if me == "a" else self.model_b),
            "--engine-url",
            engine.url,
            "--router-url",
            engine.url,
            "--rollout-function",
            f"mrlx_plugin.rollout.{fn}",
            "--num-rollout",
            str(self.steps),
            "--rollout-batch-size",
            str(groups),
            "--n-samples-per-prompt",
            str(self.per_prompt),
            "--rollout-max-response-len",
            "16",
            "--out",
            str(self.root / f"out_{me}"),
            "--save-samples",
            *extra,
        ]
        log = open(self.root / f"job_{me}.log", "ab")  # noqa: SIM115 (the job writes to it for its whole life)
        job = processes.start(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **ENV))
        self.jobs[me] = job
        return job

    def rows(self, me: str, name: str) -> list[dict[str, Any]]:
        path = self.root / f"out_{me}" / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def latest_checkpoint(self, me: str) -> int | None:
        """The step of the newest complete checkpoint of a job (None: none yet)."""
        found = sorted(
            p.name
            for p in (self.root / f"out_{me}" / "checkpoints").glob("step_*")
            if not p.name.endswith(".tmp")
        )
        return int(found[-1].split("_")[1]) if found else None

    def log(self, me: str) -> str:
        return (self.root / f"job_{me}.log").read_text(errors="replace")[-20000:]

    def wait(self, me: str, timeout: float = 240) -> int:
        return self.jobs[me].wait(timeout=timeout)

    def queue(self, consumer: str = "b") -> dict[str, Any]:
        import urllib.request

        path = f"/v1/runs/jobs/queues/{consumer}"
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.coord_port}{path}", headers=signed_headers(TOKEN, "GET", path)
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def logs(self) -> str:
        """Both jobs' logs, for what a failed wait reports (`wait_until(..., details=jobs.logs)`)."""
        return "logs:\n" + self.log("a") + "\n---\n" + self.log("b")

    def stop(self) -> None:
        for job in self.jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait(10)
        for proc in reversed(self.procs):
            proc.stop()
        if self.coordinator is not None:
            self.coordinator.stop()

    def metrics(self, url_path: str = "/metrics") -> str:
        import urllib.request

        req = urllib.request.Request(
            f"http://127.0.0.1:{self.coord_port}{url_path}", headers=signed_headers(TOKEN, "GET", url_path)
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.read().decode()

    def b_trained(self) -> list[dict[str, Any]]:
        """B's trained samples that stand for one of A's episodes (not fillers of a group set aside)."""
        return [s for s in self.rows("b", "samples.jsonl") if "dead_letter" not in s["metadata"]["mrlx"]]

    def assert_b_steps_are_a_steps(self) -> None:
        """Each of B's steps trained exactly the groups of A's step of the same number."""
        a_step = {s["metadata"]["mrlx"]["episode_id"]: s["step"] for s in self.rows("a", "samples.jsonl")}
        shifted = [
            (s["step"], a_step.get(s["metadata"]["mrlx"]["episode_id"]))
            for s in self.b_trained()
            if a_step.get(s["metadata"]["mrlx"]["episode_id"]) != s["step"]
        ]
        assert not shifted, f"B's steps trained other steps of A's (B step, A step): {sorted(set(shifted))}"

    def assert_b_trained_every_episode_once(self) -> None:
        a_ids = [s["metadata"]["mrlx"]["episode_id"] for s in self.rows("a", "samples.jsonl")]
        b_ids = [s["metadata"]["mrlx"]["episode_id"] for s in self.b_trained()]
        assert len(a_ids) == len(set(a_ids)) == self.steps * self.groups * self.per_prompt
        assert len(b_ids) == len(set(b_ids)), "a B sample was trained twice"
        assert sorted(b_ids) == sorted(a_ids), "a B sample of A's episodes never reached B's trainer"
