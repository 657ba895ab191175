"""Stands in for `miles.ray.rollout.train_data_conversion`: samples -> train data -> dp shards.

Rewards: `--custom-reward-post-process-path` `fn(args, samples) -> (raw, rewards)` replaces Miles'
normalisation. Miles' own (grpo/gspo/reinforce_plus_plus_baseline with normalisation on) groups
samples by `group_index`, then by rollout key (`rollout_id`, else `index`, else the row), REQUIRES
every sample of one rollout to carry the same reward (ValueError otherwise), and normalises the
one reward per rollout within the prompt group (mean; divided by std+1e-6 for grpo/gspo when
`grpo_std_normalization`, more than one rollout and std > 0).

Train data keeps, per sample: tokens, response_lengths, rewards, raw_reward, truncated,
sample_indices, `rollout_ids` (`rollout_id` if set, else `index`), loss_masks (None becomes all
ones; its length must equal response_length; `remove_sample` zeroes it), rollout_log_probs,
weight_versions.

Split: with a full schedule config and at least `global_batch_size` distinct rollout ids, the
rollout side schedules (`dp_schedule.build_dp_schedule`, gbs counting rollout ids); otherwise
samples are dealt to ranks round-robin and the trainer schedules.
"""

from __future__ import annotations

import statistics
from typing import Any

from miles.utils.dp_schedule import build_dp_schedule, has_full_schedule_config
from miles.utils.types import Sample


def rollout_key(sample: Sample, row: int) -> Any:
    if sample.rollout_id is not None:
        return sample.rollout_id
    return sample.index if sample.index is not None else ("row", row)


def convert_samples_to_train_data(
    args: Any,
    samples: list[Sample],
    metadata: dict,
    custom_convert_func: Any,
    custom_reward_post_process_func: Any,
) -> dict[str, Any]:
    if custom_convert_func is not None:
        return custom_convert_func(args, samples)
    if custom_reward_post_process_func is not None:
        raw_rewards, rewards = custom_reward_post_process_func(args, samples)
    else:
        raw_rewards = [s.get_reward_value(args) for s in samples]
        rewards = raw_rewards
        if (
            args.advantage_estimator in ("grpo", "gspo", "reinforce_plus_plus_baseline")
            and args.rewards_normalization
        ):
            rewards = _normalize_rewards_by_rollout(args, samples, raw_rewards)
    assert len(raw_rewards) == len(samples) and len(rewards) == len(samples)
    loss_masks = []
    for s in samples:
        if s.loss_mask is None:
            s.loss_mask = [1] * s.response_length
        assert len(s.loss_mask) == s.response_length, (
            f"loss mask length {len(s.loss_mask)} != response length {s.response_length}"
        )
        if s.remove_sample:
            s.loss_mask = [0] * s.response_length
        loss_masks.append(s.loss_mask)
    data: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": rewards,
        "raw_reward": raw_rewards,
        "truncated": [int(s.status == Sample.Status.TRUNCATED) for s in samples],
        "sample_indices": [s.index for s in samples],
        "rollout_ids": [s.rollout_id if s.rollout_id is not None else s.index for s in samples],
        "loss_masks": loss_masks,
    }
    if samples and samples[0].rollout_log_probs is not None:
        data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    if any(s.weight_versions for s in samples):
        data["weight_versions"] = [s.weight_versions for s in samples]
    return data


def _normalize_rewards_by_rollout(args: Any, samples: list[Sample], raw_rewards: list[float]) -> list[float]:
    out = [0.0] * len(samples)
    by_group: dict[Any, list[int]] = {}
    for row, s in enumerate(samples):
        by_group.setdefault(s.group_index if s.group_index is not None else "all", []).append(row)
    for rows in by_group.values():
        by_rollout: dict[Any, list[int]] = {}
        for row in rows:
            by_rollout.setdefault(rollout_key(samples[row], row), []).append(row)
        shared = []
        for key, members in by_rollout.items():
            values = [raw_rewards[r] for r in members]
            if any(v != values[0] for v in values[1:]):
                raise ValueError(
                    f"all samples in rollout {key!r} must share one reward; rows {members} have rewards "
                    f"{values}"
                )
            shared.append(float(values[0]))
        mean = sum(shared) / len(shared)
        std = statistics.stdev(shared) if len(shared) > 1 else 0.0
        divide = (
            args.advantage_estimator in ("grpo", "gspo")
            and args.grpo_std_normalization
            and len(shared) > 1
            and std > 0
        )
        for value, members in zip(shared, by_rollout.values(), strict=True):
            for r in members:
                out[r] = (value - mean) / (std + 1e-6) if divide else value - mean
    return out


def split_train_data_by_dp(
    args: Any, data: dict[str, Any], train_parallel_config: dict
) -> list[dict[str, Any]]:
    """One shard per data-parallel rank (Miles puts them in its object store)."""
    lengths = [len(t) for t in data["tokens"]]
    if (
        has_full_schedule_config(train_parallel_config)
        and len(set(data["rollout_ids"])) >= args.global_batch_size
    ):
        partitions = build_dp_schedule(
            args,
            train_parallel_config,
            lengths,
            global_batch_size=args.global_batch_size,
            rollout_indices=data["rollout_ids"],
        )
    else:
        dp = train_parallel_config["dp_size"]
        partitions = [list(range(rank, len(lengths), dp)) for rank in range(dp)]
    return [{"partition": p, **{k: [v[i] for i in p] for k, v in data.items()}} for p in partitions]
