"""The host's default rollout and data source, for running without slime (CLI, demo, tests).

`default_rollout` does what slime's `generate_rollout` does for the plugin: take
`--rollout-batch-size` prompt groups from the data source, call the
`--custom-generate-function-path` function on every sample (at most
`--sglang-server-concurrency` at once), and return the groups as a `RolloutFnTrainOutput`. Unlike
slime it does not over-sample and then abort the leftovers; the plugin handles those aborts
(they come back as ABORTED samples) and tests cover them with injected faults.
"""

from __future__ import annotations

import asyncio
import copy
import random
from typing import Any

from ..host import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample, Status, load_function, run_in_host_loop
from ..hostargs import sampling_params
from ..runtime import cached_runtime


class LocalDataSource:
    """slime's data source for prompts held in memory: `n_samples_per_prompt` copies of each
    prompt per group, with `group_index` and `index` counting up across the whole run."""

    def __init__(self, prompts: list[tuple[Any, Any]], n_samples_per_prompt: int, *, shuffle: bool = False,
                 seed: int = 0, eval_prompts: list[tuple[Any, Any]] | None = None):
        if not prompts:
            raise ValueError("no prompts")
        self.prompts = list(prompts)
        self.eval_prompts = list(eval_prompts or [])
        self.n = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.offset = 0
        self.epoch = 0
        self.group_index = 0
        self.sample_index = 0
        self._order = list(range(len(self.prompts)))

    def _next_prompt(self) -> tuple[Any, Any]:
        if self.offset == len(self._order):
            self.offset, self.epoch = 0, self.epoch + 1
            if self.shuffle:
                random.Random(self.seed + self.epoch).shuffle(self._order)
        prompt = self.prompts[self._order[self.offset]]
        self.offset += 1
        return prompt

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_groups):
            prompt, label = self._next_prompt()
            group = []
            for _ in range(self.n):
                group.append(Sample(group_index=self.group_index, index=self.sample_index, prompt=copy.deepcopy(prompt),
                                    label=label))
                self.sample_index += 1
            self.group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise RuntimeError("this data source is read-only (the plugin does not use partial rollouts)")

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "epoch": self.epoch, "group_index": self.group_index,
                "sample_index": self.sample_index, "order": list(self._order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset, self.epoch = state["offset"], state["epoch"]
        self.group_index, self.sample_index = state["group_index"], state["sample_index"]
        self._order = list(state["order"])


async def _generate_groups(args: Any, groups: list[list[Sample]], evaluation: bool) -> list[list[Any]]:
    generate = load_function(getattr(args, "custom_generate_function_path", None) or "mrlx_plugin.rollout.generate")
    semaphore = asyncio.Semaphore(getattr(args, "sglang_server_concurrency", None) or 512)
    params = sampling_params(args)

    async def one(sample: Sample) -> Any:
        async with semaphore:
            return await generate(args, sample, dict(params), evaluation=evaluation)

    async def group(g: list[Sample]) -> list[Any]:
        return list(await asyncio.gather(*(one(s) for s in g)))

    return list(await asyncio.gather(*(group(g) for g in groups)))


def default_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's `generate_rollout`, for the plugin's purposes (see the module docstring)."""
    if evaluation:
        prompts = getattr(data_source, "eval_prompts", None) or []
        eval_source = LocalDataSource(prompts or [("", None)], getattr(args, "n_samples_per_eval_prompt", 1) or 1)
        groups = eval_source.get_samples(len(prompts)) if prompts else []
        results = run_in_host_loop(_generate_groups(args, groups, evaluation=True))
        samples = [s for g in results for s in g]
        return RolloutFnEvalOutput(data={"eval": {
            "rewards": [float(s.reward or 0.0) for s in samples],
            "truncated": [s.status == Status.TRUNCATED for s in samples],
            "samples": samples,
        }})
    groups = data_source.get_samples(args.rollout_batch_size)
    results = run_in_host_loop(_generate_groups(args, groups, evaluation=False))
    runtime = cached_runtime(args)
    check_like_host(results, fixed_fan_out=runtime is not None and runtime.fan_out is not None)
    return RolloutFnTrainOutput(samples=results, metrics={})


def check_like_host(groups: list[list[Any]], fixed_fan_out: bool) -> None:
    """The invariants the hosts enforce on a training rollout, enforced here too so that the CPU
    runs fail where a GPU job would: the samples of one generate call share one non-None rollout
    id (slime asserts it before the split), and every call returns the same number of samples
    when the system declares a fixed fan-out (with fixed micro-batches a step's count must split
    evenly across data-parallel ranks, so a count that varies with aborts breaks the host's split)."""
    sizes = set()
    for group in groups:
        for result in group:
            if not isinstance(result, list):
                sizes.add(1)
                continue
            ids = {getattr(s, "rollout_id", None) for s in result}
            assert len(ids) == 1 and None not in ids, f"siblings of one generate call must share a rollout_id; got {ids}"
            sizes.add(len(result))
    assert not fixed_fan_out or len(sizes) <= 1, (
        f"generate calls of one step returned different sample counts {sorted(sizes)}; the host's static "
        "micro-batch split needs every episode to return the same number"
    )
