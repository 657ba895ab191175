"""`mrlx demo --tools`: a small CPU model learns a tool-using task written as agent code.

The task (`examples/tool_lookup`): "What is the code of item C?", where the code is in a table
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
import resource
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from mrlx_plugin.local.demo import (
    add_run_options,
    check_trainers,
    example_env,
    example_root,
    fmt,
    peak_memory_kib,
    print_files,
    print_measures,
    refuse_previous_run,
    run_main,
    save_plot,
    start_trainer,
    write_report,
)
from mrlx_plugin.local.trainer import read_rows

AGENT = "solver"
SYSTEM = "tool_lookup"
HOOKS = "examples.tool_lookup.hooks"
# What a run leaves in --out besides the model (which comes back identical from --preset and --seed).
ROLLOUT = "mrlx_plugin.local.fake_host.default_rollout"  # slime's default rollout, as the trainer's own
RUN_STATE = (AGENT, "logs", "metrics.json", "rewards.png", "job.yaml", "prompts", "warm_start.jsonl")
MAX_NEW_TOKENS = 64  # one turn: a call of lookup (about 57 tokens here) or "\\boxed{7}"
MAX_RESPONSE = 128  # the conversation after the prompt: the call, the tool's answer, the answer
THREADS = 2  # the engine and the trainer take turns (the trainer waits on the rollout): both cores each


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrlx demo --tools", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default="runs/tool_demo", help="working directory (model, logs, checkpoints, plot)"
    )
    p.add_argument("--steps", type=int, default=60, help="RL steps (rollouts)")
    p.add_argument("--prompts-per-step", type=int, default=8, help="--rollout-batch-size")
    p.add_argument(
        "--samples-per-prompt", type=int, default=8, help="--n-samples-per-prompt (GRPO group size)"
    )
    p.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts per evaluation")
    p.add_argument("--eval-interval", type=int, default=10, help="evaluate every N steps (and before, after)")
    p.add_argument("--preset", default="small", help="model size (mrlx_plugin.local.model presets)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="sampling temperature of the rollouts (the trainer's log-probs use the same)",
    )
    p.add_argument("--warmup-steps", type=int, default=1200, help="supervised warm-start steps (0: none)")
    p.add_argument("--warmup-lr", type=float, default=2e-3, help="learning rate of the warm-start")
    p.add_argument("--save-samples", action="store_true", help="write every trained sample to samples.jsonl")
    add_run_options(p, router=False)
    return p


def tools_system_text(model_dir: Path, tools: list[dict]) -> str:
    """The system message that renders exactly as the model's chat template renders `tools`.

    The trainer's supervised warm-start renders its examples without tools; an example that opens
    with this system message is then the very prompt an episode shows."""
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.model import IM_END, IM_START, load_tokenizer

    tok = load_tokenizer(model_dir)
    probe = [{"role": "user", "content": "?"}]
    plain = tok.apply_chat_template(probe, tokenize=False)
    with_tools = tok.apply_chat_template(probe, tools=tools, tokenize=False)
    head, opening, closing = with_tools[: len(with_tools) - len(plain)], f"{IM_START}system\n", f"{IM_END}\n"
    text = head[len(opening) : -len(closing)]
    if not (
        with_tools.endswith(plain)
        and head.startswith(opening)
        and head.endswith(closing)
        and tok.apply_chat_template([{"role": "system", "content": text}, *probe], tokenize=False)
        == with_tools
    ):
        raise ConfigError(
            f"the chat template of {model_dir} does not render tools as one system block before the "
            "messages (a model built before tool support?); remove that directory or give another --out"
        )
    return text


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
                "lr": ns.lr,
                "lr_warmup_steps": 5,
                "lr_decay_style": "cosine",
                "lr_min": ns.lr / 10,
                "kl_coef": 0.1,
                "ppo_epochs": 2,
                "adam_eps": 1.0e-5,
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


def run_tool_demo(ns: argparse.Namespace) -> dict[str, Any]:
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.core.processes import stop_all
    from mrlx_plugin.local.model import ensure_model
    from mrlx_plugin.local.processes import start_engine

    if ns.steps < 1 or ns.eval_interval < 1 or ns.eval_prompts < 1:
        raise ConfigError("--steps, --eval-interval and --eval-prompts must be at least 1")
    root = example_root("examples.tool_lookup.data", "mrlx demo --tools")
    from examples.tool_lookup import data

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
    env = example_env(root)

    procs: list[Any] = []
    jobs: list[subprocess.Popen] = []
    peak_kib: dict[int, int] = {}
    with ExitStack() as stack:
        stack.callback(lambda: (stop_all(jobs, timeout=20), stop_all([p.proc for p in procs], timeout=10)))
        engine = start_engine(
            model,
            log_dir=logs,
            name="engine",
            threads=THREADS,
            extra=["--seed", str(ns.seed), "--max-batch", "256"],
        )
        procs.append(engine)
        extra = [
            "--num-rollout",
            str(ns.steps),
            "--prompt-data",
            str(train),
            "--rollout-batch-size",
            str(ns.prompts_per_step),
            "--n-samples-per-prompt",
            str(ns.samples_per_prompt),
            "--rollout-max-response-len",
            str(MAX_RESPONSE),
            "--rollout-temperature",
            str(ns.temperature),
            "--warmup-data",
            str(warmup),
            "--eval-interval",
            str(ns.eval_interval),
            "--eval-prompt-data",
            str(held_out),
        ] + (["--save-samples"] if ns.save_samples else [])
        jobs.append(
            start_trainer(out, AGENT, config, model, engine.url, engine.url, ROLLOUT, env, ns.seed, extra)
        )
        _follow(ns, out, jobs[0], procs, peak_kib)
        check_trainers(out, {AGENT: jobs[0]})
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_mib = (sum(peak_kib.values()) + own) / 1024
    return _report(ns, out, time.monotonic() - started, peak_mib)


# ----------------------------------------------------------------------------------------------
# Reading the metrics
# ----------------------------------------------------------------------------------------------


def measures(row: dict[str, Any], prefix: str = "") -> dict[str, float | None]:
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


def _evals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The held-out evaluations in order: the one before training (step 0), then after each step."""
    points = []
    for r in rows:
        if "eval/eval/reward_mean" in r:
            step = 0 if r.get("eval/before_training") else r["step"] + 1
            points.append({"step": step, **measures(r, "eval/eval/")})
    return points


def _follow(
    ns: argparse.Namespace, out: Path, job: subprocess.Popen, procs: list[Any], peak_kib: dict[int, int]
) -> None:
    """A line per step and per evaluation while the trainer runs; the peak memory of every process."""

    if not ns.quiet:
        print(f"{'step':>5}  {'right':>6}  {'looked it up':>12}  {'elapsed':>7}", flush=True)
    shown, t0 = 0, time.monotonic()
    while True:
        done = job.poll() is not None
        for pid in [job.pid] + [p.proc.pid for p in procs]:
            peak_kib[pid] = max(peak_kib.get(pid, 0), peak_memory_kib(pid))
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
        if done:
            return
        time.sleep(0.5)


def _report(ns: argparse.Namespace, out: Path, wall: float, peak_mib: float) -> dict[str, Any]:
    rows = read_rows(out / AGENT / "metrics.jsonl")
    steps = [r for r in rows if r.get("step", -1) >= 0]
    warm = [r for r in rows if "warm_start/steps" in r]
    evals = _evals(rows)
    summary: dict[str, Any] = {
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
        "held_out": {
            "prompts": ns.eval_prompts,
            "before": evals[0] if evals else None,
            "after": evals[-1] if len(evals) > 1 else None,
            "curve": evals,
        },
        "checkpoints": str(out / AGENT / "checkpoints"),
    }
    summary["plot"] = str(_plot(out, steps, evals))
    return write_report(out, summary, rows)


def _plot(out: Path, steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> Path:
    def draw(ax: Any) -> None:
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


def print_summary(s: dict[str, Any]) -> None:
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
