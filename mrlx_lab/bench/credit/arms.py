"""One arm of `mrlx bench credit`: its config, its engine and trainer run until its engine-call
budget is spent, and its record; the seed's warm-start, which every arm starts from; the arms of
a part one after another."""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import yaml

from mrlx_lab.bench.credit.settings import (
    AGENT,
    ARMS,
    GAME_STEP,
    MAX_NEW_TOKENS,
    MAX_RESPONSE,
    NIM_TRAIN,
    PARTS,
    TRAINER,
    WARMUP_EXAMPLES,
    arm_settings,
    arm_trainer,
)
from mrlx_lab.bench.credit.tasks import chain_sets, nim_prompt, warmup_data
from mrlx_plugin.core.values import JSON, JSONObject
from mrlx_plugin.local.trainer.records import read_rows

# What a part reads of an evaluation row (`value`), the line it prints for a metrics row (`show`),
# a probe of the policy an engine serves (url, model, options, seed), and what it is told of an
# arm's finished run (`done`: the arm, the run).
Value = Callable[[JSONObject], JSONObject]
Show = Callable[[JSONObject], "str | None"]
Probe = Callable[[str, Path, argparse.Namespace, int], JSONObject]
Done = Callable[[str, JSONObject], None]


def job_config(
    path: Path,
    run_id: str,
    model: Path,
    game: JSONObject,
    rewards: JSONObject,
    ns: argparse.Namespace,
    seed: int,
    part: str,
    trainer: JSONObject | None = None,
) -> Path:
    doc = {
        "mrlx": {
            "run_id": run_id,
            "system": "game",
            "agents": {
                AGENT: {
                    "url": "self",
                    "tokenizer": str(model),
                    "sampling": {"max_new_tokens": MAX_NEW_TOKENS[part], "temperature": 1.0},
                }
            },
            "game": game,
            "rewards": rewards,
            "engine": {"request_timeout_s": 300, "sampling_seed": seed},
            "trainer": {
                **TRAINER,
                "threads": ns.threads,
                "lr": ns.lr,
                "lr_min": ns.lr,
                "warmup_sft_steps": ns.warmup_steps,
                "ppo_epochs": ns.ppo_epochs,
                **(trainer or {}),
            },
        }
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_trainer(
    argv: list[str], log_path: Path, out: Path, label: str, ns: argparse.Namespace, show: Show | None = None
) -> list[JSONObject]:
    """Run one embedded trainer to its end, printing a line per evaluation; its metrics rows."""
    from mrlx_plugin.core import processes

    job = None
    try:
        with open(log_path, "ab") as log:
            job = processes.start(
                [sys.executable, "-m", "mrlx_plugin.local.trainer", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        shown, t0 = 0, time.monotonic()
        while True:
            done = job.poll() is not None
            rows = read_rows(out / "metrics.jsonl", growing=True)
            if show is not None and not ns.quiet:
                for row in rows[shown:]:
                    line = show(row)
                    if line:
                        print(f"  {label:<22} {line}  ({time.monotonic() - t0:.0f} s)", flush=True)
                shown = len(rows)
            if done:
                break
            time.sleep(1.0)
    finally:
        if job is not None:
            processes.stop(job, timeout=20)
    if job.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the trainer of {label} failed (exit {job.returncode}); {log_path}:\n{tail}")
    return read_rows(out / "metrics.jsonl")


def train_prompts(part: str, ns: argparse.Namespace, seed: int) -> list[tuple[str, str]]:
    """The prompts `part`'s arms train on, for `seed`."""
    from mrlx_plugin.local.trainer.tasks import kuhn_prompts

    if part == "chain":
        return chain_sets(ns, seed)[0]
    if part == "nim":  # the trained starting piles only
        rng = random.Random(seed)
        return [nim_prompt(rng.choice(NIM_TRAIN)) for _ in range(256)]
    return kuhn_prompts(256, seed=seed)


def warm_unit(ns: argparse.Namespace, work: Path, base: Path) -> JSONObject:
    """The seed's format-only warm-start, once for every part it runs: supervised steps on the
    parts' warm-start conversations, mixed (WARMUP_EXAMPLES of each). Every arm starts from it."""
    import shutil

    seed = ns.unit_seed
    parts = [p for p in PARTS if any(ARMS[a] == p for a in ns.arms)]
    lines: list[str] = []
    for part in parts:
        prompts = train_prompts(part, ns, seed)
        data = warmup_data(work / f"warmup-{part}.jsonl", part, prompts, WARMUP_EXAMPLES, seed)
        lines += data.read_text().splitlines()
    random.Random(seed).shuffle(lines)
    data = work / "warmup.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    game = {"name": "nim", "seats": [AGENT, AGENT]}  # any: the warm-start plays no game
    config = job_config(work / "warm.yaml", f"bench-credit-warm-{seed}", base, game, {}, ns, seed, "nim")
    out = work / "warm_start"
    shutil.rmtree(out, ignore_errors=True)  # a measurement starts from scratch
    out.mkdir(parents=True)
    argv = [
        *("--config", str(config), "--model", str(base), "--router-url", "http://127.0.0.1:9"),
        *("--num-rollout", "0", "--warmup-data", str(data), "--out", str(out), "--seed", str(seed)),
    ]
    if not ns.quiet:
        what = f"{ns.warmup_steps} format-only steps ({', '.join(parts)})"
        print(f"  seed {seed} {'warm-start':<17} {what}", flush=True)
    started = time.monotonic()
    rows = run_trainer(argv, work / "logs" / "trainer-warm-start.log", out, f"seed {seed} warm-start", ns)
    model = out / "warm_start" if (out / "warm_start" / "config.json").exists() else base  # --warmup-steps 0
    loss = next((r for r in rows if "warm_start/steps" in r), {})
    return {
        "model": str(model),
        "parts": parts,
        "examples": len(lines),
        "steps": loss.get("warm_start/steps", 0),
        "loss_first": loss.get("warm_start/loss_first"),
        "loss_last": loss.get("warm_start/loss_last"),
        "wall_time_s": time.monotonic() - started,
    }


def warm_model(ns: argparse.Namespace) -> Path:
    """The seed's warm-started model (its `warm` unit ran first)."""
    done = Path(ns.out) / f"seed_{ns.unit_seed}" / "warm" / "result.json"
    return Path(json.loads(done.read_text())["model"])


def run_arm(
    arm: str,
    work: Path,
    model: Path,
    config: Path,
    *,
    prompts: Path,
    eval_args: list[str],
    budget: int,
    episodes_per_step: tuple[int, int],
    ns: argparse.Namespace,
    show: Show | None,
    probe: Probe | None = None,
    snapshots: int = 0,
) -> JSONObject:
    """One arm from `model`: its engine and its trainer, until `budget` engine calls are spent;
    the probe (if any) of the engine before and after training, and with `snapshots`, of that
    many policies evenly spaced over training (`probe_snapshots`). Its metrics rows and more."""
    import shutil

    from mrlx_plugin.core.processes import stop_all
    from mrlx_plugin.local.services import start_engine

    shutil.rmtree(work, ignore_errors=True)  # a measurement starts from scratch
    logs = work / "logs"
    logs.mkdir(parents=True)
    seed, (per_step, per_prompt) = ns.unit_seed, episodes_per_step
    started = time.monotonic()
    out: JSONObject = {}
    with ExitStack() as stack:
        engine = start_engine(
            model,
            log_dir=logs,
            name="engine",
            threads=ns.threads,
            extra=["--seed", str(seed), "--max-batch", "256"],
        )
        stack.callback(lambda: stop_all([engine.proc], timeout=10))
        if probe is not None:
            out["probe_before"] = probe(engine.url, model, ns, seed)
        # Every episode costs at least one call: the most steps the budget can take (a cap; the
        # trainer stops when the budget is spent).
        most_steps = math.ceil(budget / per_step) + 1
        argv = [
            "--config",
            str(config),
            "--model",
            str(model),
            "--engine-url",
            engine.url,
            "--router-url",
            engine.url,
            "--num-rollout",
            str(most_steps),
            "--engine-call-budget",
            str(budget),
            "--prompt-data",
            str(prompts),
            "--rollout-batch-size",
            str(per_step // per_prompt),
            "--n-samples-per-prompt",
            str(per_prompt),
            "--rollout-max-response-len",
            str(MAX_RESPONSE),
            "--out",
            str(work / "trainer"),
            "--seed",
            str(seed),
            *eval_args,
        ]
        if snapshots:  # every step's checkpoint, for the snapshots probed after training
            argv += ["--keep-checkpoints", str(most_steps + 1)]
        rows = run_trainer(argv, logs / "trainer.log", work / "trainer", f"seed {seed} {arm}", ns, show)
        if probe is not None:
            out["probe_after"] = probe(engine.url, model, ns, seed)
            if snapshots:
                out["snapshots"] = probe_snapshots(
                    engine.url, model, work / "trainer", out, snapshots, probe, ns
                )
    out["wall_time_s"] = time.monotonic() - started
    return out | {"rows": rows}


def probe_snapshots(
    url: str, model: Path, trainer_out: Path, run: JSONObject, n: int, probe: Probe, ns: argparse.Namespace
) -> list[JSONObject]:
    """The probes of `n` policies evenly spaced in training steps, the start and the last
    included (`run`'s probe_before and probe_after): each other one's checkpoint is loaded into
    the engine at `url` and probed (its own sampling seed). The checkpoints are then removed.
    [{"after_steps": t, **probe}], t = 0 .. the steps trained."""
    import shutil

    from mrlx_plugin.local.trainer.weights import push_weights

    found = sorted(p for p in (trainer_out / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    last = len(found)  # checkpoint step_{i} holds the policy after i + 1 steps
    spots = sorted({round(j * last / max(1, n - 1)) for j in range(n)})
    out: list[JSONObject] = []
    for t in spots:
        if t == 0:
            got = run["probe_before"]
        elif t == last:
            got = run["probe_after"]
        else:
            push_weights([url], found[t - 1], version=t)
            got = probe(url, model, ns, ns.unit_seed * 1000 + t)
        out.append({"after_steps": t, **got})
    shutil.rmtree(trainer_out / "checkpoints", ignore_errors=True)  # a step's weights each: large
    return out


def arm_record(arm: str, run: JSONObject, value: Value, ns: argparse.Namespace, **extra: JSON) -> JSONObject:
    """What one arm of one seed reports: calls, counts, the evaluation curve (`value(row)` per
    evaluation row), probes, times."""
    rows = run.pop("rows")
    steps = [r for r in rows if r.get("step", -1) >= 0]
    curve, calls = [], 0.0
    for row in rows:
        if row.get("step", -1) >= 0:
            calls += row.get("engine_calls") or 0.0
        if any(k.startswith("eval/") and k.endswith("/episodes") for k in row):
            curve.append({"after_steps": row["step"] + 1, "engine_calls": calls, **value(row)})
    rewards, game = arm_settings(arm, ns)
    return {
        "arm": arm,
        "seed": ns.unit_seed,
        "rewards": rewards,
        "game": game,
        "trainer": arm_trainer(arm, ns),
        "steps": len(steps),
        "engine_calls": sum(r.get("engine_calls") or 0.0 for r in steps),
        "engine_calls_per_step": [r.get("engine_calls") for r in steps],
        "episodes": sum(r.get("multi_agent/episodes") or 0 for r in steps),
        "samples_all": sum(r.get("samples", 0) for r in steps),
        "samples_trained": sum(r.get("samples_trained", 0) for r in steps),
        "tokens_trained": sum(r.get("tokens_trained", 0) for r in steps),
        "branch_candidates_per_episode": [r.get("credit/branch_candidates") for r in steps],
        "curve": curve,
        "before": curve[0] if curve and curve[0]["after_steps"] == 0 else None,
        "after": curve[-1] if curve else None,
        "rollout_s": sum(r.get("rollout_s", 0.0) for r in steps),
        "train_s": sum(r.get("train_s", 0.0) for r in steps),
        "eval_s": sum(
            v for r in rows for k, v in r.items() if k.startswith("eval/") and k.endswith("/seconds")
        ),
        **extra,
        **run,
    }


def sizes(arm: str, ns: argparse.Namespace) -> tuple[int, int]:
    """(episodes per step, episodes per prompt): the options' for the chain, GAME_STEP for the
    games (a game's episode is many calls: fewer episodes, more steps). A tree arm spends `branch`
    calls on a turn, so it runs `branch` times fewer episodes per prompt, for about the calls per
    step of the others."""
    prompts, per_prompt = (
        (ns.prompts_per_step, ns.samples_per_prompt) if ARMS[arm] == "chain" else GAME_STEP[ns.quick]
    )
    if arm_settings(arm, ns)[0].get("branch", 1) > 1:
        per_prompt //= ns.branch
    return prompts * per_prompt, per_prompt


def run_id_of(part: str, ns: argparse.Namespace) -> str:
    """The run id of every arm of `part` of the seed: one per seed, so the arms draw the same
    sampling seeds."""
    return f"bench-credit-{part}-{ns.unit_seed}"


def run_arms(
    part: str,
    ns: argparse.Namespace,
    work: Path,
    game: JSONObject,
    prompts: Path,
    eval_args: list[str],
    *,
    budget: int,
    show: Show | None,
    value: Value,
    probe: Probe | None = None,
    done: Done | None = None,
    snapshots: int = 0,
) -> JSONObject:
    """Every arm of `part`, one after another from the seed's warm-started model: its config (the
    part's game with the arm's settings), its run until `budget` engine calls, its record.
    `done(arm, run)` is told of each finished run."""
    run_id, warm = run_id_of(part, ns), warm_model(ns)
    arms = {}
    for arm in (a for a in ns.arms if ARMS[a] == part):
        rewards, extra = arm_settings(arm, ns)
        config = job_config(
            work / f"{arm}.yaml",
            run_id,
            warm,
            {**game, **extra},
            rewards,
            ns,
            ns.unit_seed,
            part,
            arm_trainer(arm, ns),
        )
        per_step = sizes(arm, ns)
        run = run_arm(
            arm,
            work / arm,
            warm,
            config,
            prompts=prompts,
            eval_args=eval_args,
            budget=budget,
            episodes_per_step=per_step,
            ns=ns,
            show=show,
            probe=probe,
            snapshots=snapshots,
        )
        if done is not None:
            done(arm, run)
        arms[arm] = arm_record(arm, run, value, ns, budget=budget, episodes_per_step=per_step[0])
    return arms
