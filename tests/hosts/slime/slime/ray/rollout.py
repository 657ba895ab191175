"""Fake of `slime.ray.rollout`: the `RolloutManager`, without Ray, engines or a trainer.

`generate(rollout_id)` does what the real one does, in the real order:
1. call `--rollout-function-path` through `call_rollout_fn` (training);
2. check the nested output's rollout ids (`validate_rollout_id_annotated`), then flatten it while
   its first element is a list;
3. `log_rollout_data` with the output's metrics;
4. convert the samples to train data: `--custom-reward-post-process-path` or the host's GRPO
   normalisation (reshaped per prompt only when the count is exactly
   `n_samples_per_prompt * rollout_batch_size`, else across the whole batch); a missing loss mask
   becomes all ones; the mask must have `response_length` entries; `remove_sample` zeroes it;
   with `--rollout-top-p` != 1 every sample must carry its replayed nucleus ids; None rollout ids
   get fresh unused ids;
5. split by data-parallel rank through `build_dp_schedule`, `global_batch_size` counting rollout
   ids, and return one dict per rank.
`eval(rollout_id)` calls `--eval-function-path` with `evaluation=True` and `log_eval_rollout_data`.
`save(rollout_id)`/`load(rollout_id)` keep and restore the data source's state (`--save`/`--load`).
The samples of the last rollout stay in `last_samples` (for the test driver; not in slime).
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

from slime.observability.rollout_data_utils import validate_rollout_id_annotated
from slime.observability.rollout_metrics import log_eval_rollout_data, log_rollout_data
from slime.rollout.base_types import call_rollout_fn
from slime.utils.dp_schedule import build_dp_schedule
from slime.utils.misc import load_function
from slime.utils.types import Sample

_PER_RANK_KEYS = (
    "tokens",
    "response_lengths",
    "rewards",
    "truncated",
    "loss_masks",
    "sample_indices",
    "rollout_ids",
    "rollout_log_probs",
)


class RolloutManager:
    def __init__(self, args: Any, data_source: Any, train_parallel_config: dict[str, int]):
        self.args = args
        self.data_source = data_source
        self.train_parallel_config = train_parallel_config
        self.generate_rollout = load_function(args.rollout_function_path)
        self.eval_generate_rollout = load_function(args.eval_function_path)
        self.post_process = (
            load_function(args.custom_reward_post_process_path)
            if args.custom_reward_post_process_path
            else None
        )
        self.last_samples: list[Sample] = []

    def generate(self, rollout_id: int) -> list[dict[str, Any]]:
        start = time.time()
        fn = self.generate_rollout
        output = call_rollout_fn(fn, self.args, rollout_id, self.data_source, evaluation=False)
        data = output.samples
        validate_rollout_id_annotated(data)
        while isinstance(data[0], list):
            data = list(itertools.chain.from_iterable(data))
        self.last_samples = data
        log_rollout_data(rollout_id, self.args, data, output.metrics, time.time() - start)
        return self._split_by_dp(self._to_train_data(data))

    def eval(self, rollout_id: int) -> None:
        fn = self.eval_generate_rollout
        result = call_rollout_fn(fn, self.args, rollout_id, self.data_source, evaluation=True)
        log_eval_rollout_data(rollout_id, self.args, result.data, result.metrics)

    def save(self, rollout_id: int) -> None:
        self.data_source.save(rollout_id)

    def load(self, rollout_id: int | None = None) -> None:
        self.data_source.load(rollout_id)

    def _rewards(self, samples: list[Sample]) -> tuple[list[Any], list[float]]:
        if self.post_process is not None:
            return self.post_process(self.args, samples)
        args = self.args
        raw = [s.get_reward_value(args) for s in samples]
        if (
            args.advantage_estimator not in ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
            or not args.rewards_normalization
        ):
            return raw, raw
        width = (
            args.n_samples_per_prompt
            if len(raw) == args.n_samples_per_prompt * args.rollout_batch_size
            else len(raw)
        )  # a variable count normalises across the whole batch (slime issue 1414)
        out: list[float] = []
        for i in range(0, len(raw), width):
            row = [float(r) for r in raw[i : i + width]]
            mean = sum(row) / len(row)
            row = [r - mean for r in row]
            if args.advantage_estimator != "reinforce_plus_plus_baseline" and args.grpo_std_normalization:
                std = math.sqrt(sum(r * r for r in row) / (len(row) - 1)) if len(row) > 1 else math.nan
                row = [r / (std + 1e-6) for r in row]
            out += row
        return raw, out

    def _to_train_data(self, samples: list[Sample]) -> dict[str, Any]:
        raw, rewards = self._rewards(samples)
        assert len(raw) == len(samples) and len(rewards) == len(samples)
        ids = [s.rollout_id for s in samples]
        used = {rid for rid in ids if rid is not None}
        fresh = 0
        for i, rid in enumerate(ids):
            if rid is None:
                while fresh in used:
                    fresh += 1
                ids[i] = fresh
                used.add(fresh)
        masks = []
        for s in samples:
            if s.loss_mask is None:
                s.loss_mask = [1] * s.response_length
            assert len(s.loss_mask) == s.response_length, (
                f"loss mask length {len(s.loss_mask)} != response length {s.response_length}"
            )
            if s.remove_sample:
                s.loss_mask = [0] * s.response_length
            masks.append(s.loss_mask)
        if self.args.rollout_top_p != 1.0:
            for s in samples:
                assert s.rollout_top_p_token_ids is not None, "--rollout-top-p != 1: no top-p token ids"
                assert s.rollout_top_p_token_offsets is not None, "--rollout-top-p != 1: no top-p offsets"
        data = {
            "tokens": [s.tokens for s in samples],
            "response_lengths": [s.response_length for s in samples],
            "rewards": rewards,
            "raw_reward": raw,
            "truncated": [int(s.status == Sample.Status.TRUNCATED) for s in samples],
            "sample_indices": [s.index for s in samples],
            "rollout_ids": ids,
            "loss_masks": masks,
        }
        if samples[0].rollout_log_probs is not None:
            data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
        return data

    def _split_by_dp(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        lengths = [len(t) for t in data["tokens"]]
        partitions = build_dp_schedule(
            self.args,
            self.train_parallel_config,
            lengths,
            global_batch_size=self.args.global_batch_size,
            rollout_indices=data["rollout_ids"],
        )
        ranks = []
        for partition in partitions:
            rank = {"partition": partition}
            for key in _PER_RANK_KEYS:
                if key in data:
                    rank[key] = [data[key][j] for j in partition]
            ranks.append(rank)
        return ranks
