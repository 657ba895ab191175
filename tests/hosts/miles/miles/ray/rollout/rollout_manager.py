"""Stands in for `miles.ray.rollout.rollout_manager.RolloutManager` (a Ray actor in Miles; a plain
object here, its methods synchronous, like Miles' rollout calls made from a worker thread).

Construction: `args.rollout_function_path`/`eval_function_path` were resolved by `parse_args`
(class-based `InferenceRolloutFn` by default, `FullyAsyncRolloutFn` with `--fully-async`, the
legacy `sglang_rollout.generate_rollout` with `MILES_USE_LEGACY_ROLLOUT_V1=1`). Class-based:
each is loaded with `load_rollout_function` (a class is constructed once; the eval function IS the
rollout function object when the paths are equal, so they share one GenerateState); legacy: with
`load_function`, called through `call_rollout_fn`.

`generate(rollout_id)`: call the rollout function, post-process (validate rollout ids, flatten),
`log_rollout_data(rollout_id, args, flat_samples, output.metrics, seconds)`, convert to train data
(custom reward post-process, else Miles' normalisation), split by dp. Returns the shards (Miles
returns object-store refs) and, for test drivers, the flat samples.

`set_weight_version(v)`: the engines' weight version after a weight update (Miles' trainer calls it
once per update, counting from 1 for the update before the first rollout); each train call's
`RolloutFnTrainInput.weight_version` is the one set last.

`save(rollout_id)` / `load(rollout_id)`: the data source's checkpoint (save only with the global
dataset), as Miles' trainer loop asks for it.

`eval(rollout_id)`: call the eval function with evaluation, then
`log_eval_rollout_data(rollout_id, args, output.data, output.metrics)`: Miles' own rollouts
return eval metrics None, so a custom eval log function receives `extra_metrics=None`.
"""

from __future__ import annotations

import time
from typing import Any

from miles.ray.rollout.metrics import log_eval_rollout_data, log_rollout_data
from miles.ray.rollout.rollout_data_conversion import postprocess_rollout_data
from miles.ray.rollout.train_data_conversion import convert_samples_to_train_data, split_train_data_by_dp
from miles.rollout.base_types import (
    RolloutFnConstructorInput,
    RolloutFnEvalInput,
    RolloutFnTrainInput,
    call_rollout_fn,
)
from miles.rollout.inference_rollout.compatibility import call_rollout_function, load_rollout_function
from miles.utils.environ import use_legacy_rollout_v1
from miles.utils.misc import load_function


class RolloutManager:
    def __init__(self, args: Any, data_source: Any, train_parallel_config: dict):
        self.args = args
        self.data_source = data_source
        self.train_parallel_config = train_parallel_config
        self.weight_version: int | None = None
        self.use_legacy_rollout_v1 = use_legacy_rollout_v1()
        if not self.use_legacy_rollout_v1:
            input = RolloutFnConstructorInput(args=args, data_source=data_source)
            self.generate_rollout = load_rollout_function(input, args.rollout_function_path)
            if args.eval_function_path == args.rollout_function_path:
                self.eval_generate_rollout = self.generate_rollout
            else:
                self.eval_generate_rollout = load_rollout_function(input, args.eval_function_path)
        else:
            self.generate_rollout = load_function(args.rollout_function_path)
            self.eval_generate_rollout = load_function(args.eval_function_path)
        self.custom_reward_post_process_func = load_function(args.custom_reward_post_process_path)
        self.custom_convert_samples_to_train_data_func = load_function(
            args.custom_convert_samples_to_train_data_path
        )

    def set_weight_version(self, weight_version: int) -> None:
        assert self.weight_version is None or weight_version >= self.weight_version, (
            f"Engine weight version went backwards: {self.weight_version} -> {weight_version}"
        )
        self.weight_version = weight_version

    def save(self, rollout_id: int) -> None:
        if self.args.rollout_global_dataset:
            self.data_source.save(rollout_id)

    def load(self, rollout_id: int | None = None) -> None:
        self.data_source.load(rollout_id)

    def generate(self, rollout_id: int) -> dict[str, Any]:
        start = time.time()
        if not self.use_legacy_rollout_v1:
            output = call_rollout_function(
                self.generate_rollout,
                RolloutFnTrainInput(rollout_id=rollout_id, weight_version=self.weight_version),
            )
        else:
            output = call_rollout_fn(
                self.generate_rollout, self.args, rollout_id, self.data_source, evaluation=False
            )
        samples, metadata = postprocess_rollout_data(self.args, output.samples, self.train_parallel_config)
        log_rollout_data(rollout_id, self.args, samples, output.metrics, time.time() - start)
        data = convert_samples_to_train_data(
            self.args,
            samples,
            metadata,
            self.custom_convert_samples_to_train_data_func,
            self.custom_reward_post_process_func,
        )
        shards = split_train_data_by_dp(self.args, data, self.train_parallel_config)
        return {"sample_indices": data.get("sample_indices"), "data_ref": shards, "samples": samples}

    def eval(self, rollout_id: int) -> dict[str, Any]:
        if not self.use_legacy_rollout_v1:
            output = call_rollout_function(
                self.eval_generate_rollout, RolloutFnEvalInput(rollout_id=rollout_id)
            )
        else:
            output = call_rollout_fn(
                self.eval_generate_rollout, self.args, rollout_id, self.data_source, evaluation=True
            )
        log_eval_rollout_data(rollout_id, self.args, output.data, output.metrics)
        return output.data
