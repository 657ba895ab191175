"""`mrlx bench coordinator` (`main`): the three measurements in one run, the report and its table."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import sys
import tempfile
from typing import TypedDict

from mrlx_lab.bench.coordinator.service import (
    WakeUp,
    consumer_main,
    producer_main,
    start_coordinator,
    wake_up_latency,
)
from mrlx_lab.bench.coordinator.steps import Throughput, run_steps, throughput
from mrlx_plugin.core import processes
from mrlx_plugin.core.values import JSON


class CoordinatorBenchReport(TypedDict, total=False):
    """The numbers of `mrlx bench coordinator`: its settings, each step of the coordinator and of
    the baseline (the last one also on its own), the barrier's wake-up latency, the speed-ups."""

    config: dict[str, JSON]
    coordinator_steps: list[Throughput]
    coordinator: Throughput
    wake_up_ms: WakeUp
    baseline_steps: list[Throughput]
    baseline: Throughput
    speedup_vs_baseline: float
    speedup_vs_baseline_first_step: float


def run_coordinator_bench(
    out_json: str | None,
    samples: int = 2048,
    tokens: int = 8192,
    *,
    steps: int = 2,
    step_gap_s: float = 2.0,
    group_size: int = 8,
    lease_groups: int = 16,
    consumer_workers: int = 2,
    wake_trials: int = 200,
    baseline: bool = True,
    baseline_producers: int = 16,
    synchronous: str = "full",
    workdir: str | None = None,
    timeout_s: float = 900.0,
) -> CoordinatorBenchReport:
    """Run the three measurements; return (and write to `out_json`) their numbers.

    `report["coordinator"]` and `report["baseline"]` are the last step (steady state);
    `..._steps` hold every step, the first being the cold one.
    """
    if steps < 1 or samples < 1 or tokens < 2:
        raise ValueError("need steps >= 1, samples >= 1 and tokens >= 2")
    ctx = mp.get_context("spawn")
    token = secrets.token_hex(16)
    report: CoordinatorBenchReport = {
        "config": {
            "samples": samples,
            "tokens": tokens,
            "response_length": max(1, tokens // 2),
            "steps": steps,
            "step_gap_s": step_gap_s,
            "group_size": group_size,
            "lease_groups": lease_groups,
            "consumer_workers": consumer_workers,
            "synchronous": synchronous,
            "wake_trials": wake_trials,
            "baseline_producers": baseline_producers,
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
        }
    }
    if workdir:
        os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mrlx-coord-bench-", dir=workdir) as tmp:
        proc, url = start_coordinator(tmp, token, synchronous, max_depth=max(65536, 2 * samples))
        try:
            results = run_steps(
                ctx,
                (producer_main, (url, token, samples, tokens, group_size)),
                (consumer_main, (url, token, samples, lease_groups, consumer_workers)),
                steps,
                step_gap_s,
                timeout_s,
                server_pid=proc.pid,
            )
            report["coordinator_steps"] = [throughput(result, samples, tokens) for result in results]
            report["coordinator"] = report["coordinator_steps"][-1]
            if wake_trials > 0:
                report["wake_up_ms"] = wake_up_latency(ctx, url, token, wake_trials, timeout_s)
        finally:
            processes.stop(proc, timeout=20)
        if baseline:
            from mrlx_lab.bench.coordinator.baseline import run_baseline

            results = run_baseline(
                ctx, tmp, samples, tokens, baseline_producers, steps, step_gap_s, timeout_s
            )
            report["baseline_steps"] = [throughput(result, samples, tokens) for result in results]
            report["baseline"] = report["baseline_steps"][-1]
            report["speedup_vs_baseline"] = round(
                report["coordinator"]["tokens_per_s"] / report["baseline"]["tokens_per_s"], 2
            )
            report["speedup_vs_baseline_first_step"] = round(
                report["coordinator_steps"][0]["tokens_per_s"] / report["baseline_steps"][0]["tokens_per_s"],
                2,
            )
    print(format_table(report))
    if out_json:
        from mrlx_lab.bench.report import write_report

        write_report(out_json, report)
    return report


def format_table(report: CoordinatorBenchReport) -> str:
    """The report as a plain-text table."""
    cfg = report["config"]
    lines = [
        (
            f"coordinator benchmark: {cfg['samples']} samples x {cfg['tokens']} tokens "
            f"(response {cfg['response_length']}), groups of {cfg['group_size']}, {cfg['steps']} steps, "
            f"synchronous={cfg['synchronous']}, {cfg['cpus']} CPUs"
        ),
        f"{'path':<48} {'step':>5} {'seconds':>8} {'Mtok/s':>7} {'samples/s':>9} {'first':>6} "
        f"{'cpu p/s/c':>16} {'ok':>3}",
    ]
    for rows, label in (
        (report.get("coordinator_steps", []), "coordinator (Arrow frames, SQLite, lease/ack)"),
        (report.get("baseline_steps", []), "baseline (1 JSON item/request, in memory)"),
    ):
        for step, row in enumerate(rows):
            cpu = (
                f"{row['producer_cpu_s']:.2f}/{row.get('server_cpu_s', float('nan')):.2f}/"
                f"{row['consumer_cpu_s']:.2f}"
            )
            lines.append(
                f"{label:<48} {step:>5} {row['seconds']:>8.3f} {row['tokens_per_s'] / 1e6:>7.2f} "
                f"{row['samples_per_s']:>9.1f} "
                f"{row['consumer_timeline_s'].get('first', float('nan')):>6.3f} {cpu:>16} "
                f"{'yes' if row['checksum_ok'] else 'NO':>3}"
            )
    if "speedup_vs_baseline" in report:
        lines.append(
            f"speed-up vs baseline: {report['speedup_vs_baseline']:.2f}x (last step), "
            f"{report['speedup_vs_baseline_first_step']:.2f}x (first step)"
        )
    if "wake_up_ms" in report:
        wake = report["wake_up_ms"]
        lines.append(
            f"wait_version wake-up after report ({wake['trials']} trials): p50 {wake['p50']:.2f} ms, "
            f"p99 {wake['p99']:.2f} ms, max {wake['max']:.2f} ms"
        )
    lines.append(
        "first = seconds until the consumer held its first samples; cpu = producer/server/consumer CPU "
        "seconds"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m mrlx_lab.bench.coordinator [--samples N --tokens N ...]`."""
    from mrlx_lab.bench import coordinator  # the benchmark's own docstring: what it measures

    parser = argparse.ArgumentParser(
        prog="mrlx bench coordinator", description=(coordinator.__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--samples", type=int, default=2048, help="samples per step")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per sample (half of them response)")
    parser.add_argument("--steps", type=int, default=2, help="steps to run; the last one is the headline")
    parser.add_argument("--step-gap-s", type=float, default=2.0, help="idle seconds between steps")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lease-groups", type=int, default=16, help="groups per lease call")
    parser.add_argument(
        "--consumer-workers", type=int, default=2, help="concurrent lease loops in the consumer"
    )
    parser.add_argument("--wake-trials", type=int, default=200)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--baseline-producers", type=int, default=16)
    parser.add_argument("--synchronous", choices=("full", "normal"), default="full")
    parser.add_argument(
        "--workdir", default=None, help="where the database goes (a local disk; default: the temp dir)"
    )
    parser.add_argument("--out", default="runs/bench/coordinator.json", help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    run_coordinator_bench(
        args.out,
        args.samples,
        args.tokens,
        steps=args.steps,
        step_gap_s=args.step_gap_s,
        group_size=args.group_size,
        lease_groups=args.lease_groups,
        consumer_workers=args.consumer_workers,
        wake_trials=args.wake_trials,
        baseline=not args.no_baseline,
        baseline_producers=args.baseline_producers,
        synchronous=args.synchronous,
        workdir=args.workdir,
    )
    return 0
