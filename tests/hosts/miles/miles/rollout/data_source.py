"""Stands in for `miles.rollout.data_source`: the prompt groups a rollout draws.

`RolloutDataSourceWithBuffer(args).get_samples(n)` returns n groups, each `n_samples_per_prompt`
copies of one prompt from `--prompt-data` (JSONL: `--input-key`, `--label-key`,
`--metadata-key`), with `group_index` and `index` numbered across the run and no `rollout_id`.
Groups handed back with `add_samples` (aborted partial rollouts, recycled fully-async groups)
are served first. Miles tokenises and templates prompts here; the fake keeps the raw value.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from miles.utils.types import Sample


def read_prompt_samples(
    path: str, input_key: str, label_key: str | None, metadata_key: str | None
) -> list[Sample]:
    samples = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                samples.append(
                    Sample(
                        prompt=row[input_key],
                        label=row.get(label_key) if label_key else None,
                        metadata=dict(row.get(metadata_key) or {}) if metadata_key else {},
                    )
                )
    return samples


class RolloutDataSourceWithBuffer:
    def __init__(self, args: Any):
        self.args = args
        self.dataset = (
            read_prompt_samples(args.prompt_data, args.input_key, args.label_key, args.metadata_key)
            if args.rollout_global_dataset
            else None
        )
        self.offset = 0
        self.sample_group_index = 0
        self.sample_index = 0
        self.buffer: list[list[Sample]] = []

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = self.buffer[:num_samples]
        del self.buffer[: len(groups)]
        for _ in range(num_samples - len(groups)):
            if self.dataset:
                prompt = self.dataset[self.offset % len(self.dataset)]
                self.offset += 1
            else:
                prompt = Sample()
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        for group in samples:
            assert len(group) == self.args.n_samples_per_prompt, (
                f"a group handed back must hold n_samples_per_prompt samples, got {len(group)} "
                f"!= {self.args.n_samples_per_prompt}"
            )
            self.buffer.append(group)

    def get_buffer_length(self) -> int:
        return len(self.buffer)
