"""`mrlx bench demo`: the default demo, the same two agents as two LoRA adapters of one base
(`--adapters`), and the two-model demo's frozen-B baseline, each on the same seed, side by side.

Targets (2-core machine): the demo finishes in at most 10 minutes; agent A's mean reward rises
from at most 0.2 at the first step to at least 0.8 by the last; the team's final reward with
co-training ends at least 0.15 above the frozen-B baseline; peak memory (every process of the
demo together) under 4 GiB. The adapter run is measured beside them, against the same goals.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mrlx_lab.bench.report import write_report

ARMS = (
    ("two models", "co_training", []),
    ("two adapters", "adapters", ["--adapters"]),
    ("frozen B", "frozen_b", ["--freeze", "B"]),
)


def main(argv: list[str] | None = None) -> int:
    from mrlx_lab.demos.co_training import A, B, build_parser, run_demo

    p = argparse.ArgumentParser(prog="mrlx bench demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/demo.json")
    p.add_argument("--workdir", default="runs/bench/demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arms",
        nargs="+",
        choices=[key for _, key, _ in ARMS],
        default=[key for _, key, _ in ARMS],
        help="which runs to make (default: all three)",
    )
    ns, rest = p.parse_known_args(argv)
    runs = {}
    # A measurement starts from scratch: an earlier run in the work folder is replaced.
    fresh = [] if {"--resume", "--overwrite"} & set(rest) else ["--overwrite"]
    for label, key, extra in ARMS:
        if key not in ns.arms:
            continue
        out = Path(ns.workdir) / label.replace(" ", "-")
        args = build_parser().parse_args(
            ["--out", str(out), "--seed", str(ns.seed), "--quiet", *extra, *fresh, *rest]
        )
        print(f"mrlx bench demo: running {label} in {out} ...", flush=True)
        runs[label] = run_demo(args)

    def cell(run, value) -> str:
        return "-" if run is None else value(run)

    def reward(name, which):
        return lambda r: f"{r['agents'][name][which]:.3f}"

    rows = [
        ("wall time (s)", lambda r: f"{r['wall_time_s']:.0f}", "<= 600"),
        ("steps", lambda r: str(r["steps"]), ""),
        (f"{A} (A) reward, first step", reward(A, "first_step_reward"), "<= 0.2"),
        (f"{A} (A) reward, last step", reward(A, "last_step_reward"), ">= 0.8"),
        ("team's final reward, first step", reward(B, "first_step_reward"), ""),
        ("team's final reward, last step", reward(B, "last_step_reward"), ""),
        (
            "team's final reward, mean of last 5 steps",
            lambda r: f"{r['team_reward_last5']:.3f}",
            "co-training - frozen B >= +0.15",
        ),
        ("peak memory, all processes (MiB)", lambda r: f"{r['peak_memory_mib']:.0f}", "< 4096"),
    ]
    labels = [label for label, key, _ in ARMS if key in ns.arms]
    width = max(len(r[0]) for r in rows)
    print(f"\n  {'measure':<{width}}  " + "  ".join(f"{lab:>12}" for lab in labels) + "  goal")
    for name, value, goal in rows:
        print(
            f"  {name:<{width}}  "
            + "  ".join(f"{cell(runs[lab], value):>12}" for lab in labels)
            + f"  {goal}"
        )
    report = {key: runs[label] for label, key, _ in ARMS if label in runs}
    if "frozen B" in runs:
        frozen = runs["frozen B"]["team_reward_last5"] or 0.0
        for label, key in (("two models", "team_gap_last5"), ("two adapters", "adapters_team_gap_last5")):
            if label in runs:
                report[key] = (runs[label]["team_reward_last5"] or 0.0) - frozen
                print(f"  {label}: team's final reward over frozen B, last 5 steps: {report[key]:+.3f}")
    write_report(ns.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
