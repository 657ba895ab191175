"""Stands in for `miles.rollout.data_source`: the prompt groups a rollout draws.

`RolloutDataSourceWithBuffer(args).get_samples(n)` returns n groups, each `n_samples_per_prompt`
copies of one prompt from `--prompt-data` (JSONL: `--input-key`, `--label-key`,
`--metadata-key`), with `group_index` and `index` numbered across the run and no `rollout_id`.
Groups handed back with `add_samples` (aborted partial rollouts, recycled fully-async groups)
are served first. Miles tokenises and templates prompts here; the fake keeps the raw value.

Checkpoints (the rollout manager calls them): `save(rollout_id)` writes the position in the dataset
and the group and sample counters to `--save`/rollout/global_dataset_state_dict_<id> (Miles: a
torch file; the fake: JSON); `load(rollout_id)` reads them back from `--load`, and does nothing
when there is no such file. As in Miles, groups handed back and not yet served again are not saved.
"""

from __future__ import annotations

import copy
import json
import os
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

    def _state_path(self, root: str, rollout_id: int) -> str:
        return os.path.join(root, "rollout", f"global_dataset_state_dict_{rollout_id}.json")

    def save(self, rollout_id: int) -> None:
        if not self.args.rollout_global_dataset:
            return
        path = self._state_path(self.args.save, rollout_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {
            "sample_offset": self.offset,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
        }
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)

    def load(self, rollout_id: int | None = None) -> None:
        if not self.args.rollout_global_dataset or self.args.load is None:
            return
        path = self._state_path(self.args.load, rollout_id)
        if not os.path.exists(path):
            return
        with open(path) as f:
            state = json.load(f)
        self.offset = state.get("sample_offset", 0)
        self.sample_group_index = state.get("sample_group_index", 0)
        self.sample_index = state.get("sample_index", 0)
