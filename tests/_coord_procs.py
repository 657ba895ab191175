"""The one way tests start a coordinator: a real `python -m mrlx_plugin.coordinator.server` on
127.0.0.1, started on a free port (or the previous one, to come back on the same address after a
kill), with its database and log in the test's directory (`CoordinatorProcess`; the `coordinator`
fixture of conftest.py starts them and stops them after the test). Tests that need a special start
(a shim before the server, other flags) subclass it or pass `extra`. Also a raw HTTP helper for
requests the client would never send (signed with the token as the client signs, see
mrlx_plugin.link.auth), and a factory of queue items."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from mrlx_plugin.core import processes
from mrlx_plugin.core.retry import wait_until
from mrlx_plugin.link.auth import request_target, signed_headers
from mrlx_plugin.link.client import CoordinatorClient
from mrlx_plugin.link.wire import QueueItem

REPO = Path(__file__).resolve().parent.parent
TOKEN_ENV = "MRLX_TEST_COORDINATOR_TOKEN"


class CoordinatorProcess:
    """One coordinator of run `run_id` serving `agents`, its database in `workdir`."""

    def __init__(
        self,
        workdir: Path,
        *,
        run_id: str = "run1",
        agents: Sequence[str] = ("doctor", "patient"),
        token: str | None = "test-token",
        extra: Sequence[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.db = self.workdir / "coordinator.sqlite"
        self.run_id = run_id
        self.agents = list(agents)
        self.token = token
        self.extra = list(extra)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process talking to this coordinator needs in its environment (the token, under
        TOKEN_ENV: the name a config's `coordinator.token_env` gives)."""
        return {} if self.token is None else {TOKEN_ENV: self.token}

    def argv(self, port: int, port_file: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "mrlx_plugin.coordinator.server",
            "--db",
            str(self.db),
            "--run-id",
            self.run_id,
            "--agents",
            ",".join(self.agents),
            "--port",
            str(port),
            "--port-file",
            str(port_file),
            "--token-env",
            TOKEN_ENV,
            *self.extra,
        ]

    def start(self, *, same_port: bool = False, timeout: float = 30.0) -> CoordinatorProcess:
        """Start (again); with `same_port` on the port of the previous start."""
        port_file = self.workdir / "port"
        port_file.unlink(missing_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.pop(TOKEN_ENV, None)
        if self.token is not None:
            env[TOKEN_ENV] = self.token
        self.starts += 1
        log = open(self.workdir / f"coordinator-{self.starts}.log", "wb")  # noqa: SIM115 (the child keeps it)
        # Tied to this process: a test run killed halfway leaves no coordinator behind.
        self.proc = processes.start(
            self.argv(self.port if same_port else 0, port_file),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        log.close()
        proc = self.proc

        def listening() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the coordinator did not start (exit code {proc.returncode}):\n{self.log_tail()}"
                )
            return bool(port_file.exists() and port_file.read_text().strip())

        try:
            wait_until(
                listening,
                timeout,
                every=0.02,
                what=f"the coordinator in {self.workdir} to listen",
                details=self.log_tail,
            )
        except BaseException:
            self.kill()
            raise
        self.port = int(port_file.read_text())
        return self

    def kill(self) -> None:
        """SIGKILL (no shutdown code runs)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            processes.stop(self.proc, timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        path = self.workdir / f"coordinator-{self.starts}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def http(
        self,
        method: str,
        path: str,
        body: bytes | dict[str, Any] | None = None,
        *,
        token: str | None = "default",
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """A raw request (token "default": signed with this coordinator's token; None: not signed)."""
        return http(
            method, self.url + path, body, token=self.token if token == "default" else token, headers=headers
        )


def http(
    method: str,
    url: str,
    body: bytes | dict[str, Any] | None = None,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request, signed with `token` unless it is None (`headers`
    given override the signature's); HTTP errors are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    signature = {} if token is None else signed_headers(token, method, request_target(url), data)
    request = urllib.request.Request(url, data=data, method=method, headers={**signature, **(headers or {})})
    if isinstance(body, dict):
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def waits_in_progress(coord: CoordinatorProcess, kind: str) -> float:
    """Long polls of `kind` ("version", "lease") the coordinator is holding now (its /metrics)."""
    text = coord.http("GET", "/metrics")[2].decode()
    prefix = f'mrlx_coordinator_waits_in_progress{{kind="{kind}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]


def make_items(
    n: int,
    group: str,
    group_size: int | None = None,
    *,
    producer: str = "doctor",
    consumer: str = "patient",
    step: int = 0,
    start: int = 0,
    tokens: int = 48,
    seed: int = 0,
) -> list[QueueItem]:
    """`n` items of `group` (keys ep{start}..), random ids up to 2**31-1, 0/1 masks, float64 log-probs."""
    rng = np.random.default_rng(seed + start)
    items = []
    for i in range(start, start + n):
        response = tokens // 2 + i % 3
        items.append(
            QueueItem(
                key=f"ep{i}:{consumer}",
                group=group,
                group_size=group_size if group_size is not None else n,
                producer=producer,
                step=step,
                tokens=rng.integers(0, 2**31 - 1, tokens + i % 3, dtype=np.int64).tolist(),
                response_length=response,
                loss_mask=rng.integers(0, 2, response).tolist(),
                rollout_log_probs=(-rng.random(response) * 7).tolist(),
                fields={
                    "reward": float(i) / 2,
                    "status": "completed",
                    "weight_versions": [str(step), str(step + 1)],
                    "group_index": i // 4,
                    "index": i,
                    "rollout_id": step,
                    "prompt": [{"role": "user", "content": f"question {i} \u00e9\u4e2d"}],
                    "response": f"answer {i}",
                    "label": "42",
                    "metadata": {"episode": i, "nested": {"turns": [1, 2]}},
                },
            )
        )
    return items


def attempts_of(c: CoordinatorClient) -> Callable[[], int]:
    """How many HTTP requests `c` has started so far (each attempt of a call takes the session
    once): to wait until a call has really met a dead coordinator."""
    count = 0
    session = c._session

    def counted() -> aiohttp.ClientSession:
        nonlocal count
        count += 1
        return session()

    c._session = counted  # type: ignore[method-assign]
    return lambda: count
