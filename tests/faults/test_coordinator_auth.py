"""Who the coordinator's client trusts: during a coordinator outage another process binds the
coordinator's port, records everything it is sent and answers every call with a forged lease of
two items. The client must send it nothing from which the run's token can be had (no token, no
key derived from it: at most a MAC, which takes a guess per candidate token to test offline), must
refuse its answer with an error that names the cause, and, once the real coordinator is back on
its port, must go on and train only what the real coordinator hands out.

Also: what a caller without the token learns (that the service is alive, nothing about the run),
and the coordinator's side of the signatures (replays, stale times, a body other than the signed
one), with clients whose clocks are off within the allowed skew: never locked out, after a restart
or another client's burst, while a recorded request is never accepted again.

Real processes and sockets: a coordinator process on 127.0.0.1, killed and restarted on the same
port, and small aiohttp servers in this process as the impostor and as a recorder on the way.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import secrets
import time

import aiohttp
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


def test_the_replay_memory_holds_counts_per_signer_and_never_accepts_what_it_refused():
    guard = ReplayGuard(capacity=2, window=4, window_s=300)
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    now = 1000.0
    for count in range(10_000):  # a burst of one signer costs one entry
        assert guard.admit(f"{a}{count:016x}", now, now) is None
    assert len(guard) == 1
    assert guard.admit(f"{a}{9_999:016x}", now, now) == "replay"
    assert guard.admit(f"{a}{9_996:016x}", now, now) == "replay"
    assert guard.admit(f"{a}{9_995:016x}", now, now) == "behind"  # further back than the window
    assert guard.admit(f"{a}{10_002:016x}", now, now) is None  # out of order within the window
    assert guard.admit(f"{a}{10_001:016x}", now, now) is None
    assert guard.admit(f"{a}{10_001:016x}", now, now) == "replay"
    assert guard.admit("ab" * 16, now - 250, now) is None  # another nonce signs once; its time is no matter
    assert guard.admit("ab" * 16, now - 250, now) == "replay"
    assert guard.admit(f"{b}{0:016x}", now, now) == "full"  # a new signer while full
    assert guard.admit(f"{a}{10_003:016x}", now + 1, now + 1) is None  # known signers go on
    later = now + 251  # "ab" * 16 is out of the window: forgotten
    assert guard.admit(f"{b}{0:016x}", now, later) == "full"  # once refused, never accepted
    assert guard.admit(f"{b}{1:016x}", later, later) is None
    assert guard.admit(f"{b}{0:016x}", now, later) == "full"
    assert len(guard) == 2
    assert guard.admit(f"{c}{0:016x}", now + 1000, now + 1000) is None  # a and b are out of the window
    assert len(guard) == 1


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


# --------------------------------------------------------------------------- clocks within the skew

SKEW_S = 200.0  # within the coordinator's allowed +-300 s


def refusals(coord: CoordinatorProcess, endpoint: str) -> int:
    """How many calls to `endpoint` this start of the coordinator refused as retryable (503)."""
    text = coord.http("GET", "/metrics")[2].decode()
    prefix = f'mrlx_coordinator_requests_total{{endpoint="{endpoint}",status="503"}} '
    return sum(int(float(line[len(prefix) :])) for line in text.splitlines() if line.startswith(prefix))


def skewed_client(
    coord: CoordinatorProcess, agent: str, skew_s: float, url: str | None = None
) -> CoordinatorClient:
    """A client whose clock is `skew_s` seconds off the coordinator's; a call that is refused for
    longer than a few retries gives up (a lock-out fails the test instead of waiting it out)."""
    return CoordinatorClient(
        url or coord.url,
        run_id=coord.run_id,
        agent=agent,
        token=coord.token,
        clock=lambda: time.time() + skew_s,
        outage_deadline_s=10,
        backoff_max_s=0.5,
    )


def test_a_client_whose_clock_lags_is_served_at_once_after_a_coordinator_start(start_coordinator, caplog):
    """Right after a start (the first, and a restart) the coordinator serves a client whose clock
    runs 200 s behind its own: at most one refusal per call, which the client gets past at once,
    signing again (it never waits on it: nothing is logged)."""
    coord = start_coordinator()
    caplog.set_level(logging.INFO, logger="mrlx.coordinator.client")

    async def scenario() -> None:
        lagging = skewed_client(coord, "patient", -SKEW_S)
        assert (await lagging.heartbeat())["agent"] == "patient"
        assert await lagging.report_version(1) == 1
        assert refusals(coord, "heartbeat") <= 1 and refusals(coord, "report_version") == 0
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, coord.kill)
        await loop.run_in_executor(None, lambda: coord.start(same_port=True))
        fresh = skewed_client(coord, "doctor", -SKEW_S)
        # Calls at once, as a job makes them: each may be refused once, none more.
        beats = await asyncio.gather(lagging.heartbeat(), fresh.heartbeat(), lagging.queue_info())
        assert [beat.get("agent") for beat in beats[:2]] == ["patient", "doctor"]
        assert await lagging.report_version(2) == 2
        assert await fresh.get_version("patient") == 2
        assert refusals(coord, "heartbeat") <= 2 and refusals(coord, "queue") <= 1
        assert refusals(coord, "report_version") == 0 and refusals(coord, "get_version") == 0
        for c in (lagging, fresh):
            await c.close()

    asyncio.run(scenario())
    waited = [r.getMessage() for r in caplog.records if "HTTP 503" in r.getMessage()]
    assert not waited, waited


BURST = 16_500  # more signed calls than a memory of 16,384 nonces holds (30 in flight at a time)


def test_a_burst_of_one_client_refuses_no_call_of_another(start_coordinator):
    """One client (its clock 200 s ahead, within the skew) makes a burst of calls; another client's
    calls, during the burst and after it, are all served at once."""
    coord = start_coordinator()

    async def scenario() -> None:
        flooding = skewed_client(coord, "doctor", +SKEW_S)
        other = skewed_client(coord, "patient", 0.0)
        assert (await other.heartbeat())["agent"] == "patient"  # (refused once: it learns the start)
        before = refusals(coord, "heartbeat")
        served = 0

        async def worker(calls: int) -> None:
            nonlocal served
            for _ in range(calls):
                await flooding.health()
                served += 1

        burst = asyncio.ensure_future(asyncio.gather(*(worker(BURST // 30) for _ in range(30))))
        during = 0
        while not burst.done():
            assert (await other.heartbeat())["agent"] == "patient"
            during += 1
        await burst
        assert served == BURST
        for _ in range(20):
            assert (await other.heartbeat())["agent"] == "patient"
        refused = refusals(coord, "heartbeat") - before
        assert refused == 0, f"{refused} of the other client's calls were refused ({during} during the burst)"
        for c in (flooding, other):
            await c.close()

    asyncio.run(scenario())


class Recorder:
    """A listener on the path from clients to the coordinator: it forwards every request and its
    answer unchanged, and keeps a copy of each request (method, path, headers, body) to replay."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.recorded: list[tuple[str, str, dict[str, str], bytes]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {
            k: v for k, v in request.headers.items() if k.lower().startswith("x-mrlx-") or k == "Content-Type"
        }
        self.recorded.append((request.method, request.raw_path, headers, body))
        async with self.session.request(
            request.method, self.upstream + request.raw_path, data=body, headers=headers
        ) as answer:
            content = await answer.read()
            kept = {
                k: v
                for k, v in answer.headers.items()
                if k.lower().startswith("x-mrlx-") or k in ("Content-Type", "Retry-After")
            }
            return web.Response(status=answer.status, body=content, headers=kept)

    async def __aenter__(self) -> Recorder:  # noqa: PYI034
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()
        await self.session.close()


def test_a_recorded_request_is_refused_before_and_after_a_restart(start_coordinator):
    """Requests recorded on the way (clients whose clocks lag, agree and lead by 200 s) are
    refused when replayed, both to the coordinator that served them and, on the same database,
    to its successor."""
    coord = start_coordinator()
    recorded: dict[float, tuple[str, str, dict[str, str], bytes]] = {}

    async def scenario() -> None:
        async with Recorder(coord.url) as recorder:
            for index, skew in enumerate((-SKEW_S, 0.0, SKEW_S)):
                c = skewed_client(coord, "doctor", skew, url=recorder.url)
                await c.heartbeat()  # the client knows the coordinator from here on
                items = make_items(2, f"recorded{index}", start=10 * index)
                assert (await c.commit("patient", items)).accepted == 2
                method, path, headers, body = recorder.recorded[-1]
                assert path.endswith("/commit") and headers["X-Mrlx-Time"]
                recorded[skew] = (method, path, headers, body)
                await c.close()

    asyncio.run(scenario())

    def replay(skew: float) -> tuple[int, str]:
        method, path, headers, body = recorded[skew]
        status, _, answer = coord.http(method, path, body, token=None, headers=headers)
        return status, (error_of(answer) if status >= 400 else answer.decode())

    for skew in recorded:
        status, message = replay(skew)
        assert status == 503 and "used before" in message, (skew, status, message)
    coord.kill()
    coord.start(same_port=True)
    for skew in recorded:
        status, message = replay(skew)
        assert status == 503 and "sign it afresh" in message, (skew, status, message)
    status, _, body = coord.http("GET", f"/v1/runs/{coord.run_id}/queues/patient")
    assert status == 200 and json.loads(body)["queued_items"] == 6, body
