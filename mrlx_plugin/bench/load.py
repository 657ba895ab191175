"""`mrlx bench load`: many concurrent multi-model episodes, the coordinator under backpressure,
and a soak that looks for leaks.

Every party is its own process on 127.0.0.1: a stub engine (model-free, answering every
`/generate` after `--latency` seconds, so that episodes really wait on it), the coordinator
(durable SQLite, a small `--max-depth`), a consumer that leases and acks agent b's groups
continuously at `--consumer-rate` items per second (slower than the producer, so backpressure
engages), and the rollout process. The rollout process is job a of a two-model run: it calls
`mrlx_plugin.rollout.initiator_rollout(args, rollout_id, data_source)` with host-shaped `args`
(slime's flag names, a rollout semaphore as large as the episode count), which runs the host's
default rollout, which calls the generate function per sample; every episode is a 2-turn
dialogue (agent a, then agent b) whose b-samples are committed to the coordinator one prompt
group at a time.

1. load: one round of `--episodes` (10,000) concurrent episodes. Reports how many were in flight
   at once, the rollout process's RSS before the round and its peak.
2. coordinator: samples `/metrics` every `--metrics-interval` seconds; reports committed items
   per second, the deepest queue seen (never above `--max-depth`), how many commits the
   coordinator pushed back (HTTP 429) and how long the rollout waited for its last groups to be
   accepted after its episodes had ended.
3. soak: rounds of `--soak-episodes` episodes through the same rollout process and coordinator
   for `--soak-minutes` (10); every `--sample-interval` seconds the RSS and open file descriptors
   of the rollout process and of the coordinator are sampled. Growth is the mean of the last
   `--window-s` seconds against the mean of the first `--window-s` seconds after `--warmup-s`;
   growth past the tolerances is flagged.

Prints a table and writes JSON (default runs/bench/load.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from mrlx_plugin.bench.report import write_report
from mrlx_plugin.core import processes
from mrlx_plugin.local.procstat import cpu_seconds, memory_mib, open_fds

RUN_ID = "load"
PRODUCER, CONSUMER = "a", "b"
TOKEN_ENV = "MRLX_LOAD_BENCH_TOKEN"
# Spare descriptors beyond one connection per concurrent episode (coordinator, pipes, files).
FD_HEADROOM = 512


# ---------------------------------------------------------------------------------------------
# The rollout process
# ---------------------------------------------------------------------------------------------


class _Flight:
    """Episodes inside the generate function right now, the most at once, and when the last ended."""

    now = 0
    peak = 0
    last_end = 0.0

    @classmethod
    def reset(cls) -> None:
        cls.now, cls.peak, cls.last_end = 0, 0, 0.0


async def counted_generate(
    args: Any, sample: Any, sampling_params: Any = None, evaluation: bool = False
) -> Any:
    """`mrlx_plugin.rollout.generate`, counting the episodes in flight (the benchmark's
    `--custom-generate-function-path`; the count costs two integer updates per episode)."""
    from mrlx_plugin.rollout import generate

    _Flight.now += 1
    _Flight.peak = max(_Flight.peak, _Flight.now)
    try:
        return await generate(args, sample, sampling_params, evaluation=evaluation)
    finally:
        _Flight.now -= 1
        _Flight.last_end = time.time()


def job_settings(
    engine_url: str, coordinator_url: str, response_tokens: int, max_connections: int, latency: float
) -> dict[str, Any]:
    """The `mrlx:` settings of job a: a 2-turn dialogue a -> b; b is another job's agent."""
    sampling = {"max_new_tokens": response_tokens}
    return {
        "run_id": RUN_ID,
        "system": "dialogue",
        "self": PRODUCER,
        "agents": {
            PRODUCER: {"url": "self", "sampling": sampling},
            CONSUMER: {"url": engine_url, "trainable": True, "sampling": sampling},
        },
        "dialogue": {"first": PRODUCER, "order": [PRODUCER, CONSUMER], "max_turns": 2},
        # One pool slot per concurrent episode: turns are sequential, so an episode holds at most one.
        "engine": {
            "max_connections": max_connections,
            "request_timeout_s": 60 + 2 * latency,
            "max_retries": 2,
        },
        "coordinator": {
            "url": coordinator_url,
            "token_env": TOKEN_ENV,
            "max_staleness": 1,
            "wait_deadline_s": 900,
            "lease_s": 120,
            "request_timeout_s": 60,
        },
    }


def host_args(
    engine_url: str, tokenizer: str, mrlx: dict[str, Any], response_tokens: int, n_samples_per_prompt: int
) -> argparse.Namespace:
    """What slime hands the rollout function: its flags (slime's names) plus the `mrlx` key."""
    from mrlx_plugin.local.fake_host import add_host_arguments, set_router
    from mrlx_plugin.local.fake_host import host_args as build

    parser = argparse.ArgumentParser()
    add_host_arguments(parser)
    ns = parser.parse_args([])
    ns.hf_checkpoint = tokenizer
    args = build(ns, None)
    set_router(args, engine_url)
    args.mrlx = mrlx
    args.n_samples_per_prompt = n_samples_per_prompt
    args.rollout_max_response_len = 4 * response_tokens
    args.custom_generate_function_path = "mrlx_plugin.bench.load.counted_generate"
    return args


def _emit(path: str, event: dict[str, Any]) -> None:
    """Append one event line; the driver reads them as they come (progress) and at the end (results)."""
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def _count(output: Any) -> dict[str, int]:
    """Samples the host got back, by status (groups -> episodes -> samples)."""
    counts: dict[str, int] = {}
    for group in output.samples:
        for episode in group:
            for s in episode if isinstance(episode, list) else [episode]:
                status = getattr(s.status, "value", str(s.status))
                counts[status] = counts.get(status, 0) + 1
    return counts


def rollout_worker(ns: argparse.Namespace) -> int:
    """Job a: a warm-up round, the load round, then soak rounds until the soak time is up."""
    from mrlx_plugin.core.host import run_in_host_loop
    from mrlx_plugin.local.fake_host import LocalDataSource
    from mrlx_plugin.rollout import initiator_rollout
    from mrlx_plugin.runtime import runtime_for

    n = ns.n_samples_per_prompt
    problems = json.loads(Path(ns.problems).read_text())
    source = LocalDataSource([([{"role": "user", "content": p}], "42") for p in problems], n)
    mrlx = job_settings(
        ns.engine_url, ns.coordinator_url, ns.response_tokens, max(ns.episodes, ns.soak_episodes), ns.latency
    )
    args = host_args(ns.engine_url, ns.tokenizer, mrlx, ns.response_tokens, n)
    runtime = runtime_for(args)  # settings, plugins, tokenizers: before any clock starts
    rss, hwm = memory_mib()
    _emit(ns.events, {"event": "ready", "t": time.time(), "rss_mib": rss, "hwm_mib": hwm, "fds": open_fds()})

    def one_round(rollout_id: int, phase: str, episodes: int) -> dict[str, Any]:
        groups = max(1, episodes // n)
        args.rollout_batch_size = groups
        args.sglang_server_concurrency = groups * n  # slime's semaphore: every episode may run at once
        _Flight.reset()
        rss_before, _ = memory_mib()
        t0 = time.time()
        output = initiator_rollout(args, rollout_id, source)
        t1 = time.time()
        rss_after, hwm_after = memory_mib()
        metrics = {
            k: float(v)
            for k, v in (output.metrics or {}).items()
            if k.startswith(("coordinator/", "staleness/"))
        }
        statuses = _count(output)
        del output
        event = {
            "event": "round",
            "phase": phase,
            "round": rollout_id,
            "episodes": groups * n,
            "t_start": t0,
            "t_end": t1,
            "wall_s": t1 - t0,
            "episodes_s": max(0.0, _Flight.last_end - t0),  # until the last episode returned
            "drain_wait_s": max(0.0, t1 - _Flight.last_end),  # then: waiting for the coordinator to accept
            "max_in_flight": _Flight.peak,
            "statuses": statuses,
            "items_sent": int(metrics.get("coordinator/samples_sent", 0)),
            "groups_sent": int(metrics.get("coordinator/groups_sent", 0)),
            "duplicates": int(metrics.get("coordinator/duplicates", 0)),
            "barrier_wait_s": metrics.get(f"coordinator/wait_seconds/{CONSUMER}", 0.0),
            "staleness": metrics.get(f"staleness/{CONSUMER}"),
            "rss_before_mib": rss_before,
            "rss_after_mib": rss_after,
            "hwm_mib": hwm_after,
            "fds": open_fds(),
        }
        _emit(ns.events, event)
        return event

    rollout_id = 0
    one_round(rollout_id, "warmup", ns.warmup_episodes)  # connections, grader worker, caches
    rollout_id += 1
    one_round(rollout_id, "load", ns.episodes)
    soak_end = time.time() + ns.soak_s
    _emit(ns.events, {"event": "soak_start", "t": time.time()})
    while time.time() < soak_end:
        rollout_id += 1
        one_round(rollout_id, "soak", ns.soak_episodes)
    _emit(ns.events, {"event": "soak_end", "t": time.time()})
    run_in_host_loop(runtime.aclose())
    return 0


# ---------------------------------------------------------------------------------------------
# The consumer process (agent b's trainer, reduced to lease -> decode -> ack)
# ---------------------------------------------------------------------------------------------


async def _consume(ns: argparse.Namespace) -> dict[str, Any]:
    from mrlx_plugin.link.client import CoordinatorClient
    from mrlx_plugin.link.codec import sample_from_item

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    client = CoordinatorClient(
        ns.coordinator_url, run_id=RUN_ID, agent=CONSUMER, token=os.environ.get(TOKEN_ENV)
    )
    stats = {"items": 0, "groups": 0, "leases": 0, "redelivered_groups": 0, "bad_groups": 0, "version": 0}
    steps: dict[int, int] = {}
    started = time.monotonic()
    stopped_at: float | None = None
    try:
        while True:
            if stop.is_set() and stopped_at is None:
                stopped_at = time.monotonic()
            # After the stop signal: drain at full speed until a lease comes back empty.
            lease = await client.lease(ns.lease_groups, lease_s=120.0, wait_s=0.5 if stopped_at else 2.0)
            received = time.monotonic()
            if not lease.groups:
                if stopped_at is not None:
                    break
                continue
            for info, group in zip(lease.group_info, lease.groups):
                samples = [sample_from_item(item) for item in group]  # what a responder's trainer gets
                if len(samples) != info["size"] or any(s.tokens is None for s in samples):
                    stats["bad_groups"] += 1
                stats["redelivered_groups"] += bool(info.get("redelivered"))
                steps[int(info["step"])] = steps.get(int(info["step"]), 0) + len(samples)
                stats["items"] += len(samples)
                stats["groups"] += 1
            stats["leases"] += 1
            if stopped_at is None and ns.rate > 0:  # a trainer's pace: each lease takes items / rate seconds
                busy = sum(len(g) for g in lease.groups) / ns.rate - (time.monotonic() - received)
                if busy > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), busy)
                    except asyncio.TimeoutError:
                        pass
            await client.ack(lease.lease_id)
            # Trained on step s: this job's weights are now version s + 1 (what the barrier waits for).
            version = max(int(i["step"]) for i in lease.group_info) + 1
            if version > stats["version"]:
                stats["version"] = await client.report_version(version)
    finally:
        await client.close()
    stats["wall_s"] = time.monotonic() - started
    stats["items_per_step"] = {str(k): v for k, v in sorted(steps.items())}
    return stats


def consumer_worker(ns: argparse.Namespace) -> int:
    result = asyncio.run(_consume(ns))
    Path(ns.result).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def scrape_metrics(url: str, token: str) -> dict[str, float]:
    """The coordinator's /metrics as {'name{labels}': value} (blocking; the driver has no event loop)."""
    from mrlx_plugin.link.auth import request_target, signed_headers

    signed = signed_headers(token, "GET", request_target(url + "/metrics"))
    req = urllib.request.Request(url + "/metrics", headers=signed)
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _metric(m: dict[str, float], name: str, **labels: str) -> float:
    rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return m.get(f"{name}{{{rendered}}}" if rendered else name, 0.0)


def growth(
    samples: list[dict[str, Any]],
    key: str,
    warmup_s: float,
    window_s: float,
    tolerance_pct: float,
    tolerance_abs: float,
) -> dict[str, Any]:
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


class _Worker:
    """A worker subprocess in its own process group (its grader child goes with it)."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name = name
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = processes.start(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def stop(self, timeout: float = 15.0) -> None:
        processes.stop(self.proc, timeout, group=True)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _worker_argv(*args: str) -> list[str]:
    # `-c` rather than `-m`: the rollout imports this module by name (the generate function's
    # path), and must find the same module object that counts episodes, not a second copy.
    return [
        sys.executable,
        "-c",
        "import sys; from mrlx_plugin.bench.load import main; sys.exit(main(sys.argv[1:]))",
        *args,
    ]


def run_load_bench(ns: argparse.Namespace) -> dict[str, Any]:
    """Start every process, run the load round and the soak, sample, stop everything; the report."""
    from mrlx_plugin.bench.engine_calls import prepare, stub_text
    from mrlx_plugin.local.processes import start_coordinator, start_stub_engine

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max(ns.episodes, ns.soak_episodes) + FD_HEADROOM
    if hard != resource.RLIM_INFINITY and need > hard:
        raise SystemExit(
            f"mrlx bench load: {max(ns.episodes, ns.soak_episodes)} concurrent episodes need about {need} "
            f"open files per process, but the hard limit is {hard}; lower --episodes or raise "
            "`ulimit -Hn`"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the processes started below inherit it
    workdir = Path(ns.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = workdir / f"load-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir.mkdir()
    tokenizer, problems, mean_prompt = prepare(workdir, ns.prompt_tokens, ns.seed)
    token = secrets.token_hex(16)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **{TOKEN_ENV: token})
    events_path = run_dir / "events.jsonl"
    consumer_result = run_dir / "consumer.json"
    services: list[Any] = []
    workers: list[_Worker] = []
    metric_rows: list[dict[str, Any]] = []
    proc_rows: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    try:
        stub = start_stub_engine(
            log_dir=run_dir,
            name="stub",
            extra=[
                "--latency",
                str(ns.latency),
                "--response-tokens",
                str(ns.response_tokens),
                "--vocab-size",
                "8192",
                "--text",
                stub_text(max(8, ns.response_tokens // 2)),
            ],
        )
        services.append(stub)
        coordinator = start_coordinator(
            run_dir / "coordinator.sqlite",
            RUN_ID,
            [PRODUCER, CONSUMER],
            log_dir=run_dir,
            token_env=TOKEN_ENV,
            env={TOKEN_ENV: token},
            extra=["--max-depth", str(ns.max_depth)],
        )
        services.append(coordinator)
        workers.append(
            _Worker(
                "consumer",
                _worker_argv(
                    "--worker",
                    "consumer",
                    "--coordinator-url",
                    coordinator.url,
                    "--rate",
                    str(ns.consumer_rate),
                    "--lease-groups",
                    str(ns.lease_groups),
                    "--result",
                    str(consumer_result),
                ),
                run_dir / "consumer.log",
                env,
            )
        )
        consumer = workers[-1]
        workers.append(
            _Worker(
                "rollout",
                _worker_argv(
                    "--worker",
                    "rollout",
                    "--engine-url",
                    stub.url,
                    "--coordinator-url",
                    coordinator.url,
                    "--tokenizer",
                    tokenizer,
                    "--problems",
                    problems,
                    "--episodes",
                    str(ns.episodes),
                    "--soak-episodes",
                    str(ns.soak_episodes),
                    "--warmup-episodes",
                    str(ns.warmup_episodes),
                    "--n-samples-per-prompt",
                    str(ns.n_samples_per_prompt),
                    "--response-tokens",
                    str(ns.response_tokens),
                    "--latency",
                    str(ns.latency),
                    "--soak-s",
                    str(ns.soak_minutes * 60),
                    "--events",
                    str(events_path),
                ),
                run_dir / "rollout.log",
                env,
            )
        )
        rollout = workers[-1]

        pids = {"rollout": rollout.proc.pid, "coordinator": coordinator.proc.pid}
        cpu_pids = {**pids, "consumer": consumer.proc.pid, "stub": stub.proc.pid}
        db = run_dir / "coordinator.sqlite"
        next_metrics = next_procs = time.monotonic()
        read_pos = 0
        deadline = time.monotonic() + ns.soak_minutes * 60 + ns.max_extra_s
        while rollout.proc.poll() is None:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(
                    f"the rollout process did not finish within {ns.max_extra_s:.0f} s after the soak"
                )
            for svc in (stub, coordinator):
                if not svc.alive():
                    raise RuntimeError(f"{svc.name} exited (code {svc.proc.returncode}):\n{svc.log_tail()}")
            if consumer.proc.poll() is not None:
                raise RuntimeError(
                    f"the consumer exited (code {consumer.proc.returncode}):\n{consumer.tail()}"
                )
            if now >= next_metrics:
                next_metrics += ns.metrics_interval
                try:
                    m = scrape_metrics(coordinator.url, token)
                except (urllib.error.URLError, OSError, ValueError) as exc:
                    metric_rows.append({"t": time.time(), "error": str(exc)})
                else:
                    queued = _metric(m, "mrlx_coordinator_queue_items", consumer=CONSUMER, state="queued")
                    leased = _metric(m, "mrlx_coordinator_queue_items", consumer=CONSUMER, state="leased")
                    metric_rows.append(
                        {
                            "t": time.time(),
                            "depth": int(queued + leased),
                            "queued": int(queued),
                            "leased": int(leased),
                            "enqueued": int(
                                _metric(m, "mrlx_coordinator_items_enqueued_total", consumer=CONSUMER)
                            ),
                            "acked": int(_metric(m, "mrlx_coordinator_items_acked_total", consumer=CONSUMER)),
                            "commits_ok": int(
                                _metric(m, "mrlx_coordinator_requests_total", endpoint="commit", status="200")
                            ),
                            "commits_429": int(
                                _metric(m, "mrlx_coordinator_requests_total", endpoint="commit", status="429")
                            ),
                        }
                    )
            if now >= next_procs:
                next_procs += ns.sample_interval
                # The machine's 1-minute load average: other work on it shows up here, not in the
                # processes above.
                row: dict[str, Any] = {"t": time.time(), "loadavg_1m": os.getloadavg()[0]}
                for name, pid in pids.items():
                    try:
                        row[f"{name}_rss_mib"] = memory_mib(pid)[0]
                        row[f"{name}_fds"] = open_fds(pid)
                    except OSError:  # it just exited
                        row[f"{name}_rss_mib"] = row[f"{name}_fds"] = None
                for name, pid in cpu_pids.items():
                    try:
                        row[f"{name}_cpu_s"] = cpu_seconds(pid)
                    except OSError:
                        row[f"{name}_cpu_s"] = None
                for key, path in (("db_mib", db), ("wal_mib", Path(f"{db}-wal"))):
                    row[key] = path.stat().st_size / (1 << 20) if path.exists() else 0.0
                proc_rows.append(row)
            read_pos = _read_events(events_path, read_pos, events, ns.quiet)
            time.sleep(max(0.02, min(next_metrics, next_procs) - time.monotonic()))
        _read_events(events_path, read_pos, events, ns.quiet)
        if rollout.proc.returncode != 0:
            raise RuntimeError(
                f"the rollout process failed (code {rollout.proc.returncode}):\n{rollout.tail()}"
            )
        # The consumer drains what is left, then reports.
        consumer.proc.send_signal(signal.SIGTERM)
        try:
            consumer.proc.wait(ns.max_extra_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"the consumer did not drain the queue within {ns.max_extra_s:.0f} s"
            ) from None
        if consumer.proc.returncode != 0:
            raise RuntimeError(f"the consumer failed (code {consumer.proc.returncode}):\n{consumer.tail()}")
        consumed = json.loads(consumer_result.read_text())
        final = scrape_metrics(coordinator.url, token)
    finally:
        for worker in reversed(workers):
            worker.stop()
        for svc in reversed(services):
            svc.stop()
    return _report(ns, events, metric_rows, proc_rows, consumed, final, mean_prompt, str(run_dir))


def _read_events(path: Path, pos: int, events: list[dict[str, Any]], quiet: bool) -> int:
    """Read the rollout's new event lines (complete ones only); print progress."""
    try:
        with open(path) as f:
            f.seek(pos)
            data = f.read()
    except FileNotFoundError:
        return pos
    end = data.rfind("\n") + 1
    for line in data[:end].splitlines():
        event = json.loads(line)
        events.append(event)
        if quiet:
            continue
        if event["event"] == "ready":
            print(f"  rollout process ready: RSS {event['rss_mib']:.0f} MiB", flush=True)
        elif event["event"] == "round":
            print(
                f"  round {event['round']:>3} ({event['phase']}): {event['episodes']} episodes, "
                f"{event['max_in_flight']} in flight at once, {event['wall_s']:.1f} s "
                f"(episodes {event['episodes_s']:.1f} s, waiting on the queue {event['drain_wait_s']:.1f} "
                "s), "
                f"RSS {event['rss_after_mib']:.0f} MiB, {event['fds']} fds",
                flush=True,
            )
    return pos + len(data[:end].encode())


def _report(
    ns: argparse.Namespace,
    events: list[dict[str, Any]],
    metric_rows: list[dict[str, Any]],
    proc_rows: list[dict[str, Any]],
    consumed: dict[str, Any],
    final: dict[str, float],
    mean_prompt: float,
    run_dir: str,
) -> dict[str, Any]:
    rounds = [e for e in events if e["event"] == "round"]
    ready = next(e for e in events if e["event"] == "ready")
    load = next(r for r in rounds if r["phase"] == "load")
    soak_rounds = [r for r in rounds if r["phase"] == "soak"]
    soak_start = next((e["t"] for e in events if e["event"] == "soak_start"), load["t_end"])
    soak_end = next((e["t"] for e in events if e["event"] == "soak_end"), soak_start)

    def window(rows: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
        return [r for r in rows if t0 <= r["t"] <= t1 and "error" not in r]

    def rates(rows: list[dict[str, Any]]) -> dict[str, Any]:
        if len(rows) < 2:
            return {"items_per_s": None, "acked_per_s": None, "commits_429": 0, "commits_ok": 0}
        dt = rows[-1]["t"] - rows[0]["t"]
        return {
            "items_per_s": (rows[-1]["enqueued"] - rows[0]["enqueued"]) / dt if dt > 0 else None,
            "acked_per_s": (rows[-1]["acked"] - rows[0]["acked"]) / dt if dt > 0 else None,
            "commits_ok": rows[-1]["commits_ok"] - rows[0]["commits_ok"],
            "commits_429": rows[-1]["commits_429"] - rows[0]["commits_429"],
        }

    good = [r for r in metric_rows if "error" not in r]
    t_first = min((r["t"] for r in good), default=0.0)
    depths = [r["depth"] for r in good]
    load_rows = window(good, load["t_start"], load["t_end"])
    soak_rows = window(good, soak_start, soak_end)
    # The load round commits nothing until its first prompt groups are whole (near the end of
    # its episodes); from then on its producers are backlogged. How fast the items went in then,
    # and how often the queue stood empty while producers sat in their 429 backoff.
    base = load_rows[0]["enqueued"] if load_rows else 0
    committing = [r for r in load_rows if r["enqueued"] > base]
    backlog = {
        "items_per_s": rates(load_rows[max(0, load_rows.index(committing[0]) - 1) :])["items_per_s"]
        if committing
        else None,
        "seconds": committing[-1]["t"] - committing[0]["t"] if committing else 0.0,
        "empty_queue_share": (sum(r["depth"] == 0 for r in committing) / len(committing))
        if committing
        else None,
    }
    total_sent = sum(r["items_sent"] for r in rounds)
    statuses: dict[str, int] = {}
    for r in rounds:
        for k, v in r["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    coordinator = {
        "max_depth_limit": ns.max_depth,
        "max_depth_observed": max(depths, default=None),
        "max_depth_observed_load": max((r["depth"] for r in load_rows), default=None),
        "depth_bounded": bool(depths) and max(depths) <= ns.max_depth,
        "load_round": {**rates(load_rows), "drain_wait_s": load["drain_wait_s"], "while_committing": backlog},
        "soak": {**rates(soak_rows), "drain_wait_s": sum(r["drain_wait_s"] for r in soak_rounds)},
        "whole_run": rates(good),
        "commits_429_total": int(
            _metric(final, "mrlx_coordinator_requests_total", endpoint="commit", status="429")
        ),
        "commits_ok_total": int(
            _metric(final, "mrlx_coordinator_requests_total", endpoint="commit", status="200")
        ),
        "items_enqueued_total": int(
            _metric(final, "mrlx_coordinator_items_enqueued_total", consumer=CONSUMER)
        ),
        "items_acked_total": int(_metric(final, "mrlx_coordinator_items_acked_total", consumer=CONSUMER)),
        "items_redelivered_total": int(
            _metric(final, "mrlx_coordinator_items_redelivered_total", consumer=CONSUMER)
        ),
        "items_sent_by_rollout": total_sent,
        "duplicates": sum(r["duplicates"] for r in rounds),
        "barrier_wait_s": sum(r["barrier_wait_s"] for r in rounds),
        "consumer": consumed,
        "depth_samples": [
            [round(r["t"] - t_first, 2), r["depth"], r["enqueued"], r["acked"], r["commits_429"]]
            for r in good
        ],
        "depth_samples_columns": ["t_s", "depth", "enqueued_so_far", "acked_so_far", "commits_429_so_far"],
    }
    samples = [
        {**{k: v for k, v in r.items() if k != "t"}, "t_s": round(r["t"] - soak_start, 2)}
        for r in proc_rows
        if soak_start <= r["t"] <= soak_end
    ]
    tol = (ns.rss_tolerance_pct, ns.rss_tolerance_mib)
    trends = {
        "rollout_rss_mib": growth(samples, "rollout_rss_mib", ns.warmup_s, ns.window_s, *tol),
        "rollout_fds": growth(
            samples, "rollout_fds", ns.warmup_s, ns.window_s, ns.fd_tolerance_pct, ns.fd_tolerance
        ),
        "coordinator_rss_mib": growth(samples, "coordinator_rss_mib", ns.warmup_s, ns.window_s, *tol),
        "coordinator_fds": growth(
            samples, "coordinator_fds", ns.warmup_s, ns.window_s, ns.fd_tolerance_pct, ns.fd_tolerance
        ),
        "db_mib": growth(samples, "db_mib", ns.warmup_s, ns.window_s, *tol),
        "wal_mib": growth(samples, "wal_mib", ns.warmup_s, ns.window_s, *tol),
    }
    # Disk, not memory: the database keeps one small row per item ever committed (its key, for
    # exactly-once), so it grows with the work done by design, and the WAL is copied back only
    # when the writer is idle or the WAL passes its cap. Reported, never flagged as a leak.
    trends["db_mib"]["flagged"] = trends["wal_mib"]["flagged"] = False
    checks = {
        "all_episodes_in_flight": load["max_in_flight"] == load["episodes"],
        "depth_bounded": coordinator["depth_bounded"],
        "backpressure_engaged": coordinator["commits_429_total"] > 0,
        "no_aborted_samples": statuses.get("aborted", 0) == 0,
        "every_item_acked_once": (
            consumed["items"]
            == total_sent
            == coordinator["items_enqueued_total"]
            == coordinator["items_acked_total"]
            and consumed["bad_groups"] == 0
        ),
        "no_growth_flagged": not any(t["flagged"] for t in trends.values()),
    }
    cpu: dict[str, float | None] = {}
    if len(samples) >= 2 and samples[-1]["t_s"] > samples[0]["t_s"]:
        span = samples[-1]["t_s"] - samples[0]["t_s"]
        for name in ("rollout", "coordinator", "consumer", "stub"):
            a, b = samples[0].get(f"{name}_cpu_s"), samples[-1].get(f"{name}_cpu_s")
            cpu[name] = None if a is None or b is None else round(100 * (b - a) / span, 1)
    per_round = [r["wall_s"] for r in soak_rounds]
    k = max(1, len(per_round) // 10)
    return {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0]},
        "config": {
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
        },
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
        "soak": {
            "duration_s": soak_end - soak_start,
            "rounds": len(soak_rounds),
            "episodes": sum(r["episodes"] for r in soak_rounds),
            "episodes_per_s": (
                sum(r["episodes"] for r in soak_rounds) / (soak_end - soak_start)
                if soak_end > soak_start
                else None
            ),
            "trends": trends,
            "samples": samples,
            "cpu_pct": cpu,
            # first and last tenth of the rounds: does a round get slower as the soak goes on?
            "round_wall_s_first": sum(per_round[:k]) / k if per_round else None,
            "round_wall_s_last": sum(per_round[-k:]) / k if per_round else None,
            "round_rss_after_mib": [round(r["rss_after_mib"], 1) for r in soak_rounds],
        },
        "rounds": rounds,
        "statuses": statuses,
        "checks": checks,
        "ok": all(checks.values()),
    }


def _fmt(v: Any, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(r: dict[str, Any]) -> str:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mrlx bench load", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/load.json")
    p.add_argument(
        "--workdir", default="runs/bench", help="tokenizer, prompts, and each run's logs and database"
    )
    p.add_argument("--episodes", type=int, default=10000, help="concurrent episodes of the load round")
    p.add_argument(
        "--n-samples-per-prompt", type=int, default=8, help="episodes per prompt group (committed together)"
    )
    p.add_argument("--latency", type=float, default=1.5, help="seconds the stub engine takes per call")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--response-tokens", type=int, default=64, help="tokens per turn")
    p.add_argument("--max-depth", type=int, default=1000, help="the coordinator's --max-depth (items)")
    p.add_argument(
        "--consumer-rate", type=float, default=1000.0, help="items/s the consumer acks (0: no limit)"
    )
    p.add_argument("--lease-groups", type=int, default=16, help="groups per lease")
    p.add_argument("--soak-minutes", type=float, default=10.0)
    p.add_argument("--soak-episodes", type=int, default=2000, help="episodes per soak round")
    p.add_argument("--warmup-episodes", type=int, default=64)
    p.add_argument("--sample-interval", type=float, default=10.0, help="seconds between RSS/fd samples")
    p.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics samples")
    p.add_argument("--warmup-s", type=float, default=60.0, help="soak seconds left out of the growth measure")
    p.add_argument("--window-s", type=float, default=60.0, help="seconds averaged at each end of the soak")
    p.add_argument("--rss-tolerance-pct", type=float, default=5.0)
    p.add_argument("--rss-tolerance-mib", type=float, default=16.0)
    p.add_argument("--fd-tolerance", type=float, default=8.0, help="open fds growth allowed")
    p.add_argument("--fd-tolerance-pct", type=float, default=5.0)
    p.add_argument(
        "--max-extra-s", type=float, default=600.0, help="give up this long after the soak should end"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    # worker modes (internal)
    p.add_argument("--worker", choices=("rollout", "consumer"), help=argparse.SUPPRESS)
    p.add_argument("--engine-url", help=argparse.SUPPRESS)
    p.add_argument("--coordinator-url", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--problems", help=argparse.SUPPRESS)
    p.add_argument("--soak-s", type=float, help=argparse.SUPPRESS)
    p.add_argument("--events", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker == "rollout":
        return rollout_worker(ns)
    if ns.worker == "consumer":
        return consumer_worker(ns)
    for name in (
        "episodes",
        "n_samples_per_prompt",
        "max_depth",
        "lease_groups",
        "soak_episodes",
        "warmup_episodes",
    ):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if ns.episodes % ns.n_samples_per_prompt or ns.soak_episodes % ns.n_samples_per_prompt:
        p.error(
            "--episodes and --soak-episodes must be multiples of --n-samples-per-prompt (whole prompt groups)"
        )
    if ns.n_samples_per_prompt > ns.max_depth:
        p.error("--max-depth must hold at least one prompt group (--n-samples-per-prompt items)")
    report = run_load_bench(ns)
    print(format_table(report))
    write_report(ns.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
