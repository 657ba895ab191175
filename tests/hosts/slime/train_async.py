"""The fake slime's `train_async.py`: slime's asynchronous training loop, the rollout side of it.

    PYTHONPATH=tests/hosts/slime:tests/hosts:. python tests/hosts/slime/train_async.py <slime flags> \
        --num-rollout N --fake-result FILE [as train.py]

What slime's `train_async.py` does, modelled here: the rollout manager is a Ray actor, so its
calls run one at a time in the order they were made (here: one worker thread taking them in
turn); the driver asks for the next step's rollout before the current step trains, so rollout
k+1 runs while step k trains. Per step k:
1. wait for rollout k (started one step earlier; the first one before the loop);
2. start rollout k+1 (unless k is the last step);
3. train step k (there is no trainer: nothing, or `--fake-train-hold`, see train.py);
4. with `--save`, save the data source (queued on the actor behind rollout k+1: it runs once
   that rollout is done);
5. every `--update-weights-interval` steps, wait for rollout k+1 before the weight push (the
   pause around it with `--fake-weight-push`, see train.py), which then is the step k+1 data;
6. evaluation when `--eval-interval` is due (no evaluation before the first step, as in slime).
The result file is train.py's.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from slime.utils.misc import should_run_periodic_action
from train import Job


class Actor:
    """A Ray actor's mailbox: calls run on one daemon thread, one at a time, in order."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], Future]] = queue.Queue()
        threading.Thread(target=self._serve, name="rollout-manager", daemon=True).start()

    def remote(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self.calls.put((fn, args, future))
        return future

    def _serve(self) -> None:
        while True:
            fn, args, future = self.calls.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the call
                future.set_exception(exc)


def main(argv: list[str]) -> int:
    job = Job(argv)
    args = job.args
    actor = Actor()
    rollout_id, phase = args.start_rollout_id, "generate"
    try:
        next_rollout: Future | None = actor.remote(job.generate, args.start_rollout_id)
        current: Any = None
        for rollout_id in range(args.start_rollout_id, args.num_rollout):
            phase = "generate"
            if next_rollout is not None:
                current = next_rollout.result()
            job.record(rollout_id, *current)
            last = rollout_id + 1 == args.num_rollout
            next_rollout = None if last else actor.remote(job.generate, rollout_id + 1)
            job.train(rollout_id)
            if args.save:
                actor.remote(job.manager.save, rollout_id).result()
            if (rollout_id + 1) % args.update_weights_interval == 0:
                current = next_rollout.result() if next_rollout is not None else None
                next_rollout = None
                job.push_weights(rollout_id)
            if should_run_periodic_action(rollout_id, args.eval_interval):
                phase = "eval"
                actor.remote(job.evaluate, rollout_id).result()
    except BaseException as exc:  # noqa: BLE001 - report any failure of a step, then fail like slime
        return job.fail(exc, rollout_id, phase)
    job.write()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
