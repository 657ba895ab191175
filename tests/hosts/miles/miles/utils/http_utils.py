"""Stands in for `miles.utils.http_utils`: JSON GET/POST from rollout code (raises on HTTP errors)."""

from __future__ import annotations

from typing import Any

import aiohttp

_TIMEOUT = aiohttp.ClientTimeout(total=30)


async def get(url: str) -> Any:
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as session, session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)


async def post(url: str, payload: Any) -> Any:
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as session, session.post(url, json=payload) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)
