"""Starting and stopping the embedded default's processes: engines, router, coordinator.

Used by the CLI (`mrlx rollout --local`, `mrlx demo`), the benchmarks and the tests. Each
service is its own process on 127.0.0.1, started with `--port 0 --port-file F` so it binds a free
port and says which, then polled on its health URL until it answers. This is launcher code that
runs before any event loop; it blocks on purpose.

Every process started here is tied to its starter: on Linux, a process started from the main
thread is SIGKILLed by the kernel when the starting process dies, however it dies (SIGKILL
included; `prctl(PR_SET_PDEATHSIG)`, set by a small exec wrapper in the child, see `tied`). A
clean stop is still the starter's job (`ManagedProcess.stop`, `stop_all`), which sends SIGTERM
first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrlx_plugin.core.netutil import free_port
from mrlx_plugin.core.retry import Deadline, wait_until


class ProcessStartError(RuntimeError):
    pass


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


def popen_tied(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(argv, **kwargs)` for a process that must not outlive this one (`tied`)."""
    return subprocess.Popen(tied(argv), **kwargs)


def stop_all(procs: Iterable[ManagedProcess | subprocess.Popen], timeout: float = 10.0) -> None:
    """Stop several processes at once: SIGTERM to each, one shared `timeout` for all of them to
    exit, then SIGKILL to any still running."""
    popens = []
    for p in procs:
        if isinstance(p, ManagedProcess):
            p._stopped = True
            p = p.proc
        popens.append(p)
    for p in popens:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = Deadline(timeout)
    for p in popens:
        try:
            p.wait(deadline.remaining())
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout)


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    proc: subprocess.Popen
    url: str
    log_path: Path
    _stopped: bool = field(default=False, repr=False)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        if self._stopped:
            return
        self._stopped = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL at once (fault tests)."""
        self._stopped = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_http_ok(
    url: str, timeout: float, proc: subprocess.Popen | None = None, headers: dict | None = None
) -> None:
    """Block until `url` answers 200 (ProcessStartError after `timeout` s, or at once if `proc` exits)."""
    last = "no answer yet"

    def answers() -> bool:
        nonlocal last
        if proc is not None and proc.poll() is not None:
            raise ProcessStartError(f"process exited with code {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers or {}), timeout=2
            ) as resp:
                if resp.status == 200:
                    return True
                last = f"HTTP {resp.status}"
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            last = str(exc)
        return False

    try:
        wait_until(answers, Deadline(timeout), what=url)
    except TimeoutError:
        raise ProcessStartError(f"{url} did not answer within {timeout:.0f}s (last: {last})") from None


def _start_failure(name: str, argv: list[str], log_path: Path) -> ProcessStartError:
    tail = log_path.read_text(errors="replace")[-3000:]
    return ProcessStartError(f"{name} did not start ({' '.join(argv)}):\n{tail}")


def start_service(
    name: str,
    argv: list[str],
    *,
    log_dir: str | os.PathLike | None = None,
    health_path: str = "/health",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> ManagedProcess:
    """Start `argv` (which must accept --port/--port-file unless `port` is given), wait for health."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="mrlx-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    port_file = log_dir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    full = list(argv) + (["--port", "0", "--port-file", str(port_file)] if port is None else [])
    penv = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    # Its own session: a terminal's Ctrl-C or hang-up reaches the starter, which stops it.
    with open(log_path, "ab") as log:
        proc = popen_tied(full, stdout=log, stderr=subprocess.STDOUT, env=penv, start_new_session=True)
    deadline = Deadline(timeout)  # one for both waits: the port, then the health URL
    try:
        if port is None:

            def port_written() -> bool:
                if proc.poll() is not None:
                    raise _start_failure(name, full, log_path)
                return port_file.exists() and bool(port_file.read_text().strip())

            try:
                wait_until(port_written, deadline, what=f"{name}'s port file {port_file}")
            except TimeoutError:
                raise _start_failure(name, full, log_path) from None
            port = int(port_file.read_text().strip())
        url = f"http://127.0.0.1:{port}"
        handle = ManagedProcess(name, full, proc, url, log_path)
        try:
            wait_http_ok(url + health_path, max(1.0, deadline.remaining()), proc)
        except ProcessStartError as exc:
            raise ProcessStartError(f"{name}: {exc}\n{handle.log_tail()}") from None
    except BaseException:  # a failed start, and also a signal or Ctrl-C while waiting: no handle escapes
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise
    return handle


def start_engine(
    model_dir: str | os.PathLike,
    *,
    log_dir=None,
    name: str = "engine",
    extra: list[str] | None = None,
    threads: int | None = None,
) -> ManagedProcess:
    argv = [sys.executable, "-m", "mrlx_plugin.local.engine", "--model", str(model_dir)]
    if threads:
        argv += ["--threads", str(threads)]
    return start_service(name, argv + list(extra or []), log_dir=log_dir)


def start_stub_engine(*, log_dir=None, name: str = "stub", extra: list[str] | None = None) -> ManagedProcess:
    argv = [sys.executable, "-m", "mrlx_plugin.local.stub_engine"] + list(extra or [])
    return start_service(name, argv, log_dir=log_dir)


def router_available() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


def start_router(worker_urls: list[str], *, log_dir=None, name: str = "router") -> ManagedProcess:
    """The real sglang-router in front of `worker_urls` (requires the sglang-router package)."""
    from mrlx_plugin.local.engine import router_command

    port = free_port()
    argv = router_command("127.0.0.1", port, worker_urls)
    return start_service(name, argv, log_dir=log_dir, port=port, health_path="/health", timeout=60)


def start_coordinator(
    db: str | os.PathLike,
    run_id: str,
    agents: list[str],
    *,
    log_dir=None,
    token_env: str = "MRLX_TOKEN",
    name: str = "coordinator",
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    """`mrlx coordinator` on 127.0.0.1 with its database at `db` (the token from `token_env`)."""
    argv = [
        sys.executable,
        "-m",
        "mrlx_plugin.coordinator.server",
        "--db",
        str(db),
        "--run-id",
        run_id,
        "--agents",
        ",".join(agents),
        "--token-env",
        token_env,
    ] + list(extra or [])
    return start_service(name, argv, log_dir=log_dir, env=env)
