"""`mrlx demo --research`: a planner and a searcher, two small CPU models, co-train as agent code.

The task (`mrlx_lab/examples/research_pair`): the planner is asked "What is the capital of Laku?", whose
answer is in a small corpus of made-up facts. It delegates a sub-question to the searcher, which
calls a `search(query)` tool (the episode's code runs it: a keyword match over the corpus), reads
the result (a `tool` message: context, never trained on) and reports back; the planner answers
in `\\boxed{}`. Both are rewarded on the final answer only.

The same processes as `mrlx demo` (`mrlx_lab.demos.co_training`; the start-up is the kit's): two
embedded engines, the coordinator, and one embedded trainer per agent. The planner's job runs
every episode; the searcher's samples reach its own trainer through the coordinator. Both models
are built on this machine and warm-started on demonstrations that hold no true fact (so no
answer can be learned from them), from a searcher that searches only half the time and guesses
otherwise: that searching pays, RL has to find out.
Held-out questions (countries never asked in training, whose documents training never
searches) are evaluated before the first RL step and every `--eval-interval` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mrlx_lab.demos.kit import (
    Running,
    add_evaluation_options,
    add_run_options,
    add_training_options,
    add_warm_start_options,
    fmt,
    held_out_summary,
    print_files,
    print_measures,
    refuse_previous_run,
    rl_settings,
    run_main,
    save_plot,
    start_services,
    start_trainer,
    tools_system_text,
    trainer_flags,
    write_report,
)
from mrlx_plugin.core.values import JSONObject
from mrlx_plugin.local.trainer.records import read_rows

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PLANNER, SEARCHER = "planner", "searcher"
HOOKS = "mrlx_lab.examples.research_pair.hooks"
# What a run leaves in --out (the models, built from --preset and --seed, come back identical).
RUN_STATE = (
    PLANNER,
    SEARCHER,
    "coordinator.sqlite",
    "coordinator.sqlite-wal",
    "coordinator.sqlite-shm",
    "logs",
    "metrics.json",
    "rewards.png",
    "prompts",
)
MAX_RESPONSE = 160  # a conversation after its prompt: the searcher's call, the search result, its report
WARMUP_BATCH = 16
MODEL_TURNS = 3  # per episode without the searcher's second turn (two of the planner, one of the searcher)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrlx demo --research", description=__doc__.split("\n\n")[0])
    add_training_options(
        p,
        out="runs/research_demo",
        steps=60,
        steps_help="RL steps (rollouts) per agent",
        prompts_per_step=4,
        samples_per_prompt=8,
        lr=5e-4,
    )
    add_evaluation_options(p, prompts=32, interval=20, what="questions")
    add_warm_start_options(p, per_agent=True)
    add_run_options(p)
    return p


def _job_yaml(
    path: Path,
    me: str,
    urls: dict[str, str],
    models: dict[str, Path],
    coordinator: str,
    ns: argparse.Namespace,
) -> Path:
    import yaml

    from mrlx_lab.examples.research_pair import hooks

    def agent(name: str, max_new_tokens: int) -> JSONObject:
        return {
            "url": "self" if name == me else urls[name],
            "tokenizer": str(models[name]),
            "trainable": True,
            "tool_parser": "hermes",
            "sampling": {"max_new_tokens": max_new_tokens, "temperature": 1.0},
        }

    doc = {
        "mrlx": {
            "run_id": "research-demo",
            "plugins": [HOOKS],
            "system": hooks.SYSTEM_NAME,
            "self": me,
            "agents": {
                PLANNER: agent(PLANNER, hooks.SHORT_TOKENS),
                SEARCHER: agent(SEARCHER, hooks.CALL_TOKENS),
            },
            "rewards": {"shaping": "independent"},
            "engine": {
                "request_timeout_s": 120,
                "abort_retry_wait_s": 0.5,
                "peer_deadline_s": 300,
                "sampling_seed": ns.seed,
            },
            "coordinator": {
                "url": coordinator,
                "token_env": "MRLX_DEMO_TOKEN",
                "max_staleness": 1,
                "wait_deadline_s": 900,
                "lease_s": 120,
            },
            # The demo's trainer settings (docs/local.md); the warm-start is done before the jobs start.
            "trainer": {
                **rl_settings(ns.lr),
                "warmup_sft_steps": 0,
                "micro_batch_size": 64,
                "threads": 1,
            },
        }
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def warm_start_models(out: Path, models: dict[str, Path], ns: argparse.Namespace) -> dict[str, Path]:
    """Each agent's warm-start, before any engine serves it: the held-out evaluation
    before the first RL step then sees both agents warm-started (were each trainer to warm-start
    its own, the planner's job, whose warm-start is the shorter, would evaluate before the searcher's
    is done). The result is saved where a trainer saves its own (out/AGENT/warm_start), with the
    trainer's metrics row; returns the directories the engines and trainers start from."""
    import warnings
    from concurrent.futures import ThreadPoolExecutor

    import torch

    if ns.warmup_steps < 1:
        return models
    # One thread per model, one core each: torch releases the GIL inside its kernels, and one
    # intra-op thread per model never oversubscribes a machine that other work shares.
    torch.set_num_threads(1)
    with warnings.catch_warnings(), ThreadPoolExecutor(len(models)) as pool:
        # The trainer's warm-start reads each loss with float() (harmless; its own log never shows it).
        warnings.filterwarnings("ignore", "Converting a tensor with requires_grad", UserWarning)
        futures = {
            name: pool.submit(_warm_start_one, out, name, model_dir, ns, ns.seed + i)
            for i, (name, model_dir) in enumerate(models.items())
        }
        rows = {name: future.result() for name, future in futures.items()}
    for name, row in rows.items():
        with (out / name / "metrics.jsonl").open("a") as f:  # the row the trainer writes for its own
            f.write(json.dumps(row) + "\n")
        if not ns.quiet:
            print(
                f"  warm-start of {name}: {row['warm_start/steps']} supervised steps, loss "
                f"{row['warm_start/loss_first']:.3f} -> {row['warm_start/loss_last']:.3f} "
                f"({row['warm_start/seconds']:.0f}s)",
                flush=True,
            )
    return {name: out / name / "warm_start" for name in models}


def _warm_start_one(out: Path, name: str, model_dir: Path, ns: argparse.Namespace, seed: int) -> JSONObject:
    from mrlx_lab.examples.research_pair import corpus
    from mrlx_plugin.local.model import load_model, load_tokenizer
    from mrlx_plugin.local.trainer.warm_start import warm_start

    tools_text = tools_system_text(model_dir, corpus.TOOLS) if name == SEARCHER else ""
    examples = corpus.warmup_examples(
        out / "prompts" / f"warm_start_{name}.jsonl", 2000, seed, name, tools_text
    )
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    t0 = time.monotonic()
    losses = warm_start(model, tokenizer, str(examples), ns.warmup_steps, ns.warmup_lr, WARMUP_BATCH, seed)
    model.save_pretrained(str(out / name / "warm_start"))
    tokenizer.save_pretrained(str(out / name / "warm_start"))
    return {
        "step": -1,
        "warm_start/steps": len(losses),
        "warm_start/loss_first": losses[0],
        "warm_start/loss_last": losses[-1],
        "warm_start/seconds": time.monotonic() - t0,
    }


def run_research_demo(ns: argparse.Namespace) -> JSONObject:
    from mrlx_lab.examples.research_pair import corpus
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.model import ensure_model

    if ns.steps < 1 or ns.eval_interval < 1 or ns.eval_prompts < 1 or ns.warmup_steps < 0:
        raise ConfigError(
            "--steps, --eval-interval and --eval-prompts must be at least 1, --warmup-steps 0 or more"
        )
    out = Path(ns.out)
    refuse_previous_run(out, ns, RUN_STATE)
    for name in ("logs", "prompts", PLANNER, SEARCHER):
        (out / name).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    token = secrets.token_urlsafe(24)
    env = dict(os.environ, MRLX_DEMO_TOKEN=token)
    try:
        models = {
            PLANNER: ensure_model(out / "models" / PLANNER, preset=ns.preset, seed=ns.seed),
            SEARCHER: ensure_model(out / "models" / SEARCHER, preset=ns.preset, seed=ns.seed + 1),
        }
    except (ValueError, FileExistsError) as exc:  # a model of other settings is there already
        raise ConfigError(f"--out {out}: {exc} (--preset and --seed must match the run there)") from None
    train = corpus.write_questions(
        out / "prompts" / "train.jsonl", corpus.questions(256, ns.seed, corpus.TRAIN)
    )
    held_out = corpus.write_questions(
        out / "prompts" / "held_out.jsonl", corpus.questions(ns.eval_prompts, ns.seed, corpus.HELD_OUT)
    )
    served = warm_start_models(out, models, ns)

    with Running() as run:
        coordinator, engines, urls, use_router = start_services(
            out, "research-demo", served, run.services, token=token, seed=ns.seed, router=not ns.no_router
        )
        common = trainer_flags(ns, train, MAX_RESPONSE) + (["--save-samples"] if ns.save_samples else [])
        evaluation = ["--eval-interval", str(ns.eval_interval), "--eval-prompt-data", str(held_out)]
        for name, rollout_fn, extra in (
            (SEARCHER, "mrlx_plugin.rollout.responder_rollout", common),
            (PLANNER, "mrlx_plugin.rollout.initiator_rollout", common + evaluation),
        ):
            config = _job_yaml(out / f"{name}.yaml", name, urls, served, coordinator.url, ns)
            run.trainers[name] = start_trainer(
                out, name, config, served[name], engines[name], urls[name], rollout_fn, env, ns.seed, extra
            )
        _follow(ns, out, run)
        run.check(out)
        peak_mib = run.peak_memory_mib()
    return _report(ns, out, time.monotonic() - started, peak_mib, use_router)


# ----------------------------------------------------------------------------------------------
# Reading the metrics
# ----------------------------------------------------------------------------------------------


def well_formed(row: JSONObject, prefix: str = "") -> float | None:
    """The rate of well-formed search calls of a planner's metrics row (`prefix` "eval/eval/": of its
    held-out evaluation). The searcher takes a second turn exactly when its first was a well-formed
    call (the task's code), so the rate is the model turns per episode less `MODEL_TURNS`."""
    turns = row.get(prefix + "multi_agent/avg_turns")
    return None if turns is None else max(0.0, min(1.0, turns - MODEL_TURNS))


def held_out_point(row: JSONObject) -> JSONObject:
    """A held-out evaluation of the planner's metrics: each agent's reward and the well-formed call
    rate. The planner's reward is the final answer's grade (`eval/eval/reward_mean`); the
    searcher's is the same grade."""
    right = row.get("eval/eval/reward_mean")
    step = 0 if row.get("eval/before_training") else row["step"] + 1
    return {"step": step, PLANNER: right, SEARCHER: right, "well_formed": well_formed(row, "eval/eval/")}


def _steps(rows: list[JSONObject]) -> list[JSONObject]:
    return [r for r in rows if r.get("step", -1) >= 0]


def _train_point(p_row: JSONObject, s_row: JSONObject | None) -> JSONObject:
    return {
        "step": p_row["step"],
        PLANNER: p_row.get(f"reward/{PLANNER}/mean"),
        SEARCHER: (s_row or {}).get(f"reward/{SEARCHER}/mean"),
        "well_formed": well_formed(p_row),
    }


def _follow(ns: argparse.Namespace, out: Path, run: Running) -> None:
    """A line per step, once both agents have trained it, and per held-out evaluation, while the
    trainers run."""
    if not ns.quiet:
        print(
            f"{'step':>5}  {PLANNER + ' reward':>14}  {SEARCHER + ' reward':>15}  {'well-formed':>11}  "
            f"{'elapsed':>7}",
            flush=True,
        )
    shown, t0 = 0, time.monotonic()

    def show(done: bool) -> None:
        nonlocal shown
        p_rows = read_rows(out / PLANNER / "metrics.jsonl")
        s_steps = {r["step"]: r for r in _steps(read_rows(out / SEARCHER / "metrics.jsonl"))}
        while not ns.quiet and shown < len(p_rows):
            r = p_rows[shown]
            step = r.get("step", -1)
            if step >= 0 and step not in s_steps and not done:
                break  # the searcher trains a step after the planner has rolled it out: its reward comes then
            if step >= 0:
                m = _train_point(r, s_steps.get(step))
                print(
                    f"{step:>5}  {fmt(m[PLANNER]):>14}  {fmt(m[SEARCHER]):>15}  "
                    f"{fmt(m['well_formed']):>11}  {time.monotonic() - t0:>6.0f}s",
                    flush=True,
                )
            if "eval/eval/reward_mean" in r:
                h = held_out_point(r)
                print(
                    f"  held-out after {h['step']} steps: {PLANNER} {fmt(h[PLANNER])}, {SEARCHER} "
                    f"{fmt(h[SEARCHER])}, well-formed calls {fmt(h['well_formed'])}",
                    flush=True,
                )
            shown += 1

    run.follow(show)


def _report(ns: argparse.Namespace, out: Path, wall: float, peak_mib: float, router: bool) -> JSONObject:
    rows = {name: read_rows(out / name / "metrics.jsonl") for name in (PLANNER, SEARCHER)}
    s_steps = {r["step"]: r for r in _steps(rows[SEARCHER])}
    train = [_train_point(r, s_steps.get(r["step"])) for r in _steps(rows[PLANNER])]
    evals = [held_out_point(r) for r in rows[PLANNER] if "eval/eval/reward_mean" in r]
    warm = {name: next((r for r in rows[name] if "warm_start/steps" in r), {}) for name in rows}
    summary: JSONObject = {
        "wall_time_s": wall,
        "peak_memory_mib": peak_mib,
        "router": router,
        "steps": len(train),
        "episodes_per_step": ns.prompts_per_step * ns.samples_per_prompt,
        "seed": ns.seed,
        "agents": {
            name: {
                "reward": "final answer",
                "steps_trained": len(_steps(rows[name])),
                "samples_trained": sum(r.get("samples", 0) for r in _steps(rows[name])),
                "warm_start_steps": warm[name].get("warm_start/steps", 0),
                "checkpoints": str(out / name / "checkpoints"),
            }
            for name in (PLANNER, SEARCHER)
        },
        "train": {"first_step": train[0] if train else None, "last_step": train[-1] if train else None},
        "held_out": held_out_summary(ns.eval_prompts, evals),
    }
    summary["plot"] = str(_plot(out, train, evals))
    return write_report(out, summary, rows)


def _plot(out: Path, train: list[JSONObject], evals: list[JSONObject]) -> Path:
    def draw(ax: Axes) -> None:
        x = [t["step"] + 1 for t in train]  # the step's rollout used the weights of `step` updates
        for key, color, label in (
            (PLANNER, "C0", f"{PLANNER}: final answer"),
            (SEARCHER, "C1", f"{SEARCHER}: final answer"),
            ("well_formed", "C2", "well-formed search calls"),
        ):
            ax.plot(x, [t[key] for t in train], color=color, alpha=0.5, label=f"training, {label}")
            ex, ey = [e["step"] for e in evals], [e[key] for e in evals]
            ax.plot(ex, ey, "o--", color=color, label=f"held-out, {label}")

    return save_plot(
        out,
        draw,
        title="mrlx demo --research: a planner and a searcher, two models",
        xlabel="RL steps taken",
        ylabel="mean reward / rate",
        ylim=(-0.02, 1.12),
        legend={"loc": "upper left", "fontsize": "x-small", "ncol": 2},
    )


def print_summary(s: JSONObject) -> None:
    print(
        f"\nmrlx demo --research finished in {s['wall_time_s']:.0f} s ({s['steps']} RL steps of "
        f"{s['episodes_per_step']} episodes; peak memory {s['peak_memory_mib']:.0f} MiB)"
    )
    for name, a in s["agents"].items():
        print(
            f"  {name:<9} rewarded for {a['reward']}; {a['warm_start_steps']} warm-start steps, "
            f"{a['steps_trained']} RL steps, {a['samples_trained']} samples"
        )
    columns = [
        (PLANNER, PLANNER + " reward", 14),
        (SEARCHER, SEARCHER + " reward", 15),
        ("well_formed", "well-formed call", 16),
    ]
    print_measures(s, columns, 34)
    print_files(s, [a["checkpoints"] for a in s["agents"].values()])


def main(argv: list[str] | None = None) -> int:
    return run_main("mrlx demo --research", build_parser(), run_research_demo, print_summary, argv)


if __name__ == "__main__":
    sys.exit(main())
