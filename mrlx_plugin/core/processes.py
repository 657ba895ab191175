"""Starting and stopping a child program: the one way the package, its benchmarks and its tests
do it (a benchmark's helper that is a forked Python function uses `multiprocessing` instead).

`start` is `subprocess.Popen` for a process that must not outlive its starter, `start_async` the
same for an asyncio subprocess (the math-verify grading worker), and `stop` / `stop_all` end
processes: SIGTERM, a deadline to exit, then SIGKILL for any still running.

A process started here is tied to its starter: on Linux, a process started from the main thread
is SIGKILLed by the kernel when the starting process dies, however it dies (SIGKILL included;
`prctl(PR_SET_PDEATHSIG)`, set by a small exec wrapper in the child, see `tied`). A clean stop is
still the starter's job (`stop`, `stop_all`), which sends SIGTERM first.

Starting and the synchronous stops block: they are for launchers, benchmarks and tests, which
run before or beside an event loop, never inside rollout code. Inside an event loop use
`start_async` (and the asyncio process's own `kill`/`wait`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable
from typing import Any

from mrlx_plugin.core.retry import Deadline

# Runs in the child, as its own short program, before it execs the real command: ask the kernel
# for SIGKILL when the parent dies (PR_SET_PDEATHSIG = 1), then make sure the parent did not die
# before that request (the child would have been reparented already). A separate program and not
# `preexec_fn`: the starter has threads (torch's, tqdm's), and Python code between fork and exec
# in a threaded process can deadlock. The setting survives exec (not for set-uid programs).
_TIE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def tied(argv: list[str]) -> list[str]:
    """`argv` wrapped so that the kernel SIGKILLs the process when this process dies.

    Linux only, and only from the main thread: the kernel ties the child to the *thread* that
    started it, and a worker thread may end long before the process does. Elsewhere `argv` is
    returned as it is (the starter's own stop on exit still applies)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _TIE, str(os.getpid()), *argv]


def start(argv: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(argv, **popen_kwargs)` for a process that must not outlive this one (`tied`)."""
    return subprocess.Popen(tied(argv), **popen_kwargs)


async def start_async(argv: list[str], **kwargs: Any) -> asyncio.subprocess.Process:
    """`asyncio.create_subprocess_exec(*argv, **kwargs)` for a process that must not outlive this
    one (`tied`: from an event loop on the main thread; on another thread it is not tied, and the
    starter's own stop applies)."""
    return await asyncio.create_subprocess_exec(*tied(argv), **kwargs)


def _signal(proc: subprocess.Popen, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


def stop_all(procs: Iterable[subprocess.Popen], timeout: float = 10.0, *, group: bool = False) -> None:
    """Stop several processes at once: SIGTERM to each, one shared `timeout` for all of them to
    exit, then SIGKILL to any still running. `group`: signal each one's whole process group (for
    processes started with `start_new_session=True`, whose own children go with them)."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGTERM, group)
    deadline = Deadline(timeout)
    for p in procs:
        try:
            p.wait(deadline.remaining())
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL, group)
            p.wait(timeout)


def stop(proc: subprocess.Popen, timeout: float = 10.0, *, group: bool = False) -> int:
    """SIGTERM, up to `timeout` seconds to exit, then SIGKILL; the exit code (as `Popen.wait`)."""
    stop_all([proc], timeout, group=group)
    return proc.returncode
