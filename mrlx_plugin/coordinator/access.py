"""Signed requests on the coordinator's side: each request's signature, time, start and nonce
checked (`authenticate`), its body checked against the hash it signed (`check_content`), and each
answer to a signed request proved (`prove`). The scheme and the client's side are in
`mrlx_plugin.link.auth`."""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from concurrent.futures import Executor

from aiohttp import web

from mrlx_plugin.coordinator.bodies import HttpProblem
from mrlx_plugin.coordinator.config import HASH_ON_THREAD_BYTES
from mrlx_plugin.link.auth import (
    BOOT_HEADER,
    CONTENT_HEADER,
    MAX_SKEW_S,
    NO_BOOT,
    PROOF_HEADER,
    SCHEME,
    ReplayGuard,
    answer_mac,
    check_request,
    content_sha256,
    derive_keys,
)

NONCE_KEY, CONTENT_KEY = "mrlx_nonce", "mrlx_content"  # on a request: its signature checked out
CHALLENGE = f'{SCHEME} realm="mrlx-coordinator"'  # the WWW-Authenticate of a 401


class RequestSigning:
    """The keys derived from the run's token (none: requests are not signed), this start's id, and
    the nonces seen; `started` is when the coordinator started, `cpu` hashes large bodies."""

    def __init__(self, token: str | None, metrics_token: str | None, started: float, cpu: Executor) -> None:
        # Keys derived from the token: one checks requests, one proves answers (the token is not kept).
        self._keys = derive_keys(token) if token else None
        self.metrics_token = metrics_token
        self.started = started
        self._cpu = cpu
        # Nonces live in memory, for this start only; a random id of the start (X-Mrlx-Boot) tells
        # the requests signed after it from those its predecessor may have served: a request that
        # names it is new to this start whatever its time, one that names another start (or none
        # yet) is refused once with this one, which the client names when it signs again at once.
        # (Not the start time: a client whose clock lags would be refused until it caught up, and
        # one whose clock leads stamps requests signed before the start with times after it.)
        self.boot = secrets.token_hex(8)
        self._replays = ReplayGuard()

    def authenticate(self, request: web.Request) -> tuple[int, str] | None:
        """Check a request's signature (with a token configured): None when it may go on, else the
        status and message of its refusal. A request whose MAC matches is marked (its nonce kept
        on it), and its answer is signed even when it is refused for its time or as a replay."""
        if self._keys is None:
            return None
        if self._metrics_reader(request):
            return None
        # The path as the request line carries it (query included), as the client signed it.
        nonce, problem, stamp, boot = check_request(
            self._keys[0], request.method, request.raw_path, request.headers
        )
        if nonce is None:
            return 401, (
                f"{problem}: every call but /health and /openapi.json must be signed with keys derived from "
                f"the run's token ({SCHEME}: the headers X-Mrlx-Time, X-Mrlx-Nonce, {CONTENT_HEADER} and "
                "X-Mrlx-Signature, see /openapi.json); the plugin's client signs its calls, and "
                "`mrlx coordinator call METHOD PATH` signs one from a shell"
            )
        request[NONCE_KEY] = nonce
        now = time.time()
        if abs(now - stamp) > MAX_SKEW_S:
            return 401, (
                f"the request's X-Mrlx-Time is {stamp - now:+.0f} s from the coordinator's clock (at most "
                f"{MAX_SKEW_S:.0f} s either way): synchronise the clocks of the client's and the "
                "coordinator's hosts"
            )
        # All refusals below are retryable (503): the request is not done, and its sender signs
        # it afresh. Each is final for the request refused: it is never accepted later.
        if boot is not None and boot != self.boot:
            named = (
                "no start of the coordinator (its client has not heard from it yet)"
                if boot == NO_BOOT
                else f"the coordinator's start {boot} (it restarted since)"
            )
            return 503, (
                f"the request's {BOOT_HEADER} names {named}, not its current start: sign it afresh "
                f"naming {BOOT_HEADER}: {self.boot}"
            )
        if boot is None and stamp <= self.started:
            return 503, (
                f"the request's X-Mrlx-Time is before this coordinator started, and the request names no "
                f"start ({BOOT_HEADER}), so it cannot be told from a replay of one its predecessor served: "
                f"sign it afresh naming its start, {BOOT_HEADER}: {self.boot}"
            )
        seen = self._replays.admit(nonce, stamp, now)
        if seen == "replay":
            # (a copy that went first must not end the true sender's call)
            return 503, (
                "the request's X-Mrlx-Nonce was used before: a replayed request is refused; sign it afresh"
            )
        if seen == "behind":
            return 503, (
                f"the request's X-Mrlx-Nonce counts more than {self._replays.window} requests behind its "
                "client's newest, further than the coordinator tells replays apart: sign it afresh"
            )
        if seen == "full":
            return 503, (
                f"the coordinator remembers the requests of at most {self._replays.capacity} clients "
                f"signed within {MAX_SKEW_S:.0f} s, and refuses a new client's until some are forgotten "
                "(too many requests were signed each with a nonce of its own): sign it afresh, with a "
                "client that numbers its requests (the plugin's client, `mrlx coordinator call`)"
            )
        request[CONTENT_KEY] = request.headers[CONTENT_HEADER].strip().lower()
        return None

    def _metrics_reader(self, request: web.Request) -> bool:
        """A GET /metrics with the bearer --metrics-token-env names (its answer is not signed)."""
        token = self.metrics_token
        if not token or request.method != "GET" or request.path != "/metrics":
            return False
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {token}".encode())

    async def check_content(self, request: web.Request, body: bytes | memoryview) -> None:
        """The body of a signed request must be the one its signature names (hashed on a worker
        thread when large)."""
        expected = request.get(CONTENT_KEY)
        if expected is None:
            return
        if len(body) > HASH_ON_THREAD_BYTES:
            given = await asyncio.get_running_loop().run_in_executor(self._cpu, content_sha256, body)
        else:
            given = content_sha256(body)
        if given != expected:
            raise HttpProblem(
                401,
                f"{request.method} {request.path}: the body is not the one the request's signed "
                f"{CONTENT_HEADER} names (changed or cut on the way); nothing was done",
                {"WWW-Authenticate": CHALLENGE},
            )

    def prove(self, request: web.Request, response: web.StreamResponse, content: str) -> None:
        """Sign an answer to a request whose signature checked out (errors included), so that its
        client can tell it from one of another process on this port."""
        nonce = request.get(NONCE_KEY)
        if nonce is not None and self._keys is not None:
            response.headers[PROOF_HEADER] = answer_mac(self._keys[1], nonce, response.status, content)
            response.headers[BOOT_HEADER] = self.boot

    def authenticated(self, request: web.Request) -> bool:
        """Signed with the token (or no token is configured): may learn the run's details."""
        return self._keys is None or request.get(CONTENT_KEY) is not None
