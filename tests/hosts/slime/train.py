"""The fake slime's `train.py`: run the rollout side of slime's training loop and report it as JSON.

    PYTHONPATH=tests/hosts/slime:tests/hosts:. python tests/hosts/slime/train.py <slime flags> \
        --num-rollout N [--eval-interval K] [--fake-dp-size D] --fake-result FILE [--fake-probe-url URL ...] \
        [--fake-train-hold K] [--fake-weight-push URL ...]

Per step, in slime's order: (evaluation before the first step when `--eval-interval` is set and
`--skip-eval-before-train` is not), `RolloutManager.generate(rollout_id)` (rollout, log,
conversion, data-parallel split), training (there is no trainer: nothing, or with
`--fake-train-hold K` a step K that trains until the job is killed), the weight push (only with
`--fake-weight-push URL`: as slime's non-colocated update does, `/pause_generation` with no mode,
which SGLang takes as `abort`, then `/continue_generation`, on each engine named), save when
`--save` is set, evaluation when due. dp_size is `world_size / (tp * pp * cp)` unless `--fake-dp-size`.
Before the first step, as slime does after loading a checkpoint, the data source loads its state
of step `--start-rollout-id` - 1 (from `--load`, when set). The rollout functions run on slime's
one background event loop (`slime.utils.async_utils`), which keeps running between steps: a
rollout function's own tasks there (a producer of groups) go on while the step trains.
train_async.py runs the same steps in slime's asynchronous loop.

The result file (written again after every step) holds, per step: the number of samples, the
per-rank sizes, the samples' rollout ids, statuses, loss-mask sums, group indices and indices, and
the plugin's stamps on them (the step each episode started in, its episode id); per evaluation:
its rollout id; and, if a step raised, the error (type, message, traceback); the driver then
exits with status 1. With `--fake-probe-url` (the
engines to watch), the default rollout's `abort` is wrapped: just before the host sets
`GenerateState.aborted` the driver records how many `/generate` requests those engines have
received (their `/_stub/stats`) and how many generate calls hold a rollout slot; after the step,
the request count again.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
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


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read() or b"{}")


def _error(exc: BaseException, rollout_id: int, phase: str) -> dict[str, Any]:
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return {
        "rollout_id": rollout_id,
        "phase": phase,
        "type": kind,
        "message": str(exc),
        "traceback": traceback.format_exc(),
    }


class Job:
    """One run of the driver: slime's parsed args, its data source and rollout manager, and the
    result file, written again after every step (a job killed mid-run leaves what it did)."""

    def __init__(self, argv: list[str]):
        own = argparse.ArgumentParser(add_help=False)
        own.add_argument("--fake-dp-size", type=int, default=None)
        own.add_argument("--fake-result", required=True)
        own.add_argument("--fake-probe-url", action="append", default=[])
        own.add_argument("--fake-train-hold", type=int, default=None)
        own.add_argument("--fake-weight-push", action="append", default=[])
        fake, rest = own.parse_known_args(argv)
        self.fake = fake
        self.args = args = parse_args(rest)
        self.probes: list[dict[str, Any]] = []
        if fake.fake_probe_url:
            _probe_aborts(fake.fake_probe_url, self.probes)
        vpp = args.virtual_pipeline_model_parallel_size or 1
        parallel = {
            "dp_size": fake.fake_dp_size or args.data_parallel_size,
            "cp_size": args.context_parallel_size,
            "vpp_size": vpp,
            "microbatch_group_size_per_vp_stage": args.microbatch_group_size_per_vp_stage
            or args.pipeline_model_parallel_size,
        }
        data_source = load_function(args.data_source_path)(args)
        self.manager = RolloutManager(args, data_source, parallel)
        if args.rollout_global_dataset:  # slime: the data source's state of the step before the first
            self.manager.load(args.start_rollout_id - 1)
        self.result: dict[str, Any] = {
            "parallel": parallel,
            "global_batch_size": args.global_batch_size,
            "steps": [],
            "evals": [],
            "aborts": self.probes,
            "errors": [],
        }

    def write(self) -> None:
        tmp = self.fake.fake_result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        os.replace(tmp, self.fake.fake_result)  # a reader never sees half a file

    def generate(self, rollout_id: int) -> tuple[list[dict[str, Any]], list[Any]]:
        """`RolloutManager.generate`: the per-rank data, and the samples it came from."""
        ranks = self.manager.generate(rollout_id)
        return ranks, self.manager.last_samples

    def record(self, rollout_id: int, ranks: list[dict[str, Any]], samples: list[Any]) -> None:
        """What step `rollout_id`'s rollout handed to training (written at once)."""
        step = {
            "rollout_id": rollout_id,
            "num_samples": len(samples),
            "rank_sizes": [len(r["partition"]) for r in ranks],
            "rollout_ids": [s.rollout_id for s in samples],
            "statuses": [s.status.value for s in samples],
            "loss_mask_sums": [sum(s.loss_mask or []) for s in samples],
            "group_indices": [s.group_index for s in samples],
            "indices": [s.index for s in samples],
            # The plugin's stamps, read back by the tests: the step each episode started in, its id.
            "born": [((s.metadata or {}).get("mrlx_born") or {}).get("step") for s in samples],
            "episode_ids": [((s.metadata or {}).get("mrlx") or {}).get("episode_id") for s in samples],
            "abort_reasons": [((s.metadata or {}).get("mrlx") or {}).get("abort_reason") for s in samples],
        }
        if self.fake.fake_probe_url:
            step["requests_after_step"] = _generate_requests(self.fake.fake_probe_url)
        self.result["steps"].append(step)
        self.write()

    def train(self, rollout_id: int) -> None:
        """The trainer's step (there is none). `--fake-train-hold K` stands for a step that trains
        until the job is killed: at step K the driver says so in `<result>.hold` and waits for ever."""
        if self.fake.fake_train_hold != rollout_id:
            return
        with open(self.fake.fake_result + ".hold", "w") as f:
            f.write(str(rollout_id))
        threading.Event().wait()

    def push_weights(self, rollout_id: int) -> None:
        """The pause around a weight update; the requests it aborted are recorded in the step."""
        aborted = 0
        for url in self.fake.fake_weight_push:
            aborted += int(_post(url + "/pause_generation", {}).get("num_aborted") or 0)
            _post(url + "/continue_generation", {})
        if self.fake.fake_weight_push and self.result["steps"]:
            self.result["steps"][-1]["aborted_by_weight_push"] = aborted
            self.write()

    def evaluate(self, rollout_id: int) -> None:
        self.manager.eval(rollout_id)
        self.result["evals"].append({"rollout_id": rollout_id})

    def fail(self, exc: BaseException, rollout_id: int, phase: str) -> int:
        self.result["errors"].append(_error(exc, rollout_id, phase))
        self.write()
        traceback.print_exc()
        return 1


def main(argv: list[str]) -> int:
    job = Job(argv)
    args, manager = job.args, job.manager
    rollout_id, phase = args.start_rollout_id, "eval"
    try:
        for rollout_id in range(args.start_rollout_id, args.num_rollout):
            if args.eval_interval is not None and rollout_id == 0 and not args.skip_eval_before_train:
                phase = "eval"
                job.evaluate(rollout_id)
            phase = "generate"
            job.record(rollout_id, *job.generate(rollout_id))
            job.train(rollout_id)
            job.push_weights(rollout_id)
            if args.save:
                manager.save(rollout_id)
            if should_run_periodic_action(rollout_id, args.eval_interval):
                phase = "eval"
                job.evaluate(rollout_id)
    except BaseException as exc:  # noqa: BLE001 - report any failure of a step, then fail like slime
        return job.fail(exc, rollout_id, phase)
    job.write()
    return 0


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )  # slime logs to stderr
    sys.exit(main(sys.argv[1:]))
