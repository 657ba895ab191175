"""`mrlx bench credit`: turn-level credit, tree sampling and the ways to play a game, measured on
the CPU with the demo's small models, every arm from the same warm-started model and seed.

1. Credit on a multi-turn task, the `chain` game ("Start at 2. ... Now +3.", then "Now +1.", ...:
   each turn the model gives the running value as \\boxed{N}; a right value earns 1 and goes on,
   a wrong one ends the episode; the outcome is 1 when every step was right). Three arms with the
   same budget of engine calls per step: `rewards.credit: episode`, `credit: turn` (discount
   `--gamma`), and `credit: turn` with `branch: K` (tree sampling: K calls per turn, so the arm
   runs K times fewer episodes per step). Each arm is evaluated on a fixed held-out set of chains
   (whole episodes through the plugin's generate in evaluation mode) before training and every
   `--eval-interval` steps: steps to reach `--threshold`, the final success rate, the engine
   calls spent, the wall time.
2. The shipped CPU game, `nim`: self-play (one model in both seats) against training with a frozen
   copy (a second engine serving the starting weights, `trainable: false`), each evaluated as the
   win rate against the game's scripted random player (`script:random`) on every starting
   position (the positions the arms train on: only the opponent is new), in both seat orders,
   before and after training.

Each arm is one embedded engine (two for the frozen copy) and one embedded trainer
(`python -m mrlx_plugin.local.trainer`, calling the plugin's rollout functions as slime does);
the arms run one after another, so each has the machine to itself. The warm-start (supervised,
the answer FORMAT only: random numbers, or random legal moves, never the right answer) is run
once per task and every arm of the task starts from its result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from mrlx_plugin.bench.report import write_report

AGENT, FROZEN = "player", "frozen"
CHAIN_ARMS = ("episode", "turn", "turn+branch")
NIM_ARMS = ("self-play", "frozen copy")
NIM_SEATS = ("first", "second")
VS_RANDOM = "script:random"
# A chain episode is a success when every step was right: its one seat (`solver`) "wins".
SUCCESS = "eval/eval/game/win_rate/solver"

# The arms run one at a time, and an arm's engine and trainer take turns (the trainer waits for
# the rollout, the engine idles while the trainer trains): each may use both cores.
THREADS = 2
# Settings that are not options: the demo's (docs/local.md), which a small model learns with.
TRAINER = {
    "lr_warmup_steps": 10,
    "lr_decay_style": "cosine",
    "kl_coef": 0.1,
    "adam_eps": 1.0e-5,
    "warmup_sft_lr": 1.0e-3,
    "micro_batch_size": 64,
    "threads": THREADS,
}
MAX_NEW_TOKENS = 10  # per turn: "\\boxed{12}" and the end of the turn
MAX_RESPONSE = 160  # per transcript: every turn of a seat and the messages between them


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrlx bench credit", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default="runs/bench-credit/credit.json", help="the JSON report (the plot goes beside it)"
    )
    p.add_argument(
        "--workdir", default=None, help="models, logs, configs, checkpoints (default: the --out folder)"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps of each chain arm (default 180; --quick 2)"
    )
    p.add_argument(
        "--nim-steps", type=int, default=None, help="training steps of each nim arm (default 30; --quick 2)"
    )
    p.add_argument(
        "--prompts-per-step", type=int, default=None, help="--rollout-batch-size (default 8; --quick 2)"
    )
    p.add_argument(
        "--samples-per-prompt",
        type=int,
        default=None,
        help="--n-samples-per-prompt of the arms without tree sampling (default 8; --quick 4); the tree "
        "sampling arm runs this / --branch, for the same engine calls per step",
    )
    p.add_argument("--chain-length", type=int, default=2, help="steps of each chain (turns per episode)")
    p.add_argument("--chain-max-start", type=int, default=2, help="chains start at 0 to this")
    p.add_argument("--chain-max-step", type=int, default=2, help="each step adds (or takes) 1 to this")
    p.add_argument("--chain-ops", default="+", help="the operations of the steps, from + - * (e.g. '+-')")
    p.add_argument("--gamma", type=float, default=0.9, help="rewards.gamma of the turn-credit arms")
    p.add_argument("--branch", type=int, default=4, help="rewards.branch of the tree-sampling arm")
    p.add_argument(
        "--threshold", type=float, default=0.5, help="held-out success rate the chain arms race to"
    )
    p.add_argument(
        "--eval-interval", type=int, default=None, help="evaluate every N steps (default 10; --quick 1)"
    )
    p.add_argument(
        "--eval-prompts",
        type=int,
        default=None,
        help="held-out chains, at most a quarter of the distinct chains (default 48; --quick 2)",
    )
    p.add_argument(
        "--eval-samples",
        type=int,
        default=None,
        help="evaluation episodes per held-out prompt (default 16 per chain, 8 per nim position and "
        "seat order; --quick 1)",
    )
    p.add_argument(
        "--preset",
        default=None,
        help="model size, mrlx_plugin.local.model presets (default small; --quick tiny)",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--warmup-steps", type=int, default=None, help="format-only supervised steps (default 80; --quick 2)"
    )
    p.add_argument("--only", choices=("chain", "nim"), default=None, help="run one of the two parts")
    p.add_argument(
        "--arms",
        default=None,
        help=f"comma-separated arms to run (default: all: {', '.join(CHAIN_ARMS + NIM_ARMS)})",
    )
    p.add_argument(
        "--ppo-epochs", type=int, default=2, help="mrlx.trainer.ppo_epochs: optimizer steps per step"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick", action="store_true", help="tiny settings (seconds per arm; the test's smoke run)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def settle(ns: argparse.Namespace) -> argparse.Namespace:
    """Fill in the defaults that depend on --quick, and check the budget can be matched."""
    quick = ns.quick
    defaults = {
        "steps": (180, 2),
        "nim_steps": (30, 2),
        "prompts_per_step": (8, 2),
        "samples_per_prompt": (8, 4),
        "eval_interval": (10, 1),
        "eval_prompts": (48, 2),
        "eval_samples": (None, 1),
        "preset": ("small", "tiny"),
        "warmup_steps": (80, 2),
    }
    for key, (full, small) in defaults.items():
        if getattr(ns, key) is None:
            setattr(ns, key, small if quick else full)
    from mrlx_plugin.core.config import ConfigError

    if ns.branch < 2:
        raise ConfigError(
            f"--branch: got {ns.branch}; the tree-sampling arm needs at least 2 candidates per turn"
        )
    if ns.samples_per_prompt % ns.branch and ns.prompts_per_step % ns.branch:
        raise ConfigError(
            f"--samples-per-prompt {ns.samples_per_prompt} and --prompts-per-step {ns.prompts_per_step}: the "
            f"tree-sampling arm runs {ns.branch} times fewer episodes per step (each turn costs {ns.branch} "
            "engine "
            f"calls); make one of them a multiple of --branch"
        )
    known = CHAIN_ARMS + NIM_ARMS
    ns.arms = [a.strip() for a in ns.arms.split(",") if a.strip()] if ns.arms else list(known)
    for arm in ns.arms:
        if arm not in known:
            raise ConfigError(f"--arms: no arm {arm!r}; the arms are {', '.join(known)}")
    for key in (
        "steps",
        "nim_steps",
        "prompts_per_step",
        "samples_per_prompt",
        "eval_interval",
        "eval_prompts",
        "chain_length",
    ):
        if getattr(ns, key) < 1:
            raise ConfigError(f"--{key.replace('_', '-')}: got {getattr(ns, key)}; expected at least 1")
    return ns


# ----------------------------------------------------------------------------------------------
# The tasks: prompts, held-out sets and format-only warm-start data
# ----------------------------------------------------------------------------------------------


def chain_sets(ns: argparse.Namespace) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Training chains and a held-out set of other chains (no chain in both).

    A chain is held out only when each of its steps (the running value before it, the operation,
    the turn it comes at) is also a step of some training chain: the held-out chains are new
    combinations of steps the training chains teach, so they measure the skill and not a guess
    at a step never trained. At most a quarter of the distinct chains are held out."""
    from mrlx_plugin.local.tasks import chain_prompts
    from mrlx_plugin.systems.games import apply_step

    def draw(n: int, seed: int) -> list[tuple[str, str]]:
        return chain_prompts(
            n,
            seed=seed,
            steps=ns.chain_length,
            max_start=ns.chain_max_start,
            max_step=ns.chain_max_step,
            ops=ns.chain_ops,
        )

    def steps_of(prompt: str) -> set[tuple[int, int, str]]:
        value, *ops = prompt.split(":")[1].split()
        out, v = set(), int(value)
        for turn, op in enumerate(ops):
            out.add((turn, v, op))
            v = apply_step(v, op)
        return out

    distinct = dict(draw(4096, ns.seed + 7919))
    order = sorted(distinct)
    random.Random(ns.seed).shuffle(order)
    limit = min(ns.eval_prompts, max(1, len(order) // 4))
    held: list[str] = []
    for chain in order:
        if len(held) == limit:
            break
        rest = set().union(*(steps_of(c) for c in order if c != chain and c not in held))
        if all(steps_of(c) <= rest for c in [*held, chain]):
            held.append(chain)
    if not held:
        raise RuntimeError(
            f"no chain of {len(order)} can be held out with its steps still trained; allow more "
            "chains (--chain-max-start, --chain-max-step, --chain-ops)"
        )
    train = [(p, lab) for p, lab in draw(4096, ns.seed) if p not in held][:256]
    return train, sorted((p, distinct[p]) for p in held)


def nim_sets(ns: argparse.Namespace) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Training games (3 to 9 stones) and the fixed starting positions of the evaluation (each
    once; --eval-samples episodes of each, per seat order)."""
    from mrlx_plugin.local.tasks import nim_prompts

    positions = [(f"Nim: {n} stones", str(n % 4)) for n in range(3, 10)]
    return nim_prompts(256, seed=ns.seed), positions[: max(ns.eval_prompts, 1)] if ns.quick else positions


def chain_warmup(path: Path, prompts: list[tuple[str, str]], n: int, seed: int) -> Path:
    """Warm-start conversations of the chain game, as its transcripts render them: the game's
    own observations, earlier turns answered with the running value (a game only goes on after a
    right one), and the turn to learn answered with a RANDOM \\boxed{N}: the format, not the sum."""
    from mrlx_plugin.systems.games import BUILT_IN_GAMES

    game, rng = BUILT_IN_GAMES["chain"], random.Random(seed)
    top = max(int(label) for _, label in prompts)
    options = {"max_steps": max(len(p.split()) - 2 for p, _ in prompts)}
    with path.open("w") as f:
        for _ in range(n):
            prompt, label = rng.choice(prompts)
            state = game.start(prompt, label, rng, options)
            messages: list[dict[str, str]] = []
            for _ in range(rng.randint(1, len(state.steps))):
                if messages:
                    state = game.play(state, 0, game.right_value(state))
                messages += [
                    {"role": "user", "content": game.observation(state, 0)},
                    {"role": "assistant", "content": f"\\boxed{{{game.right_value(state)}}}"},
                ]
            messages[-1]["content"] = f"\\boxed{{{rng.randint(0, top)}}}"
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def nim_warmup(path: Path, prompts: list[tuple[str, str]], n: int, seed: int) -> Path:
    """Warm-start conversations of one nim seat, as the game system renders them (the other
    seat's moves told, then the observation), every move a RANDOM legal one: the warm-started
    model plays about like the scripted random player, and learns the game by RL."""
    from mrlx_plugin.systems.games import BUILT_IN_GAMES

    game, rng = BUILT_IN_GAMES["nim"], random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            prompt, label = rng.choice(prompts)
            state = game.start(prompt, label, rng, {})
            seat = rng.randint(0, 1)
            messages: list[dict[str, str]] = []
            unread: list[str] = []
            while game.to_move(state) is not None:
                mover = game.to_move(state)
                move = rng.choice(game.legal_moves(state, mover))
                if mover == seat:
                    messages += [
                        {"role": "user", "content": " ".join([*unread, game.observation(state, seat)])},
                        {"role": "assistant", "content": f"\\boxed{{{move}}}"},
                    ]
                    unread = []
                else:
                    unread.append(game.describe_move(state, mover, move))
                state = game.play(state, mover, move)
            if not messages:
                continue
            cut = 2 * rng.randint(1, len(messages) // 2)
            f.write(json.dumps({"messages": messages[:cut]}) + "\n")
    return path


def write_prompts(path: Path, prompts: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "label": lab}) + "\n" for p, lab in prompts))
    return path


# ----------------------------------------------------------------------------------------------
# One arm: its engines, its config, its trainer
# ----------------------------------------------------------------------------------------------


def job_config(
    path: Path,
    run_id: str,
    agents: dict[str, dict[str, Any]],
    game: dict[str, Any],
    rewards: dict[str, Any],
    ns: argparse.Namespace,
) -> Path:
    doc = {
        "mrlx": {
            "run_id": run_id,
            "system": "game",
            "agents": agents,
            "game": game,
            "rewards": rewards,
            "engine": {"request_timeout_s": 120, "sampling_seed": ns.seed},
            "trainer": {
                **TRAINER,
                "lr": ns.lr,
                "lr_min": ns.lr / 10,
                "warmup_sft_steps": ns.warmup_steps,
                "ppo_epochs": ns.ppo_epochs,
            },
        }
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def agent_entry(model: Path, url: str = "self", trainable: bool = True) -> dict[str, Any]:
    return {
        "url": url,
        "tokenizer": str(model),
        "trainable": trainable,
        "sampling": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0},
    }


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_trainer(
    argv: list[str], log_path: Path, out: Path, label: str, ns: argparse.Namespace, show: Any = None
) -> list[dict[str, Any]]:
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
            rows = _rows(out / "metrics.jsonl")
            if show is not None and not ns.quiet:
                for row in rows[shown:]:
                    line = show(row)
                    if line:
                        print(f"  {label:<24} {line}  ({time.monotonic() - t0:.0f} s)", flush=True)
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
    return _rows(out / "metrics.jsonl")


def warm_start(
    task: str, work: Path, base_model: Path, config: Path, data: Path, ns: argparse.Namespace
) -> Path:
    """The format-only warm-start of `task`, once: every arm of the task starts from its result."""
    import hashlib
    import shutil

    out = work / "warm_start"
    # Done before with the same model, data and settings: reused (it is deterministic).
    stamp = json.dumps(
        {
            "model": str(base_model),
            "steps": ns.warmup_steps,
            "seed": ns.seed,
            "lr": ns.lr,
            "data": hashlib.sha256(data.read_bytes()).hexdigest(),
        }
    )
    if (
        (out / "warm_start" / "config.json").exists()
        and (out / "done").exists()
        and (out / "done").read_text() == stamp
    ):
        return out / "warm_start"

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    argv = [
        "--config",
        str(config),
        "--model",
        str(base_model),
        "--router-url",
        "http://127.0.0.1:9",
        "--num-rollout",
        "0",
        "--warmup-data",
        str(data),
        "--out",
        str(out),
        "--seed",
        str(ns.seed),
    ]
    if not ns.quiet:
        print(f"  {task:<24} warm-start: {ns.warmup_steps} format-only steps", flush=True)
    run_trainer(argv, work / "logs" / "trainer-warm-start.log", out, f"{task} warm-start", ns)
    if not (out / "warm_start" / "config.json").exists():  # --warmup-steps 0: the base model as it is
        return base_model
    (out / "done").write_text(stamp)
    return out / "warm_start"


def run_arm(
    label: str,
    work: Path,
    model: Path,
    config: Path,
    *,
    frozen: bool,
    prompts: Path,
    eval_prompts: Path,
    eval_configs: list[str],
    steps: int,
    prompts_per_step: int,
    samples_per_prompt: int,
    eval_samples: int,
    ns: argparse.Namespace,
    show: Any,
) -> tuple[list[dict[str, Any]], float]:
    """One arm from `model`: its engine (and the frozen copy's), its trainer; (metrics rows, wall s)."""
    import shutil

    from mrlx_plugin.core.processes import stop_all
    from mrlx_plugin.local.processes import start_engine

    shutil.rmtree(work, ignore_errors=True)  # a measurement starts from scratch
    logs = work / "logs"
    logs.mkdir(parents=True)
    started = time.monotonic()
    engines = []
    with ExitStack() as stack:
        stack.callback(lambda: stop_all([e.proc for e in engines], timeout=10))
        extra = ["--seed", str(ns.seed), "--max-batch", "256"]
        # Two engines generate at once (the frozen copy's turns alternate with the player's in
        # every episode): one core each, or their threads would fight over the two.
        threads = 1 if frozen else THREADS
        engines.append(start_engine(model, log_dir=logs, name="engine", threads=threads, extra=extra))
        url = engines[0].url
        text = config.read_text()
        if frozen:
            engines.append(
                start_engine(model, log_dir=logs, name="engine-frozen", threads=threads, extra=extra)
            )
            text = text.replace("FROZEN_URL", engines[1].url)
        job = work / "job.yaml"
        job.write_text(text)
        argv = [
            "--config",
            str(job),
            "--model",
            str(model),
            "--engine-url",
            url,
            "--router-url",
            url,
            "--num-rollout",
            str(steps),
            "--prompt-data",
            str(prompts),
            "--rollout-batch-size",
            str(prompts_per_step),
            "--n-samples-per-prompt",
            str(samples_per_prompt),
            "--rollout-max-response-len",
            str(MAX_RESPONSE),
            "--out",
            str(work / "trainer"),
            "--seed",
            str(ns.seed),
            "--eval-interval",
            str(ns.eval_interval),
            "--eval-prompt-data",
            str(eval_prompts),
            "--n-samples-per-eval-prompt",
            str(eval_samples),
        ]
        for spec in eval_configs:
            argv += ["--eval-config", spec]
        rows = run_trainer(argv, logs / "trainer.log", work / "trainer", label, ns, show)
    return rows, time.monotonic() - started


# ----------------------------------------------------------------------------------------------
# Reading an arm's metrics
# ----------------------------------------------------------------------------------------------


def engine_calls(row: dict[str, Any]) -> float:
    """Engine calls of one training step: every model turn of its episodes (on every engine),
    plus the tree-sampling candidates the episodes did not go on from."""
    episodes = row.get("multi_agent/episodes") or 0.0
    return episodes * (
        (row.get("multi_agent/avg_turns") or 0.0) + (row.get("credit/branch_candidates") or 0.0)
    )


def curve(rows: list[dict[str, Any]], key: Any) -> list[dict[str, Any]]:
    """The evaluations of a run: after how many steps, the value `key(row)`, engine calls so far."""
    out, calls = [], 0.0
    for row in rows:
        if row.get("step", -1) >= 0:
            calls += engine_calls(row)
        if any(k.startswith("eval/") and k.endswith("/episodes") for k in row):
            out.append({"after_steps": row["step"] + 1, "value": key(row), "engine_calls": calls})
    return out


def steps_to(points: list[dict[str, Any]], threshold: float) -> dict[str, Any] | None:
    for p in points:
        if p["value"] is not None and p["value"] >= threshold:
            return p
    return None


def arm_summary(rows: list[dict[str, Any]], wall: float, value: Any, train_key: str) -> dict[str, Any]:
    steps = [r for r in rows if r.get("step", -1) >= 0]
    calls = [engine_calls(r) for r in steps]
    evals = [sum(v for k, v in r.items() if k.startswith("eval/") and k.endswith("/seconds")) for r in rows]
    points = curve(rows, value)
    return {
        "steps": len(steps),
        "engine_calls": sum(calls),
        "engine_calls_per_step": calls,
        "episodes": sum(r.get("multi_agent/episodes") or 0 for r in steps),
        "samples_trained": sum(r.get("samples", 0) for r in steps),
        "branch_candidates_per_episode": [r.get("credit/branch_candidates") for r in steps],
        "train_rate_per_step": [r.get(train_key) for r in steps],
        "eval": points,
        "before": points[0]["value"] if points and points[0]["after_steps"] == 0 else None,
        "after": points[-1]["value"] if points else None,
        "wall_time_s": wall,
        "eval_time_s": sum(evals),
        "rollout_s": sum(r.get("rollout_s", 0.0) for r in steps),
        "train_s": sum(r.get("train_s", 0.0) for r in steps),
    }


# ----------------------------------------------------------------------------------------------
# The two parts
# ----------------------------------------------------------------------------------------------


def chain_part(ns: argparse.Namespace, root: Path, base_model: Path) -> dict[str, Any]:
    work = root / "chain"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    train, held = chain_sets(ns)
    prompts, eval_prompts = (
        write_prompts(work / "prompts.jsonl", train),
        write_prompts(work / "heldout.jsonl", held),
    )
    game = {
        "name": "chain",
        "seats": [AGENT],
        "max_turns": ns.chain_length,
        "options": {"max_steps": ns.chain_length},
    }
    rewards = {
        "episode": {"credit": "episode"},
        "turn": {"credit": "turn", "gamma": ns.gamma},
        "turn+branch": {"credit": "turn", "gamma": ns.gamma, "branch": ns.branch, "branch_pick": "best"},
    }
    warm = warm_start(
        "chain",
        work,
        base_model,
        job_config(
            work / "warm.yaml",
            "bench-credit-chain",
            {AGENT: agent_entry(base_model)},
            game,
            rewards["episode"],
            ns,
        ),
        chain_warmup(work / "warmup.jsonl", train, 2000, ns.seed),
        ns,
    )
    # The same engine calls per step in every arm: tree sampling spends `branch` calls on each
    # turn, so its arm runs `branch` times fewer episodes (fewer per prompt when that divides).
    per_prompt, groups = ns.samples_per_prompt, ns.prompts_per_step
    shrink = (
        (per_prompt // ns.branch, groups)
        if per_prompt % ns.branch == 0
        else (per_prompt, groups // ns.branch)
    )
    eval_samples = ns.eval_samples or 16
    arms: dict[str, Any] = {}
    for arm in (a for a in CHAIN_ARMS if a in ns.arms):
        s, p = shrink if arm == "turn+branch" else (per_prompt, groups)
        # One run id for every arm: the sampling seeds come from it and the episode ids, so the arms
        # draw the same random numbers (the evaluations before training are the same episodes).
        config = job_config(
            work / f"{arm}.yaml", "bench-credit-chain", {AGENT: agent_entry(warm)}, game, rewards[arm], ns
        )

        def show(row: dict[str, Any]) -> str | None:
            if "eval/eval/episodes" not in row:
                return None
            rate = row.get(SUCCESS) or 0.0
            return f"after {row['step'] + 1:>3} steps: held-out success {rate:.3f}"

        rows, wall = run_arm(
            f"chain {arm}",
            work / arm,
            warm,
            config,
            frozen=False,
            prompts=prompts,
            eval_prompts=eval_prompts,
            eval_configs=[],
            steps=ns.steps,
            prompts_per_step=p,
            samples_per_prompt=s,
            eval_samples=eval_samples,
            ns=ns,
            show=show,
        )
        summary = arm_summary(rows, wall, lambda r: r.get(SUCCESS) or 0.0, "game/win_rate/solver")
        reached = steps_to(summary["eval"], ns.threshold)
        summary |= {
            "rewards": rewards[arm],
            "prompts_per_step": p,
            "samples_per_prompt": s,
            "episodes_per_step": p * s,
            "engine_calls_per_step_at_most": p
            * s
            * ns.chain_length
            * (ns.branch if arm == "turn+branch" else 1),
            "steps_to_threshold": reached["after_steps"] if reached else None,
            "engine_calls_to_threshold": reached["engine_calls"] if reached else None,
            "held_out_episodes": len(held) * eval_samples,
        }
        arms[arm] = summary
    # The budget above is the same bound per step; the calls actually spent differ (an episode
    # stops at its first wrong step, and best-of-K candidates go on more often). So the arms are
    # also compared at the same engine calls: the smallest total any arm spent.
    budget = min((a["engine_calls"] for a in arms.values()), default=0.0)
    for arm in arms.values():
        within = [p for p in arm["eval"] if p["engine_calls"] <= budget]
        arm["at_equal_calls"] = {
            "engine_calls": budget,
            "after_steps": within[-1]["after_steps"] if within else None,
            "success": within[-1]["value"] if within else None,
        }
    return {
        "equal_calls": budget,
        "task": (
            f"chains of {ns.chain_length} steps (game `chain`; start 0-{ns.chain_max_start}, steps "
            f"{'/'.join(ns.chain_ops)} 1 to {ns.chain_max_step}); success = every step right"
        ),
        "threshold": ns.threshold,
        "held_out_prompts": len(held),
        "budget": (
            f"every arm {ns.steps} steps; without tree sampling {groups} prompts x {per_prompt} episodes per "
            "step "
            f"(1 engine call per turn); with branch {ns.branch}, {shrink[1]} x {shrink[0]} episodes per step "
            f"({ns.branch} calls per turn): the same engine calls per step at most"
        ),
        "warm_start": str(warm),
        "arms": arms,
    }


def nim_part(ns: argparse.Namespace, root: Path, base_model: Path) -> dict[str, Any]:
    work = root / "nim"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    train, positions = nim_sets(ns)
    prompts, eval_prompts = (
        write_prompts(work / "prompts.jsonl", train),
        write_prompts(work / "positions.jsonl", positions),
    )
    game = {"name": "nim", "options": {"max_take": 3, "max_stones": 9}}
    rewards = {"credit": "episode"}
    warm = warm_start(
        "nim",
        work,
        base_model,
        job_config(
            work / "warm.yaml",
            "bench-credit-nim",
            {AGENT: agent_entry(base_model)},
            {**game, "seats": [AGENT, AGENT]},
            rewards,
            ns,
        ),
        nim_warmup(work / "warmup.jsonl", train, 2000, ns.seed),
        ns,
    )
    # Evaluation: the trained model against the scripted random player, in each seat order.
    eval_configs = []
    for name, seats in (("first", [AGENT, VS_RANDOM]), ("second", [VS_RANDOM, AGENT])):
        path = job_config(
            work / f"eval-{name}.yaml",
            f"bench-credit-nim-eval-{name}",
            {AGENT: agent_entry(warm)},
            {**game, "seats": seats},
            rewards,
            ns,
        )
        eval_configs.append(f"{name}={path}")
    eval_samples = ns.eval_samples or 8
    key = f"game/win_rate/vs/{VS_RANDOM}"

    def win_rate(row: dict[str, Any]) -> float | None:
        rates = [row.get(f"eval/{seat}/{key}") for seat in NIM_SEATS]
        return sum(r or 0.0 for r in rates) / len(rates)

    arms: dict[str, Any] = {}
    for arm in (a for a in NIM_ARMS if a in ns.arms):
        frozen = arm == "frozen copy"
        agents = {AGENT: agent_entry(warm)}
        if frozen:
            agents[FROZEN] = agent_entry(warm, url="FROZEN_URL", trainable=False)
        config = job_config(
            work / f"{arm.replace(' ', '-')}.yaml",
            "bench-credit-nim",  # one run id: as above
            agents,
            {**game, "seats": [AGENT, FROZEN if frozen else AGENT]},
            rewards,
            ns,
        )

        def show(row: dict[str, Any]) -> str | None:
            if "eval/first/episodes" not in row:
                return None
            per = ", ".join(f"{s} seat {row.get(f'eval/{s}/{key}') or 0:.3f}" for s in NIM_SEATS)
            return f"after {row['step'] + 1:>3} steps: win rate vs {VS_RANDOM} {win_rate(row):.3f} ({per})"

        rows, wall = run_arm(
            f"nim {arm}",
            work / arm.replace(" ", "-"),
            warm,
            config,
            frozen=frozen,
            prompts=prompts,
            eval_prompts=eval_prompts,
            eval_configs=eval_configs,
            steps=ns.nim_steps,
            prompts_per_step=ns.prompts_per_step,
            samples_per_prompt=ns.samples_per_prompt,
            eval_samples=eval_samples,
            ns=ns,
            show=show,
        )
        train_key = f"game/win_rate/vs/{FROZEN}" if frozen else "game/win_rate/first"
        summary = arm_summary(rows, wall, win_rate, train_key)
        evals = [r for r in rows if "eval/first/episodes" in r]
        for when, row in (
            ("before_by_seat", evals[0] if evals and evals[0]["step"] == -1 else None),
            ("after_by_seat", evals[-1] if evals else None),
        ):
            summary[when] = {s: (row or {}).get(f"eval/{s}/{key}") for s in NIM_SEATS}
            summary[when.replace("by_seat", "illegal_rate")] = {
                s: (row or {}).get(f"eval/{s}/game/illegal_rate") for s in NIM_SEATS
            }
        summary |= {
            "seats": [AGENT, FROZEN if frozen else AGENT],
            "prompts_per_step": ns.prompts_per_step,
            "samples_per_prompt": ns.samples_per_prompt,
            "evaluation_episodes": len(positions) * eval_samples * len(NIM_SEATS),
        }
        arms[arm] = summary
    return {
        "task": "nim, 3 to 9 stones, take 1 to 3, who takes the last stone wins",
        "evaluation": (
            f"win rate against {VS_RANDOM} on {len(positions)} starting positions x {eval_samples} "
            f"episodes, in both seat orders (the mean of the two)"
        ),
        "warm_start": str(warm),
        "arms": arms,
    }


# ----------------------------------------------------------------------------------------------
# Table, plot, main
# ----------------------------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def print_tables(report: dict[str, Any]) -> None:
    chain = report.get("chain")
    if chain:
        arms = chain["arms"]
        print(f"\n  chain: {chain['task']}\n  budget: {chain['budget']}")
        rows = [
            ("episodes per step", [str(a["episodes_per_step"]) for a in arms.values()]),
            ("engine calls, all steps", [f"{a['engine_calls']:,.0f}" for a in arms.values()]),
            ("held-out success before training", [_fmt(a["before"]) for a in arms.values()]),
            (
                f"steps to held-out success >= {chain['threshold']}",
                [
                    str(a["steps_to_threshold"]) if a["steps_to_threshold"] is not None else "not reached"
                    for a in arms.values()
                ],
            ),
            (
                "engine calls to reach it",
                [
                    f"{a['engine_calls_to_threshold']:,.0f}"
                    if a["engine_calls_to_threshold"] is not None
                    else "-"
                    for a in arms.values()
                ],
            ),
            ("final held-out success", [_fmt(a["after"]) for a in arms.values()]),
            (
                f"held-out success at {chain['equal_calls']:,.0f} engine calls",
                [
                    f"{_fmt(a['at_equal_calls']['success'])} (step {a['at_equal_calls']['after_steps']})"
                    for a in arms.values()
                ],
            ),
            ("wall time (s)", [f"{a['wall_time_s']:.0f}" for a in arms.values()]),
        ]
        _table(list(arms), rows)
    nim = report.get("nim")
    if nim:
        arms = nim["arms"]
        print(f"\n  nim: {nim['task']}\n  evaluation: {nim['evaluation']}")
        rows = [
            ("steps", [str(a["steps"]) for a in arms.values()]),
            ("engine calls, all steps (every engine)", [f"{a['engine_calls']:,.0f}" for a in arms.values()]),
            ("win rate vs script:random, before", [_fmt(a["before"]) for a in arms.values()]),
            ("win rate vs script:random, after", [_fmt(a["after"]) for a in arms.values()]),
        ]
        for seat in NIM_SEATS:
            rows.append(
                (
                    f"  as the {seat} seat, before -> after",
                    [
                        f"{_fmt(a['before_by_seat'][seat])} -> {_fmt(a['after_by_seat'][seat])}"
                        for a in arms.values()
                    ],
                )
            )
        rows += [
            (
                "illegal moves after (first / second seat)",
                [
                    f"{_fmt(a['after_illegal_rate']['first'])} / {_fmt(a['after_illegal_rate']['second'])}"
                    for a in arms.values()
                ],
            ),
            ("wall time (s)", [f"{a['wall_time_s']:.0f}" for a in arms.values()]),
        ]
        _table(list(arms), rows)
    print(f"\n  total wall time {report['wall_time_s']:.0f} s; plot: {report.get('plot')}")


def _table(names: list[str], rows: list[tuple[str, list[str]]]) -> None:
    width = max(len(r[0]) for r in rows)
    cols = [max(len(n), *(len(r[1][i]) for r in rows)) for i, n in enumerate(names)]
    print(f"  {'measure':<{width}}  " + "  ".join(f"{n:>{c}}" for n, c in zip(names, cols)))
    for name, values in rows:
        print(f"  {name:<{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(values, cols)))


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Success (chain) and win rate (nim) at each evaluation, per arm: the chain against training
    steps and against engine calls spent, nim against training steps."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (p, x)
        for p, xs in (("chain", ("after_steps", "engine_calls")), ("nim", ("after_steps",)))
        if report.get(p)
        for x in xs
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), dpi=120, squeeze=False)
    for ax, (part, x) in zip(axes[0], panels):
        for name, arm in report[part]["arms"].items():
            points = [p for p in arm["eval"] if p["value"] is not None]
            ax.plot([p[x] for p in points], [p["value"] for p in points], marker="o", ms=3, label=name)
        if part == "chain":
            ax.axhline(report["chain"]["threshold"], color="grey", lw=0.8, ls="--")
            ax.set_title("chain: held-out success")
            ax.set_ylabel("success rate (every step right)")
        else:
            ax.set_title(f"nim: win rate vs {VS_RANDOM} (both seat orders)")
            ax.set_ylabel("win rate")
        ax.set_xlabel("training step" if x == "after_steps" else "engine calls spent in training")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.model import ensure_model

    ns = settle(build_parser().parse_args(argv))
    out = Path(ns.out)
    root = Path(ns.workdir) if ns.workdir else out.parent
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        base = ensure_model(root / "models" / ns.preset, preset=ns.preset, seed=ns.seed)
    except (ValueError, FileExistsError) as exc:
        raise ConfigError(f"--workdir {root}: {exc}") from None
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "config": {k: v for k, v in vars(ns).items()},
    }
    try:
        if ns.only in (None, "chain") and set(ns.arms) & set(CHAIN_ARMS):
            report["chain"] = chain_part(ns, root, base)
        if ns.only in (None, "nim") and set(ns.arms) & set(NIM_ARMS):
            report["nim"] = nim_part(ns, root, base)
    except RuntimeError as exc:
        print(f"mrlx bench credit: {exc}", file=sys.stderr)
        return 1
    report["wall_time_s"] = time.monotonic() - started
    picture = plot(report, out.with_suffix(".png"))
    report["plot"] = str(picture) if picture else None
    print_tables(report)
    write_report(out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
