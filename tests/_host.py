"""The host's side of a test: an `args` object shaped exactly like slime's, and its samples."""

from __future__ import annotations

import argparse
import asyncio
import json
import urllib.request
from typing import Any

from mrlx_plugin.core.host import Sample, run_in_host_loop
from mrlx_plugin.local.trainer.fake_host import (
    LocalDataSource,
    add_host_arguments,
    default_rollout,
    host_args,
    sampling_params,
    set_router,
)
from mrlx_plugin.runtime import runtime_for


def slime_args(
    router_url: str | None, tokenizer: str, mrlx: dict[str, Any], **flags: Any
) -> argparse.Namespace:
    """What slime passes after parsing its flags and applying `--custom-config-path` (key `mrlx`)."""
    parser = argparse.ArgumentParser()
    add_host_arguments(parser)
    ns = parser.parse_args([])
    ns.hf_checkpoint = tokenizer
    args = host_args(ns, None)
    if router_url:
        set_router(args, router_url)
    args.mrlx = mrlx
    for key, value in flags.items():
        setattr(args, key, value)
    return args


def generate_all(args: argparse.Namespace, samples: list[Sample]) -> list[list[Sample]]:
    """One `generate` call per sample, concurrently, as the host makes them, and the runtime
    closed after; each call's samples."""
    from mrlx_plugin.rollout import generate
    from mrlx_plugin.runtime import get_runtime

    async def go():
        try:
            outs = await asyncio.gather(*(generate(args, s, params(args)) for s in samples))
        finally:
            await (await get_runtime(args)).aclose()
        return [o if isinstance(o, list) else [o] for o in outs]

    return asyncio.run(go())


def params(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    p = sampling_params(args)
    p.update(overrides)
    return p


def group(index: int, n: int, prompt: Any = "What is 40 + 2?", label: str = "42") -> list[Sample]:
    """One prompt group as slime's data source hands it out: n copies, group and sample indices set."""
    return [Sample(group_index=index, index=index * n + j, prompt=prompt, label=label) for j in range(n)]


def batch_flags(
    rollout: int = 2,
    per_prompt: int = 2,
    global_batch: int = 4,
    micro: int = 1,
    num_rollout: int | None = None,
) -> list[str]:
    """The host's batch-size flags: prompts per step, samples per prompt, samples per train step and per
    micro-batch (and steps, where given)."""
    flags = ["--rollout-batch-size", str(rollout), "--n-samples-per-prompt", str(per_prompt)]
    flags += ["--global-batch-size", str(global_batch), "--micro-batch-size", str(micro)]
    if num_rollout is not None:
        flags += ["--num-rollout", str(num_rollout)]
    return flags


def engine_stats(url: str) -> dict[str, Any]:
    """What a stub engine has served so far."""
    with urllib.request.urlopen(url + "/_stub/stats", timeout=10) as resp:
        return json.loads(resp.read())


def engine_faults(url: str, mode: str, count: int) -> None:
    """Make a stub engine answer its next `count` requests with the fault `mode`."""
    body = json.dumps({"mode": mode, "count": count}).encode()
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url + "/_stub/faults", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["success"]


def faulted_rollout(
    engine_url: str, tokenizer: str, run_id: str, engine: dict[str, Any], mode: str, count: int, **flags: Any
) -> tuple[argparse.Namespace, list[Sample]]:
    """The host's default rollout of a one-at-a-time pipeline (2 prompts x 2 samples, one episode in
    flight) after the stub engine was told to answer its next `count` calls with `mode`: the host's
    args and every sample. Returns only once the rollout has finished, whatever the fault."""
    mrlx = {"run_id": run_id, "system": "pipeline", "pipeline": {"num_parallel": 1}, "engine": engine}
    args = slime_args(
        engine_url,
        tokenizer,
        mrlx,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        sglang_server_concurrency=1,
        **flags,
    )  # one episode at a time: the faults hit the first `count` calls
    source = LocalDataSource([("What is 40 + 2?", "42")], 2)
    engine_faults(engine_url, mode, count)
    out = default_rollout(args, 0, source)
    run_in_host_loop(runtime_for(args).aclose())
    return args, [s for g in out.samples for episode in g for s in episode]
