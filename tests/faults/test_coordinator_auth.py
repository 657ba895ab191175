"""Who the coordinator's client trusts: during a coordinator outage another process binds the
coordinator's port, records everything it is sent and answers every call with a forged lease of
two items. The client must send it nothing from which the run's token can be had (no token, no
key derived from it: at most a MAC, which takes a guess per candidate token to test offline), must
refuse its answer with an error that names the cause, and, once the real coordinator is back on
its port, must go on and train only what the real coordinator hands out.

Also: what a caller without the token learns (that the service is alive, nothing about the run),
and the coordinator's side of the signatures (replays, stale times, a body other than the signed
one).

Real processes and sockets: a coordinator process on 127.0.0.1, killed and restarted on the same
port, and a small aiohttp server in this process as the impostor.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import time

import pytest
from _coord_procs import CoordinatorProcess, error_of, make_items
from aiohttp import web

from mrlx_plugin.core.retry import async_wait_until
from mrlx_plugin.link.auth import (
    NONCE_HEADER,
    PROOF_HEADER,
    ReplayGuard,
    content_sha256,
    derive_keys,
    proven,
    request_mac,
    signed_headers,
)
from mrlx_plugin.link.client import CoordinatorClient, CoordinatorError
from mrlx_plugin.link.wire import CONTENT_TYPE, encode_items

FORGED_GROUP = "forged"


def forged_lease() -> bytes:
    """A well-formed lease answer of two items the real coordinator never had."""
    items = make_items(2, FORGED_GROUP, start=900, seed=7)
    header = {
        "lease_id": "forged-lease",
        "end": False,
        "groups": [{"group": FORGED_GROUP, "size": 2, "step": 0, "producer": "doctor", "redelivered": False}],
        "message": None,
        "dead": [],
    }
    return encode_items(items, header)


class Impostor:
    """An HTTP server on `port` that records each request (request line, raw headers, body) and
    answers every one with the forged lease; it also reflects the request's own X-Mrlx-* headers
    (a signature sent back as if it were a proof must not pass for one)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.requests: list[bytes] = []
        self.leases = 0
        self.body = forged_lease()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        head = f"{request.method} {request.raw_path}\r\n".encode()
        head += b"".join(name + b": " + value + b"\r\n" for name, value in request.raw_headers)
        self.requests.append(head + b"\r\n" + body)
        if request.path.endswith("/lease"):
            self.leases += 1
        reflected = {k: v for k, v in request.headers.items() if k.lower().startswith("x-mrlx-")}
        proof = request.headers.get("X-Mrlx-Signature")
        headers = {**reflected, **({"X-Mrlx-Proof": proof} if proof else {}), "Content-Type": CONTENT_TYPE}
        return web.Response(body=self.body, headers=headers)

    async def __aenter__(self) -> Impostor:  # noqa: PYI034
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def secrets_of(token: str) -> dict[str, bytes]:
    """What would let the listener act as a client or as the coordinator: the token in any common
    spelling, and the keys a signature scheme could derive from it."""
    raw = token.encode()
    derived = {
        "sha256(token)": hashlib.sha256(raw).digest(),
        "client key": hmac.new(raw, b"mrlx client", hashlib.sha256).digest(),
        "server key": hmac.new(raw, b"mrlx server", hashlib.sha256).digest(),
    }
    found = {"token": raw, "base64(token)": base64.b64encode(raw), "hex(token)": raw.hex().encode()}
    for name, key in derived.items():
        found[name] = key.hex().encode()
        found[f"base64({name})"] = base64.b64encode(key)
    return found


def test_an_impostor_on_the_coordinators_port_gets_no_token_and_trains_nothing(start_coordinator):
    coord: CoordinatorProcess = start_coordinator(token=secrets.token_urlsafe(24))
    real = make_items(3, "real")

    def client(agent: str, **kwargs) -> CoordinatorClient:
        return CoordinatorClient(
            coord.url, run_id=coord.run_id, agent=agent, token=coord.token, backoff_max_s=0.5, **kwargs
        )

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        producer, consumer = client("doctor"), client("patient")
        hasty = client("patient", outage_deadline_s=2)  # gives up while the impostor answers
        assert (await producer.commit("patient", real)).accepted == 3
        await loop.run_in_executor(None, coord.kill)
        async with Impostor(coord.port) as impostor:
            # A call whose deadline passes while only the impostor answers.
            try:
                outcome: object = await hasty.lease(10, 60, 0)
            except CoordinatorError as exc:
                outcome = exc
            # A call that rides the outage out, as a job's calls do.
            riding = asyncio.ensure_future(consumer.lease(10, 60, 0))
            before = impostor.leases
            await async_wait_until(
                lambda: impostor.leases >= before + 2 or riding.done(),
                30,
                what="the consumer's lease refused by the client and sent again",
            )
        assert impostor.requests, "the impostor was never asked"
        for request in impostor.requests:
            for name, value in secrets_of(coord.token).items():
                assert value not in request, f"the impostor received the run's {name}:\n{request[:600]!r}"
        assert isinstance(outcome, CoordinatorError), (
            f"the client took the impostor's answer as the coordinator's: {outcome!r}"
        )
        message = str(outcome)
        assert "could not prove it holds the run's token" in message and coord.url in message, message
        assert "another process on its port" in message, message
        assert not riding.done(), f"the client took the impostor's lease: {riding.result()}"
        await loop.run_in_executor(None, lambda: coord.start(same_port=True))
        lease = await asyncio.wait_for(riding, 60)
        trained = sorted(item.key for group in lease.groups for item in group)
        assert trained == sorted(item.key for item in real), trained
        assert lease.lease_id != "forged-lease" and all(g["group"] == "real" for g in lease.group_info)
        await consumer.ack(lease.lease_id)
        for c in (producer, consumer, hasty):
            await c.close()

    asyncio.run(scenario())


def test_the_client_refuses_an_answer_of_a_coordinator_with_another_token(start_coordinator):
    """The real service, but started with another token: its answers prove nothing to this job."""
    coord = start_coordinator(token="the-coordinators-token")

    async def scenario() -> None:
        other = CoordinatorClient(
            coord.url,
            run_id=coord.run_id,
            agent="doctor",
            token="another-token",
            outage_deadline_s=1,
            backoff_max_s=0.2,
        )
        with pytest.raises(CoordinatorError) as refused:
            await other.health()
        assert "could not prove it holds the run's token" in str(refused.value), refused.value
        await other.close()

    asyncio.run(scenario())


def test_a_caller_without_the_token_learns_nothing_about_the_run(start_coordinator):
    coord = start_coordinator(run_id="hidden-run-7", agents=("alice-agent", "bob-agent"))
    private = ["hidden-run-7", "alice-agent", "bob-agent", str(coord.db), str(coord.workdir)]

    def shows_nothing(body: bytes, where: str) -> None:
        text = body.decode(errors="replace")
        for secret in private:
            assert secret not in text, f"{where} shows {secret!r}: {text[:400]}"

    for token in (None, "another-token"):
        status, _, body = coord.http("GET", "/health", token=token)
        assert status == 200 and json.loads(body) == {"ok": True}, body
        status, _, body = coord.http("GET", "/openapi.json", token=token)
        assert status == 200 and "paths" in json.loads(body)
        shows_nothing(body, f"/openapi.json (token {token!r})")
        for method, path in [
            ("GET", "/metrics"),
            ("GET", "/v1/runs/hidden-run-7"),
            ("GET", "/v1/runs/guess/queues/alice-agent"),
            ("POST", "/v1/runs/hidden-run-7/queues/nobody/lease"),
            ("GET", "/nothing-here"),
        ]:
            status, _, body = coord.http(method, path, {} if method == "POST" else None, token=token)
            assert status == 401, (method, path, status, body)
            shows_nothing(body, f"{method} {path} (token {token!r})")
    # Signed with the token: the details, with a proof of the coordinator's.
    headers = signed_headers(coord.token, "GET", "/health")
    status, answer_headers, body = coord.http("GET", "/health", token=None, headers=headers)
    health = json.loads(body)
    assert status == 200 and health["run_id"] == "hidden-run-7" and health["db"] == str(coord.db)
    assert proven(
        derive_keys(coord.token)[1],
        headers[NONCE_HEADER],
        200,
        content_sha256(body),
        answer_headers.get(PROOF_HEADER),
    )
    status, _, body = coord.http("GET", "/openapi.json")
    assert status == 200 and "hidden-run-7" in body.decode() and "alice-agent" in body.decode()


def test_replays_stale_times_and_other_bodies_are_refused(start_coordinator):
    coord = start_coordinator()
    path = f"/v1/runs/{coord.run_id}/queues/patient"
    headers = signed_headers(coord.token, "GET", path)
    assert coord.http("GET", path, token=None, headers=headers)[0] == 200
    status, answer_headers, body = coord.http("GET", path, token=None, headers=headers)
    # retryable: a copy that went first must not end the true sender's call (it signs again)
    assert status == 503 and "used before" in error_of(body), body
    # the refusal of a request whose signature checks out is proven too
    assert proven(
        derive_keys(coord.token)[1],
        headers[NONCE_HEADER],
        503,
        content_sha256(body),
        answer_headers.get(PROOF_HEADER),
    )

    stamp, nonce = f"{time.time() - 3600:.3f}", "ab" * 16
    old = {
        **signed_headers(coord.token, "GET", path),
        "X-Mrlx-Time": stamp,
        "X-Mrlx-Nonce": nonce,
        "X-Mrlx-Signature": request_mac(
            derive_keys(coord.token)[0], "GET", path, nonce, stamp, content_sha256(None)
        ),
    }
    status, _, body = coord.http("GET", path, token=None, headers=old)
    assert status == 401 and "synchronise the clocks" in error_of(body), body

    commit = f"/v1/runs/{coord.run_id}/queues/patient/commit"
    signed_for = encode_items(make_items(2, "signed"))
    sent = encode_items(make_items(3, "swapped", start=10))
    status, _, body = coord.http(
        "POST",
        commit,
        sent,
        token=None,
        headers={**signed_headers(coord.token, "POST", commit, signed_for), "Content-Type": CONTENT_TYPE},
    )
    assert status == 401 and "X-Mrlx-Content-Sha256" in error_of(body), body
    status, _, body = coord.http("GET", path)
    assert status == 200 and json.loads(body)["queued_items"] == 0, body


def test_the_replay_memory_is_bounded_and_refuses_only_what_it_cannot_tell_apart():
    guard = ReplayGuard(capacity=4, window_s=300)
    now = 1000.0
    for i in range(4):
        assert guard.admit(f"n{i}", now + i, now + i) is None
    assert guard.admit("n2", now + 2, now + 4) == "replay"
    assert guard.admit("n4", now + 4, now + 4) is None  # full: the oldest (n0) is forgotten
    assert len(guard._seen) == 4 and guard.floor == now
    assert guard.admit("n0", now, now + 4) == "forgotten"  # could be a replay of n0: sign afresh
    assert guard.admit("late", now + 0.5, now + 5) == "forgotten"  # older than all it remembers
    assert guard.admit("late", now + 1.5, now + 5) is None  # newer than the oldest it remembers
    assert guard.floor == now + 1
    assert guard.admit("later", now + 1000, now + 1000) is None  # the window moved: old entries go
    assert len(guard._seen) == 1


def test_a_request_signed_before_a_restart_cannot_be_replayed_after_it(start_coordinator):
    """Nonces live in memory: the restarted coordinator refuses what was signed before it started."""
    coord = start_coordinator()
    commit = f"/v1/runs/{coord.run_id}/queues/patient/commit"
    frame = encode_items(make_items(2, "once"))
    headers = {**signed_headers(coord.token, "POST", commit, frame), "Content-Type": CONTENT_TYPE}
    status, _, body = coord.http("POST", commit, frame, token=None, headers=headers)
    assert status == 200, body
    ack = f"/v1/runs/{coord.run_id}/queues/patient/ack_through"
    ack_body = json.dumps({"step": 0}).encode()
    recorded = {**signed_headers(coord.token, "POST", ack, ack_body), "Content-Type": "application/json"}
    coord.kill()
    coord.start(same_port=True)
    status, _, body = coord.http("POST", ack, ack_body, token=None, headers=recorded)
    assert status == 503 and "sign it afresh" in error_of(body), (status, body)
    status, _, body = coord.http("GET", f"/v1/runs/{coord.run_id}/queues/patient")
    assert status == 200 and json.loads(body)["queued_items"] == 2, body


def test_a_metrics_token_opens_metrics_alone(start_coordinator, monkeypatch):
    monkeypatch.setenv("MRLX_METRICS_TOKEN", "scraper-secret-123")
    coord = start_coordinator(extra=["--metrics-token-env", "MRLX_METRICS_TOKEN"])
    scraper = {"Authorization": "Bearer scraper-secret-123"}
    status, _, body = coord.http("GET", "/metrics", token=None, headers=scraper)
    assert status == 200 and b"mrlx_coordinator" in body, body[:300]
    for method, path in [
        ("GET", f"/v1/runs/{coord.run_id}"),
        ("POST", f"/v1/runs/{coord.run_id}/queues/patient/lease"),
    ]:
        status, _, body = coord.http(
            method, path, {} if method == "POST" else None, token=None, headers=scraper
        )
        assert status == 401, (method, path, status, body)
    status, _, _ = coord.http(
        "GET", "/metrics", token=None, headers={"Authorization": f"Bearer {coord.token}"}
    )
    assert status == 401  # the run's token is never taken as a bearer


def test_an_endless_answer_is_cut_before_its_proof_is_checked():
    """Another process on the port streams a JSON answer without end: the client stops reading at
    its limit and refuses it, as any unproven answer."""

    async def scenario() -> None:
        async def endless(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            chunk = b" " * (1 << 20)
            for _ in range(64):  # 64 MiB, four times the limit; the client hangs up long before
                await response.write(chunk)
            return response

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", endless)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        client = CoordinatorClient(
            f"http://127.0.0.1:{port}",
            run_id="run1",
            agent="doctor",
            token="t" * 32,
            outage_deadline_s=1,
            backoff_max_s=0.2,
        )
        with pytest.raises(CoordinatorError) as refused:
            await client.health()
        assert "byte limit" in str(refused.value), refused.value
        await client.close()
        await runner.cleanup()

    asyncio.run(scenario())
