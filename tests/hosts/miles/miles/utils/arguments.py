"""Stands in for `miles.utils.arguments.parse_args`: the flags a rollout plugin meets, and Miles'
order of work.

1. Build the parser. Unless `MILES_USE_LEGACY_ROLLOUT_V1=1`, Miles first parses what it can
   (`parse_known_args`), resolves the rollout function path (below) and
   `--custom-generate-function-path`, imports both objects and calls `obj.add_arguments(parser)`
   on each that has it, with the whole argparse parser (so one plugin named by both flags sees
   the call twice). A path whose module is missing is skipped.
2. Parse STRICTLY: Megatron's parser rejects unknown flags (exit status 2).
3. Validate: default global batch size (`--num-steps-per-rollout`, else one step per rollout,
   counted in rollouts); `--over-sampling-batch-size` defaults to the rollout batch size;
   `n_samples_per_prompt == 1` turns GRPO's std normalisation off; `--fully-async` asserts
   (class-based API, no `--rollout-function-path`, no `--colocate`, no `--partial-rollout`, no
   `--pause-generation-mode abort`); the rollout/eval function paths are resolved into `args`:
   `--rollout-function-path`, else `InferenceRolloutFn` (or the legacy `generate_rollout`),
   `FullyAsyncRolloutFn` overriding it with `--fully-async`, eval defaulting to the rollout path;
   then `--custom-config-path` (a YAML file or `base64:<payload>`): each top-level key is set on
   `args`, overwriting. Without a checkpoint to resume (`--load` holding
   `latest_checkpointed_iteration.txt`) `--start-rollout-id` becomes 0; with one it stays as given
   (None unless given: Miles resolves it later, on the trainer, from the checkpoint).
Real Miles knows hundreds more flags (Megatron, SGLang, Ray); the fake knows the ones below.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import yaml

from miles.utils.environ import use_legacy_rollout_v1
from miles.utils.eval_config import build_eval_dataset_configs
from miles.utils.file_arg_utils import resolve_file_arg
from miles.utils.misc import load_function

logger = logging.getLogger(__name__)


def resolve_rollout_function_paths(args: Any) -> tuple[str, str]:
    if use_legacy_rollout_v1():
        standard = "miles.rollout.sglang_rollout.generate_rollout"
    else:
        standard = "miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn"
    rollout_path = args.rollout_function_path or standard
    if args.fully_async:
        rollout_path = "miles.rollout.fully_async_rollout.FullyAsyncRolloutFn"
    return rollout_path, args.eval_function_path or rollout_path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles (fake)")
    add = p.add_argument
    # cluster and engines
    add("--rollout-num-gpus", type=int, default=1)
    add("--rollout-num-gpus-per-engine", type=int, default=1)
    add("--colocate", action="store_true")
    add("--sglang-router-ip", type=str, default=None)
    add("--sglang-router-port", type=int, default=None)
    add("--sglang-server-concurrency", type=int, default=512)
    add("--pause-generation-mode", choices=["abort", "retract", "in_place"], default="retract")
    # model and data
    add("--hf-checkpoint", type=str, default=None)
    add("--chat-template-path", type=str, default=None)
    add("--prompt-data", type=str, default=None)
    add("--input-key", type=str, default="input")
    add("--label-key", type=str, default=None)
    add("--metadata-key", type=str, default="metadata")
    add("--apply-chat-template", action="store_true")
    add("--data-source-path", type=str, default="miles.rollout.data_source.RolloutDataSourceWithBuffer")
    add("--disable-rollout-global-dataset", action="store_false", dest="rollout_global_dataset")
    add("--rollout-seed", type=int, default=42)
    add("--start-rollout-id", type=int, default=None)
    # rollout
    add("--rollout-function-path", type=str, default=None)
    add("--eval-function-path", type=str, default=None)
    add("--custom-generate-function-path", type=str, default=None)
    add("--custom-rm-path", type=str, default=None)
    add("--rm-type", type=str, default=None)
    add("--reward-key", type=str, default=None)
    add("--eval-reward-key", type=str, default=None)
    add("--group-rm", action="store_true")
    add("--custom-reward-post-process-path", type=str, default=None)
    add("--custom-convert-samples-to-train-data-path", type=str, default=None)
    add("--custom-rollout-log-function-path", type=str, default=None)
    add("--custom-eval-rollout-log-function-path", type=str, default=None)
    add("--custom-agent-function-path", type=str, default=None)
    add("--dynamic-sampling-filter-path", type=str, default=None)
    add("--rollout-sample-filter-path", type=str, default=None)
    add("--rollout-all-samples-process-path", type=str, default=None)
    add("--rollout-batch-size", type=int, required=True)
    add("--n-samples-per-prompt", type=int, default=1)
    add("--over-sampling-batch-size", type=int, default=None)
    add("--rollout-max-response-len", type=int, default=None)
    add("--rollout-max-context-len", type=int, default=None)
    add("--rollout-max-prompt-len", type=int, default=None)
    add("--rollout-temperature", type=float, default=1.0)
    add("--rollout-top-p", type=float, default=1.0)
    add("--rollout-top-k", type=int, default=-1)
    add("--rollout-stop", type=str, nargs="+", default=None)
    add("--rollout-stop-token-ids", type=int, nargs="+", default=None)
    add("--rollout-skip-special-tokens", action="store_true")
    add("--partial-rollout", action="store_true")
    add("--mask-offpolicy-in-partial-rollout", action="store_true")
    add("--fully-async", action="store_true")
    add("--max-weight-staleness", type=int, default=None)
    add("--async-max-concurrent-samples", type=int, default=None)
    add("--async-data-buffer-capacity-factor", type=float, default=2.0)
    add("--async-unused-samples-handler", choices=["retry", "drop"], default="drop")
    add("--custom-async-data-buffer-path", type=str, default=None)
    # evaluation
    add("--eval-interval", type=int, default=None)
    add("--skip-eval-before-train", action="store_true")
    add("--eval-prompt-data", type=str, nargs="+", default=None)
    add("--n-samples-per-eval-prompt", type=int, default=1)
    add("--eval-temperature", type=float, default=None)
    add("--eval-top-p", type=float, default=None)
    add("--eval-top-k", type=int, default=None)
    add("--eval-max-response-len", type=int, default=None)
    add("--eval-max-context-len", type=int, default=None)
    add("--eval-input-key", type=str, default=None)
    add("--eval-label-key", type=str, default=None)
    # training batches and algorithm (Megatron's and Miles')
    add("--num-rollout", type=int, default=None)
    add("--global-batch-size", type=int, default=None)
    add("--num-steps-per-rollout", type=int, default=None)
    add("--micro-batch-size", type=int, default=1)
    add("--use-dynamic-batch-size", action="store_true")
    add("--max-tokens-per-gpu", type=int, default=None)
    add("--balance-data", action="store_true")
    add("--advantage-estimator", type=str, default="grpo")
    add("--disable-rewards-normalization", action="store_false", dest="rewards_normalization")
    add("--disable-grpo-std-normalization", action="store_false", dest="grpo_std_normalization")
    add("--disable-rollout-trim-samples", action="store_true")
    add("--wandb-always-use-train-step", action="store_true")
    add("--custom-config-path", type=str, default=None, help="a YAML file, or base64:<payload>")
    # checkpoints (Megatron's flags)
    add("--load", type=str, default=None)
    add("--save", type=str, default=None)
    add("--save-interval", type=int, default=None)
    return p


def _add_user_provided_function_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    try:
        partial, _ = parser.parse_known_args(argv)
    except SystemExit:
        return
    for path in (resolve_rollout_function_paths(partial)[0], partial.custom_generate_function_path):
        try:
            fn = load_function(path)
        except (ModuleNotFoundError, ValueError):
            continue
        if fn is not None and callable(getattr(fn, "add_arguments", None)):
            fn.add_arguments(parser)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    if not use_legacy_rollout_v1():
        _add_user_provided_function_arguments(parser, argv)
    args = parser.parse_args(argv)
    validate_args(args)
    return args


def validate_args(args: argparse.Namespace) -> None:
    if args.eval_prompt_data and len(args.eval_prompt_data) % 2:
        raise ValueError("eval prompt data must be provided as name/path pairs.")
    args.eval_datasets = build_eval_dataset_configs(args, args.eval_prompt_data or [])
    _resolve_rollout_functions(args)
    if args.num_steps_per_rollout is not None:
        gbs = args.rollout_batch_size * args.n_samples_per_prompt // args.num_steps_per_rollout
        assert args.global_batch_size in (None, gbs), (
            f"global_batch_size {args.global_batch_size} is not equal to rollout_batch_size "
            f"{args.rollout_batch_size} "
            f"* n_samples_per_prompt {args.n_samples_per_prompt} // num_steps_per_rollout "
            f"{args.num_steps_per_rollout}"
        )
        args.global_batch_size = gbs
    elif args.global_batch_size is None:
        args.global_batch_size = args.rollout_batch_size * args.n_samples_per_prompt
    if args.n_samples_per_prompt == 1:
        args.grpo_std_normalization = False
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    assert args.over_sampling_batch_size >= args.rollout_batch_size, (
        f"over_sampling_batch_size {args.over_sampling_batch_size} should be greater than or equal to "
        f"rollout_batch_size {args.rollout_batch_size}"
    )
    if args.custom_config_path:
        for key, value in (yaml.safe_load(resolve_file_arg(args.custom_config_path)) or {}).items():
            if hasattr(args, key):
                logger.info(
                    "Warning: Argument %s is already set to %s, will override with %s.",
                    key,
                    getattr(args, key),
                    value,
                )
            setattr(args, key, value)
    if args.eval_max_context_len is None:
        args.eval_max_context_len = args.rollout_max_context_len
    if args.load is None or not os.path.exists(os.path.join(args.load, "latest_checkpointed_iteration.txt")):
        args.start_rollout_id = 0  # a fresh run; a resumed one learns its step from the trainer


def _resolve_rollout_functions(args: argparse.Namespace) -> None:
    if args.fully_async:
        assert not use_legacy_rollout_v1(), (
            "--fully-async needs the class-based rollout API; unset MILES_USE_LEGACY_ROLLOUT_V1"
        )
        assert args.rollout_function_path is None, (
            "--fully-async and --rollout-function-path both select a rollout function; pass only one"
        )
        assert not args.colocate, (
            "--fully-async cannot colocate: rollout must keep generating while training runs"
        )
        assert not args.partial_rollout, "--fully-async does not support --partial-rollout"
        assert args.pause_generation_mode != "abort", "--fully-async cannot use --pause-generation-mode abort"
        assert args.rollout_all_samples_process_path is None, (
            "--fully-async does not support --rollout-all-samples-process-path"
        )
    args.rollout_function_path, args.eval_function_path = resolve_rollout_function_paths(args)
