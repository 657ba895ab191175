"""Commands that start processes leave none behind: on SIGTERM, SIGINT, SIGHUP, SIGKILL and on
their own crash.

Every process a command starts inherits the environment, so each test marks the command's
environment with a fresh value and, at the end, looks through /proc for any live process still
carrying it (children, and their children, wherever they were reparented to).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from _demo import SHORT

from mrlx_plugin.core.retry import wait_until

REPO = Path(__file__).resolve().parent.parent
MARK = "MRLX_TEST_TEARDOWN_MARK"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# Start the command with SIGINT and SIGHUP at their defaults, whatever this test process inherited
# (a shell's background job starts with SIGINT ignored, and an ignored signal stays ignored
# across exec).
EXEC_WITH_DEFAULT_SIGNALS = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()
    return rest[0], int(rest[1]), int(rest[19])


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live process below `root`."""
    children: dict[int, list[int]] = {}
    start: dict[int, int] = {}
    for pid in _pids():
        st = _stat(pid)
        if st is not None and st[0] != "Z":
            children.setdefault(st[1], []).append(pid)
            start[pid] = st[2]
    found: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = start[pid]
        todo.extend(children.get(pid, []))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def marked(mark: str) -> dict[int, str]:
    """Live processes (zombies are dead) whose environment carries `mark`: pid -> command line."""
    needle = f"{MARK}={mark}".encode()
    found = {}
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        st = _stat(pid)
        if needle in env.split(b"\0") and st is not None and st[0] != "Z":
            found[pid] = cmdline(pid)
    return found


def start(argv: list[str], log: Path, mark: str, cwd: Path = REPO) -> subprocess.Popen:
    """Run `python ARGV` in `cwd` (`mrlx rollout --local` keeps its logs and port files under
    ./runs/logs: each test gets its own), the repository importable (the example hook modules).

    Plain `subprocess.Popen`, not `mrlx_plugin.core.processes.start`: these tests watch what a
    command does on its own when signalled, so it starts as a shell would start it, without the
    death signal that `start` would add to the process under test."""
    env = dict(os.environ, **{MARK: mark})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-c", EXEC_WITH_DEFAULT_SIGNALS, sys.executable, *argv],
            cwd=cwd,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )


def alive(pid: int, started: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z" and st[2] == started


def left(mark: str, seen: dict[int, int]) -> dict[int, str]:
    """What still runs of the command's processes: those seen below it (a process that rewrites
    its command line, as sglang-router does, also loses its environment), and those marked."""
    found = marked(mark)
    found.update({pid: cmdline(pid) for pid, started in seen.items() if alive(pid, started)})
    return found


def assert_nothing_left(mark: str, seen: dict[int, int], timeout: float = 90.0) -> None:
    wait_until(
        lambda: not left(mark, seen),
        timeout,
        every=0.2,
        what="every process the command started to exit",
        details=lambda: (
            "still running:\n" + "\n".join(f"  {p}: {c[:200]}" for p, c in left(mark, seen).items())
        ),
    )


def kill_left(mark: str, seen: dict[int, int]) -> None:
    """Never leave a process of a failed test running."""
    for pid in left(mark, seen):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


DEMO = ["-m", "mrlx_plugin.cli", "demo", *SHORT, "--steps", "100"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL],
    ids=lambda s: signal.Signals(s).name,
)
def test_a_signalled_demo_leaves_no_process_behind(tmp_path, sig):
    mark = uuid.uuid4().hex
    log = tmp_path / "demo.log"
    demo = start([*DEMO, "--out", str(tmp_path / "demo")], log, mark)
    seen: dict[int, int] = {}
    try:

        def trainers_running() -> dict[int, int]:
            if demo.poll() is not None:
                raise AssertionError(f"the demo exited ({demo.returncode}) early:\n{log.read_text()[-3000:]}")
            tree = descendants(demo.pid)
            return tree if sum("mrlx_plugin.local.trainer" in cmdline(p) for p in tree) == 2 else {}

        tree = wait_until(trainers_running, 300, every=0.2, what="both trainers of the demo to start")
        commands = [cmdline(p) for p in tree]
        for service in ("mrlx_plugin.coordinator.server", "mrlx_plugin.local.engine"):
            assert any(service in c for c in commands), commands
        seen.update(tree)

        os.kill(demo.pid, sig)
        code = demo.wait(120)
        assert_nothing_left(mark, seen)
        if sig == signal.SIGKILL:
            assert code == -signal.SIGKILL
        else:  # it stopped its processes itself and says so
            assert code == 128 + sig, log.read_text()[-3000:]
            assert f"stopped by {signal.Signals(sig).name}" in log.read_text()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        kill_left(mark, seen)


@pytest.mark.slow
def test_a_signalled_rollout_stops_its_engine(tmp_path, tiny_model_dir):
    """`mrlx rollout --local` on SIGTERM while its episodes run: the engine (and router) go too."""
    mark = uuid.uuid4().hex
    log = tmp_path / "rollout.log"
    proc = start(
        [
            "-m",
            "mrlx_plugin.cli",
            "rollout",
            "--local",
            "--config",
            str(REPO / "examples" / "multi_agent" / "local.yaml"),
            "--model-dir",
            str(tiny_model_dir),
            "--rollout-batch-size",
            "64",
            "--n-samples-per-prompt",
            "8",
            "--rollout-max-response-len",
            "64",
            "--output",
            str(tmp_path / "samples.jsonl"),
        ],
        log,
        mark,
        cwd=tmp_path,
    )
    seen: dict[int, int] = {}
    try:

        def engine_up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(
                    f"mrlx rollout exited ({proc.returncode}) early:\n{log.read_text()[-3000:]}"
                )
            seen.update(descendants(proc.pid))
            return "embedded engine at" in log.read_text()

        wait_until(engine_up, 300, every=0.1, what="the embedded engine to answer")
        seen.update(descendants(proc.pid))
        assert any("mrlx_plugin.local.engine" in cmdline(p) for p in seen)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        assert "mrlx rollout: stopped by SIGTERM" in log.read_text()
        assert_nothing_left(mark, seen, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_left(mark, seen)


def test_a_sigkilled_parent_takes_its_services_with_it(tmp_path):
    """Linux ends a service when the process that started it dies, however it dies."""
    mark = uuid.uuid4().hex
    log = tmp_path / "parent.log"
    script = (
        "import signal\n"
        "from mrlx_lab.stub_engine import start_stub_engine\n"
        f"stub = start_stub_engine(log_dir={str(tmp_path)!r})\n"
        "print('started', stub.proc.pid, flush=True)\n"
        "while True:\n    signal.pause()  # until the test SIGKILLs it\n"
    )
    parent = start(["-c", script], log, mark)
    seen: dict[int, int] = {}
    try:
        wait_until(
            lambda: "started" in log.read_text() or parent.poll() is not None, 60, what="the stub engine"
        )
        assert parent.poll() is None, log.read_text()
        seen.update(descendants(parent.pid))
        assert any("mrlx_lab.stub_engine" in cmdline(p) for p in seen)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        assert_nothing_left(mark, seen, timeout=30)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        kill_left(mark, seen)


@pytest.mark.slow
def test_a_crashing_rollout_stops_the_engine_it_started(tmp_path, tiny_model_dir):
    """`mrlx rollout --local` starts its engine (and router) before it reads the config: a bad
    config is its crash after the engine runs."""
    mark = uuid.uuid4().hex
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("mrlx:\n  pipeline: {num_parallel: 'x'}\n")
    log = tmp_path / "rollout.log"
    proc = start(
        [
            "-m",
            "mrlx_plugin.cli",
            "rollout",
            "--local",
            "--config",
            str(cfg),
            "--model-dir",
            str(tiny_model_dir),
            "--rollout-batch-size",
            "1",
            "--quiet",
        ],
        log,
        mark,
        cwd=tmp_path,
    )
    seen: dict[int, int] = {}
    commands: set[str] = set()
    try:

        def finished() -> bool:
            tree = descendants(proc.pid)
            seen.update(tree)
            commands.update(cmdline(p) for p in tree)
            return proc.poll() is not None

        wait_until(finished, 300, every=0.1, what="mrlx rollout to exit")
        assert proc.returncode == 2, log.read_text()[-3000:]
        assert "mrlx.pipeline.num_parallel: got str 'x'; expected an integer" in log.read_text()
        assert any("mrlx_plugin.local.engine" in c for c in commands), (
            "the engine had started before the crash"
        )
        assert_nothing_left(mark, seen, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_left(mark, seen)
