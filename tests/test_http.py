"""The shared plumbing of the package's clients and servers: the one policy of which HTTP answers
may pass (`core/http.py`), the reader of a body of a declared length (`core/netutil.py`), and the
one way to wait for a condition (`core/retry.py`)."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from _raw_server import ScriptedServer, answer

from mrlx_plugin.core.config import EngineSettings
from mrlx_plugin.core.engine_client import EngineClient, EngineError
from mrlx_plugin.core.http import RETRYABLE_STATUS, retry_after
from mrlx_plugin.core.netutil import BodyLengthError, read_declared
from mrlx_plugin.core.retry import Backoff, Deadline, async_wait_until, wait_until
from mrlx_plugin.link.client import CoordinatorClient, CoordinatorError


def test_both_clients_retry_the_same_statuses_and_fail_at_once_on_the_others():
    async def run():
        outcomes = {}
        for status in (500, 503, 404):
            async with ScriptedServer(
                answer(status, b'{"error": "no"}'), answer(200, b'{"ok": true}')
            ) as coord:
                client = CoordinatorClient(coord.url, run_id="r", agent="a", backoff_base_s=0.01)
                try:
                    outcomes["coordinator", status] = (await client.health(), len(coord.requests))
                except CoordinatorError as exc:
                    outcomes["coordinator", status] = (exc.status, len(coord.requests))
                finally:
                    await client.close()
            ok = b'{"text": "", "meta_info": {"finish_reason": "stop", "output_token_logprobs": [[-0.5, 7]]}}'
            async with ScriptedServer(answer(status, b"no"), answer(200, ok)) as engine:
                client = EngineClient(engine.url, EngineSettings(max_retries=2, backoff_s=0.01))
                try:
                    outcomes["engine", status] = (
                        (await client.generate([1], {})).token_ids,
                        len(engine.requests),
                    )
                except EngineError as exc:
                    outcomes["engine", status] = (exc.retryable, len(engine.requests))
                finally:
                    await client.close()
        return outcomes

    outcomes = asyncio.run(run())
    assert {500, 503} <= RETRYABLE_STATUS and 404 not in RETRYABLE_STATUS
    for status in (500, 503):
        assert outcomes["coordinator", status] == ({"ok": True}, 2), outcomes
        assert outcomes["engine", status] == ([7], 2), outcomes
    assert outcomes["coordinator", 404] == (404, 1) and outcomes["engine", 404] == (False, 1), outcomes


def test_retry_after_is_bounded_and_read_only_as_seconds():
    assert retry_after("2.5") == 2.5 and retry_after(None) == 0.0 and retry_after("-3") == 0.0
    assert retry_after("3600") == 60.0 and retry_after("nan") == 0.0
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


class Stream:
    """What `read_declared` reads: chunks, then b"" (the end of the body)."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


@pytest.mark.parametrize("reused", [False, True], ids=["grown", "reused"])
def test_a_declared_body_is_read_whole_and_refused_when_short_or_long(reused):
    def buffer() -> bytearray:
        return bytearray(b"x" * 16) if reused else bytearray()

    async def read(length: int, *chunks: bytes) -> tuple[bytes | BodyLengthError, bytearray]:
        buf = buffer()
        try:
            return bytes(await read_declared(Stream(*chunks), length, buf)), buf
        except BodyLengthError as exc:
            return exc, buf

    body, _ = asyncio.run(read(6, b"abc", b"def"))
    assert body == b"abcdef"
    short, buf = asyncio.run(read(6, b"abc"))
    assert isinstance(short, BodyLengthError) and (short.received, short.length) == (3, 6), short
    assert "ended after 3 of its 6 bytes" in str(short)
    buf += b"!"  # nothing holds a view of the buffer once the read failed: it can be reused
    long, _ = asyncio.run(read(4, b"abc", b"def"))
    assert isinstance(long, BodyLengthError) and long.received == 6 and "longer than" in str(long)


def test_wait_until_returns_what_held_and_names_what_never_did():
    calls = []

    def third_time() -> int:
        calls.append(1)
        return len(calls) if len(calls) >= 3 else 0

    assert wait_until(third_time, 10, every=0.001) == 3
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        wait_until(
            lambda: False,
            Deadline(0.2),
            what="the impossible",
            every=Backoff(0.01, 0.05),
            details=lambda: "ctx",
        )
    assert 0.2 <= time.monotonic() - started < 5
    assert re.fullmatch(r"waited [\d.]+ s for the impossible; it never held\nctx", str(info.value)), (
        info.value
    )


def test_async_wait_until_awaits_a_coroutine_predicate_and_lets_the_loop_run():
    async def run() -> object:
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, done.set)

        async def is_set() -> bool:
            return done.is_set()

        got = await async_wait_until(is_set, 10, what="the event")
        with pytest.raises(TimeoutError, match="waited .* s for never; it never held"):
            await async_wait_until(lambda: None, 0.1, what="never")
        return got

    assert asyncio.run(run()) is True
