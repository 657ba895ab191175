"""The fake slime's `train.py`: run the rollout side of slime's training loop and report it as JSON.

    PYTHONPATH=tests/hosts/slime:tests/hosts:. python tests/hosts/slime/train.py <slime flags> \
        --num-rollout N [--eval-interval K] [--fake-dp-size D] --fake-result FILE [--fake-probe-url URL ...]

Per step, in slime's order: (evaluation before the first step when `--eval-interval` is set and
`--skip-eval-before-train` is not), `RolloutManager.generate(rollout_id)` (rollout, log,
conversion, data-parallel split), save when `--save` is set (there is no trainer and no weight
push), evaluation when due. dp_size is `world_size / (tp * pp * cp)` unless `--fake-dp-size`.

The result file holds, per step: the number of samples, the per-rank sizes, the samples' rollout
ids and statuses; per evaluation: the datasets' sample counts; and, if a step raised, the error
(type, message, traceback); the driver then exits with status 1. With `--fake-probe-url` (the
engines to watch), the default rollout's `abort` is wrapped: just before the host sets
`GenerateState.aborted` the driver records how many `/generate` requests those engines have
received (their `/_stub/stats`) and how many generate calls hold a rollout slot; after the step,
the request count again.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
import urllib.request
from typing import Any

from slime.ray.rollout import RolloutManager
from slime.utils.arguments import parse_args
from slime.utils.misc import load_function, should_run_periodic_action


def _generate_requests(urls: list[str]) -> int:
    total = 0
    for url in urls:
        with urllib.request.urlopen(url.rstrip("/") + "/_stub/stats", timeout=10) as resp:
            total += int(json.loads(resp.read())["generate"])
    return total


def _probe_aborts(urls: list[str], probes: list[dict[str, Any]]) -> None:
    from slime.rollout import sglang_rollout

    real_abort = sglang_rollout.abort

    async def abort(args: Any, rollout_id: int) -> Any:
        state = sglang_rollout.GenerateState(args)
        capacity = args.sglang_server_concurrency * sglang_rollout.get_rollout_num_engines(args)
        # Blocking on purpose: no episode runs on the loop between this count and the flag.
        probes.append(
            {
                "rollout_id": rollout_id,
                "requests_at_abort": _generate_requests(urls),
                "generate_calls_in_flight": capacity - state.semaphore._value,
                "groups_pending": sum(not t.done() for t in state.pendings),
            }
        )
        return await real_abort(args, rollout_id)

    sglang_rollout.abort = abort


def _error(exc: BaseException, rollout_id: int, phase: str) -> dict[str, Any]:
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return {
        "rollout_id": rollout_id,
        "phase": phase,
        "type": kind,
        "message": str(exc),
        "traceback": traceback.format_exc(),
    }


def main(argv: list[str]) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--fake-dp-size", type=int, default=None)
    own.add_argument("--fake-result", required=True)
    own.add_argument("--fake-probe-url", action="append", default=[])
    fake, rest = own.parse_known_args(argv)
    args = parse_args(rest)

    probes: list[dict[str, Any]] = []
    if fake.fake_probe_url:
        _probe_aborts(fake.fake_probe_url, probes)
    vpp = args.virtual_pipeline_model_parallel_size or 1
    parallel = {
        "dp_size": fake.fake_dp_size or args.data_parallel_size,
        "cp_size": args.context_parallel_size,
        "vpp_size": vpp,
        "microbatch_group_size_per_vp_stage": args.microbatch_group_size_per_vp_stage
        or args.pipeline_model_parallel_size,
    }
    data_source = load_function(args.data_source_path)(args)
    manager = RolloutManager(args, data_source, parallel)
    result: dict[str, Any] = {
        "parallel": parallel,
        "global_batch_size": args.global_batch_size,
        "steps": [],
        "evals": [],
        "aborts": probes,
        "errors": [],
    }

    def write() -> None:
        with open(fake.fake_result, "w") as f:
            json.dump(result, f, indent=1, default=str)

    def evaluate(rollout_id: int) -> None:
        manager.eval(rollout_id)
        result["evals"].append({"rollout_id": rollout_id})

    rollout_id, phase = args.start_rollout_id, "eval"
    try:
        for rollout_id in range(args.start_rollout_id, args.num_rollout):
            if args.eval_interval is not None and rollout_id == 0 and not args.skip_eval_before_train:
                phase = "eval"
                evaluate(rollout_id)
            phase = "generate"
            ranks = manager.generate(rollout_id)
            samples = manager.last_samples
            step = {
                "rollout_id": rollout_id,
                "num_samples": len(samples),
                "rank_sizes": [len(r["partition"]) for r in ranks],
                "rollout_ids": [s.rollout_id for s in samples],
                "statuses": [s.status.value for s in samples],
                "loss_mask_sums": [sum(s.loss_mask or []) for s in samples],
            }
            if fake.fake_probe_url:
                step["requests_after_step"] = _generate_requests(fake.fake_probe_url)
            result["steps"].append(step)
            if args.save:
                manager.save(rollout_id)
            if should_run_periodic_action(rollout_id, args.eval_interval):
                phase = "eval"
                evaluate(rollout_id)
    except BaseException as exc:  # noqa: BLE001 - report any failure of a step, then fail like slime
        result["errors"].append(_error(exc, rollout_id, phase))
        write()
        traceback.print_exc()
        return 1
    write()
    return 0


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )  # slime logs to stderr
    sys.exit(main(sys.argv[1:]))
