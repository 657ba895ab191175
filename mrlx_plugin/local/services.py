"""Starting the embedded default's services: engines, router, coordinator, each its own process.

Used by the CLI (`mrlx rollout --local`), the demos, the benchmarks and the tests. Each
service is its own process on 127.0.0.1, started with `--port 0 --port-file F` so it binds a free
port and says which, then polled on its health URL until it answers. This is launcher code that
runs before any event loop; it blocks on purpose.

Processes are started and stopped the one way, `mrlx_plugin.core.processes` (`start`, `stop`,
`stop_all`): each is tied to its starter, so the kernel ends it when the starter dies however it
dies, and a clean stop sends SIGTERM first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from mrlx_plugin.core.netutil import free_port
from mrlx_plugin.core.processes import start, stop
from mrlx_plugin.core.retry import Deadline, wait_until


class ProcessStartError(RuntimeError):
    pass


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    proc: subprocess.Popen
    url: str
    log_path: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds (`core.processes.stop`)."""
        stop(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL at once (fault tests)."""
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
        proc = start(full, stdout=log, stderr=subprocess.STDOUT, env=penv, start_new_session=True)
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


def router_available() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


def start_router(worker_urls: list[str], *, log_dir=None, name: str = "router") -> ManagedProcess:
    """The real sglang-router in front of `worker_urls` (requires the sglang-router package)."""
    from mrlx_plugin.local.engine.router import router_command

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
