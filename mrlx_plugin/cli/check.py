"""`mrlx check`: validate configs and reach every URL, before any GPU is used.

    mrlx check --config job_a.yaml [--router-url http://a-router:30000]
    mrlx check --config job_a.yaml --config job_b.yaml --router-url URL_A --router-url URL_B
    mrlx check --config job_b.yaml --router-url URL_B --responder --wait 1800   (gate a launch)
    mrlx check --config a.yaml --role initiator --config b.yaml --role responder   (N jobs)
    mrlx check --config a.yaml --agent judge --wait 1800   (wait for a frozen agent's servers)

Each config is loaded exactly as the rollout process would load it (plugins imported, every key
validated). Then every agent URL gets a `/health` and `/get_model_info` call, tokenizers are
loaded, and the coordinator (if configured) is asked for its health by a call signed with the
job's token (it must take the signature and prove it holds the same token). Two or more configs
(one per slime job of a multi-model run) are also checked against each other: the same run id,
coordinator and system, the same agents with the same settings (`trainable`, `url`, `tokenizer`;
`url: self` is the job's own router, given with `--router-url`), a different `self` in each job,
a job for every trainable agent and none for a frozen one (`trainable: false`: served by its own
SGLang servers, launch/serve_frozen.sh), and, with `--role`, exactly one initiator. Exit status:
0 all good, 1 something unreachable or inconsistent, 2 a config error.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mrlx_plugin.core.config import (
    DAY_S,
    ConfigError,
    CoordinatorSettings,
    Settings,
    config_dir,
    load_yaml,
    parse_settings,
    public_text,
    read_text_setting,
)
from mrlx_plugin.core.engine_client import EngineClient, EngineError, MalformedAnswer
from mrlx_plugin.core.retry import Backoff, Deadline, wait_until
from mrlx_plugin.episodes import start_system
from mrlx_plugin.link.client import CoordinatorClient, CoordinatorError
from mrlx_plugin.local.trainer.settings import SECTIONS as TRAINER_SECTIONS
from mrlx_plugin.plugins import collect_games, collect_systems, make_plugin_manager
from mrlx_plugin.runtime import hook_users
from mrlx_plugin.settings import job_sections


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
    systems = collect_systems(pm)
    # Every section, the embedded trainer's too: one file serves the rollout and that trainer.
    settings = parse_settings(raw, path, set(systems), sections=job_sections(systems, TRAINER_SECTIONS))
    for name, agent in settings.agents.items():  # a file a setting names must be there (read as the job will)
        for key in ("system_prompt", "chat_template"):
            read_text_setting(getattr(agent, key), config_dir(path), key=f"{path}: mrlx.agents.{name}.{key}")
    return settings


async def check_engine(
    name: str,
    where: str,
    url: str,
    timeout: float,
    report: Report,
    frozen: bool = False,
    adapter: str | None = None,
) -> None:
    client = EngineClient(url)
    try:
        await client.get_json("/health", timeout=timeout)
        info = await client.get_json("/get_model_info", timeout=timeout)
        model = info.get("model_path") if isinstance(info, dict) else None
        report.ok(
            f"{where}: agent {name!r} at {public_text(url)} answers" + (f" (model {model})" if model else "")
        )
    except EngineError as exc:
        start = (
            "start its SGLang servers and router first (launch/serve_frozen.sh)"
            if frozen
            else "start its engines/router first"
        )
        report.fail(f"{where}: agent {name!r} at {public_text(url)} is unreachable: {exc.reason}; {start}")
        await client.close()
        return
    try:
        if adapter is not None:
            await _check_adapter(client, name, where, url, adapter, timeout, report)
    finally:
        await client.close()


async def _check_adapter(
    client: EngineClient, name: str, where: str, url: str, adapter: str, timeout: float, report: Report
) -> None:
    """One token generated through the agent's adapter, as its turns will be: an engine that does
    not serve the adapter refuses the request (SGLang answers 400), whatever it lists."""
    try:
        await client.generate(
            [0],
            {"max_new_tokens": 1, "temperature": 0.0},
            deadline=time.monotonic() + timeout,
            extra={"lora_path": adapter},
        )
        report.ok(f"{where}: agent {name!r} at {public_text(url)} serves adapter {adapter!r}")
    except EngineError as exc:
        if exc.retryable or isinstance(exc, MalformedAnswer):  # no refusal: it failed or never answered
            report.fail(
                f"{where}: agent {name!r} at {public_text(url)}: a 1-token generate through adapter "
                f"{adapter!r} failed: {exc.reason}"
            )
            return
        report.fail(  # the engine refused the request (HTTP 4xx): it does not serve the adapter
            f"{where}: agent {name!r} at {public_text(url)} does not serve LoRA adapter {adapter!r}: "
            f"{exc.reason}; load it (SGLang: --lora-paths {adapter}=DIR, or POST /load_lora_adapter) or "
            f"correct mrlx.agents.{name}.adapter"
        )


async def check_coordinator(path: str, settings: Settings, timeout: float, report: Report) -> None:
    c = settings.coordinator
    if not c.url:
        return
    client = EngineClient(c.url)
    try:
        await client.get_json("/health", timeout=timeout)  # reachable at all (no token needed)
    except EngineError as exc:
        report.fail(
            f"{path}: mrlx.coordinator.url {public_text(c.url)} is unreachable: {exc.reason}; "
            "start it with launch/start_coordinator.sh"
        )
        return
    finally:
        await client.close()
    # Signed, as the job's calls are: the answer names the run only when the coordinator took this
    # job's signature and proved it holds the same token.
    token = _token(c)
    coordinator = CoordinatorClient(
        c.url,
        run_id=settings.run_id,
        agent=settings.self_agent or "check",
        token=token,
        request_timeout_s=timeout,
        outage_deadline_s=timeout,
        max_retries=1,
    )
    how = (
        f"set {c.token_env} or mrlx.coordinator.token_file to the coordinator's token; or is another "
        "process on its port?"
    )
    try:
        health = await coordinator.health()
    except CoordinatorError as exc:
        report.fail(
            f"{path}: the coordinator refused the token, or could not prove it holds it ({how}): {exc}"
        )
        return
    finally:
        await coordinator.close()
    run = health.get("run_id") if isinstance(health, dict) else None
    if run is None:  # the answer to a call without a token, of a coordinator that wants one
        report.fail(f"{path}: the coordinator refused the token: this job has none ({how})")
        return
    if run != settings.run_id:
        report.fail(
            f"{path}: the coordinator at {public_text(c.url)} serves run {run!r}, but mrlx.run_id is "
            f"{settings.run_id!r}"
        )
    else:
        report.ok(f"{path}: coordinator at {public_text(c.url)} answers (run {run})")
    report.ok(
        f"{path}: coordinator accepts this job's token"
        if token
        else f"{path}: coordinator takes calls without a token (it listens on a loopback address only)"
    )


def _token(c: CoordinatorSettings) -> str | None:
    if c.token_file:
        try:
            return Path(c.token_file).read_text().strip()
        except OSError:
            return None
    return os.environ.get(c.token_env)


ROLES = ("initiator", "responder")


def cross_check(
    configs: list[tuple[str, Settings]],
    report: Report,
    routers: dict[str, str] | None = None,
    roles: list[str] | None = None,
    counts: dict[str, dict[str, int] | None] | None = None,
) -> None:
    """The jobs of one multi-model run against each other: one run, one coordinator, one system,
    the same agents with the same settings, one job per trainable agent, none for a frozen one,
    and (with `roles`) exactly one initiator. `routers` maps a config to its job's router URL,
    which is what `url: self` means there."""
    if len(configs) < 2:
        return
    (p0, s0), rest = configs[0], configs[1:]
    for path, s in rest:
        if s.run_id != s0.run_id:
            report.fail(f"{path}: mrlx.run_id {s.run_id!r} differs from {p0}'s {s0.run_id!r}")
        if (s.coordinator.url or "").rstrip("/") != (s0.coordinator.url or "").rstrip("/"):
            report.fail(
                f"{path}: mrlx.coordinator.url {s.coordinator.url!r} differs from {p0}'s "
                f"{s0.coordinator.url!r}"
            )
        if s.system != s0.system:
            report.fail(f"{path}: mrlx.system {s.system!r} differs from {p0}'s {s0.system!r}")
        if set(s.agents) != set(s0.agents):
            report.fail(f"{path}: agents {sorted(s.agents)} differ from {p0}'s {sorted(s0.agents)}")
    selves = [(p, s.self_agent) for p, s in configs]
    for p, who in selves:
        if who is None:
            report.fail(f"{p}: mrlx.self is not set; each job of a multi-model run names the agent it trains")
    seen: dict[str, str] = {}
    for p, who in selves:
        if who is not None and who in seen:
            report.fail(
                f"{p}: mrlx.self is {who!r}, the same as in {seen[who]}; each job trains a different agent"
            )
        elif who is not None:
            seen[who] = p
    common = [name for name in s0.agents if all(name in s.agents for _, s in rest)]
    for name in common:
        _same_agent(name, configs, routers or {}, report)
    for name in common:
        trainable = {bool(s.agents[name].trainable) for _, s in configs}
        jobs = [p for p, s in configs if s.self_agent == name]
        if trainable == {False}:
            for p in jobs:
                report.fail(
                    f"{p}: mrlx.self is {name!r}, a frozen agent (trainable: false in every config); a "
                    "frozen agent has no slime job: serve it with launch/serve_frozen.sh and leave this "
                    "config out"
                )
        elif trainable == {True} and not jobs:
            report.fail(
                f"agent {name!r} is trainable but none of the {len(configs)} configs trains it (mrlx.self: "
                f"{name}); add its job's config, or set mrlx.agents.{name}.trainable: false in every config"
            )
    if counts is not None and len(counts) == len(configs):  # (a config it lacks was refused already)
        _same_samples_per_episode(counts, report)
    if roles:
        initiators = [p for (p, _), role in zip(configs, roles) if role == "initiator"]
        if len(initiators) != 1:
            which = ", ".join(initiators) if initiators else "none of them"
            report.fail(
                f"{len(initiators)} jobs run the episodes (--role initiator: {which}); exactly one job is "
                "the initiator (mrlx_plugin.rollout.initiator_rollout), every other a responder"
            )
    if not report.problems:
        report.ok(f"{len(configs)} configs agree: run {s0.run_id!r}, agents {sorted(s0.agents)}")


def _samples_per_agent(path: str, s: Settings) -> dict[str, int] | None:
    """What start-up computes of the system's declarations (its fan-out and turns, with the
    system's own checks of its settings, such as a built-in game's options)."""
    pm = make_plugin_manager(s.plugins, source=f"{path}: mrlx.plugins")
    return start_system(collect_systems(pm), collect_games(pm), s, path, hook_users(pm))[1]


def _same_samples_per_episode(counts: dict[str, dict[str, int] | None], report: Report) -> None:
    """Every job counts the same samples per episode for every agent: the initiator sends that
    many of each episode to a responder, which expects its own count (`rewards.credit`,
    `rewards.branch` and the system's settings, such as a game's seats or a dialogue's turns,
    decide it)."""
    (p0, c0), rest = next(iter(counts.items())), list(counts.items())[1:]
    for path, c in rest:
        for agent in sorted(set(c0 or {}) | set(c or {})):
            mine, theirs = (c or {}).get(agent), (c0 or {}).get(agent)
            if mine != theirs:
                report.fail(
                    f"{path}: an episode gives agent {agent!r} {mine} sample(s) here but {theirs} in {p0}; "
                    "use the same mrlx.rewards (credit, branch) and system settings in every job"
                )


def _same_agent(
    name: str, configs: list[tuple[str, Settings]], routers: dict[str, str], report: Report
) -> None:
    """One agent's settings in every config: whether it trains, where it is served, its tokenizer."""
    key = f"mrlx.agents.{name}"

    def differ(what: str, values: Mapping[str, object], fix: str) -> None:
        """`values`: config -> the setting there (compared as text, a URL without its last '/')."""
        if len({str(v).rstrip("/") for v in values.values()}) > 1:
            shown = ", ".join(f"{public_text(v)} in {p}" for p, v in values.items())
            report.fail(f"{key}.{what} differs between configs ({shown}); {fix}")

    differ(
        "trainable",
        {p: str(bool(s.agents[name].trainable)).lower() for p, s in configs},
        f"every job must agree whether {name!r} is trained",
    )
    # `url: self` is that job's router: comparable only when its URL was given (--router-url)
    urls = {p: routers.get(p) if s.agents[name].url == "self" else s.agents[name].url for p, s in configs}
    differ(
        "url",
        {p: u for p, u in urls.items() if u is not None},
        f"every job must reach {name!r} at the same router (`url: self` in the job that serves it)",
    )
    named = {p: s.agents[name].tokenizer for p, s in configs if s.agents[name].tokenizer}
    differ("tokenizer", named, f"every job must read {name!r}'s turns with {name!r}'s own tokenizer")
    for p, s in configs:
        a = s.agents[name]
        if named and a.url != "self" and not a.tokenizer:
            report.fail(
                f"{p}: {key}.tokenizer is not set, so this job reads {name!r}'s turns with its own "
                f"--hf-checkpoint; set it to {name!r}'s model (as {next(iter(named))} does)"
            )


async def run_checks(
    paths: list[str],
    router_urls: list[str],
    timeout: float,
    tokenizers: bool,
    offline: bool = False,
    responder: bool = False,
    roles: list[str] | None = None,
    only: list[str] | None = None,
) -> Report:
    report = Report()
    configs = []
    counts: dict[str, dict[str, int] | None] = {}  # each config's samples per episode and agent
    for path in paths:
        settings = load_config(path)
        try:
            counts[path] = _samples_per_agent(path, settings)
        except ConfigError as exc:  # what start-up would refuse, said now
            report.fail(str(exc) if str(exc).startswith(f"{path}: ") else f"{path}: {exc}")
        else:
            report.ok(
                f"{path}: settings valid (system {settings.system!r}, agents {', '.join(settings.agents)})"
            )
        configs.append((path, settings))
    routers = {path: url for (path, _), url in zip(configs, router_urls)}
    cross_check(configs, report, routers, roles, counts)
    for name in only or []:
        if not any(name in s.agents for _, s in configs):
            report.fail(f"--agent {name!r}: no such agent in {', '.join(paths)}")
    if offline:
        return report
    reached: set[tuple[str, str]] = set()
    for i, (path, settings) in enumerate(configs):
        router = router_urls[i] if i < len(router_urls) else None
        as_responder = responder or (roles is not None and roles[i] == "responder")
        jobs = []
        for name, agent in settings.agents.items():
            if only and name not in only:
                continue
            if as_responder and agent.url != "self":
                report.lines.append(f"skip  {path}: agent {name!r} (a responder job calls no other agent)")
                continue
            url = router if agent.url == "self" else agent.url
            if url is None:
                report.lines.append(
                    f"skip  {path}: agent {name!r} is url: self (pass --router-url to check this job's "
                    "router)"
                )
                continue
            if (name, url) in reached:  # an agent named by several configs is reached once
                continue
            reached.add((name, url))
            frozen = not agent.trainable and agent.url != "self"
            jobs.append(check_engine(name, path, url, timeout, report, frozen, agent.adapter))
        await asyncio.gather(*jobs)
        await check_coordinator(path, settings, timeout, report)
        if tokenizers:
            from mrlx_plugin.core.tokenizer import load_tokenizer

            for name, agent in settings.agents.items():
                if agent.tokenizer and not (only and name not in only):
                    try:
                        await asyncio.to_thread(
                            load_tokenizer, agent.tokenizer, None, f"{path}: mrlx.agents.{name}.tokenizer"
                        )
                        report.ok(f"{path}: tokenizer of {name!r} loads")
                    except ConfigError as exc:
                        report.fail(str(exc))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mrlx check", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, help="a job's YAML (repeat for each job)")
    p.add_argument(
        "--router-url", action="append", default=[], help="the router of the job, in --config order"
    )
    p.add_argument(
        "--role",
        action="append",
        choices=ROLES,
        default=None,
        help="what each job runs, in --config order: the one initiator (runs the episodes) or a responder",
    )
    p.add_argument(
        "--agent",
        action="append",
        default=None,
        metavar="NAME",
        help="reach only this agent's URL (repeatable), e.g. to wait for a frozen agent's servers",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per URL")
    p.add_argument("--skip-tokenizers", action="store_true", help="do not load tokenizers")
    p.add_argument(
        "--offline", action="store_true", help="validate and cross-check the configs only; reach nothing"
    )
    p.add_argument(
        "--responder",
        action="store_true",
        help="the job runs mrlx_plugin.rollout.responder_rollout: reach only its router and the coordinator",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="repeat the checks until they pass or SECONDS have gone by (to gate a launch)",
    )
    ns = p.parse_args(argv)
    # The same bounds as the settings' seconds: `inf` or `nan` would wait forever or not at all.
    if not (math.isfinite(ns.timeout) and 0 < ns.timeout <= DAY_S):
        p.error(f"--timeout {ns.timeout:g}: expected seconds, more than 0 and at most {DAY_S} (a day)")
    if not (math.isfinite(ns.wait) and 0 <= ns.wait <= DAY_S):
        p.error(f"--wait {ns.wait:g}: expected seconds, 0 to {DAY_S} (a day)")
    if ns.role is not None and len(ns.role) != len(ns.config):
        p.error(f"give one --role per --config ({len(ns.config)} configs, {len(ns.role)} roles)")
    reports = []

    def passed() -> bool:
        reports.append(
            asyncio.run(
                run_checks(
                    ns.config,
                    ns.router_url,
                    ns.timeout,
                    not ns.skip_tokenizers,
                    offline=ns.offline,
                    responder=ns.responder,
                    roles=ns.role,
                    only=ns.agent,
                )
            )
        )
        problems = reports[-1].problems
        if problems and ns.wait > 0:
            print(
                f"mrlx check: {len(problems)} problem(s), first: {problems[0]}; checking again until "
                f"--wait {ns.wait:g} s runs out",
                file=sys.stderr,
                flush=True,
            )
        return not problems

    try:  # --wait gates a launch: the checks again every few seconds until they pass
        wait_until(passed, Deadline(ns.wait), what="mrlx check", every=Backoff(base_s=5.0, max_s=5.0))
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
