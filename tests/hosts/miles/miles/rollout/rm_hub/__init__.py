"""Stands in for `miles.rollout.rm_hub`: the host's reward functions.

Only `--custom-rm-path` is modelled (Miles' rule-based graders are not). `batched_async_rm` hands
the custom function the whole list at once, an empty list included.
"""

from __future__ import annotations

import asyncio
from typing import Any

from miles.utils.misc import load_function


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, sample, **kwargs)
    raise NotImplementedError(f"the fake Miles has no rule-based reward model (--rm-type {args.rm_type!r})")


async def batched_async_rm(
    args: Any, samples: list[Any], inplace_set_reward_field: bool = False, **kwargs: Any
) -> Any:
    if inplace_set_reward_field:
        rewards = await batched_async_rm(args, samples, **kwargs)
        for sample, reward in zip(samples, rewards, strict=True):
            assert sample.reward is None, f"overriding sample.reward {sample.reward} with {reward}"
            sample.reward = reward
        return None
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return await asyncio.gather(*[async_rm(args, s, **kwargs) for s in samples])
