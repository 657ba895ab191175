"""The stand-in host for running the plugin without slime or Miles (the `mrlx` CLI, the demo,
the embedded trainer, tests): the `args` slime would pass, its default rollout and its data source.

slime hands every plugin function one `argparse.Namespace` holding its flags, with each
top-level key of the `--custom-config-path` YAML set as an attribute. `host_args` builds the same
object from the same flag names, so the plugin runs exactly as it would inside the host.

`default_rollout` does what slime's `generate_rollout` does for the plugin: take
`--rollout-batch-size` prompt groups from the data source, call the
`--custom-generate-function-path` function on every sample (at most
`--sglang-server-concurrency` at once), and return the groups as a `RolloutFnTrainOutput`. Unlike
slime it does not over-sample and then abort the leftovers; the plugin handles those aborts
(they come back as ABORTED samples) and tests cover them with injected faults. `generate_group`
is slime's `generate_and_rm_group` (one prompt group, generated and graded), which the plugin's
fully asynchronous rollout calls for each group it keeps in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypedDict
from urllib.parse import urlparse

from mrlx_plugin.core.config import ConfigError, load_yaml
from mrlx_plugin.core.host import (
    HostSample,
    RolloutFnEvalOutput,
    RolloutFnTrainOutput,
    Sample,
    Status,
    load_function,
    run_in_host_loop,
)
from mrlx_plugin.core.values import JSONObject
from mrlx_plugin.runtime import cached_runtime

# A prompt (a text, or messages) and its label, as a prompt file holds them, and optionally the
# row's metadata (slime's `--metadata-key`), which every sample of the prompt carries.
Prompt = tuple["str | list[dict[str, str]]", object] | tuple["str | list[dict[str, str]]", object, dict]
# What one call of the generate function returns: a sample, or the samples of one episode.
Generated = HostSample | list[HostSample]


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    """The slime flags the plugin reads, under slime's names and defaults."""
    g = parser.add_argument_group("host settings (slime's flag names)")
    g.add_argument(
        "--hf-checkpoint", default=None, help="tokenizer/model path for agents with no tokenizer set"
    )
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
    g.add_argument("--metadata-key", default="metadata", help="the prompt rows' metadata (a JSON object)")
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
        host_default_rollout=default_rollout,  # what slime's generate_rollout is to slime
        host_generate_group=generate_group,  # and its generate_and_rm_group (async_rollout's producer)
    )
    if ns.router_url:
        set_router(args, ns.router_url)
    if config_path:
        for key, value in load_yaml(config_path).items():  # what slime does with --custom-config-path
            setattr(args, key, value)
        _trainer_flags(args)
    return args


def _trainer_flags(args: argparse.Namespace) -> None:
    """The host flags the embedded trainer takes from its `mrlx.trainer` section (a slime job sets
    them on its command line): `grpo_std_normalization`, which `normalize` reads from args.

    Read from the YAML as loaded: the runtime validates the section strictly (a bool setting takes
    YAML's true/false and nothing else) before the first step, so a value of any other type is
    refused there with the setting's path; only a real bool is copied here."""
    mrlx = getattr(args, "mrlx", None)
    section = mrlx.get("trainer") if isinstance(mrlx, dict) else None
    value = section.get("grpo_std_normalization", True) if isinstance(section, dict) else True
    if isinstance(value, bool):
        args.grpo_std_normalization = value


def set_router(args: argparse.Namespace, url: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
        raise ConfigError(f"--router-url: got {url!r}; expected http://host:port")
    args.sglang_router_ip = parsed.hostname
    args.sglang_router_port = parsed.port


def sampling_params(args: argparse.Namespace) -> JSONObject:
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


def read_prompts(path: str, input_key: str, label_key: str, metadata_key: str = "metadata") -> list[Prompt]:
    """(prompt, label) pairs from a JSONL file, with errors naming the line; a row with a
    `metadata_key` object gives (prompt, label, metadata), as slime's data source reads it."""
    rows: list[Prompt] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if input_key not in row:
            raise ConfigError(f"{path}:{lineno}: no '{input_key}' field (set --input-key)")
        metadata = row.get(metadata_key)
        if metadata is None:
            rows.append((row[input_key], row.get(label_key)))
        elif isinstance(metadata, dict):
            rows.append((row[input_key], row.get(label_key), metadata))
        else:
            raise ConfigError(
                f"{path}:{lineno}: '{metadata_key}' is {type(metadata).__name__}; expected a JSON object "
                "(or set --metadata-key)"
            )
    if not rows:
        raise ConfigError(f"{path}: no prompts")
    return rows


def make_groups(
    prompts: Sequence[Prompt], groups: int, per_prompt: int, start: int = 0
) -> Iterator[list[Sample]]:
    """Prompt groups the way the host's data source hands them out: n copies per prompt."""
    for g in range(groups):
        prompt, label, metadata = _parts(prompts[(start + g) % len(prompts)])
        yield [
            Sample(
                group_index=start + g,
                index=(start + g) * per_prompt + j,
                prompt=prompt,
                label=label,
                metadata=copy.deepcopy(metadata),
            )
            for j in range(per_prompt)
        ]


def _parts(prompt: Prompt) -> tuple[str | list[dict[str, str]], object, dict]:
    """(prompt, label, metadata) of a prompt, with or without metadata."""
    return (prompt[0], prompt[1], dict(prompt[2])) if len(prompt) > 2 else (prompt[0], prompt[1], {})


class SourceState(TypedDict):
    """Where a `LocalDataSource` stands (a checkpoint's `data_source`)."""

    offset: int
    epoch: int
    group_index: int
    sample_index: int
    order: list[int]
    returned: list[list[dict]]  # groups given back, to be handed out again first (`add_samples`)


class LocalDataSource:
    """slime's data source for prompts held in memory: `n_samples_per_prompt` copies of each
    prompt per group, with `group_index` and `index` counting up across the whole run. Groups
    given back (`add_samples`: a fully asynchronous rollout's groups too stale to train) are
    handed out again first, with their indices, as slime's buffer does."""

    def __init__(
        self,
        prompts: Sequence[Prompt],
        n_samples_per_prompt: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        eval_prompts: Sequence[Prompt] | None = None,
    ):
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
        self.returned: list[list[Sample]] = []

    def _next_prompt(self) -> Prompt:
        if self.offset == len(self._order):
            self.offset, self.epoch = 0, self.epoch + 1
            if self.shuffle:
                random.Random(self.seed + self.epoch).shuffle(self._order)
        prompt = self.prompts[self._order[self.offset]]
        self.offset += 1
        return prompt

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = []
        while self.returned and len(groups) < num_groups:
            groups.append(self.returned.pop(0))
        for _ in range(num_groups - len(groups)):
            prompt, label, metadata = _parts(self._next_prompt())
            group = []
            for _ in range(self.n):
                group.append(
                    Sample(
                        group_index=self.group_index,
                        index=self.sample_index,
                        prompt=copy.deepcopy(prompt),
                        label=label,
                        metadata=copy.deepcopy(metadata),
                    )
                )
                self.sample_index += 1
            self.group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Take back prompt groups not trained (their input samples, as handed out)."""
        self.returned.extend(list(group) for group in samples)

    def state_dict(self) -> SourceState:
        return {
            "offset": self.offset,
            "epoch": self.epoch,
            "group_index": self.group_index,
            "sample_index": self.sample_index,
            "order": list(self._order),
            "returned": [[s.to_dict() for s in group] for group in self.returned],
        }

    def load_state_dict(self, state: SourceState) -> None:
        self.offset, self.epoch = state["offset"], state["epoch"]
        self.group_index, self.sample_index = state["group_index"], state["sample_index"]
        self._order = list(state["order"])
        # A checkpoint of a version without given-back groups has no "returned".
        self.returned = [[Sample.from_dict(s) for s in group] for group in state.get("returned", [])]


async def _generate_groups(
    args: argparse.Namespace, groups: list[list[Sample]], evaluation: bool
) -> list[list[Generated]]:
    generate = load_function(
        getattr(args, "custom_generate_function_path", None) or "mrlx_plugin.rollout.generate"
    )
    semaphore = asyncio.Semaphore(getattr(args, "sglang_server_concurrency", None) or 512)
    params = sampling_params(args)

    async def one(sample: Sample) -> Generated:
        async with semaphore:
            return await generate(args, sample, dict(params), evaluation=evaluation)

    async def group(g: list[Sample]) -> list[Generated]:
        return list(await asyncio.gather(*(one(s) for s in g)))

    return list(await asyncio.gather(*(group(g) for g in groups)))


async def generate_group(args: argparse.Namespace, group: list[Sample]) -> list[Generated]:
    """slime's `generate_and_rm_group`, for the plugin's purposes: one prompt group generated and
    graded as `default_rollout` does a batch (the generate function grades each episode), with
    the host's invariants on it checked (`check_like_host`)."""
    (results,) = await _generate_groups(args, [group], evaluation=False)
    runtime = cached_runtime(args)
    check_like_host([results], fixed_count=runtime is not None and runtime.samples_per_episode is not None)
    return results


def default_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: LocalDataSource, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """slime's `generate_rollout`, for the plugin's purposes (see the module docstring)."""
    if evaluation:
        prompts = getattr(data_source, "eval_prompts", None) or []
        eval_source = LocalDataSource(
            prompts or [("", None)], getattr(args, "n_samples_per_eval_prompt", 1) or 1
        )
        groups = eval_source.get_samples(len(prompts)) if prompts else []
        results = run_in_host_loop(_generate_groups(args, groups, evaluation=True))
        samples = [s for g in results for s in g]
        return RolloutFnEvalOutput(
            data={
                "eval": {
                    "rewards": [float(s.reward or 0.0) for s in samples],
                    "truncated": [s.status == Status.TRUNCATED for s in samples],
                    "samples": samples,
                }
            }
        )
    groups = data_source.get_samples(args.rollout_batch_size)
    results = run_in_host_loop(_generate_groups(args, groups, evaluation=False))
    runtime = cached_runtime(args)
    check_like_host(results, fixed_count=runtime is not None and runtime.samples_per_episode is not None)
    return RolloutFnTrainOutput(samples=results, metrics={})


def check_like_host(groups: list[list[Generated]], fixed_count: bool) -> None:
    """The invariants the hosts enforce on a training rollout, enforced here too so that the CPU
    runs fail where a GPU job would: the samples of one generate call share one non-None rollout
    id (slime asserts it before the split), and every call returns the same number of samples
    when the system declares its samples per episode (with fixed micro-batches a step's count must split
    evenly across data-parallel ranks, so a count that varies with aborts breaks the host's split)."""
    sizes = set()
    for group in groups:
        for result in group:
            if not isinstance(result, list):
                sizes.add(1)
                continue
            ids = {getattr(s, "rollout_id", None) for s in result}
            assert len(ids) == 1 and None not in ids, (
                f"siblings of one generate call must share a rollout_id; got {ids}"
            )
            sizes.add(len(result))
    assert not fixed_count or len(sizes) <= 1, (
        f"generate calls of one step returned different sample counts {sorted(sizes)}; the host's static "
        "micro-batch split needs every episode to return the same number"
    )
