"""Streamed engine calls over real sockets: the engine client's `on_tokens` against the stub engine
and the embedded engine (both answer `"stream": true` as SGLang does), a stream its caller ends
midway, faults before and after the first chunk, the recording proxy in between, and a streamed
turn (`Episode.generate(..., on_tokens=...)`) recorded exactly as a plain one."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from _host import engine_faults, engine_stats, group, params, slime_args
from _raw_server import ScriptedServer, answer
from _recorder import RecordingProxy

from mrlx_lab.stub_engine import start_stub_engine
from mrlx_lab.stub_engine.answers import STREAM_ERROR
from mrlx_plugin import Outcome, System, hookimpl
from mrlx_plugin.core.config import EngineSettings
from mrlx_plugin.core.engine_client import EngineClient, EngineError, MalformedAnswer
from mrlx_plugin.core.retry import wait_until
from mrlx_plugin.local.services import start_engine
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime

PROMPT = [1, 74, 75, 20, 21, 9]


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


class HungUp(Exception):
    """What an `on_tokens` raises when its own client went away."""


class Collect:
    """An `on_tokens` that keeps each chunk's ids, and awaits `first(ids)` on the first chunk
    (which may look at the engine meanwhile, or raise to end the call)."""

    def __init__(self, first: Callable[[list[int]], Awaitable[None]] | None = None):
        self.chunks: list[list[int]] = []
        self.first = first

    async def __call__(self, ids: list[int]) -> None:
        self.chunks.append(list(ids))
        if self.first is not None and len(self.chunks) == 1:
            await self.first(ids)

    @property
    def ids(self) -> list[int]:
        return [i for chunk in self.chunks for i in chunk]


async def hang_up(ids: list[int]) -> None:
    raise HungUp


def call(url: str, on_tokens: Collect | None = None, **sampling: Any):
    """One `EngineClient.generate` of PROMPT (64 new tokens unless told), streamed to `on_tokens`."""

    async def go():
        settings = EngineSettings(max_retries=2, backoff_s=0.01, max_backoff_s=0.02, request_timeout_s=60)
        client = EngineClient(url, settings)
        try:
            return await client.generate(PROMPT, {"max_new_tokens": 64, **sampling}, on_tokens=on_tokens)
        finally:
            await client.close()

    return asyncio.run(go())


def same_answer(a, b) -> None:
    assert (a.token_ids, a.logprobs, a.text, a.finish_reason, a.weight_version) == (
        b.token_ids,
        b.logprobs,
        b.text,
        b.finish_reason,
        b.weight_version,
    )
    assert (a.prompt_tokens, a.cached_tokens) == (b.prompt_tokens, b.cached_tokens)


@pytest.fixture
def stub_with(logs_dir, request):
    """`stub_with(*flags)`: a stub engine of its own with those flags."""
    started = []

    def start(*flags: str):
        stub = start_stub_engine(
            log_dir=logs_dir, name=f"stream-{request.node.name[:30]}-{len(started)}", extra=list(flags)
        )
        started.append(stub)
        return stub

    yield start
    for stub in started:
        stub.stop()


# --- the engine client against streams no engine should send ---------------------------------------


def chunk(entries: list, total: int, finish: Any = None, text: str = "") -> dict:
    meta = {"finish_reason": finish, "output_token_logprobs": entries, "completion_tokens": total}
    return {"text": text, "meta_info": {**meta, "prompt_tokens": 6, "weight_version": "3"}}


def stream(*events: object, done: bool = True) -> bytes:
    """A 200 answer streaming `events` (chunks as JSON, bytes as they are), then `[DONE]`."""
    body = b"".join(e if isinstance(e, bytes) else b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    body += b"data: [DONE]\n\n" if done else b""
    return b"HTTP/1.1 200 X\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


STOP = {"type": "stop"}
WHOLE = answer(200, orjson.dumps(chunk([[-0.5, 7], [-0.25, 8]], 2, STOP, "hi")))


def scripted(*script: bytes, max_new_tokens: int = 16) -> tuple[Any, Collect, int]:
    """(the result or the error, what on_tokens got, the requests made) of one streamed call to a
    server answering `script` in turn."""
    got = Collect()

    async def go():
        async with ScriptedServer(*script) as server:
            settings = EngineSettings(max_retries=2, backoff_s=0.01, max_backoff_s=0.02)
            client = EngineClient(server.url, settings)
            try:
                out = await client.generate([1, 2], {"max_new_tokens": max_new_tokens}, on_tokens=got)
            except EngineError as exc:
                out = exc
            finally:
                await client.close()
            return out, got, len(server.requests)

    return asyncio.run(go())


def test_completion_tokens_tell_an_incremental_chunk_from_a_cumulative_one():
    # The second chunk holds the very token of the first: cumulative, it would bring nothing new;
    # its completion_tokens (2) says it is incremental: one more token.
    incremental = stream(chunk([[0.0, 5]], 1), chunk([[0.0, 5]], 2), chunk([], 2, STOP, "b"))
    result, got, requests = scripted(incremental)
    assert result.token_ids == [5, 5] and got.chunks == [[5], [5]] and requests == 1
    cumulative = stream(chunk([[0.0, 5]], 1, None, "a"), chunk([[0.0, 5], [-1.0, 6]], 2, STOP, "ab"))
    result, got, _ = scripted(cumulative)
    assert result.token_ids == [5, 6] and result.logprobs == [0.0, -1.0] and got.chunks == [[5], [6]]
    assert (result.text, result.finish_reason, result.weight_version, result.prompt_tokens) == (
        "ab",
        "stop",
        "3",
        6,
    )


def test_a_stream_that_rewrites_the_tokens_it_gave_is_malformed():
    rewritten = stream(chunk([[-0.5, 7]], 1), chunk([[-0.5, 8], [-0.1, 9]], 2, STOP))
    error, got, requests = scripted(rewritten, WHOLE)
    assert isinstance(error, MalformedAnswer) and "does not repeat the 1 tokens" in str(error)
    assert got.chunks == [[7]] and requests == 1


def test_a_stream_cut_short_is_retried_only_while_nothing_was_passed_on():
    no_answer = stream(chunk([], 0), done=False)  # a chunk with no tokens, then the end: nothing shown
    result, got, requests = scripted(no_answer, WHOLE)
    assert result.retries == 1 and requests == 2 and got.chunks == []  # the whole answer: not passed on
    assert result.token_ids == [7, 8] and result.text == "hi"
    one_chunk = stream(chunk([[-0.5, 7]], 1), done=False)
    error, got, requests = scripted(one_chunk, WHOLE)
    assert isinstance(error, EngineError) and not error.retryable and requests == 1
    assert "before a chunk with a finish_reason" in str(error) and got.chunks == [[7]]
    after_the_end = stream(chunk([[-0.5, 7]], 1, STOP), chunk([[-0.5, 7]], 1, STOP))
    error, got, requests = scripted(after_the_end, WHOLE)
    assert isinstance(error, EngineError) and not error.retryable and requests == 1
    assert "a chunk after the one with the finish_reason" in str(error)


def test_a_stream_chunk_is_held_to_what_a_whole_answer_may_take():
    big = chunk([[-0.5, 7]], 1, None, "x" * 70_000)  # over what an answer of 1 token may take
    error, got, requests = scripted(stream(big, chunk([[-0.5, 7]], 1, STOP)), max_new_tokens=1)
    assert isinstance(error, MalformedAnswer) and "more than an answer of max_new_tokens 1" in str(error)
    assert got.chunks == [] and requests == 1
    many = stream(chunk([[-0.5, 7]], 1), chunk([[-0.5, 7], [-0.5, 8]], 2, STOP))
    error, got, _ = scripted(many, max_new_tokens=1)
    assert isinstance(error, MalformedAnswer) and "2 tokens for a request of max_new_tokens 1" in str(error)


# --- the engine client against the stub engine ----------------------------------------------------


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_a_streamed_call_passes_each_chunk_on_and_returns_the_plain_answer(stub_with, incremental):
    flags = ["--response-tokens", "30", "--stream-tokens", "3"]
    stub = stub_with(*flags, *(["--incremental-streaming-output"] if incremental else []))
    got = Collect()
    streamed = call(stub.url, got)
    assert get(stub.url + "/_stub/last")["stream"] is True
    plain = call(stub.url)
    assert "stream" not in get(stub.url + "/_stub/last")
    assert len(got.chunks) == 10 and all(len(chunk) == 3 for chunk in got.chunks)
    assert got.ids == streamed.token_ids and len(streamed.token_ids) == 30
    same_answer(streamed, plain)
    assert streamed.finish_reason == "stop" and streamed.retries == 0
    stats = engine_stats(stub.url)
    assert stats["streams"] == 1 and stats["generate_ok"] == 2 and stats["pending"] == 0


def test_a_streamed_answer_is_checked_as_a_whole_one_is(stub_with):
    stub = stub_with("--response-tokens", "30", "--stream-tokens", "4")
    engine_faults(stub.url, "positive_logprob", 1)  # in the first chunk: nothing is passed on
    got = Collect()
    with pytest.raises(MalformedAnswer, match="log-prob 3.0 is positive"):
        call(stub.url, got)
    assert got.chunks == []
    engine_faults(stub.url, "too_many_tokens", 1)  # chunks past the request's max_new_tokens
    got = Collect()
    with pytest.raises(MalformedAnswer, match="20 tokens for a request of max_new_tokens 16"):
        call(stub.url, got, max_new_tokens=16)
    assert [len(chunk) for chunk in got.chunks] == [4, 4, 4, 4]
    assert engine_stats(stub.url)["generate"] == 2  # neither was retried


def test_a_fault_before_the_first_chunk_is_retried_and_one_after_it_is_not(stub_with):
    stub = stub_with("--response-tokens", "30", "--stream-tokens", "3")
    plain = call(stub.url)
    engine_faults(stub.url, "http500", 1)
    got = Collect()
    retried = call(stub.url, got)
    assert retried.retries == 1 and got.ids == retried.token_ids  # the failed attempt passed nothing on
    same_answer(retried, plain)

    before = engine_stats(stub.url)["generate"]
    engine_faults(stub.url, "cut", 1)
    got = Collect()
    with pytest.raises(EngineError) as cut:
        call(stub.url, got)
    assert not cut.value.retryable and cut.value.attempts == 1
    assert "after 3 streamed tokens were passed on (not retried)" in str(cut.value)
    assert got.chunks == [plain.token_ids[:3]]

    engine_faults(stub.url, "stream_error", 1)
    got = Collect()
    with pytest.raises(EngineError, match=STREAM_ERROR) as refused:
        call(stub.url, got)
    assert not refused.value.retryable and len(got.chunks) == 1
    assert engine_stats(stub.url)["generate"] == before + 2  # one attempt each

    engine_faults(stub.url, "cut", 1)  # the same fault unstreamed: a cut-off answer, retried
    again = call(stub.url)
    assert again.retries == 1
    same_answer(again, plain)


@pytest.mark.parametrize("raised", [HungUp, ConnectionResetError])
def test_a_stream_its_caller_ends_midway_frees_the_stub_engines_request(stub_with, raised):
    # 32 chunks half a second apart: the stream would run 16 s.
    stub = stub_with("--response-tokens", "32", "--stream-tokens", "1", "--stream-delay", "0.5")

    async def fail(ids: list[int]) -> None:
        raise raised("the caller's client went away")

    got = Collect(fail)
    with pytest.raises(raised):  # as it was raised: not an engine fault, and not retried
        call(stub.url, got)
    assert len(got.chunks) == 1
    wait_until(
        lambda: engine_stats(stub.url)["cancelled"] == 1,
        10,
        what="the stub engine to see the stream closed",
    )
    stats = engine_stats(stub.url)
    assert stats["pending"] == 0 and stats["generate"] == 1 and stats["generate_ok"] == 0
    assert get(stub.url + "/v1/loads")["loads"][0]["num_running_reqs"] == 0
    # It goes on serving.
    assert call(stub.url, Collect(), max_new_tokens=2).finish_reason == "length"


# --- through the recording proxy --------------------------------------------------------------------


def test_the_recording_proxy_passes_a_stream_on_as_it_comes_and_records_it_as_a_plain_call(stub_with):
    # 4 chunks 0.3 s apart.
    stub = stub_with("--response-tokens", "12", "--stream-tokens", "3", "--stream-delay", "0.3")
    proxy = RecordingProxy(stub.url).start()
    try:
        under_way: list[int] = []

        async def look(ids: list[int]) -> None:
            under_way.append((await asyncio.to_thread(engine_stats, stub.url))["pending"])

        got = Collect(look)
        streamed = call(proxy.url, got)
        plain = call(proxy.url)
        # The first chunk reached the client while the engine still had the others to send.
        assert under_way == [1]
        assert len(got.chunks) == 4 and got.ids == streamed.token_ids
        same_answer(streamed, plain)
        record = {
            "input_ids": PROMPT,
            "ids": streamed.token_ids,
            "logprobs": streamed.logprobs,
            "version": streamed.weight_version,
            "finish": streamed.finish_reason,
        }
        assert proxy.calls == [record, record] and proxy.streamed == 1

        # A client that hangs up midway: the proxy hangs up on the engine too, and keeps nothing.
        with pytest.raises(HungUp):
            call(proxy.url, Collect(hang_up))
        wait_until(lambda: engine_stats(stub.url)["cancelled"] == 1, 10, what="the proxy to close the stream")
        assert len(proxy.calls) == 2 and proxy.streamed == 1
    finally:
        proxy.stop()


# --- the embedded engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def incremental_engine(tiny_model_dir, logs_dir):
    proc = start_engine(
        tiny_model_dir,
        log_dir=logs_dir,
        name="engine-incremental-stream",
        extra=["--seed", "0", "--incremental-streaming-output"],
        threads=1,
    )
    yield proc
    proc.stop()


@pytest.fixture(params=["cumulative", "incremental"])
def any_engine(request):
    return request.getfixturevalue("engine" if request.param == "cumulative" else "incremental_engine")


def test_the_embedded_engine_streams_each_step_while_it_generates(any_engine):
    url = any_engine.url
    running: list[int] = []

    async def look(ids: list[int]) -> None:
        running.append((await asyncio.to_thread(get, url + "/v1/loads"))["loads"][0]["num_running_reqs"])

    got = Collect(look)
    greedy = {"max_new_tokens": 600, "ignore_eos": True, "temperature": 0}
    streamed = call(url, got, **greedy)
    plain = call(url, **greedy)
    # The first tokens reached the client while the request was still generating.
    assert running == [1]
    assert len(got.chunks) > 1 and got.ids == streamed.token_ids
    assert len(streamed.token_ids) == 600 and streamed.finish_reason == "length"
    same_answer(streamed, plain)  # a solo greedy call: the same computation, streamed or not


def test_a_stream_closed_midway_aborts_its_request_in_the_embedded_engine(engine):
    info = engine.url + "/get_server_info"
    before = get(info)["aborted_requests"]
    got = Collect(hang_up)
    with pytest.raises(HungUp):
        call(engine.url, got, max_new_tokens=3000, ignore_eos=True)  # would run for seconds
    assert len(got.chunks) == 1
    wait_until(
        lambda: get(info)["aborted_requests"] == before + 1 and get(info)["num_running_reqs"] == 0,
        30,
        what="the engine to abort the request whose stream was closed",
    )
    wait_until(lambda: "closed the stream" in engine.log_tail(200), 10, what="the engine to log the abort")
    # It goes on serving, streamed or not.
    assert call(engine.url, Collect(), max_new_tokens=4, temperature=0).finish_reason == "length"
    assert call(engine.url, max_new_tokens=4, temperature=0).finish_reason == "length"


# --- a streamed turn --------------------------------------------------------------------------------

SHOWN: list[list[int]] = []  # what the system's on_tokens received
STREAM = {"on": True}


async def _one_turn(episode):
    t = episode.new_transcript("solver", [{"role": "user", "content": episode.problem}])

    async def show(ids: list[int]) -> None:
        SHOWN.append(list(ids))

    await episode.generate(t, score=lambda turn: 1.0, on_tokens=show if STREAM["on"] else None)
    return Outcome(final_transcript=t)


@hookimpl
def mrlx_register_systems():
    return {"stream_turn": System(run=_one_turn, turns=lambda s: {"solver": 1}, scores_candidates=True)}


def run_episode(url: str, model_dir, stream: bool, **mrlx_extra: Any) -> list:
    mrlx = {
        "run_id": "stream-test",
        "plugins": ["test_engine_stream"],
        "system": "stream_turn",
        "agents": {"solver": {"url": "self"}},
        "engine": {"max_retries": 0, "request_timeout_s": 10},
        **mrlx_extra,
    }
    STREAM["on"] = stream

    async def go():
        args = slime_args(url, str(model_dir), mrlx)
        try:
            return await generate(args, group(0, 1)[0], params(args))
        finally:
            await (await get_runtime(args)).aclose()

    return asyncio.run(go())


@pytest.fixture
def proxied_stub(stub_with, tiny_model_dir):
    stub = stub_with("--tokenizer", str(tiny_model_dir), "--response-tokens", "40")
    proxy = RecordingProxy(stub.url).start()
    SHOWN.clear()
    yield proxy
    proxy.stop()


def test_a_turn_streams_its_tokens_and_is_recorded_as_a_plain_turn(proxied_stub, tiny_model_dir):
    [streamed] = run_episode(proxied_stub.url, tiny_model_dir, stream=True)
    shown = list(SHOWN)
    [plain] = run_episode(proxied_stub.url, tiny_model_dir, stream=False)
    assert shown == SHOWN  # the plain turn showed nothing
    one, two = proxied_stub.calls
    assert proxied_stub.streamed == 1 and one == two  # the same request, the same answer
    assert len(shown) > 1 and [i for chunk in shown for i in chunk] == one["ids"]
    assert streamed.tokens == one["input_ids"] + one["ids"]
    fields = ("tokens", "response", "response_length", "loss_mask", "rollout_log_probs", "status", "reward")
    for field in fields:
        assert getattr(streamed, field) == getattr(plain, field), field
    assert streamed.rollout_log_probs[-len(one["ids"]) :] == one["logprobs"]


@pytest.mark.parametrize(
    "setting",
    [
        {"rewards": {"credit": "turn", "branch": 2}},  # tree sampling: one of two answers is kept
        {"agents": {"solver": {"url": "self", "retry_on_abort": True}}},  # a peer, answered again on abort
    ],
    ids=["branched", "peer"],
)
def test_a_turn_whose_answer_may_not_be_the_one_kept_is_not_streamed(proxied_stub, tiny_model_dir, setting):
    samples = run_episode(proxied_stub.url, tiny_model_dir, stream=True, **setting)
    assert samples and SHOWN == []
    assert proxied_stub.streamed == 0 and len(proxied_stub.calls) == (2 if "rewards" in setting else 1)
