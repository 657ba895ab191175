"""The engine client's HTTP behaviour against scripted servers on real sockets: which answers are
retried and how often, the deadline, the answer cap, keep-alive reuse, and one session per
event loop.

Each server below answers every request with the next of its scripted answers (the last one
repeats), so a test states exactly what an engine said and checks what the client made of it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import orjson
import pytest
from _raw_server import HANG_UP, ScriptedServer, answer

from mrlx_plugin.core.config import EngineSettings
from mrlx_plugin.core.engine_client import EngineClient, EngineError, MalformedAnswer, PeerRetry
from mrlx_plugin.core.sglang import answer_limits
from mrlx_plugin.core.values import MIN_LOG_PROB

OK_BODY = orjson.dumps(
    {
        "text": "hi",
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.5, 7], [-0.25, 8]],
            "prompt_tokens": 3,
            "weight_version": "4",
        },
    }
)


OK = answer(200, OK_BODY)


def settings(**kw) -> EngineSettings:
    return EngineSettings(**{"max_retries": 2, "backoff_s": 0.01, "max_backoff_s": 0.02, **kw})


async def call(client: EngineClient, **kw):
    try:
        return await client.generate([1, 2, 3], {"max_new_tokens": 16}, **kw)
    finally:
        await client.close()


def test_a_passing_fault_is_retried_and_the_result_counts_the_retries():
    async def run():
        async with ScriptedServer(answer(503, b'{"error": "busy"}'), answer(429, b"slow down"), OK) as server:
            result = await call(EngineClient(server.url, settings(), api_key="k1"))
            return result, server

    result, server = asyncio.run(run())
    assert result.token_ids == [7, 8] and result.logprobs == [-0.5, -0.25] and result.weight_version == "4"
    assert result.retries == 2 and len(server.requests) == 3
    head = server.requests[0].lower()
    assert b"authorization: bearer k1" in head and b"content-type: application/json" in head
    assert b"accept-encoding: identity" in head, (
        "the body cap counts wire bytes: no compressed answers asked for"
    )
    assert server.connections == 1, "the retries reused the kept-alive connection"


def test_the_retries_are_bounded_and_the_error_names_the_last_fault():
    async def run():
        async with ScriptedServer(answer(500, b"engine crashed")) as server:
            with pytest.raises(EngineError) as info:
                await call(EngineClient(server.url, settings(max_retries=2)))
            return info.value, server

    error, server = asyncio.run(run())
    assert error.retryable and error.attempts == 3 and len(server.requests) == 3
    assert str(error) == f"{server.url}/generate: HTTP 500: engine crashed (after 3 attempts)"


def test_a_4xx_is_not_retried():
    async def run():
        async with ScriptedServer(answer(400, b'{"error": "bad input_ids"}')) as server:
            with pytest.raises(EngineError) as info:
                await call(EngineClient(server.url, settings(max_retries=3)))
            return info.value, server

    error, server = asyncio.run(run())
    assert not error.retryable and error.attempts == 1 and len(server.requests) == 1
    assert error.reason == 'HTTP 400: {"error": "bad input_ids"}'


def test_no_retry_starts_when_its_wait_would_cross_the_deadline():
    async def run():
        async with ScriptedServer(answer(503, b"busy")) as server:
            # every backoff wait (5 to 10 s) is longer than what is left of the call's 5 s
            client = EngineClient(server.url, settings(max_retries=100, backoff_s=10.0, max_backoff_s=10.0))
            with pytest.raises(EngineError) as info:
                await call(client, deadline=time.monotonic() + 5.0)
            return info.value, server

    error, server = asyncio.run(run())
    assert error.reason == "deadline passed; last error: HTTP 503: busy", str(error)
    assert error.retryable and error.attempts == 1 and len(server.requests) == 1


def test_a_deadline_already_passed_makes_no_attempt():
    async def run():
        async with ScriptedServer(OK) as server:
            with pytest.raises(EngineError) as info:
                await call(EngineClient(server.url, settings()), deadline=time.monotonic() - 1)
            return info.value, server

    error, server = asyncio.run(run())
    assert error.reason == "deadline passed; last error: no attempt made" and error.attempts == 0
    assert server.requests == []


def test_an_answer_over_the_cap_is_refused_by_its_length_and_retried():
    async def run():
        async with ScriptedServer(answer(200, b"x" * 5000), OK) as server:
            result = await call(EngineClient(server.url, settings(), max_answer_bytes=4096))
            with pytest.raises(EngineError) as info:
                await call(EngineClient(server.url, settings(max_retries=0), max_answer_bytes=64))
            return result, info.value, server

    result, error, server = asyncio.run(run())
    assert result.retries == 1, "the oversized answer was a passing fault"
    assert error.reason == f"the answer is {len(OK_BODY)} bytes, over the 64-byte limit"


def test_a_chunked_answer_is_read_and_one_over_the_cap_is_cut_off():
    half = len(OK_BODY) // 2
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        half,
        OK_BODY[:half],
        len(OK_BODY) - half,
        OK_BODY[half:],
    )

    async def run():
        async with ScriptedServer(chunked) as server:
            result = await call(EngineClient(server.url, settings()))
            with pytest.raises(EngineError) as info:
                await call(EngineClient(server.url, settings(max_retries=0), max_answer_bytes=half))
            return result, info.value

    result, error = asyncio.run(run())
    assert result.token_ids == [7, 8]
    assert error.reason == f"the answer is over the {half}-byte limit" and error.retryable


def test_a_closed_port_is_a_retryable_connection_error():
    with socket.socket() as s:  # a port nobody listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

        async def run():
            with pytest.raises(EngineError) as info:
                await call(EngineClient(f"http://127.0.0.1:{port}", settings(max_retries=1)))
            return info.value

        error = asyncio.run(run())
    assert error.retryable and error.attempts == 2
    assert error.reason.startswith(f"cannot connect to 127.0.0.1:{port}: "), error.reason


def test_a_server_that_closes_without_answering_is_retried():
    async def run():
        async with ScriptedServer(HANG_UP) as server:
            with pytest.raises(EngineError) as info:
                await call(EngineClient(server.url, settings(max_retries=1)))
            return info.value, server

    error, server = asyncio.run(run())
    assert error.retryable and error.attempts == 2 and len(server.requests) == 2
    assert error.reason == "connection closed before the answer (by the server)"


def test_a_stalled_answer_ends_at_the_per_attempt_timeout():
    async def run():
        async with ScriptedServer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{") as server:
            with pytest.raises(EngineError) as info:
                await call(EngineClient(server.url, settings(max_retries=1, request_timeout_s=0.3)))
            return info.value, server

    error, server = asyncio.run(run())
    assert error.reason == "no answer within 0.3s" and error.attempts == 2 and len(server.requests) == 2


def test_many_calls_share_a_bounded_pool_of_kept_alive_connections():
    async def run():
        async with ScriptedServer(OK) as server:
            client = EngineClient(server.url, settings(max_connections=4))
            try:
                for _ in range(3):  # three waves of 16 concurrent calls
                    results = await asyncio.gather(*(client.generate([1], {}) for _ in range(16)))
                    assert all(r.token_ids == [7, 8] for r in results)
            finally:
                await client.close()
            return server

    server = asyncio.run(run())
    assert len(server.requests) == 48 and server.connections <= 4


@contextmanager
def server_in_thread(*script: bytes) -> Iterator[ScriptedServer]:
    """A ScriptedServer on its own event loop in a thread, outliving the callers' loops."""
    loop = asyncio.new_event_loop()
    server = ScriptedServer(*script)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result(10)
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.__aexit__(None, None, None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_one_client_serves_successive_event_loops():
    """A client built once (the runtime's) keeps working when the host runs a new event loop."""

    async def one(client: EngineClient) -> list[int]:
        return (await client.generate([1], {})).token_ids

    with server_in_thread(OK) as server:
        client = EngineClient(server.url, settings())
        assert asyncio.run(one(client)) == [7, 8]  # this loop ends with its session left open
        assert asyncio.run(one(client)) == [7, 8]
        asyncio.run(client.close())
    assert len(server.requests) == 2 and server.connections == 2  # one pool per loop
    assert not client._sessions, "close() closed the sessions of the loops that had ended"


def test_get_json_reads_an_endpoint():
    async def run():
        async with ScriptedServer(answer(200, b'{"status": "ok"}'), answer(503, b"down")) as server:
            client = EngineClient(server.url, settings())
            try:
                ok = await client.get_json("/health", timeout=5)
                with pytest.raises(EngineError) as info:
                    await client.get_json("/health", timeout=5)
            finally:
                await client.close()
            return ok, info.value, server

    ok, error, server = asyncio.run(run())
    assert ok == {"status": "ok"} and server.requests[0].startswith(b"GET /health HTTP/1.1")
    assert str(error) == f"{server.url}/health: HTTP 503: down (after 1 attempt)"


def test_a_url_that_is_not_http_is_refused_with_what_to_give():
    with pytest.raises(ValueError, match="is not an http"):
        EngineClient("localhost:30000")


def logprob_answer(entries: list, text: str = "hi") -> bytes:
    return answer(
        200,
        orjson.dumps(
            {"text": text, "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": entries}}
        ),
    )


def test_a_log_prob_as_low_as_a_sampled_token_can_have_is_taken_and_a_lower_one_refused():
    """A log-prob's floor is MIN_LOG_PROB (-1e4): far below a token sampled from a float32
    softmax (about -103.3) and any logit gap of a real model; -1e30 is no token's, and -1e39 is
    past float32 (a trainer's loss or the coordinator's frames could not take it)."""

    async def run():
        script = (
            logprob_answer([[-9999.5, 7], [-103.3, 8]]),
            logprob_answer([[-0.5, 7], [-1e30, 8]]),
            logprob_answer([[-1e39, 7]]),
        )
        async with ScriptedServer(*script) as server:
            client = EngineClient(server.url, settings())
            try:
                low = await client.generate([1], {"max_new_tokens": 4})
                errors = []
                for _ in range(2):
                    with pytest.raises(MalformedAnswer) as info:
                        await client.generate([1], {"max_new_tokens": 4})
                    errors.append(info.value)
            finally:
                await client.close()
            return low, errors

    low, errors = asyncio.run(run())
    assert low.logprobs == [-9999.5, -103.3] and MIN_LOG_PROB == -1e4
    assert [e.detail for e in errors] == [
        "log-prob -1e+30 is below -10000, lower than a sampled token's can be",
        "log-prob -1e+39 is below -10000, lower than a sampled token's can be",
    ]


def test_a_long_real_answer_is_within_its_request_limits():
    """The request's limits leave room for a real answer's worst case: every one of 1,024 tokens
    a 128-character text full of JSON punctuation, written twice (in `text` and in each entry)."""
    piece = '{"a": [1, 2]}, ' + "x" * 113
    entries = [[-0.5, 7, piece] for _ in range(1024)]
    body = orjson.dumps(
        {
            "text": piece * 1024,
            "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": entries},
        }
    )
    size, values = answer_limits(1024)
    assert 2 * values < len(body) < size, "the answer's values are counted, and it fits the byte allowance"

    async def run():
        async with ScriptedServer(answer(200, body)) as server:
            client = EngineClient(server.url, settings())
            try:
                return await client.generate([1], {"max_new_tokens": 1024})
            finally:
                await client.close()

    result = asyncio.run(run())
    assert len(result.token_ids) == 1024 and result.finish_reason == "length"


def test_an_error_answer_past_the_request_allowance_is_still_an_http_error():
    """Only a 200 answer is held to what its request allows: a proxy's large error page is the
    retryable HTTP error it is, quoted."""
    page = b"<html>" + b"busy " * 30_000

    async def run():
        async with ScriptedServer(answer(503, page)) as server:
            with pytest.raises(EngineError) as info:
                await call(EngineClient(server.url, settings(max_retries=0)))
            return info.value

    error = asyncio.run(run())
    assert len(page) > answer_limits(16)[0]
    assert error.retryable and not isinstance(error, MalformedAnswer)
    assert error.reason.startswith("HTTP 503: <html>busy"), error.reason


ABORT = answer(
    200,
    orjson.dumps(
        {"text": "", "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}
    ),
)


def test_a_peer_call_retries_aborts_and_lasting_faults_in_the_same_loop():
    """A peer's engine (`PeerRetry`): an `abort` answer, and a fault that outlived the call's
    retries, are tried again after the peer's wait, each told to `failed` first (None for an
    abort); `alive` runs before every attempt. Without the policy an `abort` answer is returned."""
    failed: list = []
    alive: list = []

    async def on_failed(error):
        failed.append(None if error is None else error.reason)

    peer = PeerRetry(wait_s=0.01, alive=lambda: alive.append(1), failed=on_failed)

    async def run():
        script = (ABORT, answer(503, b"updating"), answer(503, b"updating"), OK)
        async with ScriptedServer(*script) as server:
            result = await call(EngineClient(server.url, settings(max_retries=1)), peer=peer)
        async with ScriptedServer(ABORT) as server:
            own = await call(EngineClient(server.url, settings()))
        return result, own, server

    result, own, _ = asyncio.run(run())
    assert result.token_ids == [7, 8] and result.retries == 3
    assert failed == [None, "HTTP 503: updating"] and len(alive) == 4
    assert own.finish_reason == "abort" and own.retries == 0


def test_a_peer_call_ends_at_its_deadline_with_its_last_answer_or_fault():
    """No wait of the peer's crosses the call's deadline: its last `abort` answer is returned, its
    last fault raised, neither told to `failed`."""
    failed: list = []

    async def on_failed(error):
        failed.append(error)

    peer = PeerRetry(wait_s=30.0, alive=lambda: None, failed=on_failed)

    async def run():
        async with ScriptedServer(ABORT) as server:
            aborted = await call(
                EngineClient(server.url, settings()), peer=peer, deadline=time.monotonic() + 5
            )
        async with ScriptedServer(answer(500, b"down")) as server:
            with pytest.raises(EngineError) as info:
                await call(
                    EngineClient(server.url, settings(max_retries=0)),
                    peer=peer,
                    deadline=time.monotonic() + 5,
                )
        return aborted, info.value

    aborted, error = asyncio.run(run())
    assert aborted.finish_reason == "abort" and aborted.retries == 0
    assert error.retryable and error.reason == "HTTP 500: down" and error.attempts == 1
    assert failed == []
