"""`mrlx engine`: an HTTP server speaking SGLang's protocol, backed by a transformers model on the CPU.

It stands in for an SGLang engine where there is no GPU (CI, a laptop), so the plugin's rollout
code runs unchanged end to end: token-in/token-out `/generate` with log-probs and weight
versions, aborts, pause/continue, weight reloads from disk, and LoRA adapters (`--lora-paths`,
`/load_lora_adapter`, `/unload_lora_adapter`, `lora_path` per request). The real `sglang-router` can sit
in front of it (`router_command` gives a command line that works; `--router-url` registers).

This module is the HTTP side: the request models (pydantic; SGLang's field names, defaults and
refusals), `EngineServer` (the endpoints), router registration and the command line. The model
side, with how batching, log-probs and sampling work, is `batcher.py`. The aiohttp event loop
only parses, validates and answers; one `BatchWorker` thread owns the model and generates, and
hands each `Job`'s result back to the loop through a future.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from mrlx_plugin.core.netutil import free_port, public_bind_refusal, write_port_file
from mrlx_plugin.core.retry import Backoff, Deadline, retry
from mrlx_plugin.local.batcher import AdapterUpdate, BatchWorker, Job, JobResult, WeightUpdate, load_torch
from mrlx_plugin.local.requests import (
    DEFAULT_MAX_NEW_TOKENS,
    AbortRequest,
    GenerateRequest,
    LoadLoraAdapterRequest,
    PauseRequest,
    RequestError,
    SamplingParams,
    UnloadLoraAdapterRequest,
    UpdateWeightsRequest,
    split_generate_body,
    validate,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_BODY_BYTES",
    "EngineServer",
    "GenerateRequest",
    "RequestError",
    "SamplingParams",
    "add_engine_arguments",
    "deregister_from_router",
    "main",
    "register_with_router",
    "router_command",
    "run",
]

log = logging.getLogger("mrlx.engine")

# A client may send long prompts as JSON id lists; aiohttp's default body limit is 1 MiB.
MAX_BODY_BYTES = 64 * 1024 * 1024


# --------------------------------------------------------------------------------------------
# The sglang-router command line
# --------------------------------------------------------------------------------------------


def router_command(
    host: str,
    port: int,
    worker_urls: Sequence[str] = (),
    *,
    prometheus_port: int | None = None,
    log_level: str = "warn",
    python: str | None = None,
) -> list[str]:
    """The argv that starts the real `sglang-router` in front of engines of this module.

    Checked against sglang-router 0.3.x:
    - `--worker-urls` may be empty: engines then register themselves (`mrlx engine
      --router-url`; sglang-router 0.3 takes `POST /workers {"url": ...}`, older ones
      `POST /add_worker?url=...`; `register_with_router` tries both).
    - The router always starts a Prometheus exporter (default 0.0.0.0:29000, which clashes
      between routers and listens beyond loopback): it is bound next to the router on `host`
      and a free port.
    - The circuit breaker is disabled (as slime does): a slow CPU engine must not be taken
      out of rotation for being slow. The router's own health checks stay on, at a short
      interval, and workers given with `--worker-urls` are polled every second at startup.
    - On registration the router reads the worker's `/server_info` and `/model_info` and
      loads the tokenizer from the `model_path` found there (a local directory here).
    """
    if prometheus_port is None:
        prometheus_port = free_port(host)
    argv = [
        python or sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--disable-circuit-breaker",
        "--health-check-interval-secs",
        "5",
        "--worker-startup-timeout-secs",
        "120",
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        log_level,
    ]
    if worker_urls:
        argv += ["--worker-urls", *worker_urls]
    return argv


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(message: str, status: int = 400, field: str | None = None) -> web.Response:
    err: dict[str, Any] = {"message": message, "code": status}
    if field:
        err["field"] = field
    return _json({"error": err}, status)


async def _read_json(request: web.Request, required: bool = True) -> Any:
    body = await request.read()
    if not body.strip():
        if required:
            raise RequestError("body", "is empty; send a JSON object")
        return {}
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError("body", f"is not valid JSON ({exc})") from None


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


class EngineServer:
    """The HTTP front of a `BatchWorker`."""

    def __init__(self, worker: BatchWorker, *, host: str, advertise_host: str, threads: int):
        self.worker = worker
        self.host = host
        self.advertise_host = advertise_host
        self.port = 0
        self.threads = threads
        self.started = time.time()
        self.held = 0  # /generate calls waiting for /continue_generation
        self._update_lock = asyncio.Lock()
        self._resumed = asyncio.Event()
        self._resumed.set()

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/get_model_info", "/model_info"):  # the router reads /model_info
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/get_weight_version", lambda _: _json({"weight_version": self.worker.weight_version}))
        r.add_get("/v1/loads", self.v1_loads)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        return app

    # --- /generate -------------------------------------------------------------------------

    async def _jobs(self, body: Any) -> tuple[list[Job], list[asyncio.Future], bool]:
        w = self.worker
        parts, batched = split_generate_body(body)
        reqs = [
            (validate(GenerateRequest, item, renamed, vocab_size=w.vocab_size), renamed)
            for item, renamed in parts
        ]
        loop = asyncio.get_running_loop()
        texts = [r.text for r, _ in reqs if r.text is not None]
        if texts:
            encode = w.tokenizer.encode
            encoded = iter(
                await loop.run_in_executor(None, lambda: [encode(t, add_special_tokens=False) for t in texts])
            )
        jobs, futures = [], []
        for req, renamed in reqs:
            where = (
                renamed.get("input_ids", "input_ids")
                if req.input_ids is not None
                else renamed.get("text", "text")
            )
            prompt = req.input_ids if req.input_ids is not None else next(encoded)
            if req.lora_path is not None:
                self._check_adapter(req.lora_path, renamed.get("lora_path", "lora_path"))
            if len(prompt) >= w.max_positions:
                raise RequestError(
                    where,
                    f"the prompt has {len(prompt)} tokens; this model takes at most "
                    f"{w.max_positions - 1} prompt tokens",
                )
            if req.logprob_start_len >= len(prompt):
                raise RequestError(
                    "logprob_start_len",
                    f"must be -1 (no prompt log-probs) or in [0, {len(prompt)}), got {req.logprob_start_len}",
                )
            fut: asyncio.Future = loop.create_future()

            def deliver(result: JobResult, fut: asyncio.Future = fut) -> None:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

            start = req.logprob_start_len if req.return_logprob else -1
            jobs.append(
                Job(
                    req.rid or uuid.uuid4().hex,
                    prompt,
                    req.sampling_params,
                    req.return_logprob,
                    start,
                    deliver,
                    adapter=req.lora_path,
                )
            )
            futures.append(fut)
        return jobs, futures, batched

    def _check_adapter(self, name: str, where: str) -> None:
        w = self.worker
        if not w.enable_lora:
            raise RequestError(
                where,
                f"asks for LoRA adapter {name!r}, but this engine serves none; start it with --lora-paths "
                "NAME=DIR (or --enable-lora, then POST /load_lora_adapter)",
            )
        if name not in w.adapters:
            loaded = ", ".join(sorted(dict(w.adapters))) or "none"
            raise RequestError(
                where,
                f"no LoRA adapter named {name!r} is loaded (loaded: {loaded}); load it with POST "
                "/load_lora_adapter or --lora-paths, or send the name of a loaded one",
            )

    @staticmethod
    def _result_json(result: JobResult) -> dict[str, Any]:
        job = result.job
        meta: dict[str, Any] = {
            "id": job.rid,
            "finish_reason": job.finish,
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": len(job.out_ids),
            "cached_tokens": 0,
            "weight_version": result.weight_version,
            "e2e_latency": time.monotonic() - job.created,
        }
        if job.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(job.out_logprobs, job.out_ids)]
            if job.input_logprobs is not None:
                ids = job.prompt_ids[job.logprob_start_len :]
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(job.input_logprobs, ids)]
        return {"text": result.text, "meta_info": meta}

    async def generate(self, request: web.Request) -> web.Response:
        try:
            jobs, futures, batched = await self._jobs(await _read_json(request))
        except RequestError as exc:
            return _error(exc.message, 400, exc.field)
        if not self._resumed.is_set():  # paused: new requests wait for /continue_generation
            self.held += len(jobs)
            try:
                await self._resumed.wait()
            finally:
                self.held -= len(jobs)
        self.worker.submit(jobs)
        try:
            results: list[JobResult] = list(await asyncio.gather(*futures))
        except asyncio.CancelledError:  # the client went away: stop spending compute on its rows
            for job in jobs:
                job.abort_message = job.abort_message or "client disconnected"
            raise
        failed = [r.job.error for r in results if r.job.error]
        if failed:
            return _error(failed[0], 500)
        answers = [self._result_json(r) for r in results]
        return _json(answers if batched else answers[0])

    # --- control ---------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.worker.alive:
            return _error("engine worker is not running", 503)
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 once a one-token generation succeeds (at once while the engine is busy)."""
        w = self.worker
        if not w.alive:
            return _error("engine worker is not running", 503)
        load = w.load()
        if w.paused or load["running"] or load["waiting"]:
            return web.Response(status=200)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        job = Job(
            f"health-{uuid.uuid4().hex}",
            [w.pad_id],
            SamplingParams(temperature=0.0, max_new_tokens=1),
            False,
            -1,
            lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)),
        )
        w.submit([job])
        try:
            result = await asyncio.wait_for(fut, 30)
        except asyncio.TimeoutError:
            job.abort_message = "health check timed out"
            return _error("a one-token generation did not finish within 30 s", 503)
        return _error(result.job.error, 503) if result.job.error else web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        w = self.worker
        return _json(
            {
                "model_path": w.model_path,
                "tokenizer_path": w.model_path,
                "is_generation": True,
                "weight_version": w.weight_version,
                "preferred_sampling_params": None,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        w = self.worker
        load = w.load()
        return _json(
            {
                "engine": "mrlx-local",
                "model_path": w.model_path,
                "tokenizer_path": w.model_path,
                "host": self.host,
                "port": self.port,
                "weight_version": w.weight_version,
                "enable_lora": w.enable_lora,
                "lora_adapters": {  # a copy first: the worker may change the dict meanwhile
                    n: {"lora_path": a.path, "weight_version": a.weight_version}
                    for n, a in dict(w.adapters).items()
                },
                "max_running_requests": w.max_batch,
                "context_length": w.max_positions,
                "vocab_size": w.vocab_size,
                "tp_size": 1,
                "dp_size": 1,
                "threads": self.threads,
                "paused": w.paused,
                "num_running_reqs": load["running"],
                "num_waiting_reqs": load["waiting"] + self.held,
                "decode_steps": w.steps,
                "generated_tokens": w.generated_tokens,
                "uptime_s": time.time() - self.started,
            }
        )

    async def v1_loads(self, request: web.Request) -> web.Response:
        load = self.worker.load()
        waiting = load["waiting"] + self.held
        return _json(
            {
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": load["running"],
                        "num_waiting_reqs": waiting,
                        "num_total_reqs": load["running"] + waiting,
                    }
                ]
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        # There is no prefix cache to flush; every request is prefilled from scratch.
        return _json({"success": True, "message": "Cache flushed."})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            req = validate(AbortRequest, await _read_json(request, required=False))
            if not req.abort_all and not req.rid:
                raise RequestError("rid", 'send {"abort_all": true} or {"rid": "<request id>"}')
        except RequestError as exc:
            return _error(exc.message, 400, exc.field)
        n = self.worker.abort(
            None if req.abort_all else req.rid, message=req.abort_message or "aborted by /abort_request"
        )
        return _json({"success": True, "num_aborted": n})

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            mode = validate(PauseRequest, await _read_json(request, required=False)).mode
        except RequestError as exc:
            return _error(exc.message, 400, exc.field)
        self._resumed.clear()
        n = self.worker.pause("abort" if mode == "abort" else "in_place")
        return _json({"success": True, "message": f"generation paused ({mode})", "num_aborted": n})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.worker.resume()
        self._resumed.set()
        return _json({"success": True, "message": "generation continued"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            req = validate(UpdateWeightsRequest, await _read_json(request))
            if self.worker.enable_lora:
                # The adapters were trained against these base weights; a new base would silently
                # change what every adapter means.
                raise RequestError(
                    "model_path",
                    "this engine serves LoRA adapters on a fixed base model; update an adapter with POST "
                    "/load_lora_adapter (upsert: true) instead; the old weights keep serving",
                )
            if not (Path(req.model_path) / "config.json").is_file():
                raise RequestError(
                    "model_path",
                    f"{req.model_path!r} is not a model directory (no config.json); "
                    "the old weights keep serving",
                )
        except RequestError as exc:
            return _json({"success": False, "message": exc.message, "num_paused_requests": 0}, 400)
        loop = asyncio.get_running_loop()
        async with self._update_lock:
            fut: asyncio.Future = loop.create_future()
            self.worker.request_weight_update(
                WeightUpdate(
                    req.model_path,
                    req.weight_version,
                    req.abort_all_requests,
                    lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)),
                )
            )
            result = await fut
        return _json(result, 200 if result["success"] else 400)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            req = validate(LoadLoraAdapterRequest, await _read_json(request))
            if not self.worker.enable_lora:
                raise RequestError(
                    "lora_name", "this engine was started without --enable-lora (or --lora-paths)"
                )
            config = Path(req.lora_path) / "adapter_config.json"
            if not config.is_file():
                raise RequestError(
                    "lora_path", f"{req.lora_path!r} is not a LoRA adapter directory (no adapter_config.json)"
                )
            refusal = adapter_refusal(config)
            if refusal:
                raise RequestError("lora_path", f"cannot serve LoRA adapter {req.lora_name!r}: {refusal}")
        except RequestError as exc:
            return _json({"success": False, "error_message": exc.message}, 400)
        return await self._adapter_update(req.lora_name, req.lora_path, req.weight_version, req.upsert)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            req = validate(UnloadLoraAdapterRequest, await _read_json(request))
        except RequestError as exc:
            return _json({"success": False, "error_message": exc.message}, 400)
        return await self._adapter_update(req.lora_name, None, None, False)

    async def _adapter_update(
        self, name: str, path: str | None, version: str | None, upsert: bool
    ) -> web.Response:
        loop = asyncio.get_running_loop()
        async with self._update_lock:
            fut: asyncio.Future = loop.create_future()
            self.worker.request_weight_update(
                AdapterUpdate(
                    name,
                    path,
                    version,
                    upsert,
                    lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)),
                )
            )
            result = await fut
        return _json(result, 200 if result["success"] else 400)


# peft's init_lora_weights methods that rewrite the base weights of the layers they adapt when the
# adapter is built, as a load builds it before reading its saved weights.
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")

# adapter_config.json settings whose adapter cannot be served side by side with others, row by row
# in one batch, each with why. A list or mapping counts when not empty, a *_config when set.
_UNMIXABLE_SETTINGS = {
    "use_dora": "peft cannot mix a DoRA adapter's rows with other rows in one batch",
    "modules_to_save": "the adapter replaces whole modules, and while it is loaded peft fails every batch "
    "that holds rows of other adapters",
    "trainable_token_indices": "the adapter retrains token embeddings, and while it is loaded peft fails "
    "every batch that holds rows of other adapters",
    "target_parameters": "peft cannot mix rows of an adapter on parameters (not modules) with other rows "
    "in one batch",
    "layer_replication": "peft would replicate the base model's layers on load, changing the base model "
    "and every other adapter",
    "kasa_config": "KaSA rewrites the base weights on load, changing the base model and every other adapter",
    "alora_invocation_tokens": "an activated LoRA acts only after its invocation tokens, which this engine "
    "does not locate: its rows would be the base model's",
    "arrow_config": "Arrow routes among all the LoRA adapters loaded beside it, so its rows would depend "
    "on the other adapters",
}


def adapter_refusal(config: Path) -> str | None:
    """Why this engine cannot serve the adapter whose adapter_config.json is `config`, or None.

    It serves plain LoRA adapters, row by row in batches shared with other adapters and the base:
    a setting that makes peft fail such a batch, or that changes the base model (and so every
    other row), is refused by name."""
    try:
        settings = orjson.loads(config.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        return f"{config} is not readable JSON ({exc})"
    if not isinstance(settings, dict):
        return f"{config} is not a JSON object"
    if settings.get("peft_type", "LORA") != "LORA":
        return f"{config} is a {settings.get('peft_type')} adapter; this engine serves LoRA adapters"
    reasons = []
    for key, why in _UNMIXABLE_SETTINGS.items():
        value = settings.get(key)
        if value is not None if key.endswith("_config") else bool(value):
            reasons.append(f"{key} = {_short(value)} ({why})")
    bias = settings.get("bias") or "none"
    if bias != "none":
        reasons.append(
            f"bias = {_short(bias)} (the adapter trained the base model's biases, which every row shares)"
        )
    init = settings.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        reasons.append(
            f"init_lora_weights = {_short(init)} (peft rewrites the base weights when it builds such an "
            "adapter, changing the base model and every other adapter; save it converted to plain LoRA "
            "with save_pretrained's path_initial_model_for_weight_conversion)"
        )
    if not reasons:
        return None
    return (
        f"{config} sets {'; '.join(reasons)}. This engine serves plain LoRA adapters only, side by side "
        "in shared batches; train or save the adapter without these settings"
    )


def _short(value: Any, limit: int = 80) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# Router registration
# --------------------------------------------------------------------------------------------


class _Refused(Exception):
    pass


async def register_with_router(
    router_url: str,
    worker_url: str,
    stop: asyncio.Event,
    timeout_s: float = 5.0,
    backoff: Backoff = Backoff(base_s=0.25, max_s=5.0),
) -> bool:
    """Add `worker_url` to the router, retrying with backoff until the router takes it.

    Uses `POST /add_worker?url=...` (sglang-router 0.2/0.3); falls back to `POST /workers`
    with a JSON body (newer routers). Returns False only if `stop` was set first.
    """

    async def attempt(session: aiohttp.ClientSession) -> None:
        async with session.post(f"{router_url}/add_worker", params={"url": worker_url}) as resp:
            status, text = resp.status, await resp.text()
        if status == 404:
            async with session.post(f"{router_url}/workers", json={"url": worker_url}) as resp:
                status, text = resp.status, await resp.text()
        if not 200 <= status < 300:
            raise _Refused(f"HTTP {status}: {text[:200]}")

    def on_retry(n: int, exc: BaseException, wait: float) -> None:
        if isinstance(exc, _Refused):
            log.warning("router %s refused registration (%s); retrying in %.1fs", router_url, exc, wait)
        elif n == 1 or n % 10 == 0:
            log.warning("router %s not reachable yet (%s); retrying", router_url, exc)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        registering = asyncio.ensure_future(
            retry(
                lambda _: attempt(session),
                deadline=Deadline(None),
                backoff=backoff,
                on_retry=on_retry,
                retryable=lambda e: isinstance(e, (_Refused, aiohttp.ClientError, asyncio.TimeoutError)),
            )
        )
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({registering, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not registering.done():
            registering.cancel()
            await asyncio.gather(registering, return_exceptions=True)
            return False
    registering.result()
    log.info("registered %s with router %s", worker_url, router_url)
    return True


async def deregister_from_router(router_url: str, worker_url: str, timeout_s: float = 5.0) -> bool:
    """Remove `worker_url` from the router (best effort, bounded by `timeout_s`)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.post(f"{router_url}/remove_worker", params={"url": worker_url}) as resp:
                await resp.read()
                if 200 <= resp.status < 300:
                    return True
            async with session.get(f"{router_url}/workers") as resp:
                data = await resp.json(content_type=None)
            for w in (data or {}).get("workers", []):
                if w.get("url") == worker_url and w.get("id"):
                    async with session.delete(f"{router_url}/workers/{w['id']}") as resp:
                        await resp.read()
                        return 200 <= resp.status < 300
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        log.warning("could not deregister %s from router %s: %s", worker_url, router_url, exc)
    return False


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine's flags to `parser` (used by `mrlx engine` and by `main`)."""
    parser.add_argument(
        "--model", required=True, help="model directory (from_pretrained layout, with its tokenizer)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host (the engine has no authentication: trusted networks only)",
    )
    parser.add_argument(
        "--port", type=int, default=0, help="port to listen on; 0 picks a free one (default: 0)"
    )
    parser.add_argument("--port-file", default=None, help="write the bound port to this file once listening")
    parser.add_argument(
        "--router-url",
        default=None,
        help="register with this sglang-router (POST /add_worker) once up, leave it on shutdown",
    )
    parser.add_argument(
        "--max-batch", type=int, default=32, help="most sequences decoded together (default: 32)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default: 0)")
    parser.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-paths), as SGLang"
    )
    parser.add_argument(
        "--lora-paths",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="LoRA adapters (peft directories) to serve from the start, each under its name (SGLang's flag)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


class _QuietProbes(logging.Filter):
    """Drop aiohttp's tracebacks for the router's HTTP/2 probe ("PRI * HTTP/2.0"), which is
    expected: the router falls back to HTTP/1.1 at once."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI" in str(exc))


async def _serve(args: argparse.Namespace) -> int:
    from mrlx_plugin.local.model import load_model, load_tokenizer

    refusal = public_bind_refusal(args.host, args.allow_remote, "the embedded engine")
    if refusal:
        log.error("%s", refusal)
        return 2
    if args.max_batch < 1:
        log.error("--max-batch must be >= 1, got %s", args.max_batch)
        return 2
    if not (Path(args.model) / "config.json").is_file():
        log.error(
            "--model %s is not a model directory (no config.json); save one with from_pretrained's layout, "
            "e.g. mrlx_plugin.local.model.ensure_model(DIR)",
            args.model,
        )
        return 2
    adapters = []
    for spec in args.lora_paths:
        name, sep, path = spec.partition("=")
        if not sep or not name or not (Path(path) / "adapter_config.json").is_file():
            log.error(
                "--lora-paths %s: expected NAME=DIR, DIR a LoRA adapter directory (with adapter_config.json)",
                spec,
            )
            return 2
        refusal = adapter_refusal(Path(path) / "adapter_config.json")
        if refusal:
            log.error("--lora-paths %s: %s", spec, refusal)
            return 2
        adapters.append((name, path))
    torch = load_torch()
    if args.threads:
        torch.set_num_threads(args.threads)
    loop = asyncio.get_running_loop()
    try:
        model, tokenizer = await loop.run_in_executor(
            None, lambda: (load_model(args.model), load_tokenizer(args.model))
        )
    except Exception as exc:  # noqa: BLE001 - reported as one line and exit code 2
        log.error("cannot load the model and its tokenizer from %s: %s", args.model, exc)
        return 2
    worker = BatchWorker(
        model,
        tokenizer,
        model_path=str(args.model),
        max_batch=args.max_batch,
        seed=args.seed,
        enable_lora=args.enable_lora or bool(adapters),
    )
    try:
        await loop.run_in_executor(None, worker.load_adapters, adapters)
    except Exception as exc:  # noqa: BLE001 - reported as one line and exit code 2
        log.error("--lora-paths: %s", exc)
        return 2
    worker.start()
    # A router must reach the engine at an address it can dial, never at a wildcard.
    advertise = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    server = EngineServer(worker, host=args.host, advertise_host=advertise, threads=torch.get_num_threads())
    logging.getLogger("aiohttp.server").addFilter(_QuietProbes())
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", args.host, args.port, exc)
        worker.stop()
        await runner.cleanup()
        return 2
    sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
    server.port = int(sockets[0].getsockname()[1])
    if args.port_file:
        write_port_file(args.port_file, server.port)
    log.info(
        "engine serving %s at http://%s:%s (max batch %s, %s threads)",
        args.model,
        args.host,
        server.port,
        args.max_batch,
        torch.get_num_threads(),
    )

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not on the main thread
            pass
    router = args.router_url.rstrip("/") if args.router_url else None
    register_task = asyncio.create_task(register_with_router(router, server.url, stop)) if router else None
    worker_died = False
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            if not worker.alive:
                log.error("engine worker died; shutting down")
                worker_died = True
                stop.set()
    log.info("shutting down")
    if register_task is not None and await register_task:
        await deregister_from_router(router, server.url)
    await loop.run_in_executor(None, worker.stop)
    await runner.cleanup()
    return 1 if worker_died else 0


def run(args: argparse.Namespace) -> int:
    """Run an engine with parsed `add_engine_arguments` flags until SIGTERM/SIGINT; exit code."""
    # Never reach for a model hub: everything this engine loads is a local directory.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - older transformers
        pass
    return asyncio.run(_serve(args))


def main(argv: list[str] | None = None) -> int:
    """`python -m mrlx_plugin.local.engine --model DIR [...]`."""
    parser = add_engine_arguments(
        argparse.ArgumentParser(
            prog="mrlx engine", description="A CPU engine speaking SGLang's HTTP protocol."
        )
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
