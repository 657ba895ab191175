"""`mrlx bench credit` (`main`): the units (a seed's warm-start, then each part of it) in processes
of their own, --jobs at a time (`python -m mrlx_lab.bench.credit --unit SEED:PART`, `unit_main`),
then the report."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mrlx_lab.bench.credit.parts import UNITS
from mrlx_lab.bench.credit.settings import ARMS, PARTS, build_parser, settle
from mrlx_lab.bench.credit.tables import aggregate, markdown, plot
from mrlx_lab.bench.report import write_report
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    import subprocess


def seed_list(ns: argparse.Namespace) -> list[int]:
    """The seeds run: --seeds of them from --seed-start."""
    return list(range(ns.seed_start, ns.seed_start + ns.seeds))


def unit_main(ns: argparse.Namespace) -> int:
    """One part of one seed, or its warm-start (a process of its own): its result.json."""
    from mrlx_plugin.local.model import ensure_model

    seed, part = ns.unit.split(":")
    ns.unit_seed = int(seed)
    root = Path(ns.out)
    work = root / f"seed_{seed}" / part
    (work / "logs").mkdir(parents=True, exist_ok=True)
    base = ensure_model(root / "models" / f"{ns.preset}-seed{seed}", preset=ns.preset, seed=int(seed))
    try:
        result = UNITS[part](ns, work, base)
    except RuntimeError as exc:
        print(f"mrlx bench credit: seed {seed} {part}: {exc}", file=sys.stderr)
        return 1
    (work / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    from mrlx_plugin.core import processes
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.model import ensure_model

    argv = list(sys.argv[1:] if argv is None else argv)
    ns = settle(build_parser().parse_args(argv))
    if ns.table:
        try:
            saved = json.loads(Path(ns.table).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--table {ns.table}: cannot read a saved report ({exc})") from None
        print(markdown(saved))
        return 0
    if ns.unit:
        return unit_main(ns)
    root = Path(ns.out)
    started = time.monotonic()
    seeds = seed_list(ns)
    parts = [p for p in PARTS if any(ARMS[a] == p for a in ns.arms)]
    if ns.collect:  # the seeds whose every unit has finished, as a run of those seeds
        seeds = [
            s
            for s in seeds
            if all((root / f"seed_{s}" / u / "result.json").exists() for u in ("warm", *parts))
        ]
        if not seeds:
            raise ConfigError(f"--collect: no seed of {root} has finished every unit of {', '.join(parts)}")
        return report_of(ns, root, seeds, parts, started)
    root.mkdir(parents=True, exist_ok=True)
    for seed in seeds:  # built here once, not by two units at once
        try:
            ensure_model(root / "models" / f"{ns.preset}-seed{seed}", preset=ns.preset, seed=seed)
        except (ValueError, FileExistsError) as exc:
            raise ConfigError(f"--out {root}: {exc}") from None
    # Seed by seed, its warm-start first (its parts start from it): whole seeds finish early, and
    # a stopped run leaves whole seeds behind.
    pending = [(seed, unit) for seed in seeds for unit in ("warm", *parts)]
    threads = max(1, (os.cpu_count() or 2) // ns.jobs)
    running: dict[tuple[int, str], subprocess.Popen[bytes]] = {}
    done: set[tuple[int, str]] = set()
    if ns.resume:  # units finished by a run stopped before (the same options): kept, not rerun
        done = {u for u in pending if (root / f"seed_{u[0]}" / u[1] / "result.json").exists()}
        pending = [u for u in pending if u not in done]
    failed = None
    try:
        while (pending or running) and failed is None:
            ready = [u for u in pending if u[1] == "warm" or (u[0], "warm") in done]
            while ready and len(running) < ns.jobs:
                unit = ready.pop(0)
                pending.remove(unit)
                argv_unit = [*argv, "--unit", f"{unit[0]}:{unit[1]}", "--threads", str(threads)]
                command = [sys.executable, "-m", "mrlx_lab.bench.credit", *argv_unit]
                running[unit] = processes.start(command)
            for unit, proc in list(running.items()):
                if proc.poll() is not None:
                    del running[unit]
                    if proc.returncode != 0:
                        failed = failed or unit
                    done.add(unit)
            time.sleep(0.5)
    finally:  # a failed unit, or the bench stopped: the others are stopped too
        processes.stop_all(list(running.values()), timeout=20)
    if failed is not None:
        print(f"mrlx bench credit: seed {failed[0]} {failed[1]} failed (its error is above)", file=sys.stderr)
        return 1
    return report_of(ns, root, seeds, parts, started)


def report_of(ns: argparse.Namespace, root: Path, seeds: list[int], parts: list[str], started: float) -> int:
    """The report of `seeds` from their units' results: printed, plotted, credit.json."""

    def result(seed: int, unit: str) -> JSONObject:
        return json.loads((root / f"seed_{seed}" / unit / "result.json").read_text())

    units = {(seed, part): result(seed, part) for part in parts for seed in seeds}
    report: JSONObject = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "config": {k: v for k, v in vars(ns).items() if k not in ("unit", "table", "collect")},
        "seeds": seeds,
        "warm_start": [{"seed": seed, **result(seed, "warm")} for seed in seeds],
        **aggregate(ns, units),
    }
    # Collected: the units' own times only (the run's is unknown).
    report["wall_time_s"] = None if ns.collect else time.monotonic() - started
    picture = plot(report, root / "credit.png")
    report["plot"] = str(picture) if picture else None
    print(markdown(report))
    if report["wall_time_s"] is not None:
        print(f"\n  total wall time {report['wall_time_s']:.0f} s; plot: {report['plot']}")
    write_report(root / "credit.json", report)
    return 0
