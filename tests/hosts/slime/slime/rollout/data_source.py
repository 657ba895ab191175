"""Fake of `slime.rollout.data_source`: `RolloutDataSourceWithBuffer`.

Prompts come from `--prompt-data` (JSONL; `--input-key`, `--label-key`, `--metadata-key`) or from
an in-memory list of such rows. `get_samples(n)` first pops groups that were given back with
`add_samples` (aborted or partial groups), then hands out new prompts in order, cycling, as
`n_samples_per_prompt` copies each, with `group_index` and `index` counting up over the whole run.
`add_samples` requires groups of exactly `n_samples_per_prompt` items, like the real buffer.
`save`/`load` keep the read position under `--save`/`--load` (JSON here, torch files in slime).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from slime.utils.types import Sample


class RolloutDataSourceWithBuffer:
    def __init__(self, args: Any, rows: list[dict[str, Any]] | None = None):
        self.args = args
        if rows is None and args.prompt_data is not None:
            with open(args.prompt_data) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        self.prompts = [
            Sample(
                prompt=row[args.input_key],
                label=row.get(args.label_key) if args.label_key else None,
                metadata=dict(row.get(args.metadata_key) or {}),
            )
            for row in rows or []
        ]
        self.buffer: list[list[Any]] = []
        self.sample_offset = 0
        self.epoch_id = 0
        self.sample_group_index = 0
        self.sample_index = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        groups = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        for _ in range(num_samples - len(groups)):
            if self.prompts:
                if self.sample_offset == len(self.prompts):
                    self.sample_offset, self.epoch_id = 0, self.epoch_id + 1
                prompt = self.prompts[self.sample_offset]
                self.sample_offset += 1
            else:
                prompt = Sample()
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index, sample.index = self.sample_group_index, self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Any]]) -> None:
        if not samples:
            return
        assert isinstance(samples[0], list), f"the elements of samples must be lists, got {type(samples[0])}"
        for group in samples:
            assert len(group) == self.args.n_samples_per_prompt, (
                f"the length of the elements of samples must be equal to n_samples_per_prompt, "
                f"got {len(group)} != {self.args.n_samples_per_prompt}"
            )
            self.buffer.append(group)

    def _state_path(self, root: str, rollout_id: Any) -> str:
        return os.path.join(root, f"rollout/global_dataset_state_dict_{rollout_id}.json")

    def save(self, rollout_id: int) -> None:
        if not self.args.save:
            return
        path = self._state_path(self.args.save, rollout_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        keys = ("sample_offset", "epoch_id", "sample_group_index", "sample_index")
        state = {k: getattr(self, k) for k in keys}
        with open(path, "w") as f:
            json.dump(state, f)

    def load(self, rollout_id: int | None = None) -> None:
        if not self.args.load:
            return
        path = self._state_path(self.args.load, rollout_id)
        if os.path.exists(path):
            with open(path) as f:
                for key, value in json.load(f).items():
                    setattr(self, key, value)
