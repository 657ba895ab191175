"""`mrlx bench rollout`: what the plugin costs per model call, and how close a pipeline gets to
its critical path.

Three measurements, each in a fresh rollout process driving `mrlx_plugin.rollout.generate` the
way slime's rollout does (host-shaped args, n samples per prompt, a concurrency semaphore),
against the model-free stub engine in its own process:

1. throughput: the rollout process pinned to one core, the stub (answering at once) on the
   other; pipeline episodes with ~2k-token problems. Reports model calls per second and the
   rollout process's CPU milliseconds per call (user + system, every thread).
2. critical path: 64 concurrent pipeline episodes (num_parallel 5: 11 calls each) against a stub
   that answers every call after 1 s. The critical path is 3 calls (solve, rewrite, select) =
   3 s; reports wall time / 3 s.
3. memory: 1,024 concurrent episodes against the 1 s stub; peak RSS of the rollout process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from mrlx_lab.bench.report import write_report
from mrlx_plugin.core import processes
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    from mrlx_plugin.local.services import ManagedProcess

WORDS = [
    "let",
    "the",
    "number",
    "of",
    "integers",
    "between",
    "positive",
    "real",
    "triangle",
    "sum",
    "product",
    "prime",
    "divisor",
    "coefficient",
    "sequence",
    "function",
    "polynomial",
    "probability",
    "circle",
    "radius",
    "angle",
    "area",
    "perimeter",
    "digit",
    "remainder",
    "modulo",
    "consider",
    "find",
    "compute",
    "show",
    "that",
    "such",
    "where",
    "each",
    "every",
    "value",
    "maximum",
    "minimum",
    "expected",
    "ordered",
    "pair",
]
MATH = [
    "x^2+y^2=25",
    "\\frac{a}{b}",
    "n!",
    "2^{10}",
    "\\sqrt{3}",
    "a_{n+1}=2a_n+1",
    "f(x)=x^3-3x",
    "\\binom{12}{4}",
]


def make_problem(rng: random.Random, approx_words: int) -> str:
    paragraphs, words = [], 0
    while words < approx_words:
        sentence_count = rng.randint(3, 6)
        sentences = []
        for _ in range(sentence_count):
            n = rng.randint(8, 20)
            parts = [rng.choice(MATH) if rng.random() < 0.12 else rng.choice(WORDS) for _ in range(n)]
            sentences.append(" ".join(parts).capitalize() + ".")
            words += n
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs) + "\n\nWhat is the value? Put the answer in \\boxed{}."


def stub_text(response_words: int) -> str:
    """A ~response_words reasoning text; `{i}` makes every answer distinct (the stub fills it in)."""
    rng = random.Random(1)
    body = " ".join(rng.choice(WORDS) for _ in range(response_words))
    return f"Attempt {{i}}. {body}\n\nSo the result is \\boxed{{42}}.\n\nJudgment: 1"


# ---------------------------------------------------------------------------------------------
# The rollout worker (runs in its own process)
# ---------------------------------------------------------------------------------------------


def _host_args(
    url: str,
    tokenizer_dir: str,
    response_tokens: int,
    num_parallel: int,
    system: str = "pipeline",
    plugins: list[str] | None = None,
) -> argparse.Namespace:
    from mrlx_plugin.local.trainer.fake_host import set_router

    args = argparse.Namespace(
        hf_checkpoint=tokenizer_dir,
        rollout_max_response_len=response_tokens,
        rollout_max_context_len=None,
        eval_max_context_len=None,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_stop=None,
        rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        n_samples_per_prompt=8,
        apply_chat_template=False,
        partial_rollout=False,
        custom_config_path=None,
        mrlx={
            "run_id": "bench",
            "system": system,
            "plugins": list(plugins or []),
            "pipeline": {"num_parallel": num_parallel},
            "engine": {"max_connections": 1024, "request_timeout_s": 120},
        },
    )
    if system != "pipeline":  # the built-in pipeline's agents are its defaults; agent code names its own
        args.mrlx["agents"] = {role: {"url": "self"} for role in ("solver", "rewriter", "selector")}
    set_router(args, url)
    return args


async def _drive(
    args: argparse.Namespace, problems: list[str], episodes: int, concurrency: int, start: int
) -> int:
    from mrlx_plugin.core.host import Sample
    from mrlx_plugin.local.trainer.fake_host import sampling_params
    from mrlx_plugin.rollout import generate

    semaphore = asyncio.Semaphore(concurrency)
    params = sampling_params(args)

    async def one(i: int) -> int:
        group = (start + i) // 8
        s = Sample(
            group_index=group,
            index=start + i,
            prompt=[{"role": "user", "content": problems[group % len(problems)]}],
            label="42",
        )
        async with semaphore:
            out = await generate(args, s, dict(params))
        return out[0].metadata["mrlx"]["turns"]

    return sum(await asyncio.gather(*(one(i) for i in range(episodes))))


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker(ns: argparse.Namespace) -> JSONObject:
    if ns.cpu is not None:
        os.sched_setaffinity(0, {ns.cpu})
    problems = json.loads(Path(ns.problems).read_text())
    args = _host_args(
        ns.url,
        ns.tokenizer,
        ns.response_tokens,
        ns.num_parallel,
        ns.system,
        ns.plugins.split(",") if ns.plugins else [],
    )

    async def run() -> JSONObject:
        from mrlx_plugin.runtime import get_runtime

        await get_runtime(args)  # load plugins and the tokenizer before the clock starts
        await _drive(args, problems, ns.warmup, min(ns.concurrency, max(ns.warmup, 1)), start=10**6)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu0, t0 = _cpu_seconds(), time.perf_counter()
        calls = await _drive(args, problems, ns.episodes, ns.concurrency, start=0)
        wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
        await (await get_runtime(args)).aclose()
        for module in args.mrlx["plugins"]:  # agent code's own clients, where it has a close for them
            aclose = getattr(sys.modules.get(module), "aclose", None)
            if aclose is not None:
                await aclose()
        return {
            "episodes": ns.episodes,
            "calls": calls,
            "wall_s": wall,
            "cpu_s": cpu,
            "calls_per_s": calls / wall,
            "cpu_ms_per_call": 1000 * cpu / calls,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_after_warmup_mib": rss_before / 1024,
        }

    return asyncio.run(run())


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def _run_worker(
    mode: str,
    url: str,
    tokenizer: str,
    problems: str,
    *,
    episodes: int,
    concurrency: int,
    num_parallel: int,
    response_tokens: int,
    cpu: int | None,
    warmup: int,
    system: str = "pipeline",
    plugins: str = "",
) -> JSONObject:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out = f.name
    argv = [
        sys.executable,
        "-m",
        "mrlx_lab.bench.engine_calls",
        "--worker",
        "--url",
        url,
        "--tokenizer",
        tokenizer,
        "--problems",
        problems,
        "--episodes",
        str(episodes),
        "--concurrency",
        str(concurrency),
        "--num-parallel",
        str(num_parallel),
        "--response-tokens",
        str(response_tokens),
        "--warmup",
        str(warmup),
        "--result",
        out,
        "--system",
        system,
        "--plugins",
        plugins,
    ] + (["--cpu", str(cpu)] if cpu is not None else [])
    worker = processes.start(argv)
    try:
        if worker.wait() != 0:
            raise subprocess.CalledProcessError(worker.returncode, argv)
    finally:
        processes.stop(worker)  # only still running when this process was interrupted
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    result["mode"] = mode
    return result


def start_stubs(
    workdir: Path, tokenizer: str, response_tokens: int, latency: float
) -> tuple[ManagedProcess, ManagedProcess]:
    """Two stub engines answering ~response_tokens-token texts spelled in the agents' tokenizer (so
    peers read real answers): one at once, one after `latency` seconds. The caller stops them."""
    from mrlx_lab.stub_engine import start_stub_engine

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # thousands of connections in flight
    common = ["--response-tokens", str(response_tokens), "--vocab-size", "8192", "--tokenizer", tokenizer]
    common += ["--text", stub_text(max(8, response_tokens // 2))]
    logs = workdir / "logs"
    instant = start_stub_engine(log_dir=logs, name="stub-instant", extra=common)
    try:
        slow = start_stub_engine(log_dir=logs, name="stub-slow", extra=common + ["--latency", str(latency)])
    except BaseException:
        instant.stop()
        raise
    return instant, slow


@contextmanager
def pinned_stubs(
    workdir: Path, tokenizer: str, response_tokens: int, latency: float
) -> Iterator[tuple[ManagedProcess, ManagedProcess, int | None]]:
    """The two stub engines of `start_stubs`, stopped when the block ends; on a machine of two
    cores or more they run on the second, and the block is given the first for the rollout
    worker (else None). Yields (instant, slow, the rollout's core)."""
    instant, slow = start_stubs(workdir, tokenizer, response_tokens, latency)
    cpus = sorted(os.sched_getaffinity(0))
    try:
        if len(cpus) >= 2:
            os.sched_setaffinity(instant.proc.pid, {cpus[1]})
            os.sched_setaffinity(slow.proc.pid, {cpus[1]})
        yield instant, slow, cpus[0] if len(cpus) >= 2 else None
    finally:
        instant.stop()
        slow.stop()


def prepare(workdir: Path, prompt_tokens: int, seed: int) -> tuple[str, str, float]:
    """A realistic byte-level BPE tokenizer (8k vocab) and ~prompt_tokens-token problems."""
    from mrlx_plugin.core.tokenizer import load_tokenizer
    from mrlx_plugin.local.model import build_tokenizer

    workdir.mkdir(parents=True, exist_ok=True)
    tok_dir = workdir / "tokenizer-8k"
    if not (tok_dir / "tokenizer.json").exists():
        build_tokenizer(tok_dir, vocab_size=8192)
    tok = load_tokenizer(str(tok_dir))
    rng = random.Random(seed)
    words = prompt_tokens // 2
    problems = [make_problem(rng, words) for _ in range(64)]
    sizes = [len(tok.encode(p)) for p in problems]
    scale = prompt_tokens / (sum(sizes) / len(sizes))
    if abs(scale - 1) > 0.1:
        rng = random.Random(seed)
        problems = [make_problem(rng, int(words * scale)) for _ in range(64)]
        sizes = [len(tok.encode(p)) for p in problems]
    path = workdir / "problems.json"
    path.write_text(json.dumps(problems))
    return str(tok_dir), str(path), sum(sizes) / len(sizes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrlx bench rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/rollout.json")
    p.add_argument("--workdir", default="runs/bench")
    p.add_argument("--episodes", type=int, default=600, help="throughput run: pipeline episodes")
    p.add_argument("--concurrency", type=int, default=64, help="throughput run: episodes in flight")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--response-tokens", type=int, default=256)
    p.add_argument("--num-parallel", type=int, default=5)
    p.add_argument("--path-episodes", type=int, default=64, help="critical-path run: concurrent episodes")
    p.add_argument("--memory-episodes", type=int, default=1024, help="memory run: concurrent episodes")
    p.add_argument("--latency", type=float, default=1.0, help="seconds per call of the slow stub")
    p.add_argument("--seed", type=int, default=0)
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--problems", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--system", default="pipeline", help=argparse.SUPPRESS)
    p.add_argument("--plugins", default="", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.worker:
        Path(ns.result).write_text(json.dumps(worker(ns)))
        return 0

    workdir = Path(ns.workdir)
    tokenizer, problems, mean_prompt = prepare(workdir, ns.prompt_tokens, ns.seed)
    with pinned_stubs(workdir, tokenizer, ns.response_tokens, ns.latency) as (instant, slow, cpu):
        kw = dict(num_parallel=ns.num_parallel, response_tokens=ns.response_tokens)
        throughput = _run_worker(
            "throughput",
            instant.url,
            tokenizer,
            problems,
            episodes=ns.episodes,
            concurrency=ns.concurrency,
            cpu=cpu,
            warmup=32,
            **kw,
        )
        path = _run_worker(
            "critical_path",
            slow.url,
            tokenizer,
            problems,
            episodes=ns.path_episodes,
            concurrency=ns.path_episodes,
            cpu=cpu,
            warmup=ns.path_episodes,
            **kw,
        )
        memory = _run_worker(
            "memory",
            slow.url,
            tokenizer,
            problems,
            episodes=ns.memory_episodes,
            concurrency=ns.memory_episodes,
            cpu=None,
            warmup=0,
            **kw,
        )
    cpus = len(os.sched_getaffinity(0))
    critical = 3 * ns.latency
    result = {
        "machine": {"cpus": cpus, "python": sys.version.split()[0]},
        "workload": {
            "mean_prompt_tokens": round(mean_prompt),
            "response_tokens": ns.response_tokens,
            "num_parallel": ns.num_parallel,
            "calls_per_episode": 2 * ns.num_parallel + 1,
        },
        "throughput": throughput,
        "critical_path": {**path, "critical_path_s": critical, "ratio": path["wall_s"] / critical},
        "memory": memory,
    }
    pinned = ", rollout pinned to one core" if cpu is not None else ""
    print(
        f"mrlx bench rollout  (prompts ~{round(mean_prompt)} tokens, {ns.response_tokens}-token answers, "
        f"num_parallel {ns.num_parallel}, {cpus} CPUs{pinned})"
    )
    print(_table(ns, result))
    write_report(ns.out, result)
    return 0


def _table(ns: argparse.Namespace, result: JSONObject) -> str:
    """The measures against their goals."""
    throughput, path, memory = result["throughput"], result["critical_path"], result["memory"]
    critical = path["critical_path_s"]
    rows = [
        ("model calls/s on one core (instant engine)", f"{throughput['calls_per_s']:.0f}", ">= 1000"),
        ("plugin CPU ms per call", f"{throughput['cpu_ms_per_call']:.3f}", "<= 1"),
        (
            f"{ns.path_episodes} episodes vs {ns.latency:g} s engine: wall / critical path",
            f"{path['wall_s']:.2f} s / {critical:.0f} s = {path['wall_s'] / critical:.3f}",
            "<= 1.10",
        ),
        (
            f"peak RSS, {ns.memory_episodes} concurrent episodes",
            f"{memory['peak_rss_mib']:.0f} MiB",
            "report",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"  {'measure':<{width}}  {'result':<28} goal"]
    lines += [f"  {name:<{width}}  {value:<28} {goal}" for name, value, goal in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
