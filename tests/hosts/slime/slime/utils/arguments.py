"""Fake of `slime.utils.arguments`: `parse_args` for the flags the plugin and the split read.

What it models from the real parser (slime's own flags, Megatron's and SGLang's merged into one
Namespace):
- unknown flags are ignored silently (slime parses with `ignore_unknown_args` / `parse_known_args`);
- `--num-steps-per-rollout` derives `global_batch_size = rollout_batch_size * n_samples_per_prompt
  // num_steps_per_rollout` (and must agree with an explicit `--global-batch-size`); with neither,
  Megatron's default `micro_batch_size * data_parallel_size` applies;
- `world_size = actor_num_nodes * actor_num_gpus_per_node`, and Megatron's
  `data_parallel_size = world_size // (tp * pp * cp)`;
- `over_sampling_batch_size` defaults to `rollout_batch_size` and may not be smaller;
- `eval_function_path` defaults to `rollout_function_path`, `eval_max_context_len` to
  `rollout_max_context_len`; `n_samples_per_prompt == 1` turns off the std normalisation;
- every top-level key of the `--custom-config-path` YAML is set on `args`, overwriting.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

import yaml

logger = logging.getLogger(__name__)


def _add_flags(p: argparse.ArgumentParser) -> None:
    # cluster and Megatron parallelism
    p.add_argument("--actor-num-nodes", type=int, default=1)
    p.add_argument("--actor-num-gpus-per-node", type=int, default=8)
    p.add_argument("--rollout-num-gpus", type=int, default=1)  # real: derived or required; here one engine
    p.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    p.add_argument("--microbatch-group-size-per-vp-stage", type=int, default=None)
    # batches
    p.add_argument("--rollout-batch-size", type=int, required=True)
    p.add_argument("--n-samples-per-prompt", type=int, default=1)
    p.add_argument("--over-sampling-batch-size", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--num-steps-per-rollout", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--use-dynamic-batch-size", action="store_true", default=False)
    p.add_argument("--max-tokens-per-gpu", type=int, default=None)
    p.add_argument("--num-rollout", type=int, default=None)
    p.add_argument("--start-rollout-id", type=int, default=0)  # real: from the --load checkpoint, else 0
    p.add_argument("--update-weights-interval", type=int, default=1)
    # rollout and sampling
    p.add_argument("--hf-checkpoint", type=str, default=None)
    p.add_argument("--rollout-temperature", type=float, default=1.0)
    p.add_argument("--rollout-top-p", type=float, default=1.0)
    p.add_argument("--rollout-top-k", type=int, default=-1)
    p.add_argument("--rollout-max-response-len", type=int, default=None)
    p.add_argument("--rollout-max-context-len", type=int, default=None)
    p.add_argument("--rollout-stop", type=str, nargs="+", default=None)
    p.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None)
    p.add_argument("--rollout-skip-special-tokens", action="store_true", default=False)
    p.add_argument("--rollout-seed", type=int, default=42)
    p.add_argument("--partial-rollout", action="store_true", default=False)
    p.add_argument("--disable-rollout-global-dataset", action="store_false", dest="rollout_global_dataset")
    # SGLang side (slime parses these with a separate parser and merges them)
    p.add_argument("--sglang-router-ip", type=str, default=None)
    p.add_argument("--sglang-router-port", type=int, default=None)
    p.add_argument("--sglang-server-concurrency", type=int, default=512)
    # plugin paths
    p.add_argument("--rollout-function-path", default="slime.rollout.sglang_rollout.generate_rollout")
    p.add_argument("--eval-function-path", type=str, default=None)
    p.add_argument("--custom-generate-function-path", type=str, default=None)
    p.add_argument("--custom-reward-post-process-path", type=str, default=None)
    p.add_argument("--custom-convert-samples-to-train-data-path", type=str, default=None)
    p.add_argument("--custom-rollout-log-function-path", type=str, default=None)
    p.add_argument("--custom-eval-rollout-log-function-path", type=str, default=None)
    p.add_argument("--custom-rm-path", type=str, default=None)
    p.add_argument("--custom-config-path", type=str, default=None)
    p.add_argument("--data-source-path", default="slime.rollout.data_source.RolloutDataSourceWithBuffer")
    # data
    p.add_argument("--prompt-data", type=str, default=None)
    p.add_argument("--input-key", type=str, default="input")
    p.add_argument("--label-key", type=str, default=None)
    p.add_argument("--metadata-key", type=str, default="metadata")
    p.add_argument("--apply-chat-template", action="store_true", default=False)
    # rewards
    p.add_argument("--rm-type", type=str, default=None)
    p.add_argument("--reward-key", type=str, default=None)
    p.add_argument("--eval-reward-key", type=str, default=None)
    p.add_argument("--advantage-estimator", type=str, default="grpo")
    p.add_argument("--disable-rewards-normalization", action="store_false", dest="rewards_normalization")
    p.add_argument("--disable-grpo-std-normalization", action="store_false", dest="grpo_std_normalization")
    # evaluation
    p.add_argument("--eval-interval", type=int, default=None)
    p.add_argument("--skip-eval-before-train", action="store_true", default=False)
    p.add_argument("--eval-prompt-data", type=str, nargs="+", default=None)
    p.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    p.add_argument("--eval-max-response-len", type=int, default=None)
    p.add_argument("--eval-max-context-len", type=int, default=None)
    p.add_argument("--eval-temperature", type=float, default=None)
    p.add_argument("--eval-top-p", type=float, default=None)
    p.add_argument("--eval-top-k", type=int, default=None)
    # logging and checkpoints
    p.add_argument("--wandb-always-use-train-step", action="store_true", default=False)
    p.add_argument("--save", type=str, default=None)
    p.add_argument("--load", type=str, default=None)


def parse_args(
    argv: list[str] | None = None,
    add_custom_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    _add_flags(parser)
    if add_custom_arguments is not None:
        add_custom_arguments(parser)
    args, _unknown = parser.parse_known_args(argv)  # slime drops unknown flags without a word

    args.world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
    model_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    args.data_parallel_size = args.world_size // (model_size * args.context_parallel_size)

    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path
    if args.num_steps_per_rollout is not None:
        derived = args.rollout_batch_size * args.n_samples_per_prompt // args.num_steps_per_rollout
        assert args.global_batch_size in (None, derived), (
            f"global_batch_size {args.global_batch_size} is not rollout_batch_size * n_samples_per_prompt "
            f"// num_steps_per_rollout ({derived})"
        )
        args.global_batch_size = derived
    if args.global_batch_size is None:  # Megatron's default
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.n_samples_per_prompt == 1:
        args.grpo_std_normalization = False
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    assert args.over_sampling_batch_size >= args.rollout_batch_size, (
        f"over_sampling_batch_size {args.over_sampling_batch_size} should be greater than or equal to "
        f"rollout_batch_size {args.rollout_batch_size}"
    )
    assert args.num_rollout is not None, "set --num-rollout"

    if args.custom_config_path:
        with open(args.custom_config_path) as f:
            data = yaml.safe_load(f) or {}
        for key, value in data.items():
            if hasattr(args, key):
                logger.info(
                    "argument %s is already %r; the custom config overrides it with %r",
                    key,
                    getattr(args, key),
                    value,
                )
            setattr(args, key, value)

    if args.eval_max_context_len is None:
        args.eval_max_context_len = args.rollout_max_context_len
    return args
