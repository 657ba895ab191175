"""`mrlx engine`: an HTTP server speaking SGLang's protocol, backed by a transformers model on the CPU.

It stands in for an SGLang engine where there is no GPU (CI, a laptop), so the plugin's
rollout code runs unchanged end to end: token-in/token-out `/generate` with log-probs and
weight versions, aborts, pause/continue, and weight reloads from disk. The real
`sglang-router` can sit in front of it (`router_command` gives a command line that works).

How it works:
- The aiohttp event loop only parses, validates and answers. One worker thread owns the model
  and runs a continuous-batching loop: requests that arrive while others are decoding are
  prefilled (left-padded, together) and merged into the running batch between two decode
  steps; every decode step advances all running rows by one token with a shared KV cache;
  rows that finish leave the batch at once.
- Log-probs: each generated token's log-prob is log-softmax(logits / temperature) over the
  full vocabulary, before top-k/top-p/min-p truncation; with temperature 0 (greedy) it is
  log-softmax(logits). Like SGLang, a matched EOS or stop token id is part of the output ids
  and log-probs; the text omits it unless `no_stop_trim` is set.
- Sampling: a request with `sampling_seed` samples from its own generator, so its output does
  not depend on which other requests shared its batch; otherwise the engine's generator
  (seeded with `--seed`) is used.
- `/update_weights_from_disk` loads the new weights in the worker thread and swaps them in
  between batches: in-flight requests first finish (or are aborted with
  `abort_all_requests`), new requests wait; while generation is paused the swap happens at
  once. A directory that does not load leaves the old weights serving.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import inspect
import itertools
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

if TYPE_CHECKING:
    import torch
else:
    # Imported by `_load_torch` when an engine starts, so that importing this module (for
    # `router_command` or the argument parser) stays cheap.
    torch = None

log = logging.getLogger("mrlx.engine")

DEFAULT_MAX_NEW_TOKENS = 128
# A client may send long prompts as JSON id lists; aiohttp's default body limit is 1 MiB.
MAX_BODY_BYTES = 64 * 1024 * 1024
# Prefill at most this many (padded) tokens in one forward pass; bounds the memory of a wave.
PREFILL_TOKEN_BUDGET = 16384


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for tools that cannot bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------------
# Request validation
# --------------------------------------------------------------------------------------------


class RequestError(ValueError):
    """A request the engine refuses (HTTP 400); `field` names the offending part."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


@dataclass
class SamplingSettings:
    """The validated `sampling_params` of one request."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


# Sampling parameters SGLang knows that this engine accepts only at their neutral value.
_NEUTRAL_PARAMS: dict[str, Callable[[Any], bool]] = {
    "repetition_penalty": lambda v: v is None or v == 1,
    "frequency_penalty": lambda v: v is None or v == 0,
    "presence_penalty": lambda v: v is None or v == 0,
    "n": lambda v: v is None or v == 1,
    "regex": lambda v: v is None,
    "json_schema": lambda v: v is None,
    "ebnf": lambda v: v is None,
    "structural_tag": lambda v: v is None,
    "logit_bias": lambda v: not v,
}
# Accepted and without effect here: spacing between special tokens does not arise with a
# byte-level tokenizer, `custom_params` only feeds custom logit processors (none here), and
# stream_interval only matters for streaming.
_IGNORED_PARAMS = {"spaces_between_special_tokens", "custom_params", "stream_interval"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _bool_field(d: dict[str, Any], key: str, default: bool, where: str) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{where}{key}", f"must be true or false, got {v!r}")
    return v


def parse_sampling_params(raw: Any, vocab_size: int, where: str = "sampling_params") -> SamplingSettings:
    """Validate SGLang `sampling_params`; raise `RequestError` naming the first bad field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(where, f"must be an object, got {type(raw).__name__}")
    p = f"{where}."
    s = SamplingSettings()
    known = {f for f in SamplingSettings.__dataclass_fields__} | set(_NEUTRAL_PARAMS) | _IGNORED_PARAMS
    for key in raw:
        if key not in known:
            raise RequestError(f"{p}{key}", f"unknown sampling parameter; known: {', '.join(sorted(known))}")
    for key, neutral in _NEUTRAL_PARAMS.items():
        if key in raw and not neutral(raw[key]):
            raise RequestError(
                f"{p}{key}", f"is not supported by this engine (got {raw[key]!r}); leave it unset"
            )

    v = raw.get("temperature")
    if v is not None:
        if not _is_number(v) or v < 0:
            raise RequestError(f"{p}temperature", f"must be a number >= 0 (0 = greedy), got {v!r}")
        s.temperature = float(v)
    v = raw.get("top_p")
    if v is not None:
        if not _is_number(v) or not 0 < v <= 1:
            raise RequestError(f"{p}top_p", f"must be a number in (0, 1], got {v!r}")
        s.top_p = float(v)
    v = raw.get("top_k")
    if v is not None:
        if not _is_int(v) or (v != -1 and v < 1):
            raise RequestError(f"{p}top_k", f"must be -1 (off) or an integer >= 1, got {v!r}")
        s.top_k = int(v)
    v = raw.get("min_p")
    if v is not None:
        if not _is_number(v) or not 0 <= v <= 1:
            raise RequestError(f"{p}min_p", f"must be a number in [0, 1], got {v!r}")
        s.min_p = float(v)
    for key in ("max_new_tokens", "min_new_tokens"):
        v = raw.get(key)
        if v is not None:
            if not _is_int(v) or v < 0:
                raise RequestError(f"{p}{key}", f"must be an integer >= 0, got {v!r}")
            setattr(s, key, int(v))
    v = raw.get("stop")
    if v is not None:
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise RequestError(f"{p}stop", f"must be a non-empty string or a list of them, got {v!r}")
        s.stop = list(stops)
    v = raw.get("stop_token_ids")
    if v is not None:
        if not isinstance(v, list) or not all(_is_int(x) and 0 <= x < vocab_size for x in v):
            raise RequestError(
                f"{p}stop_token_ids", f"must be a list of token ids in [0, {vocab_size}), got {v!r}"
            )
        s.stop_token_ids = frozenset(v)
    s.ignore_eos = _bool_field(raw, "ignore_eos", False, p)
    s.skip_special_tokens = _bool_field(raw, "skip_special_tokens", True, p)
    s.no_stop_trim = _bool_field(raw, "no_stop_trim", False, p)
    v = raw.get("sampling_seed")
    if v is not None:
        if not _is_int(v):
            raise RequestError(f"{p}sampling_seed", f"must be an integer, got {v!r}")
        s.sampling_seed = int(v)
    return s


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


# --------------------------------------------------------------------------------------------
# Jobs and their results
# --------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One sequence to generate; created on the event loop, advanced by the worker thread."""

    rid: str
    prompt_ids: list[int]
    settings: SamplingSettings
    return_logprob: bool
    logprob_start_len: int  # -1: no input log-probs
    return_text_in_logprobs: bool
    deliver: Callable[[JobResult], None]
    created: float = field(default_factory=time.monotonic)
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    # Set by any thread; read by the worker between steps.
    abort_message: str | None = None
    # Worker-only state.
    generator: Any = None
    finish: dict[str, Any] | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None


@dataclass
class JobResult:
    job: Job
    text: str
    weight_version: str


# --------------------------------------------------------------------------------------------
# KV-cache plumbing that works across transformers versions
# --------------------------------------------------------------------------------------------


def _cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _make_cache(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    if hasattr(DynamicCache, "from_legacy_cache"):
        return DynamicCache.from_legacy_cache(tuple(tensors))
    return DynamicCache(ddp_cache_data=tensors)


@dataclass
class _Batch:
    """The running rows: their KV cache, attention mask and next input token/position."""

    jobs: list[Job]
    cache: Any
    mask: torch.Tensor  # (B, L) long; 0 = left padding
    next_tokens: torch.Tensor  # (B,) sampled, not yet fed to the model
    next_pos: torch.Tensor  # (B,) position of next_tokens

    def select(self, keep: list[int]) -> _Batch:
        idx = torch.tensor(keep, dtype=torch.long)
        tensors = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in _cache_tensors(self.cache)]
        mask = self.mask.index_select(0, idx)
        # Drop the left columns no remaining row attends to (a long row that left the batch
        # leaves that much padding behind).
        used = mask.sum(0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        if start > 0:
            tensors = [(k[:, :, start:, :], v[:, :, start:, :]) for k, v in tensors]
            mask = mask[:, start:]
        return _Batch(
            [self.jobs[i] for i in keep],
            _make_cache(tensors),
            mask,
            self.next_tokens.index_select(0, idx),
            self.next_pos.index_select(0, idx),
        )

    @staticmethod
    def merge(a: _Batch, b: _Batch) -> _Batch:
        la, lb = a.mask.shape[1], b.mask.shape[1]
        width = max(la, lb)

        def pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
            if n == 0:
                return t
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([torch.zeros(shape, dtype=t.dtype), t], dim=dim)

        tensors = []
        for (ka, va), (kb, vb) in zip(_cache_tensors(a.cache), _cache_tensors(b.cache)):
            tensors.append(
                (
                    torch.cat([pad(ka, width - la, 2), pad(kb, width - lb, 2)], 0),
                    torch.cat([pad(va, width - la, 2), pad(vb, width - lb, 2)], 0),
                )
            )
        mask = torch.cat([pad(a.mask, width - la, 1), pad(b.mask, width - lb, 1)], 0)
        return _Batch(
            a.jobs + b.jobs,
            _make_cache(tensors),
            mask,
            torch.cat([a.next_tokens, b.next_tokens]),
            torch.cat([a.next_pos, b.next_pos]),
        )


# --------------------------------------------------------------------------------------------
# The worker: continuous batching on one thread
# --------------------------------------------------------------------------------------------


@dataclass
class _WeightUpdate:
    model_path: str
    weight_version: str | None
    abort_all: bool
    deliver: Callable[[dict[str, Any]], None]


class BatchWorker:
    """Owns the model; runs the generation loop on its own thread.

    Thread contract: `submit`, `abort`, `pause`, `resume`, `request_weight_update` and the
    read-only properties may be called from any thread; everything else runs on the worker.
    """

    def __init__(
        self, model: Any, tokenizer: Any, *, model_path: str, max_batch: int, seed: int, weight_version: str
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.max_batch = max_batch
        self.weight_version = weight_version
        self.vocab_size = int(model.config.vocab_size)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        eos = set()
        for src in (
            getattr(tokenizer, "eos_token_id", None),
            getattr(model.generation_config, "eos_token_id", None),
        ):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, (list, tuple)):
                eos.update(int(x) for x in src)
        self.eos_ids = frozenset(eos)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self._generator = torch.Generator().manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []  # admitted, not finished (guarded by _cond)
        self._batch: _Batch | None = None
        self._paused: str | None = None  # None | "abort" | "in_place"
        self._updates: collections.deque[_WeightUpdate] = collections.deque()
        self._stopping = False
        self._keep_arg = self._logits_to_keep_arg(model)
        self.steps = 0
        self.generated_tokens = 0
        self.thread = threading.Thread(target=self._run, name="mrlx-engine-worker", daemon=True)

    @staticmethod
    def _logits_to_keep_arg(model: Any) -> str | None:
        params = inspect.signature(model.forward).parameters
        for name in ("logits_to_keep", "num_logits_to_keep"):
            if name in params:
                return name
        return None

    # --- called from any thread ----------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def submit(self, jobs: list[Job]) -> None:
        with self._cond:
            if self._stopping:
                for job in jobs:
                    job.abort_message = "engine is shutting down"
            self._waiting.extend(jobs)
            self._cond.notify()

    def abort(self, rid: str | None = None, message: str = "aborted by /abort_request") -> int:
        """Mark waiting and running jobs (all, or those with `rid`) as aborted; returns how many."""
        with self._cond:
            n = 0
            for job in itertools.chain(self._waiting, self._running):
                if (rid is None or job.rid == rid) and job.abort_message is None and not job.done:
                    job.abort_message = message
                    n += 1
            self._cond.notify()
            return n

    def pause(self, mode: str) -> int:
        with self._cond:
            self._paused = mode
            self._cond.notify()
        if mode == "abort":
            return self.abort(message="aborted by /pause_generation")
        return 0

    def resume(self) -> None:
        with self._cond:
            self._paused = None
            self._cond.notify()

    def request_weight_update(self, update: _WeightUpdate) -> None:
        with self._cond:
            self._updates.append(update)
            self._cond.notify()
        if update.abort_all:
            self.abort(message="aborted by /update_weights_from_disk (abort_all_requests)")

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self.abort(message="engine is shutting down")
        self.thread.join(timeout)

    @property
    def paused(self) -> str | None:
        return self._paused

    def load(self) -> dict[str, int]:
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting)}

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # --- worker thread ---------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            try:
                self._loop()
            except BaseException:  # never die silently: fail everything still open
                log.exception("engine worker crashed")
                with self._cond:
                    jobs = list(self._waiting) + list(self._running)
                    self._waiting.clear()
                    self._running = []
                    updates = list(self._updates)
                    self._updates.clear()
                for job in jobs:
                    if not job.done:
                        job.error = "engine worker crashed; see the engine log"
                        self._deliver(job)
                for u in updates:
                    u.deliver(
                        {"success": False, "message": "engine worker crashed", "num_paused_requests": 0}
                    )
                raise

    def _has_work(self) -> bool:
        if self._stopping or self._updates:
            return True
        if any(job.abort_message for job in self._running) or any(job.abort_message for job in self._waiting):
            return True
        if self._paused:
            return False
        return bool(self._waiting or self._running)

    def _loop(self) -> None:
        while True:
            admit: list[Job] = []
            update: _WeightUpdate | None = None
            with self._cond:
                while not self._has_work():
                    self._cond.wait(timeout=1.0)
                # Aborted jobs that never started finish here, with no tokens.
                dropped = [j for j in self._waiting if j.abort_message]
                if dropped:
                    self._waiting = collections.deque(j for j in self._waiting if not j.abort_message)
                if self._stopping and not self._running and not self._waiting:
                    updates = list(self._updates)
                    self._updates.clear()
                    stopping = True
                else:
                    updates, stopping = [], False
                    # A weight update waits for running rows to finish, unless generation is
                    # paused (rows then stay frozen in place across the swap, as in SGLang).
                    if self._updates and (not self._running or self._paused):
                        update = self._updates.popleft()
                    elif not self._updates and not self._paused:
                        room = self.max_batch - len(self._running)
                        while self._waiting and room > 0:
                            admit.append(self._waiting.popleft())
                            room -= 1
                        self._running = self._running + admit
            for job in dropped:
                self._finish_abort(job)
                self._deliver(job)
            if stopping:
                for u in updates:
                    u.deliver(
                        {"success": False, "message": "engine is shutting down", "num_paused_requests": 0}
                    )
                return
            self._drop_aborted_rows()
            if update is not None:
                self._apply_weight_update(update)
                continue
            if admit:
                self._prefill(admit)
            if self._batch is not None and not self._paused:
                self._decode_step()

    # --- generation ------------------------------------------------------------------------

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any, keep_all: bool
    ) -> Any:
        kwargs: dict[str, Any] = {}
        if self._keep_arg and not keep_all:
            kwargs[self._keep_arg] = 1
        return self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            **kwargs,
        )

    def _prefill(self, jobs: list[Job]) -> None:
        # Jobs that want prompt log-probs need every position's logits; the others only the last.
        # Sorting by length keeps the padding inside a wave small.
        for wants_inputs in (False, True):
            group = sorted(
                (j for j in jobs if (j.logprob_start_len >= 0) == wants_inputs),
                key=lambda j: len(j.prompt_ids),
            )
            start = 0
            while start < len(group):
                end = start + 1
                while (
                    end < len(group)
                    and len(group[end].prompt_ids) * (end + 1 - start) <= PREFILL_TOKEN_BUDGET
                ):
                    end += 1
                self._prefill_wave(group[start:end], wants_inputs)
                start = end

    def _prefill_wave(self, jobs: list[Job], keep_all: bool) -> None:
        from transformers import DynamicCache

        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for i, job in enumerate(jobs):
            n = len(job.prompt_ids)
            ids[i, width - n :] = torch.tensor(job.prompt_ids, dtype=torch.long)
            mask[i, width - n :] = 1
            if job.settings.sampling_seed is not None:
                job.generator = torch.Generator().manual_seed(job.settings.sampling_seed)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        try:
            out = self._forward(ids, mask, pos, DynamicCache(), keep_all)
        except Exception as exc:  # a failure here is this wave's, not the engine's
            log.exception("prefill failed")
            self._fail(jobs, f"prefill failed: {exc}")
            return
        logits = out.logits.float()
        if keep_all:
            for i, job in enumerate(jobs):
                job.input_logprobs = self._prompt_logprobs(job, logits[i, width - len(job.prompt_ids) :])
        next_tokens = self._sample(jobs, logits[:, -1, :])
        batch = _Batch(jobs, out.past_key_values, mask, next_tokens, mask.sum(1))
        keep = [i for i, job in enumerate(jobs) if not job.done]
        for job in jobs:
            if job.done:
                self._deliver(job)
        if len(keep) < len(jobs):
            batch = batch.select(keep) if keep else None
        if batch is not None:
            self._batch = batch if self._batch is None else _Batch.merge(self._batch, batch)
        self._sync_running()

    def _prompt_logprobs(self, job: Job, logits: torch.Tensor) -> list[float | None]:
        t = job.settings.temperature
        logp = torch.log_softmax(logits / t if t > 0 else logits, dim=-1)
        ids = torch.tensor(job.prompt_ids[1:], dtype=torch.long)
        values = logp[:-1].gather(1, ids[:, None])[:, 0].tolist() if len(ids) else []
        return ([None] + values)[job.logprob_start_len :]

    def _decode_step(self) -> None:
        batch = self._batch
        assert batch is not None
        mask = torch.cat([batch.mask, torch.ones((len(batch.jobs), 1), dtype=torch.long)], dim=1)
        try:
            out = self._forward(batch.next_tokens[:, None], mask, batch.next_pos[:, None], batch.cache, False)
        except Exception as exc:
            log.exception("decode step failed")
            self._batch = None
            self._fail(batch.jobs, f"decode failed: {exc}")
            self._sync_running()
            return
        self.steps += 1
        batch.mask = mask
        batch.cache = out.past_key_values
        batch.next_tokens = self._sample(batch.jobs, out.logits[:, -1, :].float())
        batch.next_pos = batch.next_pos + 1
        keep = [i for i, job in enumerate(batch.jobs) if not job.done]
        for job in batch.jobs:
            if job.done:
                self._deliver(job)
        if len(keep) < len(batch.jobs):
            self._batch = batch.select(keep) if keep else None
            self._sync_running()

    def _sample(self, jobs: list[Job], logits: torch.Tensor) -> torch.Tensor:
        """Pick each row's next token, record it and its log-prob, and check for a finish."""
        for i, job in enumerate(jobs):
            s = job.settings
            if len(job.out_ids) < s.min_new_tokens and not s.ignore_eos:
                banned = list(self.eos_ids | s.stop_token_ids)
                if banned:
                    logits[i, banned] = -math.inf
        temps = torch.tensor([j.settings.temperature for j in jobs], dtype=logits.dtype)
        greedy = temps == 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        chosen = scaled.argmax(dim=-1)
        for i, job in enumerate(jobs):
            if not bool(greedy[i]):
                chosen[i] = self._draw(logp[i], job)
        lps = logp.gather(1, chosen[:, None])[:, 0].tolist()
        for i, job in enumerate(jobs):
            if job.settings.max_new_tokens == 0:  # a prefill-only request (e.g. for prompt log-probs)
                job.finish = {"type": "length", "length": 0}
                continue
            job.out_ids.append(int(chosen[i]))
            job.out_logprobs.append(float(lps[i]))
            self._check_finish(job)
        self.generated_tokens += len(jobs)
        return chosen

    def _draw(self, logp: torch.Tensor, job: Job) -> int:
        s = job.settings
        probs = logp.exp()
        if s.top_k > 0 and s.top_k < probs.shape[0]:
            kth = torch.topk(probs, s.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if s.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            drop = (cum - sorted_p) > s.top_p * cum[-1]
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        if s.min_p > 0:
            probs = torch.where(probs >= s.min_p * probs.max(), probs, torch.zeros_like(probs))
        gen = job.generator if job.generator is not None else self._generator
        return int(torch.multinomial(probs, 1, generator=gen))

    def _check_finish(self, job: Job) -> None:
        # The order follows SGLang: length first, then a stop token, then a stop string.
        s = job.settings
        n = len(job.out_ids)
        last = job.out_ids[-1]
        if n >= s.max_new_tokens:
            job.finish = {"type": "length", "length": s.max_new_tokens}
        elif (
            not s.ignore_eos and n >= s.min_new_tokens and (last in self.eos_ids or last in s.stop_token_ids)
        ):
            job.finish = {"type": "stop", "matched": last}
        elif s.stop and n >= s.min_new_tokens:
            matched = self._match_stop_string(job)
            if matched is not None:
                job.finish = {"type": "stop", "matched": matched}
        if job.finish is None and len(job.prompt_ids) + n >= self.max_positions:
            # The model has no position left for another token.
            job.finish = {"type": "length", "length": n}

    def _match_stop_string(self, job: Job) -> str | None:
        # Every token holds at least one byte, so a stop string of b bytes that ends in the
        # newest token lies within the last b tokens (plus any special tokens that decode to
        # nothing in between; a margin covers those); decoding just that tail is enough.
        window = max(len(x.encode()) for x in job.settings.stop) + 16
        tail = self.tokenizer.decode(
            job.out_ids[-window:], skip_special_tokens=job.settings.skip_special_tokens
        )
        for stop in job.settings.stop:
            if stop in tail:
                return stop
        return None

    def _drop_aborted_rows(self) -> None:
        batch = self._batch
        if batch is None:
            return
        keep = [i for i, job in enumerate(batch.jobs) if not job.abort_message]
        if len(keep) == len(batch.jobs):
            return
        for job in batch.jobs:
            if job.abort_message:
                self._finish_abort(job)
                self._deliver(job)
        self._batch = batch.select(keep) if keep else None
        self._sync_running()

    def _sync_running(self) -> None:
        # `_running` holds every admitted job not finished yet, including those still waiting
        # for their prefill wave, so that an abort arriving mid-prefill reaches them too.
        with self._cond:
            self._running = [j for j in self._running if not j.done]

    @staticmethod
    def _finish_abort(job: Job) -> None:
        job.finish = {"type": "abort", "message": job.abort_message or "aborted"}

    def _fail(self, jobs: list[Job], message: str) -> None:
        for job in jobs:
            if not job.done:
                job.error = message
            self._deliver(job)
        self._sync_running()

    def _deliver(self, job: Job) -> None:
        text = ""
        if job.error is None:
            ids = job.out_ids
            matched = job.finish.get("matched") if job.finish else None
            if isinstance(matched, int) and not job.settings.no_stop_trim:
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=job.settings.skip_special_tokens)
            if isinstance(matched, str) and not job.settings.no_stop_trim:
                cut = text.find(matched)
                if cut >= 0:
                    text = text[:cut]
        job.deliver(JobResult(job, text, self.weight_version))

    # --- weights ---------------------------------------------------------------------------

    def _apply_weight_update(self, update: _WeightUpdate) -> None:
        from .model import load_model

        try:
            model = load_model(update.model_path)
            vocab = int(model.config.vocab_size)
            if vocab != self.vocab_size:
                raise ValueError(f"its vocabulary has {vocab} ids, the served model's has {self.vocab_size}")
        except Exception as exc:  # noqa: BLE001 - whatever fails, the old weights keep serving
            update.deliver(
                {
                    "success": False,
                    "message": f"could not load weights from {update.model_path}: {exc}; the old weights keep serving",
                    "num_paused_requests": 0,
                }
            )
            return
        self.model = model
        self._keep_arg = self._logits_to_keep_arg(model)
        self.model_path = update.model_path
        if update.weight_version is not None:
            self.weight_version = update.weight_version
        elif self.weight_version.isdigit():
            self.weight_version = str(int(self.weight_version) + 1)
        paused_rows = len(self._batch.jobs) if self._batch is not None else 0
        update.deliver(
            {
                "success": True,
                "message": f"loaded weights from {update.model_path}; weight_version {self.weight_version}",
                "num_paused_requests": paused_rows,
            }
        )


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


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
            if not _is_int(t) or not 0 <= t < w.vocab_size:
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
            if not _is_int(start) or start < -1 or start >= len(prompts[i]):
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
            update = _WeightUpdate(
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
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a non-loopback --host (the engine has no authentication: trusted networks only)")
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


def _write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)  # readers never see a half-written file


class _QuietProbes(logging.Filter):
    """Drop aiohttp's tracebacks for the router's HTTP/2 probe ("PRI * HTTP/2.0"), which is
    expected: the router falls back to HTTP/1.1 at once."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI" in str(exc))


def _load_torch() -> None:
    global torch
    import torch as _torch

    torch = _torch


async def _serve(args: argparse.Namespace) -> int:
    from ..netutil import public_bind_refusal
    from .model import load_model, load_tokenizer

    refusal = public_bind_refusal(args.host, args.allow_remote, "the embedded engine")
    if refusal:
        log.error("%s", refusal)
        return 2
    _load_torch()
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
        _write_port_file(args.port_file, server.port)
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
