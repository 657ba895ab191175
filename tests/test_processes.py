"""`mrlx_plugin.core.processes`, the one way to start and stop a process: a stop sends SIGTERM
first and SIGKILL only after its deadline, a group stop takes the children along, and a process
started (sync or async) dies with its starter, even when the starter is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mrlx_plugin.core import processes
from mrlx_plugin.core.retry import wait_until

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie has exited; only its entry is left)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text.rsplit(")", 1)[1].split()[0] != "Z"


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_stop_sends_sigterm_first(tmp_path):
    said = tmp_path / "said"
    code = (
        "import signal, sys, time\n"
        f"def term(*_):\n    open({str(said)!r}, 'w').write('TERM'); sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        f"open({str(said)!r}, 'w').write('ready')\n"
        "while True:\n    time.sleep(1)\n"
    )
    proc = processes.start(python(code))
    try:
        wait_until(lambda: said.exists() and said.read_text() == "ready", 30, what="the child to be ready")
        assert processes.stop(proc, timeout=30) == 3
        assert said.read_text() == "TERM"
    finally:
        processes.stop(proc, timeout=0)


def test_stop_kills_a_process_that_outlives_its_deadline(tmp_path):
    ready = tmp_path / "ready"
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "while True:\n    time.sleep(1)\n"
    )
    proc = processes.start(python(code))
    try:
        wait_until(ready.exists, 30, what="the child to ignore SIGTERM")
        assert processes.stop(proc, timeout=0.5) == -signal.SIGKILL
    finally:
        processes.stop(proc, timeout=0)


@linux_only
def test_a_group_stop_takes_the_childs_own_children(tmp_path):
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "while True:\n    time.sleep(1)\n"
    )
    proc = processes.start(python(code), start_new_session=True)
    grandchild = None
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text(), 30, what="the grandchild's pid")
        grandchild = int(pid_file.read_text())
        assert alive(grandchild)
        processes.stop(proc, timeout=30, group=True)
        wait_until(lambda: not alive(grandchild), 30, what="the grandchild to exit")
    finally:
        processes.stop(proc, timeout=0, group=True)
        if grandchild is not None and alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


@linux_only
def test_a_sigkilled_starter_takes_what_it_started_with_it(tmp_path):
    """One child started with `start`, one with `start_async` (from an event loop on the main
    thread, as the grading worker is); the starter is SIGKILLed, so no code of its own runs."""
    pids = tmp_path / "pids"
    starter_code = (
        "import asyncio, signal, sys\n"
        "from mrlx_plugin.core import processes\n"
        "sleeper = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
        "sync_child = processes.start(sleeper)\n"
        "async def main():\n"
        "    return await processes.start_async(sleeper)\n"
        "async_child = asyncio.run(main())\n"
        f"open({str(pids)!r}, 'w').write(f'{{sync_child.pid}} {{async_child.pid}}')\n"
        "while True:\n    signal.pause()\n"
    )
    # Plain Popen: the starter itself must not be tied to this test, which kills it.
    starter = subprocess.Popen(python(starter_code))
    children: list[int] = []
    try:
        wait_until(lambda: pids.exists() and pids.read_text(), 60, what="the starter's children")
        children = [int(p) for p in pids.read_text().split()]
        assert len(children) == 2 and all(alive(p) for p in children)
        starter.kill()
        starter.wait(30)
        wait_until(
            lambda: not any(alive(p) for p in children),
            30,
            what="both children to die with their starter",
            details=lambda: f"alive: {[p for p in children if alive(p)]}",
        )
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait(30)
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
