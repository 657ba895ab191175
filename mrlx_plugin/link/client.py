"""The async client of the coordinator, for rollout code running on an event loop.

Nothing here blocks the loop: HTTP goes through aiohttp (one session per event loop, connections
reused: `mrlx_plugin.core.http`), frames are encoded and decoded on a worker thread when they are
large. Calls that fail for a passing reason (the package's one policy, `mrlx_plugin.core.http`:
connection refused while the coordinator restarts, a request that times out, 429 backpressure,
500/502/503/504) are retried with exponential backoff and jitter until the call's
deadline: by default `outage_deadline_s` (minutes), so that a coordinator outage costs waiting, not
the job; while it waits, the client logs what it waits for every few seconds ("coordinator
unreachable for N s"). Errors the caller must fix (401, 404, 409, 413, 422, 507) are raised at once
as `CoordinatorError` with the server's message. Every call names the caller (`X-Mrlx-Agent`,
pid, host), which the coordinator records as a heartbeat.

With the run's token, the token itself is never sent: every attempt is signed, and an answer is
used only once it proves that it comes from a holder of the token (`mrlx_plugin.link.auth`).
An attempt names the coordinator start the client last heard from; after a restart (or at the
client's first call) the coordinator refuses it with its current start, and the client signs it
again at once, whatever its clock (within the allowed skew) says.
Another process answering on the coordinator's address (bound to its port during an outage) learns
no token, and its answers are refused: as a passing failure, retried until the deadline like an
outage, with a message naming the cause; an unproven 401 is raised at once (the token differs).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import TypeVar, cast

import aiohttp
import orjson
from yarl import URL

from mrlx_plugin.core.http import (
    RETRYABLE_STATUS,
    TRANSPORT_ERRORS,
    HttpClient,
    Passing,
    as_passing,
    is_passing,
    read_capped,
    retry_after,
)
from mrlx_plugin.core.netutil import BodyLengthError, read_declared
from mrlx_plugin.core.retry import Backoff, Deadline, RetriesExhausted, retry
from mrlx_plugin.core.values import JSON, JSONObject
from mrlx_plugin.link.auth import (
    BOOT_HEADER,
    NONCE_HEADER,
    PROOF_HEADER,
    Signer,
    content_sha256,
    derive_keys,
    proven,
)
from mrlx_plugin.link.wire import (
    CONTENT_TYPE,
    BufferPool,
    DeadLetter,
    LeasedGroup,
    QueueItem,
    decode_frame,
    encode_items_into,
)

log = logging.getLogger("mrlx.coordinator.client")

OUTAGE_DEADLINE_S = 600.0  # how long a call rides out an unreachable coordinator by default
OUTAGE_LOG_EVERY_S = 5.0
# Frames above this size are encoded/decoded on a worker thread so the loop keeps serving turns.
THREAD_FRAME_BYTES = 256 << 10
# The most bytes of a JSON answer (every answer but a lease's frame) read before its proof is
# checked: the coordinator's JSON answers are a few KiB; an impostor's endless body is cut here.
MAX_JSON_ANSWER_BYTES = 16 << 20
MAX_CONNECTIONS = 32

# A decoded frame: its header and its items.
Frame = tuple[JSONObject, list[QueueItem]]
# (status, headers, body) of an exchange: the body as bytes, or a successful frame answer decoded.
_Answered = tuple[int, Mapping[str, str], "bytes | memoryview | Frame"]
D = TypeVar("D", bound="Sized | None")
R = TypeVar("R")


class CoordinatorError(RuntimeError):
    """The coordinator refused a call, or could not be reached in time; the message says which."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class CoordinatorUnavailable(CoordinatorError):
    """The call kept failing for passing reasons (unreachable, backpressure) until its deadline."""


class CoordinatorWaitTimeout(CoordinatorError):
    """`wait_version` reached its deadline; the message names the agent, its version and last seen."""


@dataclass
class CommitResult:
    accepted: int
    duplicates: int
    duplicate_keys: list[str] = field(default_factory=list)
    stale: int = 0  # new items of steps the consumer acknowledged through: kept by key, never delivered


@dataclass
class Lease:
    """Groups handed out under `lease_id` (ack it once trained), or none: then `end` says the
    producer ended the queue and it is empty, and `message` says why nothing came (who was waited for)."""

    lease_id: str | None
    groups: list[list[QueueItem]]
    end: bool
    message: str | None = None
    group_info: list[LeasedGroup] = field(default_factory=list)
    # Groups set aside (never delivered again): {"group", "size", "step", "producer", "reason"};
    # with `step`, every one of that step, else those this call set aside.
    dead: list[DeadLetter] = field(default_factory=list)


def _error_text(body: bytes) -> str:
    try:
        data = orjson.loads(body)
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            return data["error"]
    except orjson.JSONDecodeError:
        pass
    return body[:500].decode("utf-8", "replace")


@dataclass(frozen=True)
class _Request:
    """One logical call as each of its attempts sends it (signed afresh each time)."""

    method: str
    url: str
    target: str  # the path as the request line carries it: what is signed
    payload: bytes | memoryview | None
    headers: dict[str, str]
    content: str | None  # the payload's SHA-256, when requests are signed
    timeout: aiohttp.ClientTimeout
    frame_answer: bool  # a successful answer is a wire frame, decoded


class CoordinatorClient(HttpClient):
    """One agent's connection to the run's coordinator.

    `url` is the coordinator's base URL; `agent` is who this client speaks for (its own queue is the
    default `consumer` of `lease`/`ack`, its own version the default of `report_version`).
    `request_timeout_s` bounds one HTTP exchange (long polls get their wait on top); a call that
    fails for a passing reason is retried until `outage_deadline_s` (and at most `max_retries` times
    when that is set); `commit` retries until its own deadline, `wait_version` until its wait's.
    Commits are cut into requests of at most `max_commit_bytes` / `max_commit_items` and up to
    `commit_concurrency` of them are in flight, so encoding overlaps the transfer.
    """

    def __init__(
        self,
        url: str,
        *,
        run_id: str,
        agent: str,
        token: str | None = None,
        request_timeout_s: float = 60.0,
        max_retries: int | None = None,
        outage_deadline_s: float = OUTAGE_DEADLINE_S,
        backoff_base_s: float = 0.05,
        backoff_max_s: float = 2.0,
        commit_deadline_s: float = 600.0,
        max_commit_bytes: int = 16 << 20,
        max_commit_items: int = 1024,
        commit_concurrency: int = 2,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url.rstrip("/")
        base = URL(self.url)
        self._address = f"{base.host}:{base.port}"
        self.run_id = run_id
        self.agent = agent
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.outage_deadline_s = outage_deadline_s
        self._down_since: float | None = None  # monotonic time of the first failure of an outage
        self._down_logged = 0.0
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.commit_deadline_s = commit_deadline_s
        self.max_commit_bytes = max_commit_bytes
        self.max_commit_items = max_commit_items
        self.commit_concurrency = max(1, commit_concurrency)
        identity = {
            "X-Mrlx-Agent": agent,
            "X-Mrlx-Pid": str(os.getpid()),
            "X-Mrlx-Host": socket.gethostname(),
        }
        super().__init__(identity, max_connections=MAX_CONNECTIONS)
        # Keys derived from the token sign requests and check answers; the token is not kept.
        # `clock` gives the Unix time requests are stamped with.
        self._keys = derive_keys(token) if token else None
        self._signer = Signer(self._keys[0], clock) if self._keys else None
        self._buffers = BufferPool(keep=self.commit_concurrency + 2)

    def __repr__(self) -> str:  # never shows the token
        return f"CoordinatorClient(url={self.url!r}, run_id={self.run_id!r}, agent={self.agent!r})"

    # ----------------------------------------------------------------- plumbing

    async def __aenter__(self) -> CoordinatorClient:  # noqa: PYI034
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _path(self, suffix: str) -> str:
        return f"{self.url}/v1/runs/{self.run_id}{suffix}"

    async def _call(
        self,
        method: str,
        url: str,
        *,
        json: JSON = None,
        data: bytes | memoryview | None = None,
        deadline_s: float | None = None,
        max_retries: int | None = None,
        extra_timeout_s: float = 0.0,
        frame_answer: bool = False,
    ) -> _Answered:
        """One logical call: retried for passing failures until `deadline_s` (seconds from now;
        default `outage_deadline_s`) and at most `max_retries` retries (default the client's; None:
        until the deadline). Returns (status, headers, body): the body as bytes, or with
        `frame_answer` the decoded frame (header, items) of a successful answer."""
        deadline = Deadline(deadline_s if deadline_s is not None else self.outage_deadline_s)
        if max_retries is None:
            max_retries = self.max_retries
        headers = {}
        payload: bytes | memoryview | None = data
        if json is not None:
            payload = orjson.dumps(json)
            headers["Content-Type"] = "application/json"
        elif data is not None:
            headers["Content-Type"] = CONTENT_TYPE
        total = self.request_timeout_s + extra_timeout_s
        request = _Request(
            method,
            url,
            URL(url).raw_path_qs,
            payload,
            headers,
            None if self._keys is None else await _off_loop(content_sha256, payload),
            self._timeout(total),
            frame_answer,
        )

        async def attempt(_: int) -> _Answered:
            try:
                answered = await self._exchange(request, resend=True)
                if answered is None:  # signed again, naming the start the coordinator told
                    answered = await self._exchange(request, resend=False)
                assert answered is not None
                return answered
            except TRANSPORT_ERRORS as exc:
                raise as_passing(exc, self._address, total) from exc

        def on_retry(_: int, exc: BaseException, wait: float) -> None:
            assert isinstance(exc, Passing)
            self._waiting(method, url, exc.problem, exc.status, deadline.remaining())

        try:
            return await retry(
                attempt,
                retryable=is_passing,
                deadline=deadline,
                backoff=Backoff(self.backoff_base_s, self.backoff_max_s),
                max_retries=max_retries,
                on_retry=on_retry,
            )
        except RetriesExhausted as exc:
            last = exc.last
            assert isinstance(last, Passing)
            raise CoordinatorUnavailable(
                f"coordinator {method} {url} did not succeed after {exc.attempts} attempts: {last.problem}",
                last.status,
            ) from None

    async def _exchange(self, request: _Request, resend: bool) -> _Answered | None:
        """One HTTP exchange of `request` (status, headers, body); None when the coordinator refused
        the start the request named and told its current one, and `resend`: then the call signs
        again at once."""
        method, url, headers = request.method, request.url, request.headers
        sent, nonce = headers, None
        if self._signer is not None:
            sent = {**headers, **self._signer.sign(method, request.target, cast(str, request.content))}
            nonce = sent[NONCE_HEADER]  # fresh for every attempt: the coordinator refuses a repeat
        async with self._session().request(
            method, url, data=request.payload, headers=sent, timeout=request.timeout
        ) as resp:
            frame = request.frame_answer and resp.status < 400
            buf, body = (
                await self._read_frame(resp)
                if frame
                else (None, await read_capped(resp, MAX_JSON_ANSWER_BYTES))
            )
            if nonce is not None:  # signed: the answer must prove it knows the token
                answer = await _off_loop(content_sha256, body)
                proof = resp.headers.get(PROOF_HEADER)
                if not proven(cast("tuple[bytes, bytes]", self._keys)[1], nonce, resp.status, answer, proof):
                    if buf is not None:
                        self._buffers.give(buf)
                    self._unproven(method, url, resp.status, body)
                # The coordinator's start: when the request named another (or none yet), the
                # coordinator refused its signature (a 503; on an open route such as /health, the
                # answer a request without one gets), and the request signed again names this one.
                assert self._signer is not None
                told = self._signer.learn(resp.headers.get(BOOT_HEADER))
                if resend and told is not None and told != sent[BOOT_HEADER]:
                    return None
            if resp.status < 400:
                self._reached()
                if not frame:
                    return resp.status, resp.headers, body
                decoded = await _off_loop(decode_frame, body)
                # the decoded items hold no reference to it (not reused if cancelled)
                if buf is not None:
                    self._buffers.give(buf)
                return resp.status, resp.headers, decoded
            problem = f"HTTP {resp.status}: {_error_text(cast(bytes, body))}"  # not a frame
            if resp.status not in RETRYABLE_STATUS:
                self._reached()
                raise CoordinatorError(f"coordinator {method} {url} failed: {problem}", resp.status)
            # Retry-After is outside the answer's proof: `retry_after` bounds it.
            raise Passing(problem, resp.status, retry_after(resp.headers.get("Retry-After")))

    def _unproven(self, method: str, url: str, status: int, body: bytes | memoryview) -> None:
        """An answer without a valid proof: never used. A 401 is raised at once (the likely cause
        is a token that differs from the coordinator's); any other is retried like an outage."""
        if status == 401:
            raise CoordinatorError(
                f"coordinator {method} {url} refused this job's signature (HTTP 401, unverified: "
                f"{_error_text(bytes(body[:500]))}): the token this job reads (mrlx.coordinator.token_env or "
                "token_file) is not the coordinator's, or another process, which could not prove it holds "
                "the run's token, answers on its port",
                401,
            )
        raise Passing(
            f"the coordinator at {self.url} could not prove it holds the run's token (HTTP {status} "
            f"without a valid {PROOF_HEADER}; its answer was not used): is another process on its port? "
            "(Or does the coordinator run with another token, or none?)"
        )

    def _waiting(self, method: str, url: str, problem: str, status: int | None, remaining: float) -> None:
        """Say what the job waits for, at the first failure and every few seconds after."""
        now = time.monotonic()
        if status == 429:  # backpressure: the coordinator is up, the consumer has not caught up
            self._reached()
            if now - self._down_logged >= 6 * OUTAGE_LOG_EVERY_S:
                self._down_logged = now
                log.info(
                    "coordinator %s %s: %s; retrying for up to %.0f s more", method, url, problem, remaining
                )
            return
        if self._down_since is None:
            self._down_since, self._down_logged = now, -OUTAGE_LOG_EVERY_S
        if now - self._down_logged >= OUTAGE_LOG_EVERY_S:
            self._down_logged = now
            log.warning(
                "coordinator unreachable for %.1f s (%s %s: %s); retrying for up to %.0f s more "
                "(mrlx.coordinator.outage_deadline_s)",
                now - self._down_since,
                method,
                url,
                problem,
                remaining,
            )

    def _reached(self) -> None:
        if self._down_since is not None:
            log.warning("coordinator reachable again after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None

    async def _json_call(
        self,
        method: str,
        url: str,
        body: JSON = None,
        *,
        deadline_s: float | None = None,
        extra_timeout_s: float = 0.0,
    ) -> JSONObject:
        _, _, raw = await self._call(
            method, url, json=body, deadline_s=deadline_s, extra_timeout_s=extra_timeout_s
        )
        return orjson.loads(cast("bytes | memoryview", raw))

    # ----------------------------------------------------------------- agents

    async def health(self) -> JSONObject:
        """GET /health: signed, so the answer has the run id, uptime and database path (a request
        without the token gets only {"ok": true})."""
        return await self._json_call("GET", f"{self.url}/health")

    async def run_info(self) -> JSONObject:
        """Every agent's version and last seen, and every queue's depth."""
        return await self._json_call("GET", self._path(""))

    async def heartbeat(self) -> JSONObject:
        """Tell the coordinator this agent is alive (any call does; this one does nothing else)."""
        return await self._json_call(
            "POST",
            self._path(f"/agents/{self.agent}/heartbeat"),
            {"pid": os.getpid(), "host": socket.gethostname()},
        )

    async def report_version(self, version: int, agent: str | None = None) -> int:
        """Report a weight version (monotonic: a lower one is ignored); returns the registered version."""
        data = await self._json_call(
            "POST", self._path(f"/agents/{agent or self.agent}/version"), {"version": int(version)}
        )
        return int(cast(int, data["version"]))

    async def get_version(self, agent: str) -> int | None:
        """The agent's last reported version, None if it has reported none."""
        data = await self._json_call("GET", self._path(f"/agents/{agent}/version"))
        return cast("int | None", data["version"])

    async def wait_version(
        self, agent: str, min_version: int, deadline_s: float, *, poll_s: float = 30.0
    ) -> int:
        """Wait until `agent` has reported a version >= `min_version`; returns that version.

        Long-polls (each up to `poll_s`) until `deadline_s` seconds have passed, riding out
        coordinator restarts; raises `CoordinatorWaitTimeout` naming the agent, its version and
        when it was last seen.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        message = f"agent {agent!r} did not reach version {min_version} within {deadline_s:.1f} s"
        while True:
            remaining = deadline - loop.time()
            poll = max(0.0, min(poll_s, remaining))
            try:
                data = await self._json_call(
                    "POST",
                    self._path(f"/agents/{agent}/wait_version"),
                    {"min_version": int(min_version), "timeout_s": poll},
                    deadline_s=max(remaining, 0.0) + 1.0,
                    extra_timeout_s=poll,
                )
            except CoordinatorUnavailable as exc:
                raise CoordinatorWaitTimeout(
                    f"{message}; the coordinator was unreachable: {exc}", exc.status
                ) from None
            if data["reached"]:
                return int(cast(int, data["version"]))
            message = cast(str, data.get("message") or message)
            if deadline - loop.time() <= 0:
                raise CoordinatorWaitTimeout(f"waited {deadline_s:.1f} s: {message}")

    # ----------------------------------------------------------------- queues

    def _plan_chunks(self, items: Sequence[QueueItem]) -> list[Sequence[QueueItem]]:
        """Cut a commit into requests. The first requests are small and each next one twice as large
        (up to `max_commit_bytes`), so the first groups reach the consumer after a small request
        instead of after a full-sized one, while the bulk still travels in large requests."""
        chunks: list[Sequence[QueueItem]] = []
        start, size = 0, 0
        budget = max(1, self.max_commit_bytes // 16)
        for index, item in enumerate(items):
            estimate = 4 * len(item.tokens) + 5 * int(item.response_length) + 512
            if index > start and (size + estimate > budget or index - start >= self.max_commit_items):
                chunks.append(items[start:index])
                start, size = index, 0
                budget = min(self.max_commit_bytes, 2 * budget)
            size += estimate
        chunks.append(items[start:])
        return chunks

    async def commit(
        self, consumer: str, items: Iterable[QueueItem], deadline_s: float | None = None
    ) -> CommitResult:
        """Commit `items` to the queue of `consumer`; keys already known count as duplicates.

        Retries backpressure (429) and connection failures with backoff until `deadline_s` (default
        `commit_deadline_s`), then raises `CoordinatorUnavailable`; raises `CoordinatorError` at once
        for a rejected item (422, naming key and field), bad token (401), a request over the size
        limit (413) or a database that cannot be written (507). Each request is all or nothing; a
        commit cut into several requests may be partly stored when it raises, and is safe to repeat.
        """
        items = list(items)
        if not items:
            return CommitResult(0, 0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (deadline_s if deadline_s is not None else self.commit_deadline_s)
        url = self._path(f"/queues/{consumer}/commit")
        result = CommitResult(0, 0)
        slots = asyncio.Semaphore(self.commit_concurrency)
        tasks: list[asyncio.Task[None]] = []

        async def send(buf: bytearray, frame: memoryview) -> None:
            try:
                _, _, raw = await self._call(
                    "POST", url, data=frame, deadline_s=max(0.0, deadline - loop.time())
                )
                # Reused only after a complete exchange: the server has read every byte by then.
                self._buffers.give(buf)
            finally:
                slots.release()
            data = orjson.loads(cast("bytes | memoryview", raw))
            result.accepted += data["accepted"]
            result.duplicates += data["duplicates"]
            result.stale += data.get("stale", 0)
            result.duplicate_keys.extend(data.get("duplicate_keys", []))

        try:
            for chunk in self._plan_chunks(items):
                if len(tasks) and any(task.done() and task.exception() for task in tasks):
                    break
                await slots.acquire()
                try:
                    if sum(len(item.tokens) for item in chunk) * 4 > THREAD_FRAME_BYTES:
                        buf, frame = await loop.run_in_executor(None, encode_items_into, chunk, self._buffers)
                    else:
                        buf, frame = encode_items_into(chunk, self._buffers)
                except BaseException:
                    slots.release()
                    raise
                tasks.append(asyncio.create_task(send(buf, frame)))
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return result

    async def seal(self, consumer: str, group: str, size: int) -> bool:
        """Fix a group's final size (episodes came up short); True when the group is now complete."""
        data = await self._json_call(
            "POST", self._path(f"/queues/{consumer}/seal"), {"group": group, "size": int(size)}
        )
        return bool(data["complete"])

    async def end_stream(self, consumer: str) -> int:
        """No more items for `consumer`; incomplete groups are sealed as they are. Returns how many were."""
        data = await self._json_call("POST", self._path(f"/queues/{consumer}/end"), {})
        return int(cast(int, data["sealed_groups"]))

    async def queue_info(self, consumer: str | None = None) -> JSONObject:
        """Depth, ready and incomplete groups, and the end mark of a queue."""
        return await self._json_call("GET", self._path(f"/queues/{consumer or self.agent}"))

    async def lease(
        self,
        max_groups: int,
        lease_s: float,
        wait_s: float,
        consumer: str | None = None,
        *,
        step: int | None = None,
    ) -> Lease:
        """Lease up to `max_groups` complete groups of `consumer`'s queue (default: this agent's) for
        `lease_s` seconds, waiting up to `wait_s` for the first one. Ack the lease after training on
        it; an unacked lease's groups are delivered again after it expires."""
        consumer = consumer or self.agent
        body: JSONObject = {
            "max_groups": int(max_groups),
            "lease_s": float(lease_s),
            "wait_s": float(wait_s),
        }
        if step is not None:
            body["step"] = int(step)
        _, _, answer = await self._call(
            "POST",
            self._path(f"/queues/{consumer}/lease"),
            json=body,
            deadline_s=wait_s + self.outage_deadline_s,
            extra_timeout_s=wait_s,
            frame_answer=True,
        )
        header, items = cast(Frame, answer)
        groups: list[list[QueueItem]] = []
        start = 0
        for info in cast("list[LeasedGroup]", header.get("groups", [])):
            groups.append(items[start : start + info["size"]])
            start += info["size"]
        return Lease(
            cast("str | None", header.get("lease_id")),
            groups,
            bool(header.get("end")),
            cast("str | None", header.get("message")),
            cast("list[LeasedGroup]", header.get("groups", [])),
            cast("list[DeadLetter]", header.get("dead", [])),
        )

    async def extend(self, lease_id: str, lease_s: float, consumer: str | None = None) -> float:
        """Keep a lease for `lease_s` more seconds (training takes longer than the lease); returns
        the seconds until it now expires. Raises `CoordinatorError` (409) once it was redelivered."""
        data = await self._json_call(
            "POST",
            self._path(f"/queues/{consumer or self.agent}/extend"),
            {"lease_id": lease_id, "lease_s": float(lease_s)},
        )
        return float(cast(float, data["expires_in_s"]))

    async def ack(self, lease_id: str, consumer: str | None = None) -> JSONObject:
        """Mark a lease's groups done for good (idempotent). Raises `CoordinatorError` (409) when the
        lease expired and its groups were already delivered again."""
        return await self._json_call(
            "POST", self._path(f"/queues/{consumer or self.agent}/ack"), {"lease_id": lease_id}
        )

    async def ack_through(self, step: int, consumer: str | None = None) -> JSONObject:
        """Mark every group of producer step <= `step` done for good, leased or not (idempotent; a
        lower step than one acked before changes nothing). Returns {"through_step", "acked_groups",
        "acked_items"}. Items of those steps committed later are dropped (never delivered)."""
        return await self._json_call(
            "POST", self._path(f"/queues/{consumer or self.agent}/ack_through"), {"step": int(step)}
        )

    async def release(self, consumer: str | None = None) -> int:
        """Hand back every lease of the queue now (a restarted consumer takes over the leases of its
        dead predecessor instead of waiting them out); returns how many groups."""
        data = await self._json_call("POST", self._path(f"/queues/{consumer or self.agent}/release"), {})
        return int(cast(int, data["released_groups"]))

    async def reject(self, group: str, reason: str, consumer: str | None = None) -> JSONObject:
        """Set a group aside now, with the reason (its consumer cannot train it): never delivered
        again, counted. Returns {"group", "items", "step", "already"}."""
        return await self._json_call(
            "POST",
            self._path(f"/queues/{consumer or self.agent}/reject"),
            {"group": group, "reason": reason[:1000]},
        )

    async def _read_frame(self, resp: aiohttp.ClientResponse) -> tuple[bytearray | None, bytes | memoryview]:
        """A frame answer's bytes (and the buffer to give back once decoded): into a reused buffer
        when one of its Content-Length is at hand, else into one grown as the bytes arrive, so that
        memory follows the bytes received, never a length the answer declares before it is proven."""
        length = resp.content_length
        if length is None:
            return None, await resp.read()
        kept = self._buffers.take_existing(length)
        buf = bytearray() if kept is None else kept
        try:
            return buf, await read_declared(resp.content, length, buf)
        except BaseException as exc:
            self._buffers.give(buf)  # nothing else reads it
            if isinstance(exc, BodyLengthError):
                raise Passing(f"the frame does not match its Content-Length {length}") from None
            raise


async def _off_loop(function: Callable[[D], R], data: D) -> R:
    """`function(data)` on a worker thread when `data` is large (hashing or decoding megabytes would
    hold up the event loop's other calls), inline otherwise."""
    if data is not None and len(data) > THREAD_FRAME_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, function, data)
    return function(data)
