"""The report of `mrlx bench load`: the load round, the coordinator under backpressure, the soak's
growth of memory, open files and disk, the checks; and its table."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TypedDict

from mrlx_lab.bench.load.scrape import metric_value
from mrlx_lab.bench.load.workers import CONSUMER, ConsumerStats, LoadEvent
from mrlx_plugin.core.values import JSON


class MetricRow(TypedDict, total=False):
    """One scrape of the coordinator's /metrics by the driver: agent b's queue and the commits
    (`error` in their place when the scrape failed)."""

    t: float
    error: str
    depth: int
    queued: int
    leased: int
    enqueued: int
    acked: int
    commits_ok: int
    commits_429: int


# The driver's sample of the processes (memory, open files, CPU time, the database's size, the
# machine's load) at `t`: measure -> value (None: the process had just exited).
ProcRow = dict[str, "float | None"]
# The growth of one measure over the soak (`growth`).
Growth = dict[str, "float | bool | None"]


class Rates(TypedDict):
    """Items committed and acked per second over some scrapes, and the commits accepted and pushed back."""

    items_per_s: float | None
    acked_per_s: float | None
    commits_ok: int
    commits_429: int


class Backlog(TypedDict):
    """The load round once its first groups were whole: how fast items went in, for how long, and
    how often the queue stood empty."""

    items_per_s: float | None
    seconds: float
    empty_queue_share: float | None


class SoakRates(Rates):
    drain_wait_s: float  # the rollout's wait for the coordinator to take its items


class LoadRoundRates(SoakRates):
    while_committing: Backlog


class CoordinatorSection(TypedDict):
    """The coordinator under backpressure (`_coordinator`)."""

    max_depth_limit: int
    max_depth_observed: int | None
    max_depth_observed_load: int | None
    depth_bounded: bool
    load_round: LoadRoundRates
    soak: SoakRates
    whole_run: Rates
    commits_429_total: int
    commits_ok_total: int
    items_enqueued_total: int
    items_acked_total: int
    items_redelivered_total: int
    items_sent_by_rollout: int
    duplicates: int
    barrier_wait_s: float
    consumer: ConsumerStats
    depth_samples: list[list[float]]
    depth_samples_columns: list[str]


class LoadSection(TypedDict):
    """The load round: every episode at once."""

    episodes: int
    max_in_flight: int
    wall_s: float
    episodes_s: float
    drain_wait_s: float
    rss_ready_mib: float
    rss_before_mib: float
    peak_rss_mib: float
    rss_after_mib: float
    fds_after: int
    statuses: dict[str, int]


class SoakSection(TypedDict):
    """The soak (`_soak`)."""

    duration_s: float
    rounds: int
    episodes: int
    episodes_per_s: float | None
    trends: dict[str, Growth]
    samples: list[ProcRow]
    cpu_pct: dict[str, float | None]
    round_wall_s_first: float | None
    round_wall_s_last: float | None
    round_rss_after_mib: list[float]


class LoadReport(TypedDict):
    """The report of `mrlx bench load` (`report`), written as JSON."""

    machine: dict[str, int | str]
    config: dict[str, JSON]
    load: LoadSection
    coordinator: CoordinatorSection
    soak: SoakSection
    rounds: list[LoadEvent]
    statuses: dict[str, int]
    checks: dict[str, bool]
    ok: bool


def growth(
    samples: list[ProcRow],
    key: str,
    warmup_s: float,
    window_s: float,
    tolerance_pct: float,
    tolerance_abs: float,
) -> Growth:
    """first/last/max of `key` over `samples` (each with `t_s` since the soak began), and the
    growth: mean of the last window against the mean of the first window after warm-up. The
    windows shrink for short soaks so that each holds at least one sample."""
    points = [(s["t_s"], s[key]) for s in samples if s.get(key) is not None]
    if not points:
        return {
            "first": None,
            "last": None,
            "max": None,
            "growth": None,
            "growth_pct": None,
            "flagged": False,
        }
    end = points[-1][0]
    warm = [p for p in points if p[0] >= min(warmup_s, end * 0.25)] or points[-1:]
    start = warm[0][0]
    span = min(window_s, max(0.0, (end - start) / 3))
    first = [v for t, v in warm if t <= start + span] or [warm[0][1]]
    last = [v for t, v in warm if t >= end - span] or [warm[-1][1]]
    a, b = sum(first) / len(first), sum(last) / len(last)
    delta = b - a
    pct = 100.0 * delta / a if a else 0.0
    return {
        "first": points[0][1],
        "last": points[-1][1],
        "max": max(v for _, v in points),
        "first_window_mean": a,
        "last_window_mean": b,
        "growth": delta,
        "growth_pct": pct,
        "flagged": delta > tolerance_abs and pct > tolerance_pct,
    }


def report(
    ns: argparse.Namespace,
    events: list[LoadEvent],
    metric_rows: list[MetricRow],
    proc_rows: list[ProcRow],
    consumed: ConsumerStats,
    final: dict[str, float],
    mean_prompt: float,
    run_dir: str,
) -> LoadReport:
    """The benchmark's report from what the driver sampled (`final`: the last /metrics scrape,
    `consumed`: the consumer's result)."""
    rounds = [e for e in events if e["event"] == "round"]
    ready = next(e for e in events if e["event"] == "ready")
    load = next(r for r in rounds if r["phase"] == "load")
    soak_rounds = [r for r in rounds if r["phase"] == "soak"]
    soak_start = next((e["t"] for e in events if e["event"] == "soak_start"), load["t_end"])
    soak_end = next((e["t"] for e in events if e["event"] == "soak_end"), soak_start)
    statuses: dict[str, int] = {}
    for r in rounds:
        for k, v in r["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    coordinator = _coordinator(ns, metric_rows, rounds, (soak_start, soak_end), consumed, final)
    samples = [
        {**{k: v for k, v in r.items() if k != "t"}, "t_s": round(r["t"] - soak_start, 2)}
        for r in proc_rows
        if soak_start <= r["t"] <= soak_end
    ]
    trends = _trends(ns, samples)
    checks = {
        "all_episodes_in_flight": load["max_in_flight"] == load["episodes"],
        "depth_bounded": coordinator["depth_bounded"],
        "backpressure_engaged": coordinator["commits_429_total"] > 0,
        "no_aborted_samples": statuses.get("aborted", 0) == 0,
        "every_item_acked_once": (
            consumed["items"]
            == coordinator["items_sent_by_rollout"]
            == coordinator["items_enqueued_total"]
            == coordinator["items_acked_total"]
            and consumed["bad_groups"] == 0
        ),
        "no_growth_flagged": not any(t["flagged"] for t in trends.values()),
    }
    return {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0]},
        "config": _config(ns, mean_prompt, run_dir),
        "load": {
            "episodes": load["episodes"],
            "max_in_flight": load["max_in_flight"],
            "wall_s": load["wall_s"],
            "episodes_s": load["episodes_s"],
            "drain_wait_s": load["drain_wait_s"],
            "rss_ready_mib": ready["rss_mib"],
            "rss_before_mib": load["rss_before_mib"],
            "peak_rss_mib": load["hwm_mib"],
            "rss_after_mib": load["rss_after_mib"],
            "fds_after": load["fds"],
            "statuses": load["statuses"],
        },
        "coordinator": coordinator,
        "soak": _soak(soak_rounds, soak_start, soak_end, samples, trends),
        "rounds": rounds,
        "statuses": statuses,
        "checks": checks,
        "ok": all(checks.values()),
    }


def _config(ns: argparse.Namespace, mean_prompt: float, run_dir: str) -> dict[str, JSON]:
    return {
        "episodes": ns.episodes,
        "n_samples_per_prompt": ns.n_samples_per_prompt,
        "system": "dialogue a -> b (2 turns)",
        "latency_s": ns.latency,
        "mean_prompt_tokens": round(mean_prompt),
        "response_tokens": ns.response_tokens,
        "max_depth": ns.max_depth,
        "consumer_rate": ns.consumer_rate,
        "lease_groups": ns.lease_groups,
        "soak_minutes": ns.soak_minutes,
        "soak_episodes": ns.soak_episodes,
        "sample_interval_s": ns.sample_interval,
        "metrics_interval_s": ns.metrics_interval,
        "warmup_s": ns.warmup_s,
        "window_s": ns.window_s,
        "synchronous": "full",
        "run_dir": run_dir,
    }


def _rates(rows: list[MetricRow]) -> Rates:
    """Items committed and acked per second, and the commits accepted and pushed back, over `rows`."""
    if len(rows) < 2:
        return {"items_per_s": None, "acked_per_s": None, "commits_429": 0, "commits_ok": 0}
    dt = rows[-1]["t"] - rows[0]["t"]
    return {
        "items_per_s": (rows[-1]["enqueued"] - rows[0]["enqueued"]) / dt if dt > 0 else None,
        "acked_per_s": (rows[-1]["acked"] - rows[0]["acked"]) / dt if dt > 0 else None,
        "commits_ok": rows[-1]["commits_ok"] - rows[0]["commits_ok"],
        "commits_429": rows[-1]["commits_429"] - rows[0]["commits_429"],
    }


def _coordinator(
    ns: argparse.Namespace,
    metric_rows: list[MetricRow],
    rounds: list[LoadEvent],
    soak: tuple[float, float],
    consumed: ConsumerStats,
    final: dict[str, float],
) -> CoordinatorSection:
    """The coordinator under backpressure: its queue's depth, the commit rates of the load round,
    the soak and the whole run, the totals of the last scrape."""
    load = next(r for r in rounds if r["phase"] == "load")
    soak_rounds = [r for r in rounds if r["phase"] == "soak"]

    def window(rows: list[MetricRow], t0: float, t1: float) -> list[MetricRow]:
        return [r for r in rows if t0 <= r["t"] <= t1 and "error" not in r]

    good = [r for r in metric_rows if "error" not in r]
    t_first = min((r["t"] for r in good), default=0.0)
    depths = [r["depth"] for r in good]
    load_rows = window(good, load["t_start"], load["t_end"])
    soak_rows = window(good, *soak)
    # The load round commits nothing until its first prompt groups are whole (near the end of
    # its episodes); from then on its producers are backlogged. How fast the items went in then,
    # and how often the queue stood empty while producers sat in their 429 backoff.
    base = load_rows[0]["enqueued"] if load_rows else 0
    committing = [r for r in load_rows if r["enqueued"] > base]
    backlog: Backlog = {
        "items_per_s": _rates(load_rows[max(0, load_rows.index(committing[0]) - 1) :])["items_per_s"]
        if committing
        else None,
        "seconds": committing[-1]["t"] - committing[0]["t"] if committing else 0.0,
        "empty_queue_share": (sum(r["depth"] == 0 for r in committing) / len(committing))
        if committing
        else None,
    }
    return {
        "max_depth_limit": ns.max_depth,
        "max_depth_observed": max(depths, default=None),
        "max_depth_observed_load": max((r["depth"] for r in load_rows), default=None),
        "depth_bounded": bool(depths) and max(depths) <= ns.max_depth,
        "load_round": {
            **_rates(load_rows),
            "drain_wait_s": load["drain_wait_s"],
            "while_committing": backlog,
        },
        "soak": {**_rates(soak_rows), "drain_wait_s": sum(r["drain_wait_s"] for r in soak_rounds)},
        "whole_run": _rates(good),
        "commits_429_total": int(
            metric_value(final, "mrlx_coordinator_requests_total", endpoint="commit", status="429")
        ),
        "commits_ok_total": int(
            metric_value(final, "mrlx_coordinator_requests_total", endpoint="commit", status="200")
        ),
        "items_enqueued_total": int(
            metric_value(final, "mrlx_coordinator_items_enqueued_total", consumer=CONSUMER)
        ),
        "items_acked_total": int(
            metric_value(final, "mrlx_coordinator_items_acked_total", consumer=CONSUMER)
        ),
        "items_redelivered_total": int(
            metric_value(final, "mrlx_coordinator_items_redelivered_total", consumer=CONSUMER)
        ),
        "items_sent_by_rollout": sum(r["items_sent"] for r in rounds),
        "duplicates": sum(r["duplicates"] for r in rounds),
        "barrier_wait_s": sum(r["barrier_wait_s"] for r in rounds),
        "consumer": consumed,
        "depth_samples": [
            [round(r["t"] - t_first, 2), r["depth"], r["enqueued"], r["acked"], r["commits_429"]]
            for r in good
        ],
        "depth_samples_columns": ["t_s", "depth", "enqueued_so_far", "acked_so_far", "commits_429_so_far"],
    }


def _trends(ns: argparse.Namespace, samples: list[ProcRow]) -> dict[str, Growth]:
    """The soak's growth of memory, open files and disk, each flagged past its tolerance."""
    tol = (ns.rss_tolerance_pct, ns.rss_tolerance_mib)
    fds = (ns.fd_tolerance_pct, ns.fd_tolerance)
    trends = {
        "rollout_rss_mib": growth(samples, "rollout_rss_mib", ns.warmup_s, ns.window_s, *tol),
        "rollout_fds": growth(samples, "rollout_fds", ns.warmup_s, ns.window_s, *fds),
        "coordinator_rss_mib": growth(samples, "coordinator_rss_mib", ns.warmup_s, ns.window_s, *tol),
        "coordinator_fds": growth(samples, "coordinator_fds", ns.warmup_s, ns.window_s, *fds),
        "db_mib": growth(samples, "db_mib", ns.warmup_s, ns.window_s, *tol),
        "wal_mib": growth(samples, "wal_mib", ns.warmup_s, ns.window_s, *tol),
    }
    # Disk, not memory: the database keeps one small row per item ever committed (its key, for
    # exactly-once), so it grows with the work done by design, and the WAL is copied back only
    # when the writer is idle or the WAL passes its cap. Reported, never flagged as a leak.
    trends["db_mib"]["flagged"] = trends["wal_mib"]["flagged"] = False
    return trends


def _soak(
    soak_rounds: list[LoadEvent],
    soak_start: float,
    soak_end: float,
    samples: list[ProcRow],
    trends: dict[str, Growth],
) -> SoakSection:
    """The soak: its rounds and episodes, the growth trends, each process's CPU share, and whether
    a round gets slower as the soak goes on."""
    cpu: dict[str, float | None] = {}
    if len(samples) >= 2 and samples[-1]["t_s"] > samples[0]["t_s"]:
        span = samples[-1]["t_s"] - samples[0]["t_s"]
        for name in ("rollout", "coordinator", "consumer", "stub"):
            a, b = samples[0].get(f"{name}_cpu_s"), samples[-1].get(f"{name}_cpu_s")
            cpu[name] = None if a is None or b is None else round(100 * (b - a) / span, 1)
    per_round = [r["wall_s"] for r in soak_rounds]
    k = max(1, len(per_round) // 10)
    episodes = sum(r["episodes"] for r in soak_rounds)
    return {
        "duration_s": soak_end - soak_start,
        "rounds": len(soak_rounds),
        "episodes": episodes,
        "episodes_per_s": episodes / (soak_end - soak_start) if soak_end > soak_start else None,
        "trends": trends,
        "samples": samples,
        "cpu_pct": cpu,
        # first and last tenth of the rounds: does a round get slower as the soak goes on?
        "round_wall_s_first": sum(per_round[:k]) / k if per_round else None,
        "round_wall_s_last": sum(per_round[-k:]) / k if per_round else None,
        "round_rss_after_mib": [round(r["rss_after_mib"], 1) for r in soak_rounds],
    }


def _fmt(v: object, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(r: LoadReport) -> str:
    """The benchmark's table: a line per measure, its result and its goal; then the checks."""
    c, load, coord, soak = r["config"], r["load"], r["coordinator"], r["soak"]
    lr, sr = coord["load_round"], coord["soak"]
    rows = [
        ("episodes in flight at once (peak / round)", f"{load['max_in_flight']} / {load['episodes']}", "all"),
        (
            "load round: episodes done / all committed",
            f"{load['episodes_s']:.1f} s / {load['wall_s']:.1f} s",
            "report",
        ),
        (
            "rollout RSS before the round / peak",
            f"{load['rss_before_mib']:.0f} / {load['peak_rss_mib']:.0f} MiB",
            "report",
        ),
        (
            "committed items/s: load round / soak",
            f"{_fmt(lr['items_per_s'])} / {_fmt(sr['items_per_s'])}",
            f"consumer {c['consumer_rate']:g}/s",
        ),
        (
            "queue depth: max seen / limit",
            f"{_fmt(coord['max_depth_observed'])} / {c['max_depth']}",
            "<= limit",
        ),
        (
            "load round, once groups were whole: items/s, queue empty",
            f"{_fmt(lr['while_committing']['items_per_s'])}/s, "
            f"{_fmt(lr['while_committing']['empty_queue_share'], '.0%')}"
            " of samples",
            "report",
        ),
        (
            "commits pushed back (429) / accepted",
            f"{coord['commits_429_total']} / {coord['commits_ok_total']}",
            "> 0",
        ),
        (
            "rollout waited on backpressure: load / soak",
            f"{lr['drain_wait_s']:.1f} s / {sr['drain_wait_s']:.1f} s",
            "report",
        ),
        (
            "items sent / enqueued / acked by consumer",
            f"{coord['items_sent_by_rollout']} / {coord['items_enqueued_total']} / "
            f"{coord['consumer']['items']}",
            "equal",
        ),
        (
            "soak: duration, rounds, episodes",
            f"{soak['duration_s'] / 60:.1f} min, {soak['rounds']}, {soak['episodes']}",
            f">= {c['soak_minutes']:g} min",
        ),
    ]
    rows += _soak_rows(soak)
    rows.append(("aborted samples", str(r["statuses"].get("aborted", 0)), "0"))
    width = max(len(row[0]) for row in rows)
    vwidth = max(len(row[1]) for row in rows)
    lines = [
        f"mrlx bench load  ({c['episodes']} episodes of a 2-turn dialogue a -> b, stub latency "
        f"{c['latency_s']:g} s, "
        f"prompts ~{c['mean_prompt_tokens']} tokens, {c['response_tokens']}-token turns, max depth "
        f"{c['max_depth']}, "
        f"{r['machine']['cpus']} CPUs)",
        f"  {'measure':<{width}}  {'result':<{vwidth}}  goal",
    ]
    lines += [f"  {name:<{width}}  {value:<{vwidth}}  {goal}" for name, value, goal in rows]
    failed = [k for k, v in r["checks"].items() if not v]
    lines.append(f"  checks: {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return "\n".join(lines)


def _soak_rows(soak: SoakSection) -> list[tuple[str, str, str]]:
    """The table's lines of the soak: each trend, the rounds' wall time, the CPU shares."""
    rows = []
    for key, label, unit in (
        ("rollout_rss_mib", "rollout RSS", "MiB"),
        ("rollout_fds", "rollout fds", ""),
        ("coordinator_rss_mib", "coordinator RSS", "MiB"),
        ("coordinator_fds", "coordinator fds", ""),
        ("db_mib", "coordinator db", "MiB"),
        ("wal_mib", "coordinator wal", "MiB"),
    ):
        t = soak["trends"][key]
        spec = ".0f"
        value = (
            f"{_fmt(t['first'], spec)} / {_fmt(t['last'], spec)} / {_fmt(t['max'], spec)}, "
            f"{'+' if (t['growth'] or 0) >= 0 else ''}{_fmt(t['growth'], '.1f')}"
            f" ({_fmt(t['growth_pct'], '+.1f')}%)" + (" FLAGGED" if t["flagged"] else "")
        )
        goal = "report (disk)" if key in ("db_mib", "wal_mib") else "no growth"
        rows.append((f"soak {label}{' ' + unit if unit else ''}: first/last/max, growth", value, goal))
    rows.append(
        (
            "soak round wall: first / last tenth of rounds",
            f"{_fmt(soak['round_wall_s_first'], '.1f')} s / {_fmt(soak['round_wall_s_last'], '.1f')} s",
            "report",
        )
    )
    cpu = soak["cpu_pct"]
    rows.append(
        (
            "soak CPU %: rollout / coordinator / consumer / stub",
            " / ".join(_fmt(cpu.get(n)) for n in ("rollout", "coordinator", "consumer", "stub")),
            "report",
        )
    )
    return rows
