"""`mrlx demo --tools`: a small CPU model learns a tool-using task written as agent code.

The task (`mrlx_lab/examples/tool_lookup`): "What is the code of item C?", where the code is in a table
that only the `lookup` tool reads. The episode is ordinary code with the official `openai`
client against the agent's OpenAI-compatible endpoint, which the rollout process serves: the
model calls the tool, the code runs it and sends the result back as a `tool` message (context,
never trained on), and the model answers `\\boxed{code}`.

One embedded engine and one embedded trainer (`mrlx_plugin.local.trainer`, slime's loop on the
CPU; one job, so no coordinator). The model is built on this machine and warm-started on a
demonstrator that looks the code up only half the time and guesses it otherwise (no
demonstration shows a table, so no code can be learned from them). RL, rewarded on the final
answer only, has to find out that the lookup pays and the guess does not. Held-out prompts
(tables, and item-code pairs, never seen in training) are evaluated before the first RL step
and every `--eval-interval` steps: the learning curve, the share of episodes that look the code
up with a well-formed call, and the rate of malformed calls.
"""

from __future__ import annotations

import argparse
import os
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
    start_trainer,
    tools_system_text,
    trainer_flags,
    write_report,
)
from mrlx_plugin.core.values import JSONObject
from mrlx_plugin.local.trainer.records import read_rows

if TYPE_CHECKING:
    from matplotlib.axes import Axes

AGENT = "solver"
SYSTEM = "tool_lookup"
HOOKS = "mrlx_lab.examples.tool_lookup.hooks"  # the example the trainer runs, shipped with the lab
# slime's default rollout, as the trainer's own
ROLLOUT = "mrlx_plugin.local.trainer.fake_host.default_rollout"
# What a run leaves in --out besides the model (which comes back identical from --preset and --seed).
RUN_STATE = (AGENT, "logs", "metrics.json", "rewards.png", "job.yaml", "prompts", "warm_start.jsonl")
MAX_NEW_TOKENS = 64  # one turn: a call of lookup (about 57 tokens here) or "\\boxed{7}"
MAX_RESPONSE = 128  # the conversation after the prompt: the call, the tool's answer, the answer
THREADS = 2  # the engine and the trainer take turns (the trainer waits on the rollout): both cores each


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrlx demo --tools", description=__doc__.split("\n\n")[0])
    add_training_options(
        p,
        out="runs/tool_demo",
        steps=60,
        steps_help="RL steps (rollouts)",
        prompts_per_step=8,
        samples_per_prompt=8,
        lr=5e-4,
    )
    add_evaluation_options(p, prompts=100, interval=10, what="prompts")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="sampling temperature of the rollouts (the trainer's log-probs use the same)",
    )
    add_warm_start_options(p, per_agent=False)
    add_run_options(p, router=False)
    return p


def _job_yaml(path: Path, model: Path, ns: argparse.Namespace) -> Path:
    import yaml

    doc = {
        "mrlx": {
            "run_id": "tool-demo",
            "plugins": [HOOKS],
            "system": SYSTEM,
            "agents": {
                AGENT: {
                    "url": "self",
                    "tokenizer": str(model),
                    "trainable": True,
                    "tool_parser": "hermes",
                    # The temperature is the host's (--rollout-temperature), which the trainer's
                    # log-probs use too.
                    "sampling": {"max_new_tokens": MAX_NEW_TOKENS},
                }
            },
            "engine": {"request_timeout_s": 120, "sampling_seed": ns.seed},
            # The demo's trainer settings (docs/local.md), which a small model learns with.
            "trainer": {
                **rl_settings(ns.lr),
                "warmup_sft_steps": ns.warmup_steps,
                # The call is some 57 tokens of fixed text: a higher rate than the demo's, on small
                # batches (the micro-batch is also the warm-start's batch), learns it in fewer steps.
                "warmup_sft_lr": ns.warmup_lr,
                "micro_batch_size": 16,
                "threads": THREADS,
            },
        }
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_tool_demo(ns: argparse.Namespace) -> JSONObject:
    from mrlx_lab.examples.tool_lookup import data
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.model import ensure_model
    from mrlx_plugin.local.services import start_engine

    if ns.steps < 1 or ns.eval_interval < 1 or ns.eval_prompts < 1:
        raise ConfigError("--steps, --eval-interval and --eval-prompts must be at least 1")
    out = Path(ns.out)
    refuse_previous_run(out, ns, RUN_STATE)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        model = ensure_model(out / "models" / AGENT, preset=ns.preset, seed=ns.seed)
    except (ValueError, FileExistsError) as exc:  # a model of other settings is there already
        raise ConfigError(f"--out {out}: {exc} (--preset and --seed must match the run there)") from None
    tools_text = tools_system_text(model, data.TOOLS)
    (out / "prompts").mkdir(exist_ok=True)
    train = data.write_prompts(out / "prompts" / "train.jsonl", data.prompts(240, ns.seed, data.TRAIN))
    held_out = data.write_prompts(
        out / "prompts" / "held_out.jsonl", data.prompts(ns.eval_prompts, ns.seed, data.HELD_OUT)
    )
    warmup = data.warmup_examples(out / "warm_start.jsonl", 2000, ns.seed, tools_text)
    config = _job_yaml(out / "job.yaml", model, ns)

    with Running() as run:
        engine = start_engine(
            model,
            log_dir=logs,
            name="engine",
            threads=THREADS,
            extra=["--seed", str(ns.seed), "--max-batch", "256"],
        )
        run.services.append(engine)
        extra = trainer_flags(ns, train, MAX_RESPONSE) + [
            "--rollout-temperature",
            str(ns.temperature),
            "--warmup-data",
            str(warmup),
            "--eval-interval",
            str(ns.eval_interval),
            "--eval-prompt-data",
            str(held_out),
        ]
        extra += ["--save-samples"] if ns.save_samples else []
        run.trainers[AGENT] = start_trainer(
            out, AGENT, config, model, engine.url, engine.url, ROLLOUT, dict(os.environ), ns.seed, extra
        )
        _follow(ns, out, run)
        run.check(out)
        peak_mib = run.peak_memory_mib()
    return _report(ns, out, time.monotonic() - started, peak_mib)


# ----------------------------------------------------------------------------------------------
# Reading the metrics
# ----------------------------------------------------------------------------------------------


def measures(row: JSONObject, prefix: str = "") -> dict[str, float | None]:
    """Reward, accuracy and tool calls of a metrics row (`prefix` "eval/eval/": its held-out
    evaluation). The reward and the team reward are both the final answer's grade. An episode
    takes a second turn exactly when its first turn made a well-formed call (the task's code), so
    the share of episodes that looked the code up is the engine calls per episode less one;
    `malformed` is the endpoint's count of tool calls its parser could not read, per request."""
    turns = row.get(prefix + "multi_agent/avg_turns")
    return {
        "reward": row.get(prefix + f"reward/{AGENT}/mean"),
        "accuracy": row.get(prefix + "multi_agent/team_reward"),
        "well_formed": None if turns is None else max(0.0, min(1.0, turns - 1.0)),
        "malformed": row.get(prefix + "agents/malformed_tool_call_rate"),
    }


def _evals(rows: list[JSONObject]) -> list[JSONObject]:
    """The held-out evaluations in order: the one before training (step 0), then after each step."""
    points = []
    for r in rows:
        if "eval/eval/reward_mean" in r:
            step = 0 if r.get("eval/before_training") else r["step"] + 1
            points.append({"step": step, **measures(r, "eval/eval/")})
    return points


def _follow(ns: argparse.Namespace, out: Path, run: Running) -> None:
    """A line per step and per evaluation while the trainer runs."""
    if not ns.quiet:
        print(f"{'step':>5}  {'right':>6}  {'looked it up':>12}  {'elapsed':>7}", flush=True)
    shown, t0 = 0, time.monotonic()

    def show(done: bool) -> None:
        nonlocal shown
        rows = read_rows(out / AGENT / "metrics.jsonl")
        if not ns.quiet:
            for r in rows[shown:]:
                elapsed = f"{time.monotonic() - t0:>6.0f}s"
                if r.get("step", -1) >= 0:
                    m = measures(r)
                    print(
                        f"{r['step']:>5}  {fmt(m['accuracy']):>6}  {fmt(m['well_formed']):>12}  {elapsed}",
                        flush=True,
                    )
                elif "warm_start/steps" in r:
                    print(f"  warm-start: {r['warm_start/steps']} supervised steps  {elapsed}", flush=True)
                if "eval/eval/reward_mean" in r:
                    m = measures(r, "eval/eval/")
                    print(
                        f"  held-out: right {fmt(m['accuracy'])}, looked it up {fmt(m['well_formed'])}, "
                        f"malformed calls {fmt(m['malformed'])}",
                        flush=True,
                    )
        shown = len(rows)

    run.follow(show)


def _report(ns: argparse.Namespace, out: Path, wall: float, peak_mib: float) -> JSONObject:
    rows = read_rows(out / AGENT / "metrics.jsonl")
    steps = [r for r in rows if r.get("step", -1) >= 0]
    warm = [r for r in rows if "warm_start/steps" in r]
    evals = _evals(rows)
    summary: JSONObject = {
        "wall_time_s": wall,
        "peak_memory_mib": peak_mib,
        "steps": len(steps),
        "episodes_per_step": ns.prompts_per_step * ns.samples_per_prompt,
        "seed": ns.seed,
        "warm_start_steps": warm[0]["warm_start/steps"] if warm else 0,
        "train": {
            "first_step": measures(steps[0]) if steps else None,
            "last_step": measures(steps[-1]) if steps else None,
        },
        "held_out": held_out_summary(ns.eval_prompts, evals),
        "checkpoints": str(out / AGENT / "checkpoints"),
    }
    summary["plot"] = str(_plot(out, steps, evals))
    return write_report(out, summary, rows)


def _plot(out: Path, steps: list[JSONObject], evals: list[JSONObject]) -> Path:
    def draw(ax: Axes) -> None:
        x = [r["step"] + 1 for r in steps]  # the step's rollout used the weights of `step` updates
        train = [measures(r) for r in steps]
        ax.plot(x, [m["accuracy"] for m in train], color="C0", alpha=0.5, label="training: right answer")
        ax.plot(x, [m["well_formed"] for m in train], color="C1", alpha=0.5, label="training: looked it up")
        ex = [e["step"] for e in evals]
        ax.plot(ex, [e["accuracy"] for e in evals], "o-", color="C0", label="held-out: right answer")
        well_formed = [e["well_formed"] for e in evals]
        ax.plot(ex, well_formed, "s--", color="C1", label="held-out: looked it up (well-formed call)")

    return save_plot(
        out,
        draw,
        title="mrlx demo --tools: look the code up, then answer it",
        xlabel="RL steps taken",
        ylabel="fraction of episodes",
        ylim=(-0.02, 1.02),
        legend={"loc": "lower right", "fontsize": "small"},
    )


def print_summary(s: JSONObject) -> None:
    print(
        f"\nmrlx demo --tools finished in {s['wall_time_s']:.0f} s ({s['steps']} RL steps of "
        f"{s['episodes_per_step']} episodes after {s['warm_start_steps']} warm-start steps; "
        f"peak memory {s['peak_memory_mib']:.0f} MiB)"
    )
    columns = [
        ("accuracy", "right answer", 12),
        ("well_formed", "looked it up", 12),
        ("malformed", "malformed calls", 15),
    ]
    print_measures(s, columns, 30)
    print_files(s, [s["checkpoints"]])


def main(argv: list[str] | None = None) -> int:
    return run_main("mrlx demo --tools", build_parser(), run_tool_demo, print_summary, argv)


if __name__ == "__main__":
    sys.exit(main())
