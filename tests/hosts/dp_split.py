"""The data-parallel split of one rollout's train data, as slime and Miles do it (same rule in both).

Both hosts group samples by rollout id, cut the rollout ids into steps of `global_batch_size`
rollouts, pack each step's samples into micro-batches and hand every data-parallel rank the same
number of them. With fixed micro-batches (no `--use-dynamic-batch-size`) a step is cut into chunks
of `micro_batch_size` samples, and the chunk count must be a multiple of dp_size (times the
virtual-pipeline micro-batch group) or the host raises; the dynamic path splits bins until it
aligns. The fake hosts call `split_by_dp` exactly where the real ones build their schedule.
"""

from __future__ import annotations

from typing import Any


def align_of(parallel: dict[str, int]) -> int:
    """How many micro-batches a step's count must be a multiple of."""
    vpp = parallel.get("vpp_size", 1) or 1
    group = parallel.get("microbatch_group_size_per_vp_stage", 1) or 1
    return parallel["dp_size"] * (group if vpp > 1 else 1)


def split_by_dp(
    args: Any, parallel: dict[str, int], lengths: list[int], rollout_ids: list[Any]
) -> list[list[int]]:
    """Sample positions per data-parallel rank; raises AssertionError where the host would."""
    dp = parallel["dp_size"]
    gbs = int(args.global_batch_size)
    by_rollout: dict[Any, list[int]] = {}
    for pos, rid in enumerate(rollout_ids):
        by_rollout.setdefault(rid, []).append(pos)
    ids = list(by_rollout)
    steps = len(ids) // gbs
    assert steps >= 1, (
        f"num_rollouts ({len(ids)}) < global_batch_size ({gbs}); need at least one rollout per step."
    )
    align = align_of(parallel)
    ranks: list[list[int]] = [[] for _ in range(dp)]
    for step in range(steps):
        positions = [p for rid in ids[step * gbs : (step + 1) * gbs] for p in by_rollout[rid]]
        assert len(positions) >= dp, f"step {step}: {len(positions)} samples < dp_size {dp}"
        if getattr(args, "use_dynamic_batch_size", False):
            cap = int(args.max_tokens_per_gpu) * parallel.get("cp_size", 1)
            bins: list[list[int]] = []
            used: list[int] = []
            for p in positions:  # first fit
                for b, total in enumerate(used):
                    if total + lengths[p] <= cap:
                        bins[b].append(p)
                        used[b] += lengths[p]
                        break
                else:
                    bins.append([p])
                    used.append(lengths[p])
            target = max(-(-len(bins) // align) * align, align)
            while len(bins) < target:  # split the largest multi-sample bin
                splittable = [b for b in bins if len(b) > 1]
                assert splittable, f"dynamic path: could only produce {len(bins)} mbs; need {target}"
                big = max(splittable, key=len)
                bins.remove(big)
                bins += [big[: len(big) // 2], big[len(big) // 2 :]]
        else:
            mbs = int(args.micro_batch_size)
            bins = [positions[i : i + mbs] for i in range(0, len(positions), mbs)]
            if len(bins) % align:
                raise AssertionError(
                    f"static path: num_mbs ({len(bins)}) is not a multiple of dp_size * mb_group ({align}); "
                    "got "
                    f"step_size={len(positions)}, micro_batch_size={mbs}, dp_size={dp}"
                )
        for k, b in enumerate(bins):
            ranks[k % dp].extend(b)
    return ranks
