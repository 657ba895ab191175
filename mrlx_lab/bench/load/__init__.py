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

Prints a table and writes JSON (default runs/bench/load.json). The parts: `workers` (the rollout
process and the consumer), `driver` (starting and sampling every process), `scrape` (the
coordinator's /metrics), `report` (the report and its table).
"""

from __future__ import annotations

import argparse


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
    if ns.worker is not None:  # one of the benchmark's own processes
        from mrlx_lab.bench.load.workers import consumer_worker, rollout_worker

        return rollout_worker(ns) if ns.worker == "rollout" else consumer_worker(ns)
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
    from mrlx_lab.bench.load.driver import run_load_bench
    from mrlx_lab.bench.load.report import format_table
    from mrlx_lab.bench.report import write_report

    report = run_load_bench(ns)
    print(format_table(report))
    write_report(ns.out, report)
    return 0
