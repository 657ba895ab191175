"""The pipeline written as agent code, as `mrlx bench agents` runs it: the example's episode
(`mrlx_lab.examples.pipeline_as_code`) with its turns sent as plain HTTP over one aiohttp session, beside the
example itself (the official `openai` client). Registered as `pipeline_code_http`."""

from __future__ import annotations

import asyncio
import functools
import weakref

import aiohttp

from mrlx_lab.examples.pipeline_as_code.hooks import NUM_PARALLEL, pipeline
from mrlx_plugin import hookimpl
from mrlx_plugin.agents import agent_code

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


async def aclose() -> None:
    """Close this loop's session (the benchmark's worker calls it when it is done)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


PIPELINE_HTTP = agent_code(
    functools.partial(pipeline, ask=ask_http),
    samples={"solver": NUM_PARALLEL, "rewriter": NUM_PARALLEL, "selector": 1},
    turns={"solver": 1, "rewriter": 1, "selector": 1},
)


@hookimpl
def mrlx_register_systems():
    return {"pipeline_code_http": PIPELINE_HTTP}
