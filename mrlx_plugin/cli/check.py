"""`mrlx check`: validate configs and reach every URL, before any GPU is used.

    mrlx check --config job_a.yaml [--router-url http://a-router:30000]
    mrlx check --config job_a.yaml --config job_b.yaml --router-url URL_A --router-url URL_B
    mrlx check --config job_b.yaml --router-url URL_B --responder --wait 1800   (gate a launch)

Each config is loaded exactly as the rollout process would load it (plugins imported, every key
validated). Then every agent URL gets a `/health` and `/get_model_info` call, tokenizers are
loaded, and the coordinator (if configured) is asked for its health and, with the token, its
metrics. Two or more configs are also checked against each other: the same run id, the same
coordinator, the same agents, and a different `self` in each job. Exit status: 0 all good,
1 something unreachable or inconsistent, 2 a config error.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrlx_plugin.core.config import (
    ConfigError,
    Settings,
    config_dir,
    load_yaml,
    parse_settings,
    public_text,
    read_text_setting,
)
from mrlx_plugin.core.retry import Backoff, Deadline, wait_until
from mrlx_plugin.core.engine_client import EngineClient, EngineError
from mrlx_plugin.plugins import collect_systems, make_plugin_manager


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def ok(self, text: str) -> None:
        self.lines.append(f"ok    {text}")

    def fail(self, text: str) -> None:
        self.lines.append(f"FAIL  {text}")
        self.problems.append(text)


def load_config(path: str) -> Settings:
    data = load_yaml(path)
    if "mrlx" not in data:
        raise ConfigError(f"{path}: no top-level 'mrlx' key; put every plugin setting under 'mrlx:'")
    raw = data["mrlx"] or {}
    plugins = raw.get("plugins", []) if isinstance(raw, dict) else []
    pm = make_plugin_manager(plugins if isinstance(plugins, list) else [], source=f"{path}: mrlx.plugins")
    settings = parse_settings(raw, source=path, known_systems=set(collect_systems(pm)))
    for name, agent in settings.agents.items():  # a file a setting names must be there (read as the job will)
        for key in ("system_prompt", "chat_template"):
            read_text_setting(getattr(agent, key), config_dir(path), key=f"{path}: mrlx.agents.{name}.{key}")
    return settings


async def check_engine(name: str, where: str, url: str, timeout: float, report: Report) -> None:
    client = EngineClient(url)
    try:
        await client.get_json("/health", timeout=timeout)
        info = await client.get_json("/get_model_info", timeout=timeout)
        model = info.get("model_path") if isinstance(info, dict) else None
        report.ok(f"{where}: agent {name!r} at {public_text(url)} answers"
                  + (f" (model {model})" if model else ""))
    except EngineError as exc:
        report.fail(f"{where}: agent {name!r} at {public_text(url)} is unreachable: {exc.reason}; "
                    "start its engines/router first")
    finally:
        await client.close()


async def check_coordinator(path: str, settings: Settings, timeout: float, report: Report) -> None:
    c = settings.coordinator
    if not c.url:
        return
    client = EngineClient(c.url)
    try:
        health = await client.get_json("/health", timeout=timeout)
    except EngineError as exc:
        report.fail(f"{path}: mrlx.coordinator.url {public_text(c.url)} is unreachable: {exc.reason}; "
                    "start it with launch/start_coordinator.sh")
        await client.close()
        return
    run = health.get("run_id") if isinstance(health, dict) else None
    if run is not None and run != settings.run_id:
        report.fail(f"{path}: the coordinator at {public_text(c.url)} serves run {run!r}, but mrlx.run_id is "
                    f"{settings.run_id!r}")
    else:
        report.ok(f"{path}: coordinator at {public_text(c.url)} answers (run {run})")
    token = _token(c)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        status, _ = await client._pool().request("GET", "/metrics", None, timeout, headers=headers)
        if status == 401:
            report.fail(
                f"{path}: the coordinator refused the token (set {c.token_env} or mrlx.coordinator.token_file "
                "to the coordinator's token)"
            )
        elif status != 200:
            report.fail(f"{path}: coordinator /metrics answered HTTP {status}")
        else:
            report.ok(f"{path}: coordinator accepts this job's token")
    except Exception as exc:  # noqa: BLE001 - any failure here is reported, not raised
        report.fail(f"{path}: coordinator /metrics failed: {exc}")
    finally:
        await client.close()


def _token(c: Any) -> str | None:
    if c.token_file:
        try:
            return Path(c.token_file).read_text().strip()
        except OSError:
            return None
    return os.environ.get(c.token_env)


def cross_check(configs: list[tuple[str, Settings]], report: Report) -> None:
    if len(configs) < 2:
        return
    (p0, s0), rest = configs[0], configs[1:]
    for path, s in rest:
        if s.run_id != s0.run_id:
            report.fail(f"{path}: mrlx.run_id {s.run_id!r} differs from {p0}'s {s0.run_id!r}")
        if (s.coordinator.url or "").rstrip("/") != (s0.coordinator.url or "").rstrip("/"):
            report.fail(f"{path}: mrlx.coordinator.url {s.coordinator.url!r} differs from {p0}'s {s0.coordinator.url!r}")
        if set(s.agents) != set(s0.agents):
            report.fail(f"{path}: agents {sorted(s.agents)} differ from {p0}'s {sorted(s0.agents)}")
    selves = [(p, s.self_agent) for p, s in configs]
    for p, who in selves:
        if who is None:
            report.fail(f"{p}: mrlx.self is not set; each job of a multi-model run names the agent it trains")
    seen: dict[str, str] = {}
    for p, who in selves:
        if who is not None and who in seen:
            report.fail(f"{p}: mrlx.self is {who!r}, the same as in {seen[who]}; each job trains a different agent")
        elif who is not None:
            seen[who] = p
    if not report.problems:
        report.ok(f"{len(configs)} configs agree: run {s0.run_id!r}, agents {sorted(s0.agents)}")


async def run_checks(paths: list[str], router_urls: list[str], timeout: float, tokenizers: bool,
                     offline: bool = False, responder: bool = False) -> Report:
    report = Report()
    configs = []
    for path in paths:
        settings = load_config(path)
        report.ok(f"{path}: settings valid (system {settings.system!r}, agents {', '.join(settings.agents)})")
        configs.append((path, settings))
    cross_check(configs, report)
    if offline:
        return report
    for i, (path, settings) in enumerate(configs):
        router = router_urls[i] if i < len(router_urls) else None
        jobs = []
        for name, agent in settings.agents.items():
            if responder and agent.url != "self":
                report.lines.append(f"skip  {path}: agent {name!r} (a responder job calls no other agent)")
                continue
            url = router if agent.url == "self" else agent.url
            if url is None:
                report.lines.append(f"skip  {path}: agent {name!r} is url: self (pass --router-url to check this job's router)")
                continue
            jobs.append(check_engine(name, path, url, timeout, report))
        await asyncio.gather(*jobs)
        await check_coordinator(path, settings, timeout, report)
        if tokenizers:
            from mrlx_plugin.core.tokenizer import load_tokenizer

            for name, agent in settings.agents.items():
                if agent.tokenizer:
                    try:
                        await asyncio.to_thread(load_tokenizer, agent.tokenizer, None, f"{path}: mrlx.agents.{name}.tokenizer")
                        report.ok(f"{path}: tokenizer of {name!r} loads")
                    except ConfigError as exc:
                        report.fail(str(exc))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mrlx check", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, help="a job's YAML (repeat for each job)")
    p.add_argument("--router-url", action="append", default=[], help="the router of the job, in --config order")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per URL")
    p.add_argument("--skip-tokenizers", action="store_true", help="do not load tokenizers")
    p.add_argument("--offline", action="store_true", help="validate and cross-check the configs only; reach nothing")
    p.add_argument("--responder", action="store_true",
                   help="the job runs mrlx_plugin.rollout.responder_rollout: reach only its router and the coordinator")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="repeat the checks until they pass or SECONDS have gone by (to gate a launch)")
    ns = p.parse_args(argv)
    reports = []

    def passed() -> bool:
        reports.append(asyncio.run(run_checks(ns.config, ns.router_url, ns.timeout, not ns.skip_tokenizers,
                                              offline=ns.offline, responder=ns.responder)))
        problems = reports[-1].problems
        if problems and ns.wait > 0:
            print(f"mrlx check: {len(problems)} problem(s), first: {problems[0]}; checking again until "
                  f"--wait {ns.wait:g} s runs out", file=sys.stderr, flush=True)
        return not problems

    try:  # --wait gates a launch: the checks again every few seconds until they pass
        wait_until(passed, Deadline(ns.wait), what="mrlx check", backoff=Backoff(base_s=5.0, max_s=5.0))
    except TimeoutError:
        pass
    report = reports[-1]
    for line in report.lines:
        print(line)
    if report.problems:
        print(f"mrlx check: {len(report.problems)} problem(s)")
        return 1
    print("mrlx check: all good")
    return 0
