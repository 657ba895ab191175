"""`mrlx bench credit` over the seeds: each arm's measures, their intervals, the docs' tables
(`markdown`) and the plot."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypedDict

from mrlx_lab.bench.credit.settings import ARMS, OPPONENTS, PARTS
from mrlx_lab.bench.report import interval
from mrlx_plugin.core.values import JSONObject

LINES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "chain": (
        ("success_before", "held-out success, before RL", "{:.3f}"),
        ("success_after", "held-out success, after RL", "{:.3f}"),
        ("steps_right_before", "held-out steps right (share), before RL", "{:.3f}"),
        ("steps_right_after", "held-out steps right (share), after RL", "{:.3f}"),
        ("seen_success_after", "trained chains: success, after RL", "{:.3f}"),
        ("seen_steps_right_before", "trained chains: steps right (share), before RL", "{:.3f}"),
        ("seen_steps_right_after", "trained chains: steps right (share), after RL", "{:.3f}"),
    ),
    "nim": (
        ("random_trained_before", "win rate vs script:random, trained piles, before", "{:.3f}"),
        ("random_trained_after", "win rate vs script:random, trained piles, after", "{:.3f}"),
        (
            "random_trained_first_after",
            "win rate vs script:random, trained piles, first seat, after",
            "{:.3f}",
        ),
        (
            "random_trained_second_after",
            "win rate vs script:random, trained piles, second seat, after",
            "{:.3f}",
        ),
        ("random_held_out_before", "win rate vs script:random, held-out piles, before", "{:.3f}"),
        ("random_held_out_after", "win rate vs script:random, held-out piles, after", "{:.3f}"),
        ("optimal_trained_after", "win rate vs script:optimal, trained piles, after", "{:.3f}"),
        ("optimal_held_out_after", "win rate vs script:optimal, held-out piles, after", "{:.3f}"),
        (
            "optimal_moves_trained_before",
            "optimal moves from winning positions, trained piles, before",
            "{:.3f}",
        ),
        (
            "optimal_moves_trained_after",
            "optimal moves from winning positions, trained piles, after",
            "{:.3f}",
        ),
        (
            "optimal_moves_held_out_after",
            "optimal moves from winning positions, held-out piles, after",
            "{:.3f}",
        ),
        ("illegal_after", "illegal answers (probe), after", "{:.3f}"),
    ),
    "kuhn": (
        ("exploitability_before", "exploitability, before RL", "{:.3f}"),
        ("exploitability_after", "exploitability, after RL (last iterate)", "{:.3f}"),
        ("exploitability_average", "exploitability of the average policy (snapshots alike)", "{:.3f}"),
        ("exploitability_rise", "seeds whose last iterate ends above the start", "count"),
        ("exploitability_average_rise", "seeds whose average policy ends above the start", "count"),
        ("illegal_before", "illegal answers (probe), before", "{:.3f}"),
        ("illegal_after", "illegal answers (probe), after", "{:.3f}"),
    ),
}
COMMON = (
    ("engine_calls", "engine calls spent in training", "{:,.0f}"),
    ("steps", "training steps", "{:.0f}"),
    ("samples_trained", "samples trained (no fillers)", "{:,.0f}"),
    ("tokens_trained", "tokens trained", "{:,.0f}"),
    ("samples_all", "samples returned, fillers included", "{:,.0f}"),
    ("wall_s", "wall time (s)", "{:.0f}"),
)
# The measures shown seed by seed under each table.
PER_SEED = {
    "chain": ("steps_right_after", "seen_steps_right_after"),
    "nim": ("random_trained_after", "random_held_out_after"),
    "kuhn": ("exploitability_before", "exploitability_after", "exploitability_average"),
}


def measures(part: str, rec: JSONObject) -> dict[str, float | None]:
    """The values one arm of one seed contributes to the tables."""
    out: dict[str, float | None] = {
        "engine_calls": rec["engine_calls"],
        "steps": rec["steps"],
        "samples_trained": rec["samples_trained"],
        "tokens_trained": rec["tokens_trained"],
        "samples_all": rec["samples_all"],
        "wall_s": rec["wall_time_s"],
    }
    for when in ("before", "after"):
        for key, value in (rec.get(when) or {}).items():
            if key not in ("after_steps", "engine_calls"):
                out[f"{key}_{when}"] = value
        probe = rec.get(f"probe_{when}") or {}
        if part == "nim" and probe:
            out[f"optimal_moves_trained_{when}"] = probe["optimal_trained"]
            out[f"optimal_moves_held_out_{when}"] = probe["optimal_held_out"]
            out[f"illegal_{when}"] = probe["illegal"]
        if part == "kuhn" and probe:
            out[f"exploitability_{when}"] = probe["exploitability"]
            out[f"illegal_{when}"] = probe["illegal"]
    if part == "kuhn" and rec.get("average") and rec.get("probe_before"):
        start = rec["probe_before"]["exploitability"]
        out["exploitability_average"] = rec["average"]["exploitability"]
        # Counted over the seeds (the table's cell is the share of seeds; the sum is the count).
        out["exploitability_rise"] = float(rec["probe_after"]["exploitability"] > start)
        out["exploitability_average_rise"] = float(rec["average"]["exploitability"] > start)
    return out


class Interval(TypedDict):
    """A measure over the seeds: its mean, its 95% interval, and each seed's value."""

    mean: float
    low: float
    high: float
    values: list[float | None]


def summarise(values: list[float | None]) -> Interval | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    mean, low, high = interval(known)
    return {"mean": mean, "low": low, "high": high, "values": values}


def reference(part: str, key: str, ref: dict[str, float]) -> str:
    """What a known player scores on the measure `key`, for scale."""
    if part == "kuhn" and key.startswith("exploitability") and not key.endswith("_rise"):
        return f"uniform {ref['uniform_exploitability']:.3f}, equilibrium 0"
    if part != "nim" or "_first" in key or "_second" in key:
        return ""
    if key.startswith("optimal_moves"):
        return "optimal 1"
    if key.startswith(OPPONENTS):
        opp, piles = key.split("_")[0], "held_out" if "held_out" in key else "trained"
        return f"optimal {ref[f'optimal_vs_{opp}_{piles}']:.3f}, random {ref[f'random_vs_{opp}_{piles}']:.3f}"
    return ""


def _cell(s: Interval | None, fmt: str) -> str:
    if s is None:
        return "-"
    if fmt == "count":  # a 0/1 per seed: how many seeds of how many
        known = [v for v in s["values"] if v is not None]
        return f"{sum(known):.0f} of {len(known)}"
    if s["high"] == s["low"]:
        return fmt.format(s["mean"])
    return f"{fmt.format(s['mean'])} [{fmt.format(s['low'])}, {fmt.format(s['high'])}]"


def markdown(report: JSONObject) -> str:
    """The docs' tables: per part, a line per measure, a column per arm (mean [95% interval] over
    the seeds), the reference players' values; then the main measure seed by seed."""
    lines: list[str] = []
    seeds = report["seeds"]
    for part in PARTS:
        p = report.get(part)
        if not p:
            continue
        arms = list(p["arms"])
        ref = p.get("reference") or {}
        lines += [
            "",
            f"| {part}: {p['task']} | " + " | ".join(arms) + " | reference |",
            "|---|" + "---|" * (len(arms) + 1),
        ]
        for key, label, fmt in (*LINES[part], *COMMON):
            cells = [_cell(p["arms"][a]["summary"].get(key), fmt) for a in arms]
            if all(c == "-" for c in cells):
                continue
            lines.append(f"| {label.strip()} | " + " | ".join(cells) + f" | {reference(part, key, ref)} |")
        for key in PER_SEED[part]:
            label = next(lab for k, lab, _ in LINES[part] if k == key)
            fmt = next(f for k, _, f in LINES[part] if k == key)
            per = "; ".join(
                f"{a} " + " / ".join("-" if v is None else fmt.format(v) for v in s["values"])
                for a in arms
                if (s := p["arms"][a]["summary"].get(key))
            )
            lines += ["", f"{label}, seeds {' / '.join(map(str, seeds))}: {per}"]
    return "\n".join(lines[1:])


def aggregate(ns: argparse.Namespace, units: dict[tuple[int, str], JSONObject]) -> JSONObject:
    """Per part: the units' facts, each arm's runs (one per seed) and their summary."""
    out: JSONObject = {}
    for part in PARTS:
        seeds = range(ns.seed_start, ns.seed_start + ns.seeds)
        found = [(seed, units[(seed, part)]) for seed in seeds if (seed, part) in units]
        if not found:
            continue
        first = found[0][1]
        arms: JSONObject = {}
        for arm in (a for a in ns.arms if ARMS[a] == part):
            runs = [u["arms"][arm] for _, u in found]
            per_seed = [measures(part, r) for r in runs]
            keys = dict.fromkeys(k for m in per_seed for k in m)
            arms[arm] = {
                "summary": {k: s for k in keys if (s := summarise([m.get(k) for m in per_seed])) is not None},
                "runs": runs,
            }
        out[part] = {
            "task": first["task"],
            "reference": first.get("reference"),
            "units": [{"seed": seed, **{k: v for k, v in u.items() if k != "arms"}} for seed, u in found],
            "arms": arms,
        }
    return out


def plot(report: JSONObject, path: Path) -> Path | None:
    """Steps right on the trained and held-out chains, and nim's win rate against `script:random`,
    against the engine calls spent, a line per arm and seed; kuhn's exploitability before and
    after (the last iterate) and of the average policy, per arm."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PARTS if report.get(p)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), dpi=120, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, part in zip(axes[0], panels):
        arms = report[part]["arms"]
        if part == "kuhn":
            names = list(arms)
            for j, when in enumerate(("before", "after", "average")):
                s = [arms[a]["summary"].get(f"exploitability_{when}") for a in names]
                xs = [i + (j - 1) * 0.27 for i in range(len(names))]
                means = [x["mean"] if x else 0.0 for x in s]
                errs = [x["mean"] - x["low"] if x else 0.0 for x in s]
                ax.bar(xs, means, width=0.27, yerr=errs, capsize=4, label=when)
            ax.axhline(report["kuhn"]["reference"]["uniform_exploitability"], color="grey", lw=0.8, ls="--")
            ax.set_xticks(range(len(names)), names)
            ax.set_title("kuhn poker: exploitability (uniform: dashed)")
            ax.set_ylabel("exploitability")
            ax.legend(loc="upper right")
            continue
        # chain: steps right on the trained chains (solid) and the held-out ones (dashed); nim: the
        # win rate against script:random on the trained piles.
        keys = (
            (("seen_steps_right", "-"), ("steps_right", "--"))
            if part == "chain"
            else (("random_trained", "-"),)
        )
        for i, (name, arm) in enumerate(arms.items()):
            for j, run in enumerate(arm["runs"]):
                for k, (key, style) in enumerate(keys):
                    points = [p for p in run["curve"] if p.get(key) is not None]
                    ax.plot(
                        [p["engine_calls"] for p in points],
                        [p[key] for p in points],
                        color=colours[i % len(colours)],
                        ls=style,
                        lw=1,
                        alpha=0.6,
                        label=name if j == k == 0 else None,
                    )
        ax.set_title(
            "chain: steps right, trained (solid) and held-out (dashed)"
            if part == "chain"
            else "nim: win rate vs script:random, trained piles"
        )
        ax.set_xlabel("engine calls spent in training")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
