"""Stands in for `miles.utils.eval_config`: one evaluation dataset (from `--eval-prompt-data NAME PATH`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EvalDatasetConfig:
    name: str
    path: str
    n_samples_per_eval_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int | None
    input_key: str
    label_key: str | None
    metadata_key: str | None = None
    custom_generate_function_path: str | None = None


def build_eval_dataset_configs(args: Any, pairs: list[str]) -> list[EvalDatasetConfig]:
    """Dataset settings fall back to the `--eval-*` flags, then to the rollout's."""

    def pick(eval_value: Any, rollout_value: Any) -> Any:
        return eval_value if eval_value is not None else rollout_value

    return [
        EvalDatasetConfig(
            name=pairs[i],
            path=pairs[i + 1],
            n_samples_per_eval_prompt=pick(args.n_samples_per_eval_prompt, args.n_samples_per_prompt),
            temperature=pick(args.eval_temperature, args.rollout_temperature),
            top_p=pick(args.eval_top_p, args.rollout_top_p),
            top_k=pick(args.eval_top_k, args.rollout_top_k),
            max_response_len=pick(args.eval_max_response_len, args.rollout_max_response_len),
            input_key=pick(args.eval_input_key, args.input_key),
            label_key=pick(args.eval_label_key, args.label_key),
            metadata_key=args.metadata_key,
        )
        for i in range(0, len(pairs), 2)
    ]
