"""The pipeline written as agent code, as `mrlx bench agents` runs it: the example's episode
(`mrlx_lab.examples.pipeline_as_code`) with its turns sent as plain HTTP over one aiohttp session
(`pipeline_code_http`), beside the example itself (the official `openai` client's chat
completions), and the same episode through each other API and its official client: the `openai`
client's Responses API (`pipeline_code_responses`), Anthropic's client and its Messages API
(`pipeline_code_anthropic`), the `openai` client's chat completions streamed
(`pipeline_code_stream`), and over the in-process transport, no socket (`pipeline_code_local`)."""

from __future__ import annotations

import asyncio
import functools
import weakref

import aiohttp
import anthropic
import openai

from mrlx_lab.examples.pipeline_as_code.hooks import NUM_PARALLEL, client, pipeline
from mrlx_plugin import hookimpl
from mrlx_plugin.agents import agent_code
from mrlx_plugin.agents.local_client import local_http_client

_sessions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def ask_http(endpoint, content: str) -> str:
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None:
        session = _sessions[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    body = {"model": endpoint.model, "messages": [{"role": "user", "content": content}]}
    headers = {"Authorization": f"Bearer {endpoint.api_key}"}
    async with session.post(endpoint.base_url + "/chat/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        answer = await resp.json()
    return answer["choices"][0]["message"]["content"] or ""


async def ask_responses(endpoint, content: str) -> str:
    answer = await client(endpoint).responses.create(model=endpoint.model, input=content)
    return answer.output_text


async def ask_stream(endpoint, content: str) -> str:
    stream = await client(endpoint).chat.completions.create(
        model=endpoint.model, messages=[{"role": "user", "content": content}], stream=True
    )
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    return "".join(parts)


_local: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def ask_local(endpoint, content: str) -> str:
    """The example's turn through the `openai` client over the in-process transport (no socket)."""
    loop = asyncio.get_running_loop()
    base = _local.get(loop)
    if base is None:
        base = _local[loop] = openai.AsyncOpenAI(
            base_url=endpoint.base_url,
            api_key=endpoint.api_key,
            max_retries=0,
            http_client=local_http_client(),
        )
    answer = await base.with_options(api_key=endpoint.api_key).chat.completions.create(
        model=endpoint.model, messages=[{"role": "user", "content": content}]
    )
    return answer.choices[0].message.content or ""


_anthropic: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def ask_anthropic(endpoint, content: str) -> str:
    loop = asyncio.get_running_loop()
    base = _anthropic.get(loop)
    if base is None:
        base = _anthropic[loop] = anthropic.AsyncAnthropic(
            base_url=endpoint.base_url.removesuffix("/v1"), api_key=endpoint.api_key, max_retries=0
        )
    answer = await base.with_options(api_key=endpoint.api_key).messages.create(
        model=endpoint.model, max_tokens=4096, messages=[{"role": "user", "content": content}]
    )
    return "".join(b.text for b in answer.content if b.type == "text")


async def aclose() -> None:
    """Close this loop's sessions and clients (the benchmark's worker calls it when it is done)."""
    loop = asyncio.get_running_loop()
    session = _sessions.pop(loop, None)
    if session is not None:
        await session.close()
    for clients in (_anthropic, _local):
        other = clients.pop(loop, None)
        if other is not None:
            await other.close()
    from mrlx_lab.examples.pipeline_as_code.hooks import aclose as close_openai

    await close_openai()


def _pipeline(ask) -> object:
    return agent_code(
        functools.partial(pipeline, ask=ask),
        samples={"solver": NUM_PARALLEL, "rewriter": NUM_PARALLEL, "selector": 1},
        turns={"solver": 1, "rewriter": 1, "selector": 1},
    )


@hookimpl
def mrlx_register_systems():
    return {
        "pipeline_code_http": _pipeline(ask_http),
        "pipeline_code_responses": _pipeline(ask_responses),
        "pipeline_code_anthropic": _pipeline(ask_anthropic),
        "pipeline_code_stream": _pipeline(ask_stream),
        "pipeline_code_local": _pipeline(ask_local),
    }
