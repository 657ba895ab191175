"""`mrlx demo`: two small models co-train on a CPU through the full multi-model loop.

The same processes as a two-model slime run, shrunk to fit a laptop: two embedded engines
(behind the real sglang-router when it is installed), the coordinator, and one trainer per
agent (`mrlx_plugin.local.trainer`, calling the plugin's rollout functions as slime does).

The task: agent A (the proposer) is asked "What is a + b?" and answers in \\boxed{}; agent B
(the decider) sees the question and A's answer and gives the team's final answer. A is rewarded
for its own answer, B for the team's. Both models are built from a config on this machine and
first taught the answer FORMAT only (a short supervised warm-start on random numbers, logged
as such); what the right answer is they learn by RL. `--freeze B` runs the same seed with B's
weights never updated: the baseline co-training has to beat.

`--adapters` runs the same two agents as two LoRA adapters of one base model: one engine serves
the base and both adapters, each agent's turns go through its own adapter, and each agent's
trainer trains and pushes only its adapter, with its own optimizer. The base stands for a
pretrained model: built from the config, it gets the format-only warm-start on both agents'
examples (how to answer, not what), and each adapter starts as the base. Everything else (the
coordinator, the steps, the plot and the metrics) is the two-model run's.

`mrlx demo --long-tail` (`mrlx_lab.demos.long_tail`) runs these two agents on a long-tail
workload, synchronously and fully asynchronously, through `run_demo` with a `Variant`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mrlx_lab.demos.kit import (
    Running,
    add_run_options,
    add_training_options,
    fmt,
    latest_checkpoint,
    print_files,
    refuse_previous_run,
    run_main,
    save_plot,
    start_services,
    start_trainer,
    trainer_flags,
    write_report,
)
from mrlx_plugin.core.values import JSONObject
from mrlx_plugin.local.trainer.records import read_rows

if TYPE_CHECKING:
    from matplotlib.axes import Axes

A, B = "proposer", "decider"
# What a run leaves in --out (the models, built from --preset and --seed, come back identical).
RUN_STATE = (
    A,
    B,
    "coordinator.sqlite",
    "coordinator.sqlite-wal",
    "coordinator.sqlite-shm",
    "logs",
    "metrics.json",
    "rewards.png",
)


@dataclass
class Variant:
    """What a run of the demo does differently from the default (`mrlx demo --long-tail`).

    `rollout`: the proposer's rollout function (the job that runs the episodes);
    `tail`: (fraction, rounds): that fraction of the questions, drawn at random, is discussed for
    `rounds` rounds instead of one (`mrlx_lab.examples.long_tail`);
    `settings`: more `mrlx` sections of both jobs, as YAML lines (two spaces in);
    `evaluation`: (held-out questions, every N steps) the proposer's job evaluates on;
    `micro_batch_size`: the trainers' (the gradient is the same for any: a per-token mean over
    the step; each micro-batch is padded to its longest sample, so one that mixes long and short
    samples costs as if all were long)."""

    rollout: str = "mrlx_plugin.rollout.initiator_rollout"
    tail: tuple[float, int] | None = None
    settings: str = ""
    evaluation: tuple[int, int] | None = None
    micro_batch_size: int = 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrlx demo", description=__doc__.split("\n\n")[0])
    add_training_options(
        p,
        out="runs/demo",
        steps=150,
        steps_help="training steps (rollouts) per agent",
        prompts_per_step=16,
        samples_per_prompt=16,
        lr=None,
        lr_help="learning rate (default: 2e-3; 3e-3 with --adapters)",
    )
    p.add_argument("--max-operand", type=int, default=3, help="questions are a + b with 0 <= a, b <= this")
    p.add_argument(
        "--adapters",
        action="store_true",
        help="the two agents as two LoRA adapters of one base model on one engine (each trains its own)",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank (with --adapters)")
    p.add_argument("--warmup-steps", type=int, default=80, help="format-only supervised steps (0: none)")
    p.add_argument(
        "--freeze", choices=[A, B, "A", "B"], default=None, help="never update this agent (baseline)"
    )
    add_run_options(p, resume=True)
    return p


def _yaml(
    path: Path,
    me: str,
    urls: dict[str, str],
    models: dict[str, Path],
    coordinator: str,
    ns: argparse.Namespace,
    adapters: bool = False,
    variant: Variant | None = None,
) -> Path:
    def agent(name: str) -> str:
        url = "self" if name == me else urls[name]
        adapter = f"adapter: {name}, " if adapters else ""  # its LoRA adapter's name on the engine
        return (
            f"    {name}: {{url: '{url}', {adapter}tokenizer: '{models[name]}', trainable: true, "
            f"sampling: {{max_new_tokens: 10, temperature: 1.0}}}}\n"
        )

    variant = variant or Variant()
    rounds = variant.tail[1] if variant.tail else 1
    plugins = "  plugins: [mrlx_lab.examples.long_tail]\n" if variant.tail else ""
    path.write_text(
        "mrlx:\n"
        f"  run_id: demo\n  system: dialogue\n  self: {me}\n"
        "  agents:\n"
        + agent(A)
        + agent(B)
        + plugins
        + f"  dialogue: {{first: {A}, max_turns: {2 * rounds}, final_answer_agent: {B}}}\n"
        "  rewards: {shaping: independent}\n"
        "  engine: {request_timeout_s: 60, abort_retry_wait_s: 0.5, peer_deadline_s: 300, sampling_seed: "
        f"{ns.seed}}}\n"
        f"  coordinator: {{url: '{coordinator}', token_env: MRLX_DEMO_TOKEN, max_staleness: 1, "
        "wait_deadline_s: 900, lease_s: 120}\n"
        f"  trainer: {{lr: {_lr(ns)}, lr_warmup_steps: 10, lr_decay_style: cosine, lr_min: {_lr(ns) / 10}, "
        "kl_coef: 0.1, ppo_epochs: 2, adam_eps: 1.0e-5, "
        f"warmup_sft_steps: {ns.warmup_steps}, warmup_sft_lr: 1.0e-3, "
        f"micro_batch_size: {variant.micro_batch_size}, threads: 1}}\n" + variant.settings
    )
    return path


def warm_base(path: Path, init: Path, examples: list[Path], steps: int, seed: int) -> Path:
    """`path`: the model at `init` after `steps` format-only supervised steps on `examples` (the
    adapters' base, as a pretrained model would be), built once. The steps run in a process of
    their own, so the demo's own memory stays what it is without them."""
    import multiprocessing

    record = path / "warm_start.json"
    wanted = {"init": str(init), "examples": [str(e) for e in examples], "steps": steps, "seed": seed}
    if (path / "config.json").is_file() and record.is_file():
        have = {k: json.loads(record.read_text()).get(k) for k in wanted}
        if have != wanted:
            raise ValueError(f"{path} is a base warm-started with {have}, not {wanted}")
        return path
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=_warm_base, args=(str(path), str(init), [str(e) for e in examples], steps, seed)
    )
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not (path / "config.json").is_file():
        raise RuntimeError(
            f"the warm-start of the adapters' base model in {path} failed (exit {proc.exitcode})"
        )
    return path


def _warm_base(path: str, init: str, examples: list[str], steps: int, seed: int) -> None:
    import torch

    from mrlx_plugin.local.model import load_model, load_tokenizer
    from mrlx_plugin.local.trainer.warm_start import warm_start

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    final = Path(path)
    merged = final.with_name(final.name + "-warmup.jsonl")
    merged.write_text("".join(Path(e).read_text() for e in examples))
    model, tokenizer = load_model(init), load_tokenizer(init)
    losses = warm_start(model, tokenizer, str(merged), steps, 1e-3, 64, seed) if steps else [float("nan")]
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    record = {
        "init": init,
        "examples": examples,
        "steps": steps,
        "seed": seed,
        "warm_start/steps": steps,
        "warm_start/loss_first": losses[0],
        "warm_start/loss_last": losses[-1],
    }
    (tmp / "warm_start.json").write_text(json.dumps(record))
    os.replace(tmp, final)  # the base is complete or absent


def _lr(ns: argparse.Namespace) -> float:
    # An adapter's few parameters take larger steps than a whole model's to move it as far.
    return ns.lr if ns.lr is not None else 3e-3 if getattr(ns, "adapters", False) else 2e-3


def run_demo(ns: argparse.Namespace, variant: Variant | None = None) -> JSONObject:
    variant = variant or Variant()
    freeze = {"A": A, "B": B}.get(ns.freeze, ns.freeze)
    out = Path(ns.out)
    refuse_previous_run(out, ns, RUN_STATE)
    if ns.resume:
        _check_resumable(out, ns)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    token = secrets.token_urlsafe(24)
    env = dict(os.environ, MRLX_DEMO_TOKEN=token)
    prompt_file, warmup = _prompts(out, ns, variant.tail)
    models, adapters = _models(out, ns, warmup)
    with Running() as run:
        start = adapters or models
        served = {
            name: (latest_checkpoint(out / name) if ns.resume else None) or start[name] for name in (A, B)
        }
        coordinator, engines, urls, use_router = start_services(
            out,
            "demo",
            served,
            run.services,
            token=token,
            seed=ns.seed,
            router=not ns.no_router,
            base=models[A] if adapters else None,
        )
        for name, rollout_fn in ((B, "mrlx_plugin.rollout.responder_rollout"), (A, variant.rollout)):
            config = _yaml(
                out / f"{name}.yaml", name, urls, models, coordinator.url, ns, bool(adapters), variant
            )
            # A sample's response holds every turn after its prompt (the other agent's too): 24 tokens
            # fit a round of two 10-token turns; a question of many rounds needs them all.
            extra = trainer_flags(ns, prompt_file, 24 * (variant.tail[1] if variant.tail else 1))
            if name == A and variant.evaluation:  # the job that runs the episodes evaluates
                held_out, every = variant.evaluation
                eval_file = out / "eval_prompts.jsonl"
                _write_prompts(eval_file, held_out, ns.seed + 1, ns, variant.tail)
                extra += ["--eval-interval", str(every), "--eval-prompt-data", str(eval_file)]
            # an adapter starts from the base, which had the warm-start; a model has its own
            extra += ["--adapter", str(adapters[name])] if adapters else ["--warmup-data", str(warmup[name])]
            extra += (["--freeze"] if freeze == name else []) + (["--resume"] if ns.resume else [])
            run.trainers[name] = start_trainer(
                out, name, config, models[name], engines[name], urls[name], rollout_fn, env, ns.seed, extra
            )
        _follow(ns, out, run)
        run.check(out)
        peak_mib = run.peak_memory_mib()
    return _report(ns, out, time.monotonic() - started, peak_mib, freeze, use_router)


def _check_resumable(out: Path, ns: argparse.Namespace) -> None:
    """--resume: the checkpoints in --out are whole models or adapters; resume them as they are."""
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.model import is_adapter_dir

    held = [c for c in (latest_checkpoint(out / A), latest_checkpoint(out / B)) if c is not None]
    if held and is_adapter_dir(held[0]) != ns.adapters:
        kind = "a LoRA adapter" if is_adapter_dir(held[0]) else "a whole model"
        how = "with" if is_adapter_dir(held[0]) else "without"
        raise ConfigError(f"--resume: {held[0]} holds {kind}; resume the run {how} --adapters, as it started")


def _prompts(
    out: Path, ns: argparse.Namespace, tail: tuple[float, int] | None = None
) -> tuple[Path, dict[str, Path]]:
    """The questions (out/prompts.jsonl; with `tail`, some of many rounds) and each agent's
    format-only warm-start examples."""
    from mrlx_plugin.local.trainer.tasks import addition_prompts, format_examples

    prompts = addition_prompts(256, seed=ns.seed, max_operand=ns.max_operand)
    prompt_file = _write_prompts(out / "prompts.jsonl", 256, ns.seed, ns, tail)
    warmup = {
        A: format_examples(out / f"warmup_{A}.jsonl", prompts, 2000, seed=ns.seed),
        B: format_examples(out / f"warmup_{B}.jsonl", prompts, 2000, seed=ns.seed + 1, context=True),
    }
    return prompt_file, warmup


def _write_prompts(
    path: Path, n: int, seed: int, ns: argparse.Namespace, tail: tuple[float, int] | None
) -> Path:
    """`n` questions a + b as a prompt file; with `tail` (fraction, rounds) that fraction of them,
    drawn from `seed`, is of `rounds` rounds and the others of one (their metadata says so)."""
    from mrlx_lab.examples.long_tail import ROUNDS_KEY
    from mrlx_plugin.local.trainer.tasks import addition_prompts

    long = set(random.Random(f"long-tail:{seed}").sample(range(n), round(tail[0] * n))) if tail else set()
    rows = []
    for i, (prompt, label) in enumerate(addition_prompts(n, seed=seed, max_operand=ns.max_operand)):
        row: JSONObject = {"prompt": prompt, "label": label}
        if tail is not None:
            row["metadata"] = {ROUNDS_KEY: tail[1] if i in long else 1}
        rows.append(json.dumps(row) + "\n")
    path.write_text("".join(rows))
    return path


def _models(
    out: Path, ns: argparse.Namespace, warmup: dict[str, Path]
) -> tuple[dict[str, Path], dict[str, Path]]:
    """The two models, each built from a config on this machine (never downloaded); with
    --adapters, one base model (the adapters' warm-started base for both) and an adapter per agent
    on it (each starts as the base). Returns the models by agent and the adapters (none without
    --adapters)."""
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.model import ensure_adapter, ensure_model

    try:
        if not ns.adapters:
            return {
                A: ensure_model(out / "models" / A, preset=ns.preset, seed=ns.seed),
                B: ensure_model(out / "models" / B, preset=ns.preset, seed=ns.seed + 1),
            }, {}
        init = ensure_model(out / "models" / "base-init", preset=ns.preset, seed=ns.seed)
        base = warm_base(out / "models" / "base", init, [warmup[A], warmup[B]], 2 * ns.warmup_steps, ns.seed)
        adapters = {
            name: ensure_adapter(
                out / "models" / f"adapter-{name}",
                base,
                rank=ns.lora_rank,
                alpha=2 * ns.lora_rank,
                seed=k,
            )
            for k, name in enumerate((A, B), start=ns.seed)
        }
        return {A: base, B: base}, adapters
    except (ValueError, FileExistsError) as exc:  # a model of other settings is there already
        raise ConfigError(
            f"--out {out}: {exc} (--preset, --seed and --lora-rank must match the run there)"
        ) from None


def _follow(ns: argparse.Namespace, out: Path, run: Running) -> None:
    """A progress bar and a per-step table while the trainers run."""
    bar = None
    if not ns.quiet:
        from tqdm import tqdm

        bar = tqdm(total=ns.steps, desc="co-training", unit="step", dynamic_ncols=True)
        tqdm.write(
            f"{'step':>4}  {A + ' (A) right':>17}  {'team right':>10}  {B + ' (B) trained':>17}  "
            f"{'staleness':>9}  {'elapsed':>7}"
        )
    shown, t0 = 0, time.monotonic()

    def show(done: bool) -> None:
        nonlocal shown
        a_rows = [r for r in read_rows(out / A / "metrics.jsonl") if r.get("step", -1) >= 0]
        b_done = sum(1 for r in read_rows(out / B / "metrics.jsonl") if r.get("step", -1) >= 0)
        if bar is not None and len(a_rows) > shown:
            for r in a_rows[shown:]:
                bar.write(
                    f"{r['step']:>4}  {r.get(f'reward/{A}/mean', 0):>17.3f}  "
                    f"{r.get('multi_agent/team_reward', 0):>10.3f}  {b_done:>11} steps  "
                    f"{r.get(f'staleness/{B}', 0):>9.0f}  {time.monotonic() - t0:>6.0f}s"
                )
            bar.update(len(a_rows) - shown)
            bar.set_postfix_str(f"{B}: {b_done} steps trained")
        shown = len(a_rows)

    run.follow(show)
    if bar is not None:
        bar.close()


def _report(
    ns: argparse.Namespace, out: Path, wall: float, peak_mib: float, freeze: str | None, router: bool
) -> JSONObject:
    rows = {name: [r for r in read_rows(out / name / "metrics.jsonl")] for name in (A, B)}
    steps = {name: [r for r in rows[name] if r.get("step", -1) >= 0] for name in (A, B)}
    a_rows = steps[A]

    def first_last(key: str) -> tuple[float | None, float | None]:
        values = [r[key] for r in a_rows if r.get(key) is not None]
        return (values[0], values[-1]) if values else (None, None)

    summary: JSONObject = {
        "wall_time_s": wall,
        "peak_memory_mib": peak_mib,
        "frozen": freeze,
        "adapters": bool(getattr(ns, "adapters", False)),
        "router": router,
        "steps": len(a_rows),
        "seed": ns.seed,
        "agents": {},
    }
    # A's reward is A's own grade; B's is the team's final answer (what B is rewarded for).
    keys = {A: f"reward/{A}/mean", B: "multi_agent/team_reward"}
    for name in (A, B):
        first, last = first_last(keys[name])
        warm = [r for r in rows[name] if r.get("step") == -1]
        summary["agents"][name] = {
            "reward": "own answer" if name == A else "team's final answer",
            "first_step_reward": first,
            "last_step_reward": last,
            "steps_trained": len(steps[name]) if freeze != name else 0,
            "samples_trained": sum(r.get("samples", 0) for r in steps[name]) if freeze != name else 0,
            "warm_start_steps": warm[0]["warm_start/steps"] if warm else 0,
            "checkpoints": str(out / name / "checkpoints"),
        }
    base_warm = out / "models" / "base" / "warm_start.json"  # --adapters: the base's warm-start
    summary["base_warm_start"] = json.loads(base_warm.read_text()) if summary["adapters"] else None
    team = [r.get("multi_agent/team_reward") for r in a_rows if r.get("multi_agent/team_reward") is not None]
    summary["team_reward_last5"] = sum(team[-5:]) / len(team[-5:]) if team else None
    summary["plot"] = str(_plot(out, a_rows, freeze, summary["adapters"]))
    return write_report(out, summary, rows)


def _plot(out: Path, a_rows: list[JSONObject], freeze: str | None, adapters: bool = False) -> Path:
    def draw(ax: Axes) -> None:
        steps = [r["step"] for r in a_rows]
        for key, label in (
            (f"reward/{A}/mean", f"{A} (A): own answer"),
            ("multi_agent/team_reward", f"{B} (B): team's final answer"),
        ):
            ax.plot(steps, [r.get(key) for r in a_rows], marker="o", ms=3, label=label)

    return save_plot(
        out,
        draw,
        title=f"mrlx demo: two {'LoRA adapters of one model' if adapters else 'models'} co-training"
        + (f" ({freeze} frozen)" if freeze else ""),
        xlabel="training step",
        ylabel="mean reward (fraction right)",
        ylim=(-0.02, 1.02),
        legend={"loc": "lower right"},
    )


def print_summary(s: JSONObject) -> None:
    print(
        f"\nmrlx demo finished in {s['wall_time_s']:.0f} s ({s['steps']} steps; peak memory "
        f"{s['peak_memory_mib']:.0f} MiB{'; frozen: ' + s['frozen'] if s['frozen'] else ''}"
        f"{'; two LoRA adapters on one base' if s.get('adapters') else ''})"
    )
    print(
        f"  {'agent':<10} {'rewarded for':<20} {'first step':>10} {'last step':>10} {'steps':>6} "
        f"{'samples':>8}  warm-start"
    )
    for name, a in s["agents"].items():
        print(
            f"  {name:<10} {a['reward']:<20} {fmt(a['first_step_reward']):>10} "
            f"{fmt(a['last_step_reward']):>10} "
            f"{a['steps_trained']:>6} {a['samples_trained']:>8}  {a['warm_start_steps']} format-only steps"
        )
    if s.get("base_warm_start"):
        print(
            f"  the adapters' base: {s['base_warm_start']['warm_start/steps']} format-only steps on both "
            "agents' examples; each adapter starts as the base"
        )
    print_files(s, [a["checkpoints"] for a in s["agents"].values()])


def main(argv: list[str] | None = None) -> int:
    return run_main("mrlx demo", build_parser(), run_demo, print_summary, argv)


if __name__ == "__main__":
    sys.exit(main())
