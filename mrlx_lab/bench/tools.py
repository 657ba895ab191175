"""`mrlx bench tools`: the tool-using demo (`mrlx demo --tools`) from scratch, over several seeds.

Each seed is one run of `mrlx_lab.demos.tools` (a small model built from that seed, one
embedded engine and one embedded trainer; the task is agent code with the official `openai`
client calling a `lookup` tool), on prompts, warm-start data and sampling drawn from the same
seed. For each measure the table gives the mean over the seeds with a 95% interval (Student's t),
then every seed's value: held-out right answers (tables and item-code pairs never seen in
training), the share of held-out episodes that look the code up with a well-formed call, and
the malformed-call rate, before RL (after the warm-start) and after the last step; wall time and
the peak memory of all processes together.

Goals (2-core machine): at most 8 minutes a seed; held-out right answers higher after RL than
before, the interval of the difference above 0; at least 0.9 of episodes looking the code up
after RL; peak memory under 4 GiB.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mrlx_lab.bench.report import interval, write_report
from mrlx_plugin.core.values import JSONObject


def measures(s: JSONObject) -> dict[str, float | None]:
    """The values one seed's summary contributes to the table."""
    before, after = s["held_out"]["before"] or {}, s["held_out"]["after"] or {}

    def diff(key: str) -> float | None:
        a, b = after.get(key), before.get(key)
        return None if a is None or b is None else a - b

    return {
        "right_before": before.get("accuracy"),
        "right_after": after.get("accuracy"),
        "right_gain": diff("accuracy"),
        "lookup_before": before.get("well_formed"),
        "lookup_after": after.get("well_formed"),
        "malformed_after": after.get("malformed"),
        "wall_s": s["wall_time_s"],
        "peak_mib": s["peak_memory_mib"],
    }


LINES = (  # (key, label, goal, format)
    ("right_before", "held-out right answers, before RL", "", "{:.3f}"),
    ("right_after", "held-out right answers, after RL", "", "{:.3f}"),
    ("right_gain", "held-out right answers, after - before", "> 0", "{:+.3f}"),
    ("lookup_before", "held-out episodes looking it up, before RL", "", "{:.3f}"),
    ("lookup_after", "held-out episodes looking it up, after RL", ">= 0.9", "{:.3f}"),
    ("malformed_after", "malformed tool calls per request, after RL", "", "{:.3f}"),
    ("wall_s", "wall time per seed (s)", "<= 480", "{:.0f}"),
    ("peak_mib", "peak memory, all processes (MiB)", "< 4096", "{:.0f}"),
)


def table(per_seed: list[dict[str, float | None]]) -> list[tuple[str, str, str, str]]:
    """(measure, mean [95% interval], goal, per-seed values) lines."""
    out = []
    for key, label, goal, fmt in LINES:
        values = [m[key] for m in per_seed if m[key] is not None]
        if not values:
            out.append((label, "-", goal, ""))
            continue
        mean, lo, hi = interval(values)
        shown = fmt.format(mean) + (f" [{fmt.format(lo)}, {fmt.format(hi)}]" if len(values) > 1 else "")
        out.append((label, shown, goal, " ".join(fmt.format(v) for v in values)))
    return out


def main(argv: list[str] | None = None) -> int:
    from mrlx_lab.demos.tools import build_parser, run_tool_demo
    from mrlx_plugin.core.config import ConfigError

    p = argparse.ArgumentParser(prog="mrlx bench tools", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/tools.json")
    p.add_argument("--workdir", default="runs/bench/tools", help="one run folder per seed under it")
    p.add_argument(
        "--seeds", type=int, default=5, help="runs, with seeds 0 .. N-1 (at least 2 for intervals)"
    )
    ns, rest = p.parse_known_args(argv)
    if ns.seeds < 1:
        print("mrlx bench tools: --seeds must be at least 1", file=sys.stderr)
        return 2
    summaries = []
    for seed in range(ns.seeds):
        workdir = Path(ns.workdir) / f"seed_{seed}"
        # A measurement starts from scratch: an earlier run in the work folder is replaced.
        args = build_parser().parse_args(
            ["--out", str(workdir), "--quiet", "--overwrite", *rest, "--seed", str(seed)]
        )
        print(f"mrlx bench tools: seed {seed}: mrlx demo --tools in {workdir} ...", flush=True)
        try:
            summaries.append(run_tool_demo(args))
        except (RuntimeError, ConfigError) as exc:
            print(f"mrlx bench tools: seed {seed}: {exc}", file=sys.stderr)
            return 1
    per_seed = [measures(s) for s in summaries]
    lines = table(per_seed)
    width = max(len(r[0]) for r in lines)
    print(f"\n  {'measure':<{width}}  {'mean [95% interval]':>24}  {'goal':>7}  per seed")
    for label, value, goal, values in lines:
        print(f"  {label:<{width}}  {value:>24}  {goal:>7}  {values}")
    print(
        f"  ({len(summaries)} seeds; {summaries[0]['steps']} RL steps of {summaries[0]['episodes_per_step']} "
        f"episodes after {summaries[0]['warm_start_steps']} warm-start steps; "
        f"{summaries[0]['held_out']['prompts']} held-out prompts per evaluation)"
    )
    for seed, s in enumerate(summaries):
        curve = ", ".join(
            f"{c['step']}: {c['accuracy']:.2f}/{c['well_formed']:.2f}" for c in s["held_out"]["curve"]
        )
        print(f"  seed {seed} held-out curve (RL steps: right / looked it up): {curve}")
    write_report(
        ns.out,
        {
            "tools": {"seeds": list(range(ns.seeds)), "per_seed": per_seed, "table": lines},
            "runs": summaries,
            "workdir": str(Path(ns.workdir)),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
