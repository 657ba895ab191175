"""The embedded engine's HTTP side: `EngineServer`, SGLang's endpoints in front of a `BatchWorker`.

The aiohttp event loop only parses, validates (`requests.py`: SGLang's field names, defaults and
refusals) and answers; one `BatchWorker` thread (`batcher.py`) owns the model and generates, and
hands each `Job`'s result back to the loop through a future. Served: token-in/token-out
`/generate` with log-probs and weight versions, aborts, pause/continue, weight reloads from disk,
and LoRA adapters (`/load_lora_adapter`, `/unload_lora_adapter`, `lora_path` per request).

A `/generate` with `"stream": true` (one prompt) is answered as SGLang streams it
(`mrlx_plugin.core.sglang` describes the format): server-sent events, a chunk for each decode
step as the worker reports it (a client that reads slower gets the newest state, several steps
at once), the last chunk the whole answer, then `data: [DONE]`. Every chunk holds everything so
far, or, with `--incremental-streaming-output`, only what is new. A client that closes the
stream aborts its request (its row leaves the batch at the next step).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import orjson
from aiohttp import web

from mrlx_plugin.core.values import JSON, JSONObject
from mrlx_plugin.local.engine.adapters import adapter_refusal
from mrlx_plugin.local.engine.batcher import BatchWorker
from mrlx_plugin.local.engine.jobs import AdapterUpdate, Job, JobResult, WeightUpdate
from mrlx_plugin.local.engine.requests import (
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

# A client may send long prompts as JSON id lists; aiohttp's default body limit is 1 MiB.
MAX_BODY_BYTES = 64 * 1024 * 1024
# A streamed chunk's text is decoded with this many tokens before it, so that a token's text
# that depends on the one before it (a space, a character split across tokens) comes out right.
TEXT_CONTEXT_TOKENS = 4

log = logging.getLogger("mrlx.engine")


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(message: str, status: int = 400, field: str | None = None) -> web.Response:
    err: dict[str, object] = {"message": message, "code": status}
    if field:
        err["field"] = field
    return _json({"error": err}, status)


async def _read_json(request: web.Request, required: bool = True) -> JSON:
    body = await request.read()
    if not body.strip():
        if required:
            raise RequestError("body", "is empty; send a JSON object")
        return {}
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError("body", f"is not valid JSON ({exc})") from None


def _sse(data: object) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class _Progress:
    """A streamed job's progress as the worker thread reports it: how many tokens it has (the
    job's lists only grow, so that many entries can be read on the loop), and an event the
    stream waits on, set by each step and by the job's end."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.count = 0
        self.changed = asyncio.Event()

    def step(self, count: int) -> None:  # on the worker thread
        self.loop.call_soon_threadsafe(self._note, count)

    def _note(self, count: int) -> None:
        self.count = max(self.count, count)
        self.changed.set()


def _settle(fut: asyncio.Future, result: JobResult, progress: _Progress | None) -> None:
    if not fut.done():
        fut.set_result(result)
    if progress is not None:
        progress.changed.set()


class EngineServer:
    """The HTTP front of a `BatchWorker`."""

    def __init__(
        self,
        worker: BatchWorker,
        *,
        host: str,
        advertise_host: str,
        threads: int,
        incremental_streaming: bool = False,
    ):
        self.worker = worker
        self.incremental_streaming = incremental_streaming
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

    async def _jobs(self, body: JSON) -> tuple[list[Job], list[asyncio.Future], bool, _Progress | None]:
        """The jobs of a `/generate` body, a future of each one's result, whether the body was
        batched, and the progress of a streamed one."""
        w = self.worker
        parts, batched = split_generate_body(body)
        reqs = [
            (validate(GenerateRequest, item, renamed, vocab_size=w.vocab_size), renamed)
            for item, renamed in parts
        ]
        loop = asyncio.get_running_loop()
        progress = None
        if any(r.stream for r, _ in reqs):
            if batched:
                raise RequestError(
                    "stream",
                    "streams one prompt at a time here; send each prompt as a request of its own, "
                    "or the batch without stream",
                )
            progress = _Progress(loop)
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
                loop.call_soon_threadsafe(_settle, fut, result, progress)

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
                    on_step=None if progress is None else progress.step,
                )
            )
            futures.append(fut)
        return jobs, futures, batched, progress

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
    def _result_json(result: JobResult) -> JSONObject:
        job = result.job
        meta: JSONObject = {
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

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            jobs, futures, batched, progress = await self._jobs(await _read_json(request))
        except RequestError as exc:
            return _error(exc.message, 400, exc.field)
        if not self._resumed.is_set():  # paused: new requests wait for /continue_generation
            self.held += len(jobs)
            try:
                await self._resumed.wait()
            finally:
                self.held -= len(jobs)
        self.worker.submit(jobs)
        if progress is not None:
            return await self._stream(request, jobs[0], futures[0], progress)
        try:
            results: list[JobResult] = list(await asyncio.gather(*futures))
        except asyncio.CancelledError:  # the client went away: stop spending compute on its rows
            self.worker.cancel(jobs, "client disconnected")
            raise
        failed = [r.job.error for r in results if r.job.error]
        if failed:
            return _error(failed[0], 500)
        answers = [self._result_json(r) for r in results]
        return _json(answers if batched else answers[0])

    async def _stream(
        self, request: web.Request, job: Job, fut: asyncio.Future, progress: _Progress
    ) -> web.StreamResponse:
        """Stream one job's answer: a chunk each time the worker reports a step (the tokens of
        every step since the last chunk), the whole answer as the last one, then `[DONE]`."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        sent = decoded = 0  # tokens sent; tokens whose text was sent
        text = ""  # the text sent
        try:
            await resp.prepare(request)
            while not fut.done():
                await progress.changed.wait()
                progress.changed.clear()
                end = progress.count
                if fut.done() or end <= sent:
                    continue
                delta, decoded = self._new_text(job, decoded, end)
                text += delta
                chunk = self._chunk(job, sent, end, delta if self.incremental_streaming else text)
                await resp.write(_sse(chunk))
                sent = end
            result: JobResult = fut.result()
            if result.job.error:  # as SGLang reports a failure once a stream has begun
                await resp.write(_sse({"error": {"message": result.job.error}}) + _DONE)
            else:
                await resp.write(_sse(self._last_chunk(result, sent, text)) + _DONE)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError) as exc:  # the client went away
            if not fut.done():
                log.info("request %s: its client closed the stream after %d tokens; aborted", job.rid, sent)
                self.worker.cancel([job], "client disconnected")
            if isinstance(exc, asyncio.CancelledError):
                raise
        return resp

    def _chunk(self, job: Job, start: int, end: int, text: str) -> JSONObject:
        """A chunk of a running job: its tokens up to `end` (incremental: from `start`)."""
        first = start if self.incremental_streaming else 0
        ids: list[JSON] = list(job.out_ids[first:end])
        logprobs = job.out_logprobs[first:end]
        adapter = self.worker.adapters.get(job.adapter) if job.adapter else None
        meta: JSONObject = {
            "id": job.rid,
            "finish_reason": None,
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": end,
            "cached_tokens": 0,
            "weight_version": adapter.weight_version if adapter else self.worker.weight_version,
        }
        if job.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, ids)]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _last_chunk(self, result: JobResult, sent: int, text: str) -> JSONObject:
        """The chunk that ends a stream: the whole answer, as unstreamed (incremental: what is new
        since the `sent` tokens and the `text` sent, the counts and the rest as they are)."""
        last = self._result_json(result)
        ids: list[JSON] = list(result.job.out_ids)
        if not self.incremental_streaming:
            return {**last, "output_ids": ids}
        meta = last["meta_info"]
        assert isinstance(meta, dict)
        entries = meta.get("output_token_logprobs")
        if isinstance(entries, list):
            meta["output_token_logprobs"] = entries[sent:]
        # A stop string trimmed off the end may have been sent already: that cannot be taken back.
        rest = result.text[len(text) :] if result.text.startswith(text) else ""
        return {"text": rest, "output_ids": ids[sent:], "meta_info": meta}

    def _new_text(self, job: Job, decoded: int, end: int) -> tuple[str, int]:
        """The text that tokens [decoded, end) of a running job add, decoded with a few tokens
        before them, and the tokens decoded after it; ("", decoded) while the text ends inside a
        character (its next token completes it)."""
        tok, skip = self.worker.tokenizer, job.settings.skip_special_tokens
        start = max(0, decoded - TEXT_CONTEXT_TOKENS)
        before = str(tok.decode(job.out_ids[start:decoded], skip_special_tokens=skip))
        both = str(tok.decode(job.out_ids[start:end], skip_special_tokens=skip))
        if both.endswith("\ufffd") or not both.startswith(before):
            return "", decoded
        return both[len(before) :], end

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
                "aborted_requests": w.aborted_requests,
                "incremental_streaming_output": self.incremental_streaming,
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
