"""The driver of `mrlx bench load`: it starts every process (the stub engine, the coordinator, the
consumer and the rollout process), samples the coordinator's /metrics and the processes' memory,
open files and CPU time while the rollout runs, and stops them all."""

from __future__ import annotations

import argparse
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
from typing import TYPE_CHECKING

from mrlx_lab.bench.load.report import LoadReport, MetricRow, ProcRow, report
from mrlx_lab.bench.load.scrape import metric_value, scrape_metrics
from mrlx_lab.bench.load.workers import CONSUMER, PRODUCER, RUN_ID, TOKEN_ENV, ConsumerStats, LoadEvent
from mrlx_lab.procstat import cpu_seconds, memory_mib, open_fds
from mrlx_plugin.core import processes

if TYPE_CHECKING:
    from mrlx_plugin.local.services import ManagedProcess

# Spare descriptors beyond one connection per concurrent episode (coordinator, pipes, files).
FD_HEADROOM = 512


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
    # `-c` rather than `-m`: the rollout imports `workers` by name (the generate function's path),
    # and must find the one module object that counts episodes, never a second copy run as __main__.
    return [
        sys.executable,
        "-c",
        "import sys; from mrlx_lab.bench.load import main; sys.exit(main(sys.argv[1:]))",
        *args,
    ]


def run_load_bench(ns: argparse.Namespace) -> LoadReport:
    """Start every process, run the load round and the soak, sample, stop everything; the report."""
    from mrlx_lab.bench.engine_calls import prepare

    _raise_open_files_limit(ns)
    workdir = Path(ns.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = workdir / f"load-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir.mkdir()
    tokenizer, problems, mean_prompt = prepare(workdir, ns.prompt_tokens, ns.seed)
    token = secrets.token_hex(16)
    run = _Run(ns, run_dir, token)
    try:
        run.start(tokenizer, problems)
        run.watch()
        consumed = run.drain()
        final = scrape_metrics(run.coordinator.url, token)
    finally:
        run.stop()
    return report(ns, run.events, run.metric_rows, run.proc_rows, consumed, final, mean_prompt, str(run_dir))


def _raise_open_files_limit(ns: argparse.Namespace) -> None:
    """Every concurrent episode holds a connection: raise the soft limit of open files to the hard
    one (the processes started later inherit it), or stop when even that is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max(ns.episodes, ns.soak_episodes) + FD_HEADROOM
    if hard != resource.RLIM_INFINITY and need > hard:
        raise SystemExit(
            f"mrlx bench load: {max(ns.episodes, ns.soak_episodes)} concurrent episodes need about {need} "
            f"open files per process, but the hard limit is {hard}; lower --episodes or raise "
            "`ulimit -Hn`"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class _Run:
    """One run's processes and what is sampled of them: the coordinator's /metrics rows, the
    processes' rows (memory, open files, CPU time, database size), the rollout's events."""

    def __init__(self, ns: argparse.Namespace, run_dir: Path, token: str) -> None:
        self.ns, self.run_dir, self.token = ns, run_dir, token
        self.env = dict(
            os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **{TOKEN_ENV: token}
        )
        self.events_path = run_dir / "events.jsonl"
        self.consumer_result = run_dir / "consumer.json"
        self.services: list[ManagedProcess] = []
        self.workers: list[_Worker] = []
        self.metric_rows: list[MetricRow] = []
        self.proc_rows: list[ProcRow] = []
        self.events: list[LoadEvent] = []

    def start(self, tokenizer: str, problems: str) -> None:
        """The stub engine and the coordinator, then the consumer and the rollout process."""
        from mrlx_lab.bench.engine_calls import stub_text
        from mrlx_lab.stub_engine import start_stub_engine
        from mrlx_plugin.local.services import start_coordinator

        ns, run_dir = self.ns, self.run_dir
        self.stub = start_stub_engine(
            log_dir=run_dir,
            name="stub",
            extra=[
                *("--latency", str(ns.latency), "--response-tokens", str(ns.response_tokens)),
                *("--vocab-size", "8192", "--text", stub_text(max(8, ns.response_tokens // 2))),
            ],
        )
        self.services.append(self.stub)
        self.coordinator = start_coordinator(
            run_dir / "coordinator.sqlite",
            RUN_ID,
            [PRODUCER, CONSUMER],
            log_dir=run_dir,
            token_env=TOKEN_ENV,
            env={TOKEN_ENV: self.token},
            extra=["--max-depth", str(ns.max_depth)],
        )
        self.services.append(self.coordinator)
        self.consumer = self._worker(
            "consumer",
            *("--coordinator-url", self.coordinator.url, "--rate", str(ns.consumer_rate)),
            *("--lease-groups", str(ns.lease_groups), "--result", str(self.consumer_result)),
        )
        self.rollout = self._worker(
            "rollout",
            *("--engine-url", self.stub.url, "--coordinator-url", self.coordinator.url),
            *("--tokenizer", tokenizer, "--problems", problems, "--episodes", str(ns.episodes)),
            *("--soak-episodes", str(ns.soak_episodes), "--warmup-episodes", str(ns.warmup_episodes)),
            *("--n-samples-per-prompt", str(ns.n_samples_per_prompt)),
            *("--response-tokens", str(ns.response_tokens), "--latency", str(ns.latency)),
            *("--soak-s", str(ns.soak_minutes * 60), "--events", str(self.events_path)),
        )

    def _worker(self, name: str, *args: str) -> _Worker:
        worker = _Worker(name, _worker_argv("--worker", name, *args), self.run_dir / f"{name}.log", self.env)
        self.workers.append(worker)
        return worker

    def watch(self) -> None:
        """Sample until the rollout process ends (RuntimeError when it fails, overruns, or another
        process exits)."""
        ns = self.ns
        next_metrics = next_procs = time.monotonic()
        read_pos = 0
        deadline = time.monotonic() + ns.soak_minutes * 60 + ns.max_extra_s
        while self.rollout.proc.poll() is None:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(
                    f"the rollout process did not finish within {ns.max_extra_s:.0f} s after the soak"
                )
            for svc in (self.stub, self.coordinator):
                if not svc.alive():
                    raise RuntimeError(f"{svc.name} exited (code {svc.proc.returncode}):\n{svc.log_tail()}")
            if self.consumer.proc.poll() is not None:
                raise RuntimeError(
                    f"the consumer exited (code {self.consumer.proc.returncode}):\n{self.consumer.tail()}"
                )
            if now >= next_metrics:
                next_metrics += ns.metrics_interval
                self.metric_rows.append(self._metrics_row())
            if now >= next_procs:
                next_procs += ns.sample_interval
                self.proc_rows.append(self._processes_row())
            read_pos = _read_events(self.events_path, read_pos, self.events, ns.quiet)
            time.sleep(max(0.02, min(next_metrics, next_procs) - time.monotonic()))
        _read_events(self.events_path, read_pos, self.events, ns.quiet)
        if self.rollout.proc.returncode != 0:
            raise RuntimeError(
                f"the rollout process failed (code {self.rollout.proc.returncode}):\n{self.rollout.tail()}"
            )

    def _metrics_row(self) -> MetricRow:
        """The queue of agent b and the commits, from the coordinator's /metrics now."""
        try:
            m = scrape_metrics(self.coordinator.url, self.token)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return {"t": time.time(), "error": str(exc)}
        queued = metric_value(m, "mrlx_coordinator_queue_items", consumer=CONSUMER, state="queued")
        leased = metric_value(m, "mrlx_coordinator_queue_items", consumer=CONSUMER, state="leased")
        return {
            "t": time.time(),
            "depth": int(queued + leased),
            "queued": int(queued),
            "leased": int(leased),
            "enqueued": int(metric_value(m, "mrlx_coordinator_items_enqueued_total", consumer=CONSUMER)),
            "acked": int(metric_value(m, "mrlx_coordinator_items_acked_total", consumer=CONSUMER)),
            "commits_ok": int(
                metric_value(m, "mrlx_coordinator_requests_total", endpoint="commit", status="200")
            ),
            "commits_429": int(
                metric_value(m, "mrlx_coordinator_requests_total", endpoint="commit", status="429")
            ),
        }

    def _processes_row(self) -> ProcRow:
        """Memory and open files of the rollout process and the coordinator, every process's CPU
        time, the database's size; and the machine's load."""
        pids = {"rollout": self.rollout.proc.pid, "coordinator": self.coordinator.proc.pid}
        cpu_pids = {**pids, "consumer": self.consumer.proc.pid, "stub": self.stub.proc.pid}
        db = self.run_dir / "coordinator.sqlite"
        # The machine's 1-minute load average: other work on it shows up here, not in the
        # processes above.
        row: ProcRow = {"t": time.time(), "loadavg_1m": os.getloadavg()[0]}
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
        return row

    def drain(self) -> ConsumerStats:
        """The consumer drains what is left, then reports (its result file)."""
        consumer = self.consumer
        consumer.proc.send_signal(signal.SIGTERM)
        try:
            consumer.proc.wait(self.ns.max_extra_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"the consumer did not drain the queue within {self.ns.max_extra_s:.0f} s"
            ) from None
        if consumer.proc.returncode != 0:
            raise RuntimeError(f"the consumer failed (code {consumer.proc.returncode}):\n{consumer.tail()}")
        return json.loads(self.consumer_result.read_text())

    def stop(self) -> None:
        for worker in reversed(self.workers):
            worker.stop()
        for svc in reversed(self.services):
            svc.stop()


def _read_events(path: Path, pos: int, events: list[LoadEvent], quiet: bool) -> int:
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
