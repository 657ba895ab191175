"""`mrlx bench demo`: the default demo and its frozen-B baseline on the same seed, side by side.

Targets (2-core machine): the demo finishes in at most 10 minutes; agent A's mean reward rises
from at most 0.2 at the first step to at least 0.8 by the last; the team's final reward with
co-training ends at least 0.15 above the frozen-B baseline; peak memory (every process of the
demo together) under 4 GiB.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mrlx_plugin.bench.report import write_report


def main(argv: list[str] | None = None) -> int:
    from mrlx_plugin.local.demo import A, B, build_parser, run_demo

    p = argparse.ArgumentParser(prog="mrlx bench demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/demo.json")
    p.add_argument("--workdir", default="runs/bench/demo")
    p.add_argument("--seed", type=int, default=0)
    ns, rest = p.parse_known_args(argv)
    runs = {}
    # A measurement starts from scratch: an earlier run in the work folder is replaced.
    fresh = [] if {"--resume", "--overwrite"} & set(rest) else ["--overwrite"]
    for label, extra in (("co-training", fresh), ("frozen B", ["--freeze", "B", *fresh])):
        out = Path(ns.workdir) / label.replace(" ", "-")
        args = build_parser().parse_args(
            ["--out", str(out), "--seed", str(ns.seed), "--quiet", *extra, *rest]
        )
        print(f"mrlx bench demo: running {label} in {out} ...", flush=True)
        runs[label] = run_demo(args)

    co, frozen = runs["co-training"], runs["frozen B"]

    def agent(run, name, key):
        return run["agents"][name][key]

    gap = (co["team_reward_last5"] or 0.0) - (frozen["team_reward_last5"] or 0.0)
    rows = [
        ("wall time (s)", f"{co['wall_time_s']:.0f}", f"{frozen['wall_time_s']:.0f}", "<= 600"),
        ("steps", str(co["steps"]), str(frozen["steps"]), ""),
        (
            f"{A} (A) reward, first step",
            f"{agent(co, A, 'first_step_reward'):.3f}",
            f"{agent(frozen, A, 'first_step_reward'):.3f}",
            "<= 0.2",
        ),
        (
            f"{A} (A) reward, last step",
            f"{agent(co, A, 'last_step_reward'):.3f}",
            f"{agent(frozen, A, 'last_step_reward'):.3f}",
            ">= 0.8",
        ),
        (
            "team's final reward, last step",
            f"{agent(co, B, 'last_step_reward'):.3f}",
            f"{agent(frozen, B, 'last_step_reward'):.3f}",
            "",
        ),
        (
            "team's final reward, mean of last 5 steps",
            f"{co['team_reward_last5']:.3f}",
            f"{frozen['team_reward_last5']:.3f}",
            f"co-training - frozen = {gap:+.3f} (>= +0.15)",
        ),
        (
            "peak memory, all processes (MiB)",
            f"{co['peak_memory_mib']:.0f}",
            f"{frozen['peak_memory_mib']:.0f}",
            "< 4096",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n  {'measure':<{width}}  {'co-training':>12}  {'frozen B':>10}  goal")
    for name, c, f, goal in rows:
        print(f"  {name:<{width}}  {c:>12}  {f:>10}  {goal}")
    write_report(ns.out, {"co_training": co, "frozen_b": frozen, "team_gap_last5": gap})
    return 0


if __name__ == "__main__":
    sys.exit(main())
