"""Running an agent harness you did not write (a CLI: Claude Code, Codex, an Agents SDK script)
once per episode, pointed at an agent's endpoint: `run_harness` starts it in a folder of its own,
waits for it under a deadline, and ends it, its child processes with it, when the deadline passes
or the episode is cancelled; `claude_code_env` and `codex_home` are the settings each CLI needs
(docs/harnesses.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mrlx_plugin.agents.system import Endpoint

# What a harness may print before its output is cut (its JSON result is far smaller; a runaway
# tool printing gigabytes must not fill the rollout process's memory).
MAX_OUTPUT_BYTES = 8 * 1024 * 1024
_GRACE_S = 5.0  # after SIGTERM, before SIGKILL
_OUTPUT_GRACE_S = 1.0  # after the harness exited, for the end of its output


@dataclass(frozen=True)
class HarnessResult:
    returncode: int | None  # None: it was ended at the deadline
    stdout: str
    stderr: str
    timed_out: bool


async def run_harness(
    argv: Sequence[str],
    *,
    cwd: str | os.PathLike[str],
    env: Mapping[str, str],
    timeout_s: float,
    max_output_bytes: int = MAX_OUTPUT_BYTES,
) -> HarnessResult:
    """Run `argv` in `cwd` with exactly `env` (plus PATH from this process when `env` has none) and
    return what it printed. It runs in a process group of its own, which is ended however the run
    ends: at the deadline, or when the caller is cancelled (the episode ended), the group gets
    SIGTERM, then SIGKILL after a grace period; when the harness exits by itself, whatever it left
    running in its group (a server a tool started) gets SIGKILL. A cancellation is re-raised."""
    full = dict(env)
    full.setdefault("PATH", os.environ.get("PATH", "/usr/bin:/bin"))
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=str(cwd),
        env=full,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()  # kept whatever happens to the tasks that fill them
    reads = asyncio.gather(
        _read(proc.stdout, out, max_output_bytes), _read(proc.stderr, err, max_output_bytes)
    )
    timed_out = False
    try:
        try:
            await asyncio.wait_for(_exited(proc), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await _end(proc)
        else:  # its output's end, unless something it left running holds the pipes
            await asyncio.wait({reads}, timeout=_OUTPUT_GRACE_S)
    finally:  # however it ended: nothing of its group is left running, no read left pending
        _kill_group(proc, signal.SIGKILL)
        reads.cancel()
        await asyncio.gather(reads, return_exceptions=True)
        await asyncio.shield(proc.wait())  # reaped (at once, after SIGKILL)
    return HarnessResult(
        None if timed_out else proc.returncode,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        timed_out,
    )


async def _read(stream: asyncio.StreamReader, kept: bytearray, cap: int) -> None:
    """All of `stream`, keeping at most `cap` bytes in `kept` (the rest is read and dropped, so
    the harness never blocks on a full pipe)."""
    while chunk := await stream.read(65536):
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Return once the harness's own process has exited. Not `proc.wait()`, which also waits for
    its pipes to close: a process it left running (holding them) would make it wait forever."""
    if proc.returncode is not None:
        return
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:  # exited, and reaped already
        return
    except (AttributeError, OSError):  # no pidfd here (not Linux 5.3+)
        await proc.wait()
        return
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
    try:
        await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def _kill_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def _end(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM to the harness's process group; SIGKILL to the group after the grace period
    (the caller's `finally` sends it in any case)."""
    _kill_group(proc, signal.SIGTERM)
    try:
        await asyncio.wait_for(_exited(proc), _GRACE_S)
    except asyncio.TimeoutError:
        pass


def claude_code_env(endpoint: Endpoint, home: str | os.PathLike[str]) -> dict[str, str]:
    """The environment that points Claude Code at `endpoint` (its Messages API) from a fresh
    `home`, with its traffic to anything else turned off."""
    return {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": endpoint.base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": endpoint.api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_GROWTHBOOK": "1",
        "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
    }


def codex_home(
    endpoint: Endpoint,
    home: str | os.PathLike[str],
    model: str = "mrlx-agent",
    sandbox_mode: str = "workspace-write",
) -> dict[str, str]:
    """Write a Codex `config.toml` under `home` naming `endpoint` as its only model provider (the
    Responses API, the key from the environment, no retries of its own: a refusal here does not
    pass), with nothing else reached (no web search: the endpoint serves no hosted tools; no update
    checks, analytics or feedback) and no approvals asked; return the environment that uses it.
    `sandbox_mode` is Codex's (`workspace-write` needs its bubblewrap sandbox to run where the
    rollout runs; `danger-full-access` runs commands unconfined, in the harness's folder)."""
    folder = Path(home) / ".codex"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "mrlx"\n'
        'approval_policy = "never"\n'
        f'sandbox_mode = "{sandbox_mode}"\n'
        'web_search = "disabled"\n'
        "check_for_update_on_startup = false\n"
        "\n[analytics]\nenabled = false\n"
        "\n[feedback]\nenabled = false\n"
        "\n[model_providers.mrlx]\n"
        'name = "mrlx"\n'
        f'base_url = "{endpoint.base_url}"\n'
        'env_key = "MRLX_API_KEY"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )
    return {"HOME": str(home), "CODEX_HOME": str(folder), "MRLX_API_KEY": endpoint.api_key}
