"""The trainer's evaluation (slime's --eval-interval): whole episodes on held-out prompts, under
one or more configs, nothing trained."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from mrlx_plugin.core.host import HostSample, RolloutFnEvalOutput
    from mrlx_plugin.local.trainer.fake_host import LocalDataSource

    # (name, host args, data source) of one evaluation set
    EvalSet = tuple[str, argparse.Namespace, LocalDataSource]


def evaluation_sets(ns: argparse.Namespace, args: argparse.Namespace) -> list[EvalSet]:
    """(name, args, data source) per evaluation set: the held-out prompts of --eval-prompt-data
    under each --eval-config (default: the job's own config and args, as set `eval`); with
    named prompt files, one set per config and file, `CONFIG/NAME`."""
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.trainer.fake_host import LocalDataSource, host_args, read_prompts

    if ns.eval_interval is None:
        return []
    if not ns.eval_prompt_data:
        raise ConfigError("--eval-interval: give the held-out prompts with --eval-prompt-data")
    if ns.eval_interval < 1:
        raise ConfigError(f"--eval-interval: got {ns.eval_interval}; expected at least 1")
    data = ns.eval_prompt_data
    if len(data) == 1:
        files = [("", data[0])]
    elif len(data) % 2 == 0:
        files = list(zip(data[0::2], data[1::2]))
    else:
        raise ConfigError(
            f"--eval-prompt-data: got {len(data)} values; give one file, or NAME FILE pairs (slime's form)"
        )
    sets: list[EvalSet] = []
    for spec in ns.eval_config or [None]:
        if spec is None:
            name, eval_args = "eval", args
        else:
            name, _, path = spec.rpartition("=")
            name = name or Path(path).stem
            eval_args = host_args(ns, path)
            eval_args.custom_generate_function_path = args.custom_generate_function_path
            eval_args.rollout_function_path = args.rollout_function_path
        eval_args.n_samples_per_eval_prompt = ns.n_samples_per_eval_prompt
        for label, file in files:
            prompts = read_prompts(file, ns.input_key, ns.label_key, getattr(ns, "metadata_key", "metadata"))
            source = LocalDataSource(prompts[:1], 1, eval_prompts=prompts)
            sets.append((f"{name}/{label}" if label else name, eval_args, source))
    return sets


def evaluate(
    sets: list[EvalSet], rollout_fn: Callable[..., object], rollout_id: int
) -> dict[str, float | None]:
    """Run every evaluation set through the rollout function in evaluation mode, as slime's
    `eval` does; `eval/<set>/reward_mean` is the mean reward of its episodes' final answers,
    `eval/<set>/<metric>` the rollout metrics of its samples."""
    from mrlx_plugin.core.metrics import compute_metrics

    out: dict[str, float | None] = {}
    for name, eval_args, source in sets:
        t0 = time.monotonic()
        output = cast("RolloutFnEvalOutput", rollout_fn(eval_args, rollout_id, source, evaluation=True))
        rewards: list[float] = []
        samples: list[HostSample] = []
        for entry in (output.data or {}).values():
            rewards += [float(r) for r in entry.get("rewards") or []]
            samples += list(entry.get("samples") or [])
        out[f"eval/{name}/reward_mean"] = sum(rewards) / len(rewards) if rewards else None
        out[f"eval/{name}/episodes"] = len(rewards)
        out |= {f"eval/{name}/{k}": v for k, v in compute_metrics(samples).items()}
        out[f"eval/{name}/seconds"] = time.monotonic() - t0
    return out
