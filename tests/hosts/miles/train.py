"""Drive the fake Miles (`tests/hosts/miles/miles`) the way Miles' `train.py` (and, with
`--fully-async`, `train_async.py`) drives a run, minus the trainer: parse the flags, build the
rollout manager (on its own copy of the args, as Miles' Ray actor holds one), resolve the step to
start at (`--start-rollout-id`, else the step after the one in `--load`'s
`latest_checkpointed_iteration.txt`, as Miles' trainer does) and load the data source's state of
the step before it, push the first weights, then per step (`--num-rollout`) evaluate when due
(before the first step unless `--skip-eval-before-train`, and after step k when (k + 1) %
`--eval-interval` == 0) and run the rollout. After each step: save when due (`--save`,
`--save-interval`: the data source's state and the tracker file), then push new weights: the
trainer's version goes up by one per push (1 before the first rollout), the router's engine gets
it through `/update_weights_from_disk` (the stub engine reports it in every answer) and the
rollout manager through `set_weight_version`. Under `--fully-async` the rollout of step k + 1
runs before step k is recorded, saved and followed by a weight push (train_async's overlap: its
groups were committed before step k was saved). Not modelled: pausing the engines around a
weight push, `--update-weights-interval` other than 1, the save at the last step.

    PYTHONPATH=tests/hosts/miles:tests/hosts:. python tests/hosts/miles/train.py <Miles flags> \\
        --num-rollout N [--eval-interval K] --fake-dp-size D --fake-result FILE \\
        [--fake-stub-stats-url http://ENGINE/_stub/stats] [--fake-step-timeout SECONDS]

FILE gets JSON, rewritten after every step: `args` (what Miles resolved), `steps` (per rollout:
sample count, samples per dp rank, statuses, distinct rollout ids, the prompt groups, and with
`--fake-stub-stats-url` the stub engine's counters when `abort()` set the flag and when it
returned), `evals` (per dataset: sample count, rewards, statuses) and `error` (type, message,
phase, traceback) when something raised. Exit status 0, or non-zero with the traceback on
stderr. A phase that runs past `--fake-step-timeout`, or a class-based rollout that keeps
dropping groups whose generate call raised (Miles would loop forever), is reported the same way.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):  # dp_split, then the fake `miles` package first
    if path not in sys.path:
        sys.path.insert(0, path)

from miles import _test_seams  # noqa: E402
from miles.ray.rollout.rollout_manager import RolloutManager  # noqa: E402
from miles.utils.arguments import parse_args  # noqa: E402
from miles.utils.logging_utils import configure_logger_raw  # noqa: E402
from miles.utils.misc import load_function, should_run_periodic_action  # noqa: E402

DROPPED_GROUPS_LIMIT = 20
TRACKER = "latest_checkpointed_iteration.txt"  # the trainer's checkpoint: the last saved step


class Driver:
    def __init__(self, opts: argparse.Namespace):
        self.opts = opts
        self.result: dict[str, Any] = {"args": None, "steps": [], "evals": [], "error": None}
        self.phase: str | None = None
        self.phase_started = time.monotonic()
        self.probes: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.weight_version = 0  # the trainer's: one more per weight push

    def write(self) -> None:
        with self.lock:
            tmp = Path(self.opts.fake_result + ".tmp")
            tmp.write_text(json.dumps(self.result, indent=1, default=str))
            os.replace(tmp, self.opts.fake_result)

    def fail(self, error: dict[str, Any]) -> None:
        self.result["error"] = {"phase": self.phase, **error}
        self.write()

    def start_phase(self, name: str) -> None:
        self.phase, self.phase_started = name, time.monotonic()
        _test_seams.dropped_group_errors.clear()

    def watchdog(self) -> None:
        while True:
            time.sleep(0.1)
            if self.phase is None:
                continue
            dropped = list(_test_seams.dropped_group_errors)
            if len(dropped) >= DROPPED_GROUPS_LIMIT:
                last = dropped[-1]
                message = (
                    f"{last} (the class-based rollout dropped {len(dropped)} groups whose "
                    "generate call raised and keeps drawing more, as Miles does: this rollout would never "
                    "end)"
                )
                self._give_up(
                    {
                        "type": type(last).__name__,
                        "message": message,
                        "traceback": "".join(traceback.format_exception(last)),
                    }
                )
            elif time.monotonic() - self.phase_started > self.opts.fake_step_timeout:
                self._give_up(
                    {
                        "type": "StepTimeout",
                        "message": f"{self.phase} did not finish within {self.opts.fake_step_timeout:g} s",
                    }
                )

    def _give_up(self, error: dict[str, Any]) -> None:
        self.fail(error)
        print(f"fake Miles driver: {self.phase}: {error['message']}", file=sys.stderr, flush=True)
        os._exit(3)

    async def probe(self, stage: str, info: dict[str, Any]) -> None:
        """`abort()` observer: the stub engine's counters at this instant."""
        import aiohttp

        record: dict[str, Any] = {"stage": stage, "t": time.monotonic(), **info}
        async with aiohttp.ClientSession() as session, session.get(self.opts.fake_stub_stats_url) as resp:
            stats = await resp.json()
        record.update(generate=stats["generate"], pending=stats["pending"], aborted=stats["aborted"])
        self.probes.append(record)

    def run(self, argv: list[str]) -> int:
        configure_logger_raw("fake-miles")
        threading.Thread(target=self.watchdog, daemon=True).start()
        if self.opts.fake_stub_stats_url:
            _test_seams.abort_observers.append(self.probe)
        try:
            self.start_phase("start-up")
            args = parse_args(argv)
            self.result["args"] = {
                "rollout_function_path": args.rollout_function_path,
                "eval_function_path": args.eval_function_path,
                "global_batch_size": args.global_batch_size,
                "over_sampling_batch_size": args.over_sampling_batch_size,
                "has_mrlx_config_flag": hasattr(args, "mrlx_config"),
                "custom_config_keys": sorted(k for k in ("mrlx",) if hasattr(args, k)),
            }
            # Miles' rollout manager is a Ray actor: it holds its own copy of the args, taken before
            # the trainer resolves the step a resumed run starts at.
            actor_args = copy.deepcopy(args)
            data_source = load_function(actor_args.data_source_path)(actor_args)
            parallel = {
                "dp_size": self.opts.fake_dp_size,
                "cp_size": 1,
                "vpp_size": 1,
                "microbatch_group_size_per_vp_stage": 1,
            }
            manager = RolloutManager(actor_args, data_source, parallel)
            if args.start_rollout_id is None:  # the trainer's checkpoint says where to go on
                args.start_rollout_id = int(Path(args.load, TRACKER).read_text().strip()) + 1
            if args.rollout_global_dataset:
                manager.load(args.start_rollout_id - 1)
            self.update_weights(args, manager)  # Miles pushes the trainer's weights before any rollout
            first_eval = args.eval_interval is not None and not args.skip_eval_before_train
            if first_eval and args.start_rollout_id == 0:
                self.evaluate(manager, 0)
            (self.run_async if args.fully_async else self.run_sync)(args, manager)
        except BaseException as exc:  # noqa: BLE001 - reported, then the exit status says it
            self.fail({"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()})
            traceback.print_exc()
            return 1
        self.phase = None
        self.write()
        return 0

    def generate(self, manager: RolloutManager, rollout_id: int) -> tuple[dict[str, Any], list[Any]]:
        self.start_phase(f"rollout {rollout_id}")
        self.probes = []
        out = manager.generate(rollout_id)
        return out, self.probes

    def run_sync(self, args: argparse.Namespace, manager: RolloutManager) -> None:
        """Miles' train.py: rollout, train, save, push the weights, evaluate."""
        for rollout_id in range(args.start_rollout_id, args.num_rollout or 0):
            out, probes = self.generate(manager, rollout_id)
            self.after_step(args, manager, rollout_id, out, probes)

    def run_async(self, args: argparse.Namespace, manager: RolloutManager) -> None:
        """Miles' train_async.py (`--update-weights-interval 1`): the rollout of step k + 1 starts
        before step k trains and ends before the weights are pushed; saves and evaluations come in
        between. The fake has no trainer, so the next rollout simply runs first."""
        end = args.num_rollout or 0
        pending = self.generate(manager, args.start_rollout_id) if args.start_rollout_id < end else None
        for rollout_id in range(args.start_rollout_id, end):
            assert pending is not None
            out, probes = pending
            pending = self.generate(manager, rollout_id + 1) if rollout_id + 1 < end else None
            self.after_step(args, manager, rollout_id, out, probes)

    def after_step(
        self,
        args: argparse.Namespace,
        manager: RolloutManager,
        rollout_id: int,
        out: dict[str, Any],
        probes: list[dict[str, Any]],
    ) -> None:
        """Step `rollout_id` "trained": recorded, saved when due, new weights pushed, evaluated when due."""
        self.record_step(rollout_id, out, probes)
        if args.save is not None and should_run_periodic_action(rollout_id, args.save_interval):
            manager.save(rollout_id)
            tracker = Path(args.save, TRACKER)
            tracker.parent.mkdir(parents=True, exist_ok=True)
            tracker.with_suffix(".tmp").write_text(str(rollout_id))
            os.replace(tracker.with_suffix(".tmp"), tracker)
        self.update_weights(args, manager)
        if should_run_periodic_action(rollout_id, args.eval_interval):
            self.evaluate(manager, rollout_id)

    def update_weights(self, args: argparse.Namespace, manager: RolloutManager) -> None:
        """The trainer's weight push: the router's engine gets the next version (the stub engine
        takes it from `/update_weights_from_disk`), then the rollout manager is told."""
        self.weight_version += 1
        url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/update_weights_from_disk"
        body = {"model_path": args.hf_checkpoint or "fake", "weight_version": str(self.weight_version)}
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            answer = json.loads(resp.read())
        assert answer.get("success"), f"weight update refused by {url}: {answer}"
        manager.set_weight_version(self.weight_version)

    def evaluate(self, manager: RolloutManager, rollout_id: int) -> None:
        self.start_phase(f"eval {rollout_id}")
        data = manager.eval(rollout_id)
        self.result["evals"].append(
            {
                "rollout_id": rollout_id,
                "datasets": {
                    name: {
                        "samples": len(entry["samples"]),
                        "rewards": entry["rewards"],
                        "statuses": dict(collections.Counter(s.status.value for s in entry["samples"])),
                    }
                    for name, entry in data.items()
                },
            }
        )
        self.write()

    def record_step(self, rollout_id: int, out: dict[str, Any], probes: list[dict[str, Any]]) -> None:
        samples = out["samples"]
        per_rollout = collections.Counter(
            s.rollout_id if s.rollout_id is not None else s.index for s in samples
        )
        self.result["steps"].append(
            {
                "rollout_id": rollout_id,
                "samples": len(samples),
                "rank_sizes": [len(shard["partition"]) for shard in out["data_ref"]],
                "statuses": dict(collections.Counter(s.status.value for s in samples)),
                "rollouts": len(per_rollout),
                "samples_per_rollout": sorted(per_rollout.values()),
                "groups": sorted({s.group_index for s in samples}),
                "abort": probes,
            }
        )
        self.write()


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--fake-dp-size", type=int, default=1)
    own.add_argument("--fake-result", required=True)
    own.add_argument("--fake-stub-stats-url", default=None)
    own.add_argument("--fake-step-timeout", type=float, default=120.0)
    opts, rest = own.parse_known_args(argv)
    return Driver(opts).run(rest)


if __name__ == "__main__":
    sys.exit(main())
