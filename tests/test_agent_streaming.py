"""Streamed chat completions, the in-process client, and what the endpoint says to what it does
not serve: the official `openai` SDK streams a tool call and an answer (the tokens as the engine
samples them; the trained ids exactly the engine's), a client that leaves a stream midway gets
that turn undone, the in-process transport answers and trains as a socket does, refusals come in
the API's error shape with `x-should-retry: false`, and each request field a harness sends is
honoured, ignored as documented, or refused with its reason."""

from __future__ import annotations

import functools
import json

import aiohttp
import openai
import pytest
from test_agent_attacks import ANSWER, CALL, LOOKUP, USER, assert_trains_only_engine_ids, episode, post

from mrlx_plugin.agents.local_client import local_http_client
from mrlx_plugin.core.host import Status


@pytest.fixture
def slow_engine_for(engine_for):
    """The scripted stub engine (conftest), streaming 2 tokens every 50 ms (a client can leave
    before the end)."""
    return functools.partial(engine_for, extra=("--stream-tokens", "2", "--stream-delay", "0.05"))


# An answer long enough to arrive in several chunks (67 tokens: within the stub's 80).
LONG = "The value stored under x7 is 42, as the lookup said; " * 2 + "\\boxed{42}."


def client(ep, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, **{"max_retries": 0, **kw})


async def streamed(c, messages, **kw) -> tuple[list[str], dict, list]:
    """One streamed call: its content deltas, the message the chunks make, and all chunks."""
    deltas, calls, chunks = [], {}, []
    stream = await c.chat.completions.create(
        model="solver", messages=messages, stream=True, stream_options={"include_usage": True}, **kw
    )
    async for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += call.id or ""
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
    message = {"role": "assistant", "content": "".join(deltas)}
    if calls:
        message["tool_calls"] = [
            {"id": v["id"], "type": "function", "function": {"name": v["name"], "arguments": v["arguments"]}}
            for _, v in sorted(calls.items())
        ]
    return deltas, message, chunks


def test_a_streamed_tool_call_and_answer_train_the_engine_ids_exactly(engine_for, tiny_model_dir):
    proxy = engine_for(CALL, LONG)
    seen = {}

    async def script(task, endpoints):
        async with client(endpoints["solver"]) as c:
            messages = [USER]
            d1, first, chunks1 = await streamed(c, messages, tools=[LOOKUP])
            messages += [
                first,
                {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "42"},
            ]
            d2, second, chunks2 = await streamed(c, messages, tools=[LOOKUP])
        seen.update(d1=d1, first=first, c1=chunks1, d2=d2, second=second, c2=chunks2)
        return {"solver": 1.0}

    [[s]] = episode(proxy, tiny_model_dir, script)
    assert s.status == Status.COMPLETED and s.reward == 1.0
    # The call arrives whole in one chunk; the text before it streamed, the markup never shown.
    assert seen["first"]["content"] == "Let me look it up."
    [call] = seen["first"]["tool_calls"]
    assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"]) == {"key": "x7"}
    assert seen["c1"][-1].usage.completion_tokens == len(proxy.calls[0]["ids"])
    finish = [ch.choices[0].finish_reason for ch in seen["c1"] if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    # The answer came as the engine sampled it: more than one piece, the whole text in order.
    assert seen["second"]["content"] == LONG and len(seen["d2"]) > 1, "|".join(seen["d2"])
    # One conversation, continued: one sample, every trained token the engine's.
    one, two = proxy.calls
    assert s.tokens == two["input_ids"] + two["ids"]
    assert two["input_ids"][: len(one["input_ids"]) + len(one["ids"])] == one["input_ids"] + one["ids"]
    assert_trains_only_engine_ids([s], proxy.calls)


def test_a_client_that_leaves_a_stream_midway_gets_that_turn_undone(slow_engine_for, tiny_model_dir):
    proxy = slow_engine_for(LONG, ANSWER)
    seen = {}

    async def script(task, endpoints):
        ep = endpoints["solver"]
        async with client(ep) as c:
            stream = await c.chat.completions.create(model="solver", messages=[USER], stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break  # the first piece of text: the client leaves
            await stream.close()
            # Its retry opens the conversation afresh: the one place the system allows is free.
            again = await c.chat.completions.create(model="solver", messages=[USER])
        seen["again"] = again.choices[0].message.content
        return {"solver": 1.0}

    [[s]] = episode(proxy, tiny_model_dir, script)
    assert s.status == Status.COMPLETED, s.metadata["mrlx"]["abort_reason"]
    assert seen["again"] == ANSWER
    # Only the delivered turn trains: the sample is the retry's prompt and the engine's answer to it.
    last = proxy.calls[-1]
    assert last["ids"] and s.tokens == last["input_ids"] + last["ids"]
    assert s.metadata["mrlx"]["episode"]["agent_code"]["solver"]["undelivered"] == 1, s.metadata["mrlx"][
        "agents"
    ]


def test_refusals_come_in_the_apis_shape_and_say_what_is_served(engine_for, tiny_model_dir):
    proxy = engine_for(ANSWER, ANSWER)
    seen = {}

    async def script(task, endpoints):
        ep = endpoints["solver"]
        root = ep.base_url.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {ep.api_key}"}
        async with aiohttp.ClientSession() as s:
            for path in ("/v1/completions", "/chat/completions", "/v1/messages/batches", "/v1/embeddings"):
                async with s.post(root + path, json={}, headers=headers) as r:
                    seen[path] = (r.status, await r.json(), r.headers.get("x-should-retry"))
            async with s.get(root + "/v1/chat/completions", headers=headers) as r:
                seen["GET"] = (r.status, await r.json(), r.headers.get("x-should-retry"))
        # Fields a harness sends: honoured, ignored, or refused with the reason.
        for field, value in (
            ("logit_bias", {"50256": -100}),
            ("response_format", {"type": "json_object"}),
            ("functions", [{"name": "f"}]),
            ("logprobs", True),
            ("n", 2),
            ("frobnicate", 1),
        ):
            seen[field] = await post(ep, {"messages": [USER], field: value})
        seen["ignored"] = await post(
            ep,
            {
                "messages": [USER],
                "model": "gpt-4o",
                "store": False,
                "prompt_cache_key": "k",
                "safety_identifier": "u",
                "service_tier": "auto",
                "reasoning_effort": "low",
                "parallel_tool_calls": False,
                "logprobs": False,
                "response_format": {"type": "text"},
                "presence_penalty": 0,
                "frequency_penalty": 0,
                "stream": False,
            },
        )
        # The SDK's default two retries: a limit's 429 is tried once, not three times.
        async with client(ep, max_retries=2) as c:
            try:
                await c.chat.completions.create(
                    model="solver", messages=[{"role": "user", "content": "other"}]
                )
            except openai.RateLimitError as exc:
                seen["429"] = exc
        return {"solver": 1.0}

    [[s]] = episode(proxy, tiny_model_dir, script)
    for path in ("/v1/completions", "/chat/completions", "/v1/messages/batches", "/v1/embeddings"):
        status, body, retry = seen[path]
        assert status == 404 and retry == "false", (path, status)
        error = body["error"]
        message = error["message"] if isinstance(error, dict) else error
        assert "POST /v1/chat/completions" in message and "POST /v1/messages" in message, body
    assert seen["/v1/messages/batches"][1]["type"] == "error"  # Anthropic's shape where it looks like one
    assert "missing or doubling /v1" in seen["/chat/completions"][1]["error"]["message"]
    assert seen["GET"][0] == 405
    for field, why in (
        ("logit_bias", "token ids of the client's tokenizer"),
        ("response_format", "ask for JSON in the prompt"),
        ("functions", "send tools"),
        ("logprobs", "send logprobs=false"),
        ("n", "n must be 1"),
        ("frobnicate", "unsupported field"),
    ):
        status, body = seen[field]
        assert status == 400 and why in body["error"]["message"], (field, body)
    assert seen["ignored"][0] == 200, seen["ignored"]
    assert "conversation(s) one episode may hold" in seen["429"].message
    stats = s.metadata["mrlx"]["episode"]["agent_code"]["solver"]
    assert stats["refused"] == 7 and stats["requests"] == 8, stats  # the 429 tried once


def test_the_in_process_client_answers_and_trains_as_over_a_socket(slow_engine_for, tiny_model_dir):
    proxy = slow_engine_for(CALL, LONG, LONG)
    seen = {}

    async def script(task, endpoints):
        ep = endpoints["solver"]
        async with client(ep, http_client=local_http_client()) as c:
            first = await c.chat.completions.create(model="solver", messages=[USER], tools=[LOOKUP])
            msg = first.choices[0].message
            call = msg.tool_calls[0]
            tool = {"role": "tool", "tool_call_id": call.id, "content": "42"}
            messages = [USER, msg.model_dump(exclude_none=True), tool]
            seen["deltas"], seen["second"], _ = await streamed(c, messages, tools=[LOOKUP])
            # A stream the client leaves midway, in a conversation of its own: undone.
            other = [{"role": "user", "content": "Something else."}]
            stream = await c.chat.completions.create(model="solver", messages=other, stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break
            await stream.close()
            seen["models"] = [m.id async for m in c.models.list()]
        # Any other URL is not reached through it.
        elsewhere = openai.AsyncOpenAI(
            base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0, http_client=local_http_client()
        )
        try:
            await elsewhere.models.list()
        except openai.APIConnectionError as exc:
            seen["elsewhere"] = exc
        return {"solver": 1.0}

    [samples] = episode(proxy, tiny_model_dir, script, system="atk_two")
    assert seen["second"]["content"] == LONG and len(seen["deltas"]) > 1
    assert seen["models"] == ["solver"] and "elsewhere" in seen
    trained = [s for s in samples if not s.remove_sample]
    [s] = trained
    one, two = proxy.calls[:2]
    assert s.tokens == two["input_ids"] + two["ids"]
    assert two["input_ids"][: len(one["input_ids"]) + len(one["ids"])] == one["input_ids"] + one["ids"]
    assert_trains_only_engine_ids(samples, proxy.calls)
    assert s.metadata["mrlx"]["episode"]["agent_code"]["solver"]["undelivered"] == 1
