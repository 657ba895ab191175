"""The disk under the coordinator's database fails while it runs: full, then read-only.

The faults come from the kernel, not from the coordinator's own limits:
- full: the database lives on a small tmpfs of its own, and a ballast file takes the rest of it,
  so SQLite's writes get ENOSPC (needs the right to mount, as root on a CI machine has); where
  mounting is not allowed, every file write of the coordinator process is made to fail with
  ENOSPC instead, by strace's system-call fault injection;
- read-only: every file write of the coordinator process fails with EROFS, as on a filesystem the
  kernel remounted read-only (strace's fault injection again; a real remount is refused while the
  database is open for writing).

In each case a producer's commit fails loudly (an error naming the database, never an accepted
commit that was not stored), the service keeps answering reads (/health, /metrics, queue info),
nothing of the failed commit is kept, and once the fault is gone commits succeed again without a
restart and every item committed is delivered exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _coord_procs import CoordinatorProcess, http, make_items

from mrlx_plugin.core import processes
from mrlx_plugin.link.client import CoordinatorClient, CoordinatorError

# The system calls SQLite writes files with; sockets (send/sendto) and pipes (write) keep working.
FILE_WRITES = "pwrite64,pwritev,pwritev2,ftruncate,fallocate"
TOKENS = 4000  # per item: a commit of two items is about 64 KiB on disk


@contextlib.contextmanager
def failing_file_writes(pid: int, error: str) -> Iterator[None]:
    """While inside: every file write of process `pid` (all its threads) fails with `error`."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install strace); it injects the disk errors")
    argv = [
        strace,
        "-f",
        "-qq",
        "-p",
        str(pid),
        "-e",
        f"trace={FILE_WRITES}",
        "-e",
        f"inject={FILE_WRITES}:error={error}",
        "-o",
        "/dev/null",
    ]
    tracer = processes.start(argv, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not all_threads_traced(pid):
            if tracer.poll() is not None:
                pytest.skip(
                    "strace could not attach (ptrace not allowed here): "
                    f"{tracer.stderr.read().decode()[:300]}"
                )
            assert time.monotonic() < deadline, "strace did not attach to every thread in 20 s"
            time.sleep(0.02)
        yield
    finally:
        processes.stop(tracer, timeout=20)
        deadline = time.monotonic() + 20
        while any_thread_traced(pid) and time.monotonic() < deadline:
            time.sleep(0.02)


def _tracer_pids(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("TracerPid:"):
                    out.append(int(line.split()[1]))
    return out


def all_threads_traced(pid: int) -> bool:
    return all(_tracer_pids(pid))


def any_thread_traced(pid: int) -> bool:
    return any(_tracer_pids(pid))


@contextlib.contextmanager
def small_disk(path: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of `size_mib` mounted at `path` (skips where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root; the injected ENOSPC test covers this case")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({done.stderr.strip()}); the injected ENOSPC test covers this case"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(path: Path) -> Path:
    """A ballast file that takes every free byte of the filesystem holding `path`."""
    ballast = path / "ballast"
    chunk = b"\0" * (64 << 10)
    with open(ballast, "wb", buffering=0) as f:
        for size in (64 << 10, 4096, 512):
            try:
                while True:
                    f.write(chunk[:size])
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return ballast


def clients(coord: CoordinatorProcess) -> tuple[CoordinatorClient, CoordinatorClient]:
    producer = CoordinatorClient(
        coord.url, run_id=coord.run_id, agent="doctor", token=coord.token, commit_deadline_s=3.0
    )
    consumer = CoordinatorClient(coord.url, run_id=coord.run_id, agent="patient", token=coord.token)
    return producer, consumer


async def commit_until_refused(producer: CoordinatorClient, tries: int = 300) -> tuple[int, CoordinatorError]:
    """Commit two-item groups until one is refused: (items accepted before, the error)."""
    accepted = 0
    for i in range(tries):
        try:
            result = await producer.commit(
                "patient", make_items(2, f"fill{i}", start=10_000 + 2 * i, tokens=TOKENS)
            )
        except CoordinatorError as exc:
            return accepted, exc
        assert result.accepted == 2
        accepted += 2
    raise AssertionError(
        f"{tries} commits of {2 * TOKENS * 8 // 1024} KiB each were all accepted on a failing disk"
    )


def reads_still_answer(coord: CoordinatorProcess, queued: int) -> None:
    assert http("GET", coord.url + "/health")[0] == 200
    status, _, body = http("GET", coord.url + "/metrics", token=coord.token)
    assert status == 200 and b"mrlx_coordinator_queue_items" in body
    status, _, body = http("GET", coord.url + "/v1/runs/run1/queues/patient", token=coord.token)
    assert status == 200, body
    assert json.loads(body)["queued_items"] == queued, body


async def drain(consumer: CoordinatorClient) -> list[str]:
    """Lease and ack everything queued; the keys, in delivery order."""
    keys: list[str] = []
    while True:
        lease = await consumer.lease(1000, 60, 0)
        if not lease.groups:
            return keys
        keys += [item.key for group in lease.groups for item in group]
        await consumer.ack(lease.lease_id)


def run_fault(
    coord: CoordinatorProcess, fault: contextlib.AbstractContextManager, expect_status: int, expect_words: str
) -> None:
    """The scenario shared by every disk fault: commit before, during (refused) and after."""

    async def scenario() -> None:
        producer, consumer = clients(coord)
        try:
            before = make_items(4, "before", tokens=64)
            assert (await producer.commit("patient", before)).accepted == 4
            with fault:
                accepted, refused = await commit_until_refused(producer)
                assert refused.status == expect_status, refused
                assert "database could not be written" in str(refused) and expect_words in str(refused), (
                    refused
                )
                assert coord.proc is not None and coord.proc.poll() is None, coord.log_tail()
                await asyncio.to_thread(reads_still_answer, coord, 4 + accepted)
                failed_group = make_items(2, f"fill{accepted // 2}", start=10_000 + accepted, tokens=TOKENS)
            # The fault is gone: the refused items were not kept (they are new, not duplicates) ...
            again = await producer.commit("patient", failed_group)
            assert (again.accepted, again.duplicates) == (2, 0)
            after = make_items(2, "after", start=50_000, tokens=64)
            assert (await producer.commit("patient", after)).accepted == 2
            # ... and everything accepted is delivered, each item once.
            keys = await drain(consumer)
            assert len(keys) == len(set(keys)) == 4 + accepted + 2 + 2
            assert {i.key for i in before + failed_group + after} <= set(keys)
        finally:
            await producer.close()
            await consumer.close()

    asyncio.run(scenario())
    coord.stop()
    log = coord.log_tail(10_000)
    assert coord.proc is not None and coord.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_disk_full_fails_commits_loudly_keeps_reads_and_recovers(tmp_path):
    with small_disk(tmp_path / "disk", 8) as disk:
        coord = CoordinatorProcess(disk / "coordinator").start()
        try:
            # The ballast goes in after start: the disk fills up under a running service.
            ballast: list[Path] = []

            @contextlib.contextmanager
            def full() -> Iterator[None]:
                ballast.append(fill(disk))
                try:
                    yield
                finally:
                    ballast.pop().unlink()  # space returns

            run_fault(coord, full(), 507, "full")
        finally:
            coord.stop()


@pytest.mark.parametrize(
    ("error", "status", "words"),
    [
        ("ENOSPC", 507, "full"),  # the disk full, where no tmpfs can be mounted
        # A read-only disk: 503, retried until the commit deadline (an operator may fix it in time).
        ("EROFS", 503, "I/O"),
    ],
    ids=["full", "read-only"],
)
def test_injected_disk_errors_fail_commits_loudly_keep_reads_and_recover(tmp_path, error, status, words):
    coord = CoordinatorProcess(tmp_path / "coordinator").start()
    try:
        assert coord.proc is not None
        run_fault(coord, failing_file_writes(coord.proc.pid, error), status, words)
    finally:
        coord.stop()
