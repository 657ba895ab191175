"""`mrlx demo --long-tail`: the demo's two agents on a long-tail workload, synchronous against fully
asynchronous, one run after the other on the same seed.

The workload is `mrlx demo`'s (the proposer answers "What is a + b?", the decider gives the team's
final answer), except that a fraction of the questions (`--tail-fraction`, drawn at random per
question) is discussed for `--tail-rounds` rounds instead of one: the two agents take turns, each
seeing the other's answers, and each is graded on its last one (`mrlx_lab.examples.long_tail`).
Such an episode makes `--tail-rounds` times the median's engine calls, every one a model turn on
the engine; nothing is simulated.

- sync: the proposer's job runs `initiator_rollout` (slime's synchronous loop): each step waits for
  the slowest episode of its batch while its trainer idles.
- async: it runs `async_rollout`: episodes keep generating while the trainer trains, and each step
  takes groups already finished, each trained within `async_rollout.max_staleness`
  (`--max-staleness`, default 4) weight versions of the policy that generated it.

Both runs train the same number of steps and samples and evaluate the team's final answer on the
same held-out questions (with the same long tail) every `--eval-interval` steps. The comparison:
each trainer's idle fraction (the time its rollout function held it, over the step's wall time
without evaluation), samples trained per second, the staleness of what was trained, and the
reward curves (OUT/comparison.json, OUT/long_tail.png; each run's own report in OUT/sync, OUT/async).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mrlx_lab.demos.kit import add_evaluation_options, add_run_options, add_training_options, fmt, run_main
from mrlx_plugin.core.values import JSONObject
from mrlx_plugin.local.trainer.records import read_rows

ARMS = ("sync", "async")
ROLLOUTS = {"sync": "mrlx_plugin.rollout.initiator_rollout", "async": "mrlx_plugin.rollout.async_rollout"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrlx demo --long-tail", description=__doc__.split("\n\n")[0])
    add_training_options(
        p,
        out="runs/demo-long-tail",
        steps=40,
        steps_help="training steps (rollouts) per agent, in each run",
        prompts_per_step=8,
        samples_per_prompt=16,
        lr=None,
        lr_help="learning rate (default: the demo's, 2e-3)",
    )
    p.add_argument("--max-operand", type=int, default=3, help="questions are a + b with 0 <= a, b <= this")
    p.add_argument("--warmup-steps", type=int, default=80, help="format-only supervised steps (0: none)")
    p.add_argument(
        "--tail-fraction", type=float, default=0.125, help="the share of questions discussed for many rounds"
    )
    p.add_argument("--tail-rounds", type=int, default=8, help="their rounds (the others have one)")
    p.add_argument(
        "--max-staleness",
        type=int,
        default=4,
        help="async_rollout.max_staleness of the async run (default 4: a question of 8 rounds outlasts two "
        "steps, and the decider trains one version behind; under 2 most of them are given back and "
        "generated again)",
    )
    add_evaluation_options(p, prompts=64, interval=5, what="questions")
    p.add_argument(
        "--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which runs to make (default: both)"
    )
    add_run_options(p)
    return p


def _check(ns: argparse.Namespace) -> None:
    from mrlx_plugin.core.config import ConfigError

    if not 0.0 <= ns.tail_fraction <= 1.0:
        raise ConfigError(f"--tail-fraction: got {ns.tail_fraction}; expected a share from 0 to 1")
    if ns.tail_rounds < 1:
        raise ConfigError(f"--tail-rounds: got {ns.tail_rounds}; expected at least 1")
    if ns.eval_interval < 1 or ns.eval_prompts < 1:
        raise ConfigError("--eval-interval and --eval-prompts: expected at least 1")


def run_arm(ns: argparse.Namespace, arm: str) -> JSONObject:
    """One run of the demo on the long-tail workload in OUT/ARM (`arm`: sync or async); its
    measures (`measure`)."""
    from mrlx_lab.demos.co_training import Variant, run_demo
    from mrlx_lab.demos.co_training import build_parser as demo_parser

    _check(ns)
    out = Path(ns.out) / arm
    argv = [
        "--out",
        str(out),
        "--steps",
        str(ns.steps),
        "--prompts-per-step",
        str(ns.prompts_per_step),
        "--samples-per-prompt",
        str(ns.samples_per_prompt),
        "--preset",
        ns.preset,
        "--max-operand",
        str(ns.max_operand),
        "--warmup-steps",
        str(ns.warmup_steps),
        "--seed",
        str(ns.seed),
    ]
    argv += ["--lr", str(ns.lr)] if ns.lr is not None else []
    argv += [flag for flag, on in (("--overwrite", ns.overwrite), ("--no-router", ns.no_router)) if on]
    variant = Variant(
        rollout=ROLLOUTS[arm],
        tail=(ns.tail_fraction, ns.tail_rounds),
        settings=f"  async_rollout: {{max_staleness: {ns.max_staleness}}}\n",
        evaluation=(ns.eval_prompts, ns.eval_interval),
        micro_batch_size=ns.samples_per_prompt,  # a prompt group: its samples are about as long
    )
    argv += ["--quiet"] if ns.quiet else []
    summary = run_demo(demo_parser().parse_args(argv), variant)
    return {"arm": arm, "seed": ns.seed, "wall_time_s": summary["wall_time_s"], **measure(out)}


def measure(out: Path) -> JSONObject:
    """A run's measures from its agents' metrics.jsonl: idle fractions, samples per second, the
    staleness of the trained groups, the engine calls, the reward curves."""
    from mrlx_lab.demos.co_training import A, B

    steps = {n: [r for r in read_rows(out / n / "metrics.jsonl") if r.get("step", -1) >= 0] for n in (A, B)}
    a = steps[A]

    def total(rows: list[JSONObject], key: str) -> float:
        return float(sum(r.get(key) or 0.0 for r in rows))

    def idle(rows: list[JSONObject], key: str = "rollout_s") -> float | None:
        wall = total(rows, "step_s")
        return total(rows, key) / wall if wall else None

    peer_wait = total(a, f"coordinator/wait_seconds/{B}")
    wall_a = total(a, "step_s")
    staleness: dict[str, dict[str, float]] = {}
    for r in a:
        for key, value in r.items():
            if key.startswith("staleness_trained/"):
                _, agent, n = key.split("/")
                staleness.setdefault(agent, {})
                staleness[agent][n] = staleness[agent].get(n, 0.0) + float(value)
    # The held-out evaluations: the starting policy (a row of step -1) as version 0, then after step k
    # the weights it made, version k + 1.
    every = [r for r in read_rows(out / A / "metrics.jsonl") if r.get("eval/eval/reward_mean") is not None]
    held_out = [[0 if r["step"] < 0 else r["step"] + 1, r["eval/eval/reward_mean"]] for r in every]
    team = [r.get("multi_agent/team_reward") for r in a]
    return {
        "steps": len(a),
        "idle": {A: idle(a), B: idle(steps[B])},
        "idle_waiting_for_episodes": {A: (total(a, "rollout_s") - peer_wait) / wall_a if wall_a else None},
        "idle_waiting_for_peer": {A: peer_wait / wall_a if wall_a else None},
        "samples_trained": {n: total(steps[n], "samples_trained") for n in (A, B)},
        "samples_per_s": total(a, "samples_trained") / wall_a if wall_a else None,
        "training_wall_s": wall_a + total(a, "eval_s"),
        "engine_calls": total(a, "engine_calls"),
        "groups_given_back": total(a, "multi_agent/stale_groups"),
        "staleness": staleness,
        "held_out_curve": held_out,
        "held_out_last": held_out[-1][1] if held_out else None,
        "held_out_mean": sum(v for _, v in held_out) / len(held_out) if held_out else None,
        "train_curve": {
            "team": team,
            A: [r.get(f"reward/{A}/mean") for r in a],
            "idle": {A: [_ratio(r, "rollout_s") for r in a], B: [_ratio(r, "rollout_s") for r in steps[B]]},
        },
        "team_reward_last5": _mean_last(team, 5),
    }


def _ratio(row: JSONObject, key: str) -> float | None:
    return row[key] / row["step_s"] if row.get(key) is not None and row.get("step_s") else None


def _mean_last(values: list[float | None], n: int) -> float | None:
    kept = [v for v in values if v is not None][-n:]
    return sum(kept) / len(kept) if kept else None


def run_long_tail(ns: argparse.Namespace) -> JSONObject:
    out = Path(ns.out)
    runs: JSONObject = {}
    for arm in ns.arms:
        if not ns.quiet:
            print(f"mrlx demo --long-tail: the {arm} run in {out / arm} ...", flush=True)
        runs[arm] = run_arm(ns, arm)
    report: JSONObject = {
        "workload": {
            "tail_fraction": ns.tail_fraction,
            "tail_rounds": ns.tail_rounds,
            "max_staleness": ns.max_staleness,
            "steps": ns.steps,
            "prompts_per_step": ns.prompts_per_step,
            "samples_per_prompt": ns.samples_per_prompt,
            "seed": ns.seed,
        },
        "runs": runs,
    }
    (out / "comparison.json").write_text(json.dumps(report, indent=1))
    report["plot"] = str(plot(out, runs))
    report["comparison"] = str(out / "comparison.json")
    return report


def plot(out: Path, runs: JSONObject) -> Path:
    """OUT/long_tail.png: the held-out reward and each step's idle fraction, per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mrlx_lab.demos.co_training import A, B

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for arm, run in runs.items():
        curve = run["held_out_curve"]
        left.plot([x for x, _ in curve], [y for _, y in curve], marker="o", ms=3, label=f"{arm}: held-out")
        team = run["train_curve"]["team"]
        left.plot(range(1, len(team) + 1), team, alpha=0.35, label=f"{arm}: training")
        for name, style in ((A, "-"), (B, ":")):
            idle = run["train_curve"]["idle"][name]
            right.plot(range(len(idle)), idle, style, label=f"{arm}: {name}")
    left.set(xlabel="weight version (steps trained)", ylabel="team's final answer right", ylim=(-0.02, 1.02))
    left.set_title("reward")
    right.set(xlabel="training step", ylabel="trainer idle (rollout_s / step_s)", ylim=(-0.02, 1.02))
    right.set_title("trainer idle fraction")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("mrlx demo --long-tail: synchronous vs fully asynchronous rollouts")
    fig.tight_layout()
    path = out / "long_tail.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def print_summary(report: JSONObject) -> None:
    from mrlx_lab.demos.co_training import A, B

    w, runs = report["workload"], report["runs"]
    print(
        f"\nmrlx demo --long-tail: {w['tail_fraction']:.3g} of the questions take {w['tail_rounds']} rounds "
        f"(the rest 1); {w['steps']} steps of {w['prompts_per_step']} x {w['samples_per_prompt']} "
        "episodes per run"
    )
    arms = list(runs)

    def pct(v: object) -> str:
        return f"{100 * v:.0f}%" if isinstance(v, float) else "-"

    def counts(run: JSONObject, agent: str) -> str:
        c = run["staleness"].get(agent) or {}
        return " ".join(f"{n}:{int(c[n])}" for n in sorted(c, key=int)) or "-"

    rows = [
        (f"{A} idle (waiting for its rollout)", lambda r: pct(r["idle"][A])),
        ("  of which waiting for episodes", lambda r: pct(r["idle_waiting_for_episodes"][A])),
        (f"  of which waiting for {B}'s trainer", lambda r: pct(r["idle_waiting_for_peer"][A])),
        (f"{B} idle (waiting for {A}'s groups)", lambda r: pct(r["idle"][B])),
        ("samples trained per second", lambda r: f"{r['samples_per_s']:.1f}"),
        ("training wall time (s)", lambda r: f"{r['training_wall_s']:.0f}"),
        (f"staleness of {A}'s groups (versions:n)", lambda r: counts(r, A)),
        (f"staleness for {B} (versions:n)", lambda r: counts(r, B)),
        ("groups given back (too stale)", lambda r: f"{r['groups_given_back']:.0f}"),
        ("engine calls", lambda r: f"{r['engine_calls']:.0f}"),
        ("held-out team reward, last", lambda r: fmt(r["held_out_last"])),
        ("held-out team reward, mean of curve", lambda r: fmt(r["held_out_mean"])),
        ("training team reward, last 5 steps", lambda r: fmt(r["team_reward_last5"])),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"  {'':<{width}}  " + "  ".join(f"{arm:>16}" for arm in arms))
    for name, value in rows:
        print(f"  {name:<{width}}  " + "  ".join(f"{value(runs[arm]):>16}" for arm in arms))
    print(f"  plot: {report['plot']}\n  comparison: {report['comparison']}")


def main(argv: list[str] | None = None) -> int:
    return run_main("mrlx demo --long-tail", build_parser(), run_long_tail, print_summary, argv)


if __name__ == "__main__":
    sys.exit(main())
