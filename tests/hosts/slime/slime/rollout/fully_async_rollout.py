"""Fake of `slime.rollout.fully_async_rollout`: `generate_rollout_fully_async`.

Modelled: one background worker per process (a daemon thread running ITS OWN asyncio loop, not
the `async_utils` one) keeps up to `--sglang-server-concurrency` x engines groups in flight
across rollouts, pulling one group at a time from the data buffer and running
`generate_and_rm_group` on it; it stops topping up while that many finished groups wait. Each
rollout call takes `--rollout-batch-size` finished groups (the surplus stays queued for the next
rollout) and returns them sorted by index as a bare list (so the host sees no metrics). The
worker never aborts anything.

A finished group with an ABORTED item is given back to the data buffer instead of being trained.
As in the real code, only the group's own items are inspected (`getattr(item, "status")`): a
group whose items are lists (a generate function returning several samples, as mrlx does) is
never recognised as aborted, and is trained as it is. Sorting such groups raises TypeError in
slime today (it takes `list.index` for a sample index; THUDM/slime issue 2344): the fake keeps
that, so a list-returning generate function cannot run under this rollout until slime fixes it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
from typing import Any

from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group, get_rollout_num_engines

logger = logging.getLogger(__name__)
from slime.utils.async_utils import run
from slime.utils.types import Sample


class AsyncRolloutWorker:
    def __init__(self, args: Any, data_buffer: Any, concurrency: int):
        self.args = args
        self.data_buffer = data_buffer
        self.concurrency = concurrency
        self.running = True
        self.output_queue: queue.Queue[tuple[int, list[Any]]] = queue.Queue()
        self.poll_interval = 1.0
        self.state = GenerateState(args)
        self.thread = threading.Thread(target=self._run, name="fully-async", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.running = False
        self.thread.join(timeout=5)

    def take(self, limit: int) -> list[tuple[int, list[Any]]]:
        out = []
        while len(out) < limit:
            try:
                out.append(self.output_queue.get_nowait())
            except queue.Empty:
                break
        return out

    def _run(self) -> None:
        asyncio.run(self._loop())  # this worker's own event loop

    async def _loop(self) -> None:
        active: set[asyncio.Task] = set()
        gid = 0
        while self.running:
            active = {t for t in active if not t.done()}
            while len(active) < self.concurrency and self.output_queue.qsize() < self.concurrency:
                groups = self.data_buffer.get_samples(1)
                if not groups:
                    break
                params = self.state.sampling_params.copy()
                coro = generate_and_rm_group(self.args, groups[0], params, evaluation=False)
                task = asyncio.create_task(coro)
                task.add_done_callback(self._on_done(gid))
                active.add(task)
                gid += 1
            await asyncio.sleep(self.poll_interval)
        if active:
            await asyncio.wait(active, timeout=30)

    def _on_done(self, gid: int) -> Any:
        def callback(task: asyncio.Task) -> None:
            if task.cancelled():
                return
            if task.exception() is not None:  # logged with its traceback; the group is dropped
                logger.error("fully-async: a generate task raised", exc_info=task.exception())
                return
            group = task.result()
            if any(getattr(item, "status", None) == Sample.Status.ABORTED for item in group):
                self.data_buffer.add_samples([group])
                return
            self.output_queue.put((gid, group))

        return callback


_worker: AsyncRolloutWorker | None = None
_worker_lock = threading.Lock()


def _get_worker(args: Any, data_buffer: Any) -> AsyncRolloutWorker:
    global _worker
    with _worker_lock:
        if _worker is None or not _worker.thread.is_alive():
            concurrency = args.sglang_server_concurrency * get_rollout_num_engines(args)
            _worker = AsyncRolloutWorker(args, data_buffer, concurrency)
        return _worker


@atexit.register
def _stop_worker() -> None:
    if _worker is not None:
        _worker.stop()


def _first_index(group: list[Any]) -> int:
    # As in slime: the first item with an `index`. For a group of lists that is `list.index`, a
    # method, and int() of it raises TypeError (THUDM/slime issue 2344, fix pending in PR 2345).
    for item in group:
        if getattr(item, "index", None) is not None:
            return int(item.index)
    return 0


async def _collect(args: Any, rollout_id: int, data_buffer: Any) -> list[list[Any]]:
    assert args.rollout_global_dataset
    worker = _get_worker(args, data_buffer)
    collected: dict[int, list[Any]] = {}
    while len(collected) < args.rollout_batch_size:
        got = worker.take(args.rollout_batch_size - len(collected))
        collected.update(got)
        if not got:
            await asyncio.sleep(0.05)
    return sorted(collected.values(), key=_first_index)


def generate_rollout_fully_async(
    args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False
) -> Any:
    if evaluation:
        raise ValueError("fully-async rollout doesn't support evaluation mode")
    return run(_collect(args, rollout_id, data_buffer))
