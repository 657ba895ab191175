"""The start-up check of the host's batch flags against an episode's fan-out, held against the
host-shaped split of tests/hosts/dp_split.py (the rule slime's and Miles' dp_schedule apply)."""

from __future__ import annotations

import argparse
import re

import pytest
from hosts.dp_split import split_by_dp
from hypothesis import given, settings
from hypothesis import strategies as st

from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.hostcheck import check_step_split, host_split


def megatron_args(**flags) -> argparse.Namespace:
    """The batch and parallel flags as slime's parse_args leaves them on args."""
    base = dict(
        rollout_batch_size=4,
        n_samples_per_prompt=1,
        num_steps_per_rollout=None,
        global_batch_size=None,
        micro_batch_size=1,
        use_dynamic_batch_size=False,
        max_tokens_per_gpu=None,
        actor_num_nodes=1,
        actor_num_gpus_per_node=2,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        microbatch_group_size_per_vp_stage=None,
    )
    base.update(flags)
    args = argparse.Namespace(**base)
    if args.global_batch_size is None:
        args.global_batch_size = (
            args.rollout_batch_size * args.n_samples_per_prompt // (args.num_steps_per_rollout or 1)
        )
    args.world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
    return args


def host_splits(args, per_episode: int) -> bool:
    """Whether the host's own split accepts one step of this job (every sample 100 tokens)."""
    split = host_split(args)
    parallel = {
        "dp_size": split.dp_size,
        "cp_size": 1,
        "vpp_size": args.virtual_pipeline_model_parallel_size or 1,
        "microbatch_group_size_per_vp_stage": split.mb_group,
    }
    episodes = args.global_batch_size
    rollout_ids = [e for e in range(episodes) for _ in range(per_episode)]
    try:
        split_by_dp(args, parallel, [100] * len(rollout_ids), rollout_ids)
    except AssertionError:
        return False
    return True


def test_the_issue_case_is_refused_naming_the_flags_and_what_works():
    # 4 episodes of 5 samples (pipeline, num_parallel 2) split; what the host saw after an abort did not.
    args = megatron_args(micro_batch_size=3)
    with pytest.raises(ConfigError) as info:
        check_step_split(args, 5, "pipeline", "team.yaml")
    message = str(info.value)
    assert message.startswith("team.yaml: ")
    for flag in (
        "--micro-batch-size 3",
        "--use-dynamic-batch-size --max-tokens-per-gpu",
        "--actor-num-gpus-per-node",
        "--global-batch-size",
    ):
        assert flag in message
    assert "holds 20 samples" in message and "7 micro-batches" in message
    suggested = [
        int(m)
        for m in re.search(r"--micro-batch-size ((?:\d+(?: or )?)+), or", message).group(1).split(" or ")
    ]
    assert suggested and all(host_splits(megatron_args(micro_batch_size=m), 5) for m in suggested)
    check_step_split(
        megatron_args(micro_batch_size=2), 5, "pipeline", "team.yaml"
    )  # 10 micro-batches: splits
    check_step_split(
        megatron_args(micro_batch_size=3, use_dynamic_batch_size=True, max_tokens_per_gpu=4096),
        5,
        "pipeline",
        "team.yaml",
    )


def test_a_varying_fan_out_needs_the_dynamic_path():
    with pytest.raises(
        ConfigError, match=r"varying number of samples.*--use-dynamic-batch-size --max-tokens-per-gpu N"
    ):
        check_step_split(megatron_args(), None, "my_system", "x.yaml")
    check_step_split(
        megatron_args(use_dynamic_batch_size=True, max_tokens_per_gpu=8192), None, "my_system", "x.yaml"
    )


def test_virtual_pipeline_groups_count_and_args_without_trainer_flags_are_not_checked():
    # 8 GPUs, PP 2 with virtual stages and a micro-batch group of 2: dp 4, align 8.
    args = megatron_args(
        actor_num_gpus_per_node=8,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        microbatch_group_size_per_vp_stage=2,
        rollout_batch_size=6,
    )
    assert host_split(args).align == 8
    with pytest.raises(ConfigError, match="--microbatch-group-size-per-vp-stage"):
        check_step_split(args, 1, "dialogue", "x.yaml")
    assert host_split(argparse.Namespace(rollout_batch_size=4)) is None  # the `mrlx rollout` command's args
    check_step_split(argparse.Namespace(rollout_batch_size=4), 7, "pipeline", "x.yaml")


@settings(max_examples=300, deadline=None)
@given(
    episodes=st.integers(1, 12),
    per_episode=st.integers(1, 11),
    mbs=st.integers(1, 6),
    gpus=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2]),
    dynamic=st.booleans(),
)
def test_the_check_agrees_with_the_hosts_split(episodes, per_episode, mbs, gpus, tp, dynamic):
    """Refused exactly when the host's split would raise: no false alarm, no miss."""
    if tp > gpus:
        return
    args = megatron_args(
        rollout_batch_size=episodes,
        micro_batch_size=mbs,
        actor_num_gpus_per_node=gpus,
        tensor_model_parallel_size=tp,
        use_dynamic_batch_size=dynamic,
        max_tokens_per_gpu=250 if dynamic else None,
    )
    try:
        check_step_split(args, per_episode, "pipeline", "x.yaml")
        refused = False
    except ConfigError:
        refused = True
    assert refused == (not host_splits(args, per_episode))
