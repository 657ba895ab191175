"""Fake of `slime.rollout.rm_hub`: the reward dispatch.

`async_rm(args, sample)`: a sample's own `custom_rm_path`, else `--custom-rm-path`, else the
built-in `--rm-type` grader (here one trivial grader for every type: 1.0 when the label appears
in the response's last `\\boxed{...}`, or in the response when there is none, else 0.0).
`batched_async_rm(args, samples)` calls a `--custom-rm-path` function ONCE with the whole list,
as the real one does for a generate function that returned several samples.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from slime.utils.misc import load_function


def _grade(response: str, label: Any) -> float:
    if label is None:
        return 0.0
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", response or "")
    answer = boxed[-1] if boxed else (response or "")
    return 1.0 if str(label).strip() and str(label).strip() in answer else 0.0


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    if getattr(sample, "custom_rm_path", None):
        return await load_function(sample.custom_rm_path)(args, sample, **kwargs)
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, sample, **kwargs)
    return _grade(sample.response, sample.label)


async def batched_async_rm(args: Any, samples: list[Any], **kwargs: Any) -> list[Any]:
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
