"""Fake of `slime.rollout.sglang_rollout`: the default rollout and its per-sample calls.

Modelled, as the plugin meets them in slime:
- `GenerateState`: a process singleton (SingletonMeta) holding the rollout semaphore
  (`--sglang-server-concurrency` x engines), the sampling parameters built from the flags, the
  groups in flight (`pendings`) and the `aborted` flag.
- `generate_and_rm`: one semaphore slot for the whole call; an aborted state marks the sample
  ABORTED without calling anything; the `--custom-generate-function-path` function is called
  positionally as `fn(args, sample, sampling_params, evaluation=...)` (`evaluation` only when the
  signature has it); a list return gets rewards for its samples without one (one batched
  `--custom-rm-path` call) unless one of them is ABORTED; a single sample gets `async_rm`.
- `generate_and_rm_group`: one task per sample; returns the group (of samples, or of lists).
- `abort`: sets `aborted`, asks the engine to abort everything, waits for every pending group.
- `generate_rollout`: submits `--over-sampling-batch-size` groups, keeps the first
  `--rollout-batch-size` that finish, aborts the rest, resets the state; evaluation runs every
  `--eval-prompt-data` dataset and returns `RolloutFnEvalOutput`.
Not modelled: the built-in (non-custom) generate, dynamic filters, sample hooks, group RM,
routing replay, dumps, deterministic seeds. The real `abort` lists the router's workers and
polls their load; the test "router" is one engine, so the fake posts `/abort_request` to it.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import urllib.request
import uuid
from typing import Any

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.utils.async_utils import run
from slime.utils.misc import SingletonMeta, load_function
from slime.utils.types import Sample


def get_rollout_num_engines(args: Any) -> int:
    gpus = getattr(args, "rollout_num_gpus", None) or 0
    return max(1, gpus // (getattr(args, "rollout_num_gpus_per_engine", None) or 1)) if gpus > 0 else 0


class GenerateState(metaclass=SingletonMeta):
    def __init__(self, args: Any) -> None:
        self.args = args
        self.semaphore = asyncio.Semaphore(args.sglang_server_concurrency * get_rollout_num_engines(args))
        self.sampling_params: dict[str, Any] = {
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
        if args.rollout_top_p != 1.0:  # slime then replays the kept nucleus ids in training
            self.sampling_params["custom_params"] = {"return_top_p_token_ids": True}
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.aborted = False

    def submit_generate_tasks(self, groups: list[list[Sample]]) -> None:
        for group in groups:
            coro = generate_and_rm_group(self.args, group, self.sampling_params.copy(), evaluation=False)
            self.pendings.add(asyncio.create_task(coro))
        self.remaining_batch_size += len(groups)


async def generate_and_rm(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        assert sample.reward is not None
        return sample
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        path = getattr(sample, "generate_function_path", None) or args.custom_generate_function_path
        if path is None:
            raise NotImplementedError("the fake slime models only --custom-generate-function-path")
        fn = load_function(path)
        if "evaluation" in inspect.signature(fn).parameters:
            sample = await fn(args, sample, sampling_params, evaluation=evaluation)
        else:
            sample = await fn(args, sample, sampling_params)

    if isinstance(sample, list):
        if any(s.status == Sample.Status.ABORTED for s in sample):
            return sample
        need = [s for s in sample if s.reward is None]
        for s, reward in zip(need, await batched_async_rm(args, need)):
            s.reward = reward
        return sample
    if sample.status != Sample.Status.ABORTED and sample.reward is None:
        sample.reward = await async_rm(args, sample)
    return sample


async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    state = GenerateState(args)
    if state.aborted:
        return group
    for sample in group:
        if sample.session_id is None:
            sample.session_id = str(uuid.uuid4())
    tasks = [
        asyncio.create_task(generate_and_rm(args, s, sampling_params.copy(), evaluation=evaluation))
        for s in group
    ]
    return list(await asyncio.gather(*tasks))


def _post(url: str, body: dict[str, Any]) -> None:
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()


async def abort(args: Any, rollout_id: int) -> list[list[Sample]]:
    state = GenerateState(args)
    assert not state.aborted
    state.aborted = True
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/abort_request"
    await asyncio.to_thread(_post, url, {"abort_all": True})
    given_back: list[list[Sample]] = []
    while state.pendings:  # every group in flight ends (the engine answered "abort", or it was short-cut)
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        if args.partial_rollout:
            given_back += [task.result() for task in done]
    return given_back


def _group_index(group: list[Any]) -> int:
    first = group[0][0] if isinstance(group[0], list) else group[0]
    return first.index


async def generate_rollout_async(
    args: Any, rollout_id: int, get_samples: Any
) -> tuple[RolloutFnTrainOutput, list]:
    assert args.rollout_global_dataset
    state = GenerateState(args)
    target = args.rollout_batch_size
    data: list[list[Any]] = []
    while len(data) < target:
        while state.remaining_batch_size < target:
            state.submit_generate_tasks(get_samples(args.over_sampling_batch_size))
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            group = task.result()
            assert len(group) == args.n_samples_per_prompt
            if len(data) < target:
                data.append(group)
    given_back = await abort(args, rollout_id)  # the over-sampled groups still running
    assert len(data) == args.rollout_batch_size, f"Got {len(data)} groups, expected {args.rollout_batch_size}"
    data.sort(key=_group_index)
    state.reset()
    return RolloutFnTrainOutput(samples=data, metrics={}), given_back


EVAL_DATASETS: dict[str, list[Sample]] = {}


def _eval_datasets(args: Any) -> list[tuple[str, list[Sample]]]:
    spec = args.eval_prompt_data or []
    out = []
    for name, path in zip(spec[0::2], spec[1::2]):
        if path not in EVAL_DATASETS:
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            EVAL_DATASETS[path] = [
                Sample(
                    prompt=r[args.input_key],
                    label=r.get(args.label_key) if args.label_key else None,
                    metadata=dict(r.get(args.metadata_key) or {}),
                )
                for r in rows
            ]
        out.append((name, EVAL_DATASETS[path]))
    return out


def _pick(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


async def eval_rollout(args: Any, rollout_id: int) -> RolloutFnEvalOutput:
    params = {
        "temperature": _pick(args.eval_temperature, args.rollout_temperature),
        "top_p": _pick(args.eval_top_p, args.rollout_top_p),
        "top_k": _pick(args.eval_top_k, args.rollout_top_k),
        "max_new_tokens": _pick(args.eval_max_response_len, args.rollout_max_response_len),
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    results: dict[str, dict[str, Any]] = {}
    for name, prompts in _eval_datasets(args):
        tasks, index = [], 0
        for prompt in prompts:
            for _ in range(args.n_samples_per_eval_prompt):
                sample = copy.deepcopy(prompt)
                sample.index, index = index, index + 1
                coro = generate_and_rm(args, sample, dict(params), evaluation=True)
                tasks.append(asyncio.create_task(coro))
        data: list[Sample] = []
        for out in await asyncio.gather(*tasks):
            data.extend(out if isinstance(out, list) else [out])
        data.sort(key=lambda s: s.index)
        key = args.eval_reward_key or args.reward_key
        results[name] = {
            "rewards": [s.reward[key] if key else s.reward for s in data],
            "truncated": [s.status == Sample.Status.TRUNCATED for s in data],
            "samples": data,
        }
    return RolloutFnEvalOutput(data=results)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    assert args.rollout_global_dataset
    if evaluation:
        return run(eval_rollout(args, rollout_id))
    output, given_back = run(generate_rollout_async(args, rollout_id, data_source.get_samples))
    if given_back:
        data_source.add_samples(given_back)
    return output
