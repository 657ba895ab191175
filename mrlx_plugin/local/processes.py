"""Starting and stopping the embedded default's processes: engines, router, coordinator.

Used by the CLI (`mrlx rollout --local`, `mrlx demo`), the benchmarks and the tests. Each
service is its own process on 127.0.0.1, started with `--port 0 --port-file F` so it binds a free
port and says which, then polled on its health URL until it answers. This is launcher code that
runs before any event loop; it blocks on purpose.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..netutil import free_port


class ProcessStartError(RuntimeError):
    pass


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


def wait_http_ok(url: str, timeout: float, proc: subprocess.Popen | None = None, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ProcessStartError(f"process exited with code {proc.returncode} before {url} answered")
        try:
            req = urllib.request.Request(url, headers=headers or {})
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise ProcessStartError(f"{url} did not answer within {timeout:.0f}s (last: {last})")


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
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, env=penv, start_new_session=True)
    deadline = time.monotonic() + timeout
    if port is None:
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                proc.kill()
                raise ProcessStartError(f"{name} did not start ({' '.join(full)}):\n{tail}")
            time.sleep(0.05)
        port = int(port_file.read_text().strip())
    url = f"http://127.0.0.1:{port}"
    handle = ManagedProcess(name, full, proc, url, log_path)
    try:
        wait_http_ok(url + health_path, max(1.0, deadline - time.monotonic()), proc)
    except ProcessStartError as exc:
        handle.kill()
        raise ProcessStartError(f"{name}: {exc}\n{handle.log_tail()}") from None
    return handle


def start_engine(model_dir: str | os.PathLike, *, log_dir=None, name: str = "engine", extra: list[str] | None = None,
                 threads: int | None = None) -> ManagedProcess:
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
    from .engine import router_command

    port = free_port()
    argv = router_command("127.0.0.1", port, worker_urls)
    return start_service(name, argv, log_dir=log_dir, port=port, health_path="/health", timeout=60)


def start_coordinator(db: str | os.PathLike, run_id: str, agents: list[str], *, log_dir=None,
                      token_env: str = "MRLX_TOKEN", name: str = "coordinator", extra: list[str] | None = None,
                      env: dict[str, str] | None = None) -> ManagedProcess:
    """`mrlx coordinator` on 127.0.0.1 with its database at `db` (the token from `token_env`)."""
    argv = [sys.executable, "-m", "mrlx_plugin.coordinator.server", "--db", str(db), "--run-id", run_id,
            "--agents", ",".join(agents), "--token-env", token_env] + list(extra or [])
    return start_service(name, argv, log_dir=log_dir, env=env)
