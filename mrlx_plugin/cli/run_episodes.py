"""`mrlx rollout`: run episodes of the configured system against engines, as slime's rollout would.

Each input sample goes through `mrlx_plugin.rollout.generate` exactly as slime calls it (same
args object, same sampling parameters, at most `--concurrency` at once, like the host's
semaphore); the returned samples are normalised with `mrlx_plugin.rollout.normalize`, summarised
with `mrlx_plugin.core.metrics.compute_metrics`, and written as JSONL. With `--local` the command first
starts an embedded engine on a small model built on this machine (and the real sglang-router in
front of it when that is installed), so it runs anywhere with no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from mrlx_plugin.core.host import Sample
from mrlx_plugin.local.trainer.fake_host import (
    add_host_arguments,
    host_args,
    make_groups,
    read_prompts,
    sampling_params,
    set_router,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrlx rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML with a top-level 'mrlx:' key")
    p.add_argument(
        "--output", default=None, help="JSONL file for the samples (default: runs/rollout-<time>.jsonl)"
    )
    p.add_argument("--concurrency", type=int, default=64, help="episodes in flight at once")
    p.add_argument(
        "--evaluation", action="store_true", help="run in evaluation mode (one final answer per episode)"
    )
    p.add_argument("--local", action="store_true", help="start an embedded CPU engine (and router) first")
    p.add_argument(
        "--model-dir", default="runs/models/tiny", help="with --local: where the small model lives"
    )
    p.add_argument("--preset", default="tiny", help="with --local: size of the model built if missing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    add_host_arguments(p)
    return p


async def run_episodes(
    args: argparse.Namespace, groups: list[list[Sample]], concurrency: int, evaluation: bool = False
) -> list[Sample]:
    """Call the plugin's generate function on every sample, `concurrency` at a time."""
    from mrlx_plugin.rollout import generate

    semaphore = asyncio.Semaphore(concurrency)
    params = sampling_params(args)

    async def one(sample: Sample) -> Sample | list[Sample]:
        async with semaphore:
            return await generate(args, sample, dict(params), evaluation=evaluation)

    results = await asyncio.gather(*(one(s) for group in groups for s in group))
    flat: list[Sample] = []
    for r in results:
        flat.extend(r if isinstance(r, list) else [r])
    return flat


def summary_table(metrics: dict[str, float], wall_s: float, calls: int) -> str:
    rows = [
        ("wall time (s)", f"{wall_s:.2f}"),
        ("engine calls", str(calls)),
        ("calls/s", f"{calls / wall_s:.1f}" if wall_s else "-"),
    ]
    rows += [(k, f"{v:.4g}") for k, v in sorted(metrics.items())]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    with ExitStack() as stack:
        if ns.local:
            from mrlx_plugin.local.model import ensure_model
            from mrlx_plugin.local.services import router_available, start_engine, start_router

            model_dir = ensure_model(ns.model_dir, preset=ns.preset, seed=ns.seed)
            log_dir = Path("runs/logs")
            engine = start_engine(model_dir, log_dir=log_dir, extra=["--seed", str(ns.seed)])
            stack.callback(engine.stop)
            url = engine.url
            if router_available():
                router = start_router([engine.url], log_dir=log_dir)
                stack.callback(router.stop)
                url = router.url
            ns.router_url = ns.router_url or url
            ns.hf_checkpoint = ns.hf_checkpoint or str(model_dir)
            if not ns.quiet:
                print(
                    f"embedded engine at {engine.url}"
                    + (f", behind sglang-router at {url}" if url != engine.url else "")
                )
        args = host_args(ns, ns.config)
        if ns.router_url:
            set_router(args, ns.router_url)
        if ns.prompt_data:
            prompts = read_prompts(ns.prompt_data, ns.input_key, ns.label_key)
        else:
            from mrlx_plugin.local.trainer.tasks import arithmetic_prompts

            prompts = arithmetic_prompts(max(ns.rollout_batch_size, 1), seed=ns.seed)
        groups = list(make_groups(prompts, ns.rollout_batch_size, ns.n_samples_per_prompt))
        started = time.monotonic()
        samples = asyncio.run(_run_and_close(args, groups, ns.concurrency, ns.evaluation))
        wall = time.monotonic() - started

    from mrlx_plugin.core.metrics import compute_metrics
    from mrlx_plugin.rollout import normalize

    metrics = compute_metrics(samples)
    advantages = normalize(args, samples)[1] if not ns.evaluation else [0.0] * len(samples)
    out = Path(ns.output or f"runs/rollout-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for s, adv in zip(samples, advantages):
            row = s.to_dict()
            row["advantage"] = adv
            f.write(json.dumps(row, default=str) + "\n")
    episodes = {(s.metadata.get("mrlx") or {}).get("episode_id"): s for s in samples}
    calls = sum((s.metadata.get("mrlx") or {}).get("turns", 0) for s in episodes.values())
    print(f"mrlx rollout: {len(episodes)} episodes, {len(samples)} samples -> {out}")
    print(summary_table(metrics, wall, calls))
    return 0


async def _run_and_close(
    args: argparse.Namespace, groups: list[list[Sample]], concurrency: int, evaluation: bool
) -> list[Sample]:
    from mrlx_plugin.runtime import get_runtime

    try:
        return await run_episodes(args, groups, concurrency, evaluation)
    finally:
        runtime = await get_runtime(args)
        await runtime.aclose()


if __name__ == "__main__":
    sys.exit(main())
