"""The coordinator against local users and hostile connections: who can read its files, how many
connections it holds, how long it waits for a header, and what a declared body size costs it.

- its database files (the SQLite file, its -wal and -shm) are owner-only, whatever the umask, and
  files found with looser modes are tightened, with a line in its log saying so;
- ~1,100 unauthenticated idle TCP connections against a coordinator whose file-descriptor limit
  is 1,024 do not starve it: /health and authorised calls are still answered;
- a request header trickled one byte at a time is cut off after the idle (header) timeout, and so
  is a kept-alive connection that sends nothing more;
- a commit that declares a huge body and sends 4 bytes costs memory for the 4 bytes, not for the
  declared size.

Real coordinator processes on 127.0.0.1, real sockets; every wait polls a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from _coord_procs import REPO, CoordinatorProcess, make_items

from mrlx_lab.procstat import memory_mib
from mrlx_plugin.core.retry import wait_until
from mrlx_plugin.link.auth import signed_headers
from mrlx_plugin.link.wire import CONTENT_TYPE, encode_items

IDLE_CONNECTIONS = 1100
COORDINATOR_NOFILE = 1024


class LimitedCoordinator(CoordinatorProcess):
    """A coordinator started through a small shim that first sets its umask and, when given, its
    RLIMIT_NOFILE (soft and hard, so that it cannot raise it), then execs the usual command."""

    def __init__(self, workdir: Path, *, nofile: int | None = None, umask: int = 0o022, **kwargs) -> None:
        super().__init__(workdir, **kwargs)
        self.nofile = nofile
        self.umask = umask

    def argv(self, port: int, port_file: Path) -> list[str]:
        inner = super().argv(port, port_file)
        limit = (
            ""
            if self.nofile is None
            else (f"resource.setrlimit(resource.RLIMIT_NOFILE, ({self.nofile}, {self.nofile})); ")
        )
        shim = f"import os, resource, sys; os.umask({self.umask}); {limit}os.execv(sys.argv[1], sys.argv[1:])"
        return [sys.executable, "-c", shim, *inner]


def log_text(coord: CoordinatorProcess) -> str:
    return (coord.workdir / f"coordinator-{coord.starts}.log").read_text(errors="replace")


def modes(db: Path) -> dict[str, int]:
    """Permission bits of the database and its -wal and -shm, for those that exist."""
    out = {}
    for suffix in ("", "-wal", "-shm"):
        path = Path(str(db) + suffix)
        if path.exists():
            out[path.name] = stat.S_IMODE(path.stat().st_mode)
    return out


def commit(coord: CoordinatorProcess, group: str, n: int = 2, start: int = 0) -> None:
    frame = encode_items(make_items(n, group, start=start))
    status, _, body = coord.http(
        "POST",
        f"/v1/runs/{coord.run_id}/queues/patient/commit",
        frame,
        headers={"Content-Type": CONTENT_TYPE},
    )
    assert status == 200, body


# --------------------------------------------------------------------------- 8: file modes


def test_database_files_are_created_owner_only(tmp_path):
    coord = LimitedCoordinator(tmp_path, umask=0o022).start()
    try:
        commit(coord, "g0")  # the -wal and -shm exist while the coordinator holds the file open
        found = modes(coord.db)
        assert {"coordinator.sqlite", "coordinator.sqlite-wal", "coordinator.sqlite-shm"} <= set(found), found
        loose = {name: oct(mode) for name, mode in found.items() if mode & 0o077}
        assert not loose, f"readable or writable by others: {loose}"
    finally:
        coord.stop()


def test_database_files_found_with_loose_modes_are_tightened_and_logged(tmp_path):
    coord = LimitedCoordinator(tmp_path, umask=0o022).start()
    commit(coord, "g0")
    coord.kill()  # SIGKILL: the -wal and -shm stay behind, as after a crash
    for suffix in ("", "-wal", "-shm"):
        path = Path(str(coord.db) + suffix)
        assert path.exists(), f"{path.name} is gone after the kill"
        os.chmod(path, 0o644 if suffix != "-shm" else 0o666)
    coord.start()
    try:
        loose = {name: oct(mode) for name, mode in modes(coord.db).items() if mode & 0o077}
        assert not loose, f"still readable or writable by others after a restart: {loose}"
        text = log_text(coord)
        for name in ("coordinator.sqlite", "coordinator.sqlite-wal", "coordinator.sqlite-shm"):
            assert any(f"/{name} " in line for line in text.splitlines() if "owner-only" in line), (
                f"no log line says {name} was made owner-only:\n{text}"
            )
        status, _, body = coord.http("GET", f"/v1/runs/{coord.run_id}/queues/patient")
        assert status == 200 and json.loads(body)["queued_items"] == 2, body  # the data survived
    finally:
        coord.stop()


def test_coordinator_help_says_the_database_is_owner_only():
    done = subprocess.run(
        [sys.executable, "-m", "mrlx_plugin.cli", "coordinator", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "owner-only" in text and "0600" in text, text


# --------------------------------------------------------------------------- 9: connections


@contextlib.contextmanager
def own_nofile_at_least(n: int) -> Iterator[None]:
    """Raise this process's soft RLIMIT_NOFILE to at least `n` while inside (skip if the hard limit
    is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"this test opens {n} sockets; the hard RLIMIT_NOFILE is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_idle_connections(port: int, n: int, deadline_s: float = 120.0) -> list[socket.socket]:
    """`n` TCP connections to the port that never send a byte."""
    socks: list[socket.socket] = []
    deadline = time.monotonic() + deadline_s
    try:
        for _ in range(n):
            assert time.monotonic() < deadline, (
                f"opened only {len(socks)} of {n} connections in {deadline_s:g} s"
            )
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def answered(coord: CoordinatorProcess, method: str, path: str, **kwargs) -> tuple[int, bytes] | None:
    """(status, body) of one request, or None if it could not be made or timed out."""
    try:
        status, _, body = coord.http(method, path, **kwargs)
    except OSError:
        return None
    return status, body


@pytest.mark.slow
def test_idle_connections_past_the_fd_limit_do_not_starve_the_coordinator(tmp_path):
    with own_nofile_at_least(IDLE_CONNECTIONS + 300):
        coord = LimitedCoordinator(tmp_path, nofile=COORDINATOR_NOFILE).start()
        socks: list[socket.socket] = []
        try:
            socks = open_idle_connections(coord.port, IDLE_CONNECTIONS)
            health = wait_until(
                lambda: answered(coord, "GET", "/health"),
                deadline=90,
                what="an answer to /health with 1,100 idle connections open",
                details=lambda: coord.log_tail(),
            )
            assert health[0] == 200, health
            run = wait_until(
                lambda: answered(coord, "GET", f"/v1/runs/{coord.run_id}"),
                deadline=90,
                what="an answer to an authorised call with 1,100 idle connections open",
                details=lambda: coord.log_tail(),
            )
            assert run[0] == 200 and json.loads(run[1])["run_id"] == coord.run_id, run
            commit(coord, "under-load")
            assert coord.proc is not None and coord.proc.poll() is None, coord.log_tail()
            text = log_text(coord)
            assert "Too many open files" not in text and "Errno 24" not in text, text[-3000:]
        finally:
            for sock in socks:
                sock.close()
            coord.stop()


def closed_by_peer(sock: socket.socket, wait_s: float) -> bytes | None:
    """What the peer sent before closing, if it closed within `wait_s`; None if still open."""
    got = b""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            return None
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return got
        if not data:
            return got
        got += data


@pytest.mark.slow
def test_a_trickled_header_is_cut_off_after_the_idle_timeout(tmp_path):
    coord = LimitedCoordinator(tmp_path, extra=["--idle-timeout-s", "2"]).start()
    try:
        header = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
        with socket.create_connection(("127.0.0.1", coord.port), timeout=30) as sock:
            sent, answer = 0, None
            deadline = time.monotonic() + 120  # one byte per 0.5 s would take about 2 minutes
            while sent < len(header) - 4 and time.monotonic() < deadline:
                try:
                    sock.sendall(header[sent : sent + 1])
                except (BrokenPipeError, ConnectionResetError):
                    answer = b""
                    break
                sent += 1
                answer = closed_by_peer(sock, 0.5)
                if answer is not None:
                    break
            assert answer is not None, f"the coordinator still holds a header trickled for {sent} bytes"
            assert answer == b"", f"an unfinished header got an answer: {answer[:200]!r}"
            assert sent < len(header) - 4
        # a kept-alive connection that sends nothing after its answer is closed too
        with socket.create_connection(("127.0.0.1", coord.port), timeout=30) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            got = b""
            while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, f"closed before the answer: {got!r}"
                got += chunk
            assert got.startswith(b"HTTP/1.1 200"), got
            assert closed_by_peer(sock, 60) == b"", "an idle kept-alive connection was not closed"
        status, _, _ = coord.http("GET", "/health")
        assert status == 200
    finally:
        coord.stop()


# --------------------------------------------------------------------------- 10: declared sizes


def hanging_commit(coord: CoordinatorProcess, declared: int, pid: int) -> socket.socket:
    """A commit that declares `declared` body bytes, sends 4, and keeps the connection open."""
    sock = socket.create_connection(("127.0.0.1", coord.port), timeout=30)
    path = f"/v1/runs/{coord.run_id}/queues/patient/commit"
    assert coord.token is not None
    # signed for a body it never sends: the signature is checked before the body is read
    signed = signed_headers(coord.token, "POST", path, b"MRLX")
    signature = "".join(f"{k}: {v}\r\n" for k, v in signed.items())
    head = (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: 127.0.0.1\r\n{signature}"
        f"Content-Type: {CONTENT_TYPE}\r\nContent-Length: {declared}\r\n"
        f"X-Mrlx-Agent: doctor\r\nX-Mrlx-Pid: {pid}\r\n\r\n"
    ).encode()
    sock.sendall(head + b"MRLX")
    return sock


def last_pid_seen(coord: CoordinatorProcess, agent: str) -> int | None:
    status, _, body = coord.http("GET", f"/v1/runs/{coord.run_id}/agents/{agent}/version")
    assert status == 200, body
    return json.loads(body)["pid"]


def test_declared_body_sizes_cost_no_memory_until_the_bytes_arrive(tmp_path):
    coord = LimitedCoordinator(tmp_path).start()
    socks: Sequence[socket.socket] = []
    try:
        assert coord.proc is not None
        commit(coord, "warm-up")
        before, _ = memory_mib(coord.proc.pid)
        socks = []
        for pid in (900001, 900002):  # two commits declaring 400 MB each
            socks.append(hanging_commit(coord, 400_000_000, pid))
            # the identity header is recorded just before the handler reads the body
            wait_until(
                lambda pid=pid: last_pid_seen(coord, "doctor") == pid,
                deadline=60,
                what=f"the coordinator to start reading commit {pid}",
            )
        assert coord.http("GET", "/health")[0] == 200
        after, _ = memory_mib(coord.proc.pid)
        assert after - before < 64, (
            f"RSS went from {before:.0f} to {after:.0f} MiB for two commits that sent 4 bytes each"
        )
    finally:
        for sock in socks:
            sock.close()
        if coord.proc is not None and coord.proc.poll() is None:
            assert coord.http("GET", "/health")[0] == 200, coord.log_tail()
        coord.stop()
