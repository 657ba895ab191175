"""A host-shaped `args` for running the plugin outside slime (the `mrlx` CLI, tests, the demo).

slime hands every plugin function one `argparse.Namespace` holding its flags, with each
top-level key of the `--custom-config-path` YAML set as an attribute. `host_args` builds the same
object from the same flag names, so the plugin runs exactly as it would inside the host.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .config import ConfigError, load_yaml
from .host import Sample


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    """The slime flags the plugin reads, under slime's names and defaults."""
    g = parser.add_argument_group("host settings (slime's flag names)")
    g.add_argument("--hf-checkpoint", default=None, help="tokenizer/model path for agents with no tokenizer set")
    g.add_argument("--router-url", default=None, help="the job's router, http://host:port (url: self)")
    g.add_argument("--rollout-max-response-len", type=int, default=256)
    g.add_argument("--rollout-max-context-len", type=int, default=None)
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--n-samples-per-prompt", type=int, default=2)
    g.add_argument("--rollout-batch-size", type=int, default=4, help="prompt groups per rollout")
    g.add_argument("--prompt-data", default=None, help="JSONL file of prompts (default: built-in arithmetic)")
    g.add_argument("--input-key", default="prompt")
    g.add_argument("--label-key", default="label")
    g.add_argument("--rm-type", default=None)


def host_args(ns: argparse.Namespace, config_path: str | None) -> argparse.Namespace:
    """The Namespace slime would pass, from parsed CLI flags and the YAML at `config_path`."""
    args = argparse.Namespace(
        hf_checkpoint=ns.hf_checkpoint,
        sglang_router_ip=None,
        sglang_router_port=None,
        rollout_max_response_len=ns.rollout_max_response_len,
        rollout_max_context_len=ns.rollout_max_context_len,
        eval_max_context_len=ns.rollout_max_context_len,
        rollout_temperature=ns.rollout_temperature,
        rollout_top_p=ns.rollout_top_p,
        rollout_top_k=ns.rollout_top_k,
        rollout_stop=None,
        rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        n_samples_per_prompt=ns.n_samples_per_prompt,
        rollout_batch_size=ns.rollout_batch_size,
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        reward_key=None,
        rm_type=ns.rm_type,
        custom_rm_path=None,
        apply_chat_template=False,
        partial_rollout=False,
        custom_config_path=config_path,
    )
    if ns.router_url:
        set_router(args, ns.router_url)
    if config_path:
        for key, value in load_yaml(config_path).items():  # what slime does with --custom-config-path
            setattr(args, key, value)
    return args


def set_router(args: argparse.Namespace, url: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
        raise ConfigError(f"--router-url: got {url!r}; expected http://host:port")
    args.sglang_router_ip = parsed.hostname
    args.sglang_router_port = parsed.port


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    """The per-request sampling parameters slime's rollout builds from its flags."""
    return {
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "top_k": args.rollout_top_k,
        "max_new_tokens": args.rollout_max_response_len,
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }


def read_prompts(path: str, input_key: str, label_key: str) -> list[tuple[Any, Any]]:
    """(prompt, label) pairs from a JSONL file, with errors naming the line."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if input_key not in row:
            raise ConfigError(f"{path}:{lineno}: no '{input_key}' field (set --input-key)")
        rows.append((row[input_key], row.get(label_key)))
    if not rows:
        raise ConfigError(f"{path}: no prompts")
    return rows


def make_groups(prompts: list[tuple[Any, Any]], groups: int, per_prompt: int, start: int = 0) -> Iterator[list[Sample]]:
    """Prompt groups the way the host's data source hands them out: n copies per prompt."""
    for g in range(groups):
        prompt, label = prompts[(start + g) % len(prompts)]
        yield [
            Sample(group_index=start + g, index=(start + g) * per_prompt + j, prompt=prompt, label=label)
            for j in range(per_prompt)
        ]
