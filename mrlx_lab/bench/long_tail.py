"""`mrlx bench async`: synchronous against fully asynchronous rollouts on a long-tail workload, over
seeds, at equal budgets (the same steps, and samples trained, per arm).

Each seed runs `mrlx demo --long-tail` (the demo's two agents; a fraction of the questions
discussed for many rounds), its sync run and its async run one after the other. Per arm, the mean
and 95% interval over seeds of: each trainer's idle fraction (its rollout function's time over
the step's wall time without evaluation; the proposer's split into waiting for episodes and
waiting for the decider's trainer), samples trained per second, the held-out team reward (last
evaluation and the curve), and the staleness of the trained groups (counts per number of
versions, summed over seeds).

Goals: the async proposer waits for episodes under 10% of its time where the sync one waits over
40%; the async held-out team reward is no worse than sync's within the intervals (its mean at or
above the lower end of sync's 95% interval).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mrlx_lab.bench.report import interval, write_report
from mrlx_plugin.core.values import JSONObject

MEASURES = (
    # (key in the report, title, how to show, path into a run's measures)
    ("idle_proposer", "proposer idle (waiting for its rollout)", "pct", ("idle", "proposer")),
    ("episode_wait_proposer", "  of which for episodes", "pct", ("idle_waiting_for_episodes", "proposer")),
    ("peer_wait_proposer", "  of which for decider's trainer", "pct", ("idle_waiting_for_peer", "proposer")),
    ("idle_decider", "decider idle (waiting for proposer's groups)", "pct", ("idle", "decider")),
    ("samples_per_s", "samples trained per second", "rate", ("samples_per_s",)),
    ("training_wall_s", "training wall time (s)", "int", ("training_wall_s",)),
    ("groups_given_back", "groups given back (too stale)", "int", ("groups_given_back",)),
    ("engine_calls", "engine calls", "int", ("engine_calls",)),
    ("held_out_last", "held-out team reward, last evaluation", "reward", ("held_out_last",)),
    ("held_out_mean", "held-out team reward, mean of the curve", "reward", ("held_out_mean",)),
    ("team_reward_last5", "training team reward, last 5 steps", "reward", ("team_reward_last5",)),
)


def _get(run: JSONObject, path: tuple[str, ...]) -> float | None:
    value: object = run
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def summarize(runs: list[JSONObject]) -> JSONObject:
    """One arm over its seeds: each measure's mean and 95% interval, the staleness counts summed,
    and the held-out curve's mean and interval per weight version."""
    out: JSONObject = {}
    for key, _, _, path in MEASURES:
        values = [v for v in (_get(r, path) for r in runs) if v is not None]
        out[key] = dict(zip(("mean", "low", "high"), interval(values))) if values else None
    staleness: dict[str, dict[str, float]] = {}
    for run in runs:
        for agent, counts in run["staleness"].items():
            for n, count in counts.items():
                staleness.setdefault(agent, {})[n] = staleness.get(agent, {}).get(n, 0.0) + count
    out["staleness"] = {a: dict(sorted(c.items(), key=lambda kv: int(kv[0]))) for a, c in staleness.items()}
    curves: dict[int, list[float]] = {}
    for run in runs:
        for version, reward in run["held_out_curve"]:
            curves.setdefault(int(version), []).append(float(reward))
    out["held_out_curve"] = [
        {"version": v, **dict(zip(("mean", "low", "high"), interval(rs))), "seeds": len(rs)}
        for v, rs in sorted(curves.items())
    ]
    return out


def _show(kind: str, cell: JSONObject | None) -> str:
    if cell is None:
        return "-"
    mean, low, high = cell["mean"], cell["low"], cell["high"]
    if kind == "pct":
        return f"{100 * mean:.0f}% [{100 * low:.0f}, {100 * high:.0f}]"
    if kind == "reward":
        return f"{mean:.3f} [{low:.3f}, {high:.3f}]"
    if kind == "rate":
        return f"{mean:.1f} [{low:.1f}, {high:.1f}]"
    return f"{mean:.0f} [{low:.0f}, {high:.0f}]"


def goals(arms: JSONObject) -> JSONObject:
    """The goals, met or not (None where an arm is missing)."""
    sync, asyn = arms.get("sync"), arms.get("async")
    if not sync or not asyn:
        return {}

    def mean(arm: JSONObject, key: str) -> float | None:
        return arm[key]["mean"] if arm.get(key) else None

    out: JSONObject = {}
    a_wait, s_wait = mean(asyn, "episode_wait_proposer"), mean(sync, "episode_wait_proposer")
    out["async_proposer_waits_for_episodes_under_10pct"] = None if a_wait is None else a_wait < 0.10
    out["sync_proposer_waits_for_episodes_over_40pct"] = None if s_wait is None else s_wait > 0.40
    a_idle, s_idle = mean(asyn, "idle_proposer"), mean(sync, "idle_proposer")
    out["async_proposer_idle_under_10pct"] = None if a_idle is None else a_idle < 0.10
    out["sync_proposer_idle_over_40pct"] = None if s_idle is None else s_idle > 0.40
    a_ho, s_ho = asyn.get("held_out_last"), sync.get("held_out_last")
    out["held_out_no_worse_within_intervals"] = None if not a_ho or not s_ho else a_ho["mean"] >= s_ho["low"]
    return out


def main(argv: list[str] | None = None) -> int:
    from mrlx_lab.demos.long_tail import ARMS, build_parser, run_arm

    p = argparse.ArgumentParser(prog="mrlx bench async", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/async.json")
    p.add_argument("--workdir", default="runs/bench/async")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which arms (default: both)")
    ns, rest = p.parse_known_args(argv)
    if ns.seeds < 1 or ns.steps < 1:
        print("mrlx bench async: --seeds and --steps: expected at least 1", file=sys.stderr)
        return 2
    runs: dict[str, list[JSONObject]] = {arm: [] for arm in ARMS if arm in ns.arms}
    demo_ns = None
    for seed in range(ns.seeds):
        for arm in runs:
            # A measurement starts from scratch: an earlier run in the work folder is replaced.
            out = Path(ns.workdir) / f"seed-{seed}"
            argv = ["--out", str(out), "--seed", str(seed), "--steps", str(ns.steps), "--overwrite"]
            demo_ns = build_parser().parse_args([*argv, "--quiet", *rest])
            print(f"mrlx bench async: seed {seed}, {arm} ...", flush=True)
            runs[arm].append(run_arm(demo_ns, arm))
    assert demo_ns is not None
    arms = {arm: summarize(rs) for arm, rs in runs.items()}
    report: JSONObject = {
        "workload": {
            "tail_fraction": demo_ns.tail_fraction,
            "tail_rounds": demo_ns.tail_rounds,
            "max_staleness": demo_ns.max_staleness,
            "steps": ns.steps,
            "prompts_per_step": demo_ns.prompts_per_step,
            "samples_per_prompt": demo_ns.samples_per_prompt,
            "eval_prompts": demo_ns.eval_prompts,
            "eval_interval": demo_ns.eval_interval,
            "seeds": ns.seeds,
            "preset": demo_ns.preset,
        },
        "arms": arms,
        "runs": runs,
        "goals": goals(arms),
    }
    print_table(report)
    write_report(ns.out, report)
    return 0


def print_table(report: JSONObject) -> None:
    w, arms = report["workload"], report["arms"]
    print(
        f"\nmrlx bench async: {w['seeds']} seed(s); {w['tail_fraction']:.3g} of the questions take "
        f"{w['tail_rounds']} rounds (the rest 1); {w['steps']} steps of {w['prompts_per_step']} x "
        f"{w['samples_per_prompt']} episodes per run; async max_staleness {w['max_staleness']}"
    )
    width = max(len(title) for _, title, _, _ in MEASURES)
    print(f"  {'mean [95% interval] over seeds':<{width}}  " + "  ".join(f"{arm:>24}" for arm in arms))
    for key, title, kind, _ in MEASURES:
        print(f"  {title:<{width}}  " + "  ".join(f"{_show(kind, arms[arm][key]):>24}" for arm in arms))
    for agent in sorted({a for arm in arms.values() for a in arm["staleness"]}):
        cells = [
            " ".join(f"{n}:{int(c)}" for n, c in (arms[arm]["staleness"].get(agent) or {}).items()) or "-"
            for arm in arms
        ]
        title = f"staleness for {agent} (versions:groups)"
        print(f"  {title:<{width}}  " + "  ".join(f"{cell:>24}" for cell in cells))
    for goal, met in report["goals"].items():
        print(f"  goal {goal}: {'met' if met else 'NOT met' if met is not None else '-'}")


if __name__ == "__main__":
    sys.exit(main())
