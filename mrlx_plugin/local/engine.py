"""`mrlx engine`: an HTTP server speaking SGLang's protocol, backed by a transformers model on the CPU.

It stands in for an SGLang engine where there is no GPU (CI, a laptop), so the plugin's
rollout code runs unchanged end to end: token-in/token-out `/generate` with log-probs and
weight versions, aborts, pause/continue, and weight reloads from disk. The real
`sglang-router` can sit in front of it (`router_command` gives a command line that works).

This module holds the HTTP side: `EngineServer` (the SGLang endpoints), registration with a
router (`register_with_router`, `deregister_from_router`, `router_command`) and the command
line (`add_engine_arguments`, `run`, `main`). The model side, with how batching, log-probs and
sampling work, is in `batcher.py`; its public names are importable from here too.

How the two meet:
- The aiohttp event loop only parses, validates and answers; one `BatchWorker` thread owns the
  model and generates. A request becomes `Job`s whose results come back to the loop through
  a future each.
- `/update_weights_from_disk` hands the load to the worker, which swaps the weights in between
  batches; new `/generate` requests wait while generation is paused.
- torch is imported when an engine starts (`load_torch`), never at import time, so importing
  this module for `router_command` or the argument parser stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from mrlx_plugin.core.netutil import free_port, public_bind_refusal, write_port_file
from mrlx_plugin.local.batcher import (
    DEFAULT_MAX_NEW_TOKENS,
    PREFILL_TOKEN_BUDGET,
    BatchWorker,
    Job,
    JobResult,
    RequestError,
    SamplingSettings,
    WeightUpdate,
    is_int,
    load_torch,
    parse_sampling_params,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_BODY_BYTES",
    "PREFILL_TOKEN_BUDGET",
    "BatchWorker",
    "EngineServer",
    "Job",
    "JobResult",
    "RequestError",
    "SamplingSettings",
    "add_engine_arguments",
    "deregister_from_router",
    "main",
    "parse_sampling_params",
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


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


# Top-level request fields SGLang knows that this engine accepts only at their default.
_NEUTRAL_TOP_LEVEL: dict[str, Callable[[Any], bool]] = {
    "stream": lambda v: not v,
    "top_logprobs_num": lambda v: not v,
    "token_ids_logprob": lambda v: not v,
    "image_data": lambda v: not v,
    "video_data": lambda v: not v,
    "audio_data": lambda v: not v,
    "input_embeds": lambda v: v is None,
    "lora_path": lambda v: v is None,
    "return_hidden_states": lambda v: not v,
    "return_routed_experts": lambda v: not v,
    "custom_logit_processor": lambda v: v is None,
}


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


class EngineServer:
    """The HTTP front of a `BatchWorker`."""

    def __init__(
        self,
        worker: BatchWorker,
        *,
        tokenizer_path: str,
        host: str,
        advertise_host: str,
        max_batch: int,
        threads: int,
    ):
        self.worker = worker
        self.tokenizer_path = tokenizer_path
        self.host = host
        self.advertise_host = advertise_host
        self.port = 0
        self.max_batch = max_batch
        self.threads = threads
        self.started = time.time()
        self._update_lock = asyncio.Lock()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._rid_counter = itertools.count()

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_post("/generate", self.generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health if path == "/health" else self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_get("/get_load", self.get_load)
        r.add_get("/v1/loads", self.v1_loads)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        return app

    # --- /generate -------------------------------------------------------------------------

    def _prompt(self, ids: Any, where: str) -> list[int]:
        w = self.worker
        if not isinstance(ids, list) or not ids:
            raise RequestError(where, "must be a non-empty list of token ids")
        for i, t in enumerate(ids):
            if not is_int(t) or not 0 <= t < w.vocab_size:
                raise RequestError(
                    f"{where}[{i}]", f"{t!r} is not a token id of this model (0 <= id < {w.vocab_size})"
                )
        if len(ids) >= w.max_positions:
            raise RequestError(
                where,
                f"the prompt has {len(ids)} tokens; this model takes at most {w.max_positions - 1} prompt tokens",
            )
        return ids

    async def _parse_generate(self, body: Any) -> tuple[list[Job], list[asyncio.Future], bool]:
        if not isinstance(body, dict):
            raise RequestError("body", "must be a JSON object")
        for key, neutral in _NEUTRAL_TOP_LEVEL.items():
            if key in body and not neutral(body[key]):
                raise RequestError(
                    key, f"is not supported by this engine (got {body[key]!r}); leave it unset"
                )
        has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
        if has_ids == has_text:
            raise RequestError("input_ids", "send exactly one of input_ids and text")
        loop = asyncio.get_running_loop()
        if has_ids:
            raw = body["input_ids"]
            batched = isinstance(raw, list) and bool(raw) and isinstance(raw[0], list)
            prompts = (
                [self._prompt(x, f"input_ids[{i}]") for i, x in enumerate(raw)]
                if batched
                else [self._prompt(raw, "input_ids")]
            )
        else:
            raw = body["text"]
            batched = isinstance(raw, list)
            texts = raw if batched else [raw]
            if not texts or not all(isinstance(t, str) and t for t in texts):
                raise RequestError("text", "must be a non-empty string or a list of them")
            encode = self.worker.tokenizer.encode
            encoded = await loop.run_in_executor(
                None, lambda: [encode(t, add_special_tokens=False) for t in texts]
            )
            prompts = [self._prompt(x, f"text[{i}]" if batched else "text") for i, x in enumerate(encoded)]
        n = len(prompts)

        def per_item(key: str) -> list[Any]:
            # In the batched form a list gives one value per prompt; anything else is shared.
            v = body.get(key)
            if batched and isinstance(v, list):
                if len(v) != n:
                    raise RequestError(key, f"has {len(v)} entries for {n} prompts")
                return v
            return [v] * n

        params = per_item("sampling_params")
        rids = per_item("rid")
        ret_lp = per_item("return_logprob")
        starts = per_item("logprob_start_len")
        ret_text = body.get("return_text_in_logprobs", False)
        if not isinstance(ret_text, bool):
            raise RequestError("return_text_in_logprobs", f"must be true or false, got {ret_text!r}")
        jobs, futures = [], []
        for i in range(n):
            where = (
                f"sampling_params[{i}]"
                if batched and isinstance(body.get("sampling_params"), list)
                else "sampling_params"
            )
            settings = parse_sampling_params(params[i], self.worker.vocab_size, where)
            rid = rids[i]
            if rid is None:
                rid = uuid.uuid4().hex
            elif not isinstance(rid, str):
                raise RequestError("rid", f"must be a string, got {rid!r}")
            lp = ret_lp[i]
            if lp is None:
                lp = False
            if not isinstance(lp, bool):
                raise RequestError("return_logprob", f"must be true or false, got {lp!r}")
            start = starts[i]
            if start is None:
                start = -1
            if not is_int(start) or start < -1 or start >= len(prompts[i]):
                raise RequestError(
                    "logprob_start_len",
                    f"must be -1 (no prompt log-probs) or in [0, {len(prompts[i])}), got {start!r}",
                )
            fut: asyncio.Future = loop.create_future()

            def deliver(result: JobResult, fut: asyncio.Future = fut) -> None:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

            jobs.append(Job(rid, prompts[i], settings, lp, start if lp else -1, ret_text, deliver))
            futures.append(fut)
        return jobs, futures, batched

    def _result_json(self, result: JobResult) -> dict[str, Any]:
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
            if job.return_text_in_logprobs:
                decode = self.worker.tokenizer.decode
                meta["output_token_logprobs"] = [
                    [lp, t, decode([t])] for lp, t in zip(job.out_logprobs, job.out_ids)
                ]
            else:
                meta["output_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(job.out_logprobs, job.out_ids)
                ]
            if job.input_logprobs is not None:
                ids = job.prompt_ids[job.logprob_start_len :]
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(job.input_logprobs, ids)]
        return {"text": result.text, "meta_info": meta}

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            jobs, futures, batched = await self._parse_generate(body)
        except RequestError as exc:
            return _error(exc.message, 400, exc.field)
        # New requests wait while generation is paused (the in-flight ones were aborted or
        # are held in place).
        await self._resumed.wait()
        self.worker.submit(jobs)
        try:
            results: list[JobResult] = list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            # The client went away: stop spending compute on its rows.
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
        if not self.worker.alive:
            return _error("engine worker is not running", 503)
        load = self.worker.load()
        if self.worker.paused or load["running"] or load["waiting"]:
            return web.Response(status=200)  # busy generating is healthy enough
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        job = Job(
            f"health-{next(self._rid_counter)}",
            [self.worker.pad_id],
            SamplingSettings(temperature=0.0, max_new_tokens=1),
            False,
            -1,
            False,
            lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)),
        )
        self.worker.submit([job])
        try:
            result = await asyncio.wait_for(fut, 30)
        except asyncio.TimeoutError:
            job.abort_message = "health check timed out"
            return _error("a one-token generation did not finish within 30 s", 503)
        if result.job.error:
            return _error(result.job.error, 503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.worker.model_path,
                "tokenizer_path": self.tokenizer_path,
                "is_generation": True,
                "weight_version": self.worker.weight_version,
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
                "tokenizer_path": self.tokenizer_path,
                "host": self.host,
                "port": self.port,
                "weight_version": w.weight_version,
                "max_running_requests": self.max_batch,
                "context_length": w.max_positions,
                "vocab_size": w.vocab_size,
                "tp_size": 1,
                "dp_size": 1,
                "threads": self.threads,
                "paused": w.paused,
                "num_running_reqs": load["running"],
                "num_waiting_reqs": load["waiting"],
                "decode_steps": w.steps,
                "generated_tokens": w.generated_tokens,
                "uptime_s": time.time() - self.started,
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return _json({"weight_version": self.worker.weight_version})

    async def get_load(self, request: web.Request) -> web.Response:
        load = self.worker.load()
        return _json(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": load["running"] + load["waiting"],
                    "num_waiting_reqs": load["waiting"],
                }
            ]
        )

    async def v1_loads(self, request: web.Request) -> web.Response:
        load = self.worker.load()
        return _json(
            {
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": load["running"],
                        "num_waiting_reqs": load["waiting"],
                        "num_total_reqs": load["running"] + load["waiting"],
                    }
                ]
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        # There is no prefix cache to flush; every request is prefilled from scratch.
        return _json({"success": True, "message": "Cache flushed."})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request, required=False)
            if not isinstance(body, dict):
                raise RequestError("body", "must be a JSON object")
            abort_all = body.get("abort_all", False)
            rid = body.get("rid")
            if not isinstance(abort_all, bool):
                raise RequestError("abort_all", f"must be true or false, got {abort_all!r}")
            if not abort_all and not (isinstance(rid, str) and rid):
                raise RequestError("rid", 'send {"abort_all": true} or {"rid": "<request id>"}')
        except RequestError as exc:
            return _error(exc.message, 400, exc.field)
        message = body.get("abort_message") or "aborted by /abort_request"
        n = self.worker.abort(None if abort_all else rid, message=str(message))
        return _json({"success": True, "num_aborted": n})

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request, required=False)
            mode = (body or {}).get("mode", "abort") if isinstance(body, dict) else None
            if mode not in ("abort", "in_place", "retract"):
                raise RequestError("mode", f'must be "abort", "in_place" or "retract", got {mode!r}')
        except RequestError as exc:
            return _error(exc.message, 400, exc.field)
        # "retract" (SGLang moves running requests back to its queue) has the same visible
        # outcome here as "in_place": they resume, unchanged, on /continue_generation.
        self._resumed.clear()
        n = self.worker.pause("abort" if mode == "abort" else "in_place")
        return _json({"success": True, "message": f"generation paused ({mode})", "num_aborted": n})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.worker.resume()
        self._resumed.set()
        return _json({"success": True, "message": "generation continued"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            if not isinstance(body, dict):
                raise RequestError("body", "must be a JSON object")
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise RequestError("model_path", "must be the path of a model directory")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, (str, int)):
                raise RequestError("weight_version", f"must be a string, got {version!r}")
            abort_all = body.get("abort_all_requests", False)
            if not isinstance(abort_all, bool):
                raise RequestError("abort_all_requests", f"must be true or false, got {abort_all!r}")
            load_format = body.get("load_format")
            if load_format not in (None, "auto"):
                raise RequestError(
                    "load_format", f"only the default format is supported, got {load_format!r}"
                )
        except RequestError as exc:
            return _json({"success": False, "message": exc.message, "num_paused_requests": 0}, 400)
        if not (Path(path) / "config.json").is_file():
            return _json(
                {
                    "success": False,
                    "message": f"model_path {path!r} is not a model directory (no config.json); the old weights keep serving",
                    "num_paused_requests": 0,
                },
                400,
            )
        loop = asyncio.get_running_loop()
        async with self._update_lock:
            fut: asyncio.Future = loop.create_future()
            update = WeightUpdate(
                path,
                None if version is None else str(version),
                abort_all,
                lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)),
            )
            self.worker.request_weight_update(update)
            result = await fut
        return _json(result, 200 if result["success"] else 400)


# --------------------------------------------------------------------------------------------
# Router registration
# --------------------------------------------------------------------------------------------


async def register_with_router(
    router_url: str, worker_url: str, stop: asyncio.Event, timeout_s: float = 5.0
) -> bool:
    """Add `worker_url` to the router, retrying with backoff until the router answers.

    Uses `POST /add_worker?url=...` (sglang-router 0.2/0.3); falls back to `POST /workers`
    with a JSON body (newer routers). Returns False only if `stop` was set first.
    """
    delay = 0.25
    attempt = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        while not stop.is_set():
            attempt += 1
            try:
                async with session.post(f"{router_url}/add_worker", params={"url": worker_url}) as resp:
                    text = await resp.text()
                    if resp.status == 404:
                        async with session.post(f"{router_url}/workers", json={"url": worker_url}) as resp2:
                            text = await resp2.text()
                            status = resp2.status
                    else:
                        status = resp.status
                if 200 <= status < 300:
                    log.info("registered %s with router %s", worker_url, router_url)
                    return True
                log.warning("router %s refused registration (HTTP %s): %s", router_url, status, text[:200])
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if attempt == 1 or attempt % 10 == 0:
                    log.warning("router %s not reachable yet (%s); retrying", router_url, exc)
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, 5.0)
    return False


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
    parser.add_argument("--model", required=True, help="model directory (from_pretrained layout)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
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
        "--advertise-host",
        default=None,
        help="host name the router should use to reach this engine (default: --host, or 127.0.0.1 for a wildcard --host)",
    )
    parser.add_argument(
        "--router-url", default=None, help="register with this sglang-router (POST /add_worker) once up"
    )
    parser.add_argument("--weight-version", default="0", help='initial weight version (default: "0")')
    parser.add_argument(
        "--max-batch", type=int, default=32, help="most sequences decoded together (default: 32)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default: 0)")
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
    torch = load_torch()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer_path = str(Path(args.tokenizer or args.model))
    if not (Path(args.model) / "config.json").is_file():
        log.error(
            "--model %s is not a model directory (no config.json); save one with from_pretrained's layout, "
            "e.g. mrlx_plugin.local.model.ensure_model(DIR)",
            args.model,
        )
        return 2
    if not Path(tokenizer_path).is_dir():
        log.error("--tokenizer %s is not a directory", tokenizer_path)
        return 2
    loop = asyncio.get_running_loop()
    try:
        model, tokenizer = await loop.run_in_executor(
            None, lambda: (load_model(args.model), load_tokenizer(tokenizer_path))
        )
    except Exception as exc:  # noqa: BLE001 - reported as one line and exit code 2
        log.error("cannot load the model from %s (tokenizer %s): %s", args.model, tokenizer_path, exc)
        return 2
    if args.max_batch < 1:
        log.error("--max-batch must be >= 1, got %s", args.max_batch)
        return 2
    worker = BatchWorker(
        model,
        tokenizer,
        model_path=str(args.model),
        max_batch=args.max_batch,
        seed=args.seed,
        weight_version=str(args.weight_version),
    )
    worker.start()
    advertise = args.advertise_host or ("127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host)
    server = EngineServer(
        worker,
        tokenizer_path=tokenizer_path,
        host=args.host,
        advertise_host=advertise,
        max_batch=args.max_batch,
        threads=torch.get_num_threads(),
    )
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
        "engine serving %s at http://%s:%s (weight_version %s, max batch %s, %s threads)",
        args.model,
        args.host,
        server.port,
        worker.weight_version,
        args.max_batch,
        torch.get_num_threads(),
    )

    stop = asyncio.Event()
    worker_died = False
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not on the main thread
            pass
    register_task = None
    if args.router_url:
        register_task = asyncio.create_task(
            register_with_router(args.router_url.rstrip("/"), server.url, stop)
        )
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            if not worker.alive:
                log.error("engine worker died; shutting down")
                worker_died = True
                stop.set()
    log.info("shutting down")
    if register_task is not None:
        registered = await register_task
        if registered:
            await deregister_from_router(args.router_url.rstrip("/"), server.url)
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
