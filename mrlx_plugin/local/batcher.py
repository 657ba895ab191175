"""The model side of the embedded CPU engine: request settings, jobs and the batching worker.

`engine.py` is the HTTP front; this module holds what runs behind it: the validated sampling
settings of a request (`parse_sampling_params`), one sequence to generate (`Job`) and its
outcome (`JobResult`), and `BatchWorker`, the thread that owns a transformers model and
generates for every open request.

How it works:
- One worker thread owns the model and runs a continuous-batching loop: requests that arrive
  while others are decoding are prefilled (left-padded, together) and merged into the running
  batch between two decode steps; every decode step advances all running rows by one token
  with a shared KV cache; rows that finish leave the batch at once.
- Log-probs: each generated token's log-prob is log-softmax(logits / temperature) over the
  full vocabulary, before top-k/top-p/min-p truncation; with temperature 0 (greedy) it is
  log-softmax(logits). Like SGLang, a matched EOS or stop token id is part of the output ids
  and log-probs; the text omits it unless `no_stop_trim` is set.
- Sampling: a request with `sampling_seed` samples from its own generator, so its output does
  not depend on which other requests shared its batch; otherwise the worker's generator
  (seeded with `--seed`) is used.
- Weight updates load the new weights in the worker thread and swap them in between batches:
  in-flight requests first finish (or are aborted with `abort_all_requests`); while generation
  is paused the swap happens at once. A directory that does not load leaves the old weights
  serving.

torch is imported by `load_torch`, not at import time, so that importing this module (and
`engine.py`, for `router_command` or the argument parser) stays cheap.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
else:
    # Set by `load_torch` when an engine starts; the worker's code refers to this global.
    torch = None

# The engine's logger: the worker's messages belong to the engine's log.
log = logging.getLogger("mrlx.engine")

DEFAULT_MAX_NEW_TOKENS = 128
# Prefill at most this many (padded) tokens in one forward pass; bounds the memory of a wave.
PREFILL_TOKEN_BUDGET = 16384


def load_torch() -> Any:
    """Import torch for this module's code and return it; call once before building a `BatchWorker`."""
    global torch
    import torch as _torch

    torch = _torch
    return _torch


# --------------------------------------------------------------------------------------------
# Sampling settings
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


def is_int(v: Any) -> bool:
    """An integer that is not a bool (JSON true/false arrive as Python bools)."""
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
        if not is_int(v) or (v != -1 and v < 1):
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
            if not is_int(v) or v < 0:
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
        if not isinstance(v, list) or not all(is_int(x) and 0 <= x < vocab_size for x in v):
            raise RequestError(
                f"{p}stop_token_ids", f"must be a list of token ids in [0, {vocab_size}), got {v!r}"
            )
        s.stop_token_ids = frozenset(v)
    s.ignore_eos = _bool_field(raw, "ignore_eos", False, p)
    s.skip_special_tokens = _bool_field(raw, "skip_special_tokens", True, p)
    s.no_stop_trim = _bool_field(raw, "no_stop_trim", False, p)
    v = raw.get("sampling_seed")
    if v is not None:
        if not is_int(v):
            raise RequestError(f"{p}sampling_seed", f"must be an integer, got {v!r}")
        s.sampling_seed = int(v)
    return s


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
class WeightUpdate:
    """A request to load new weights, handed from the HTTP front to the worker; `deliver`
    receives the `/update_weights_from_disk` answer."""

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
        self._updates: collections.deque[WeightUpdate] = collections.deque()
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

    def request_weight_update(self, update: WeightUpdate) -> None:
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
            update: WeightUpdate | None = None
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

    def _apply_weight_update(self, update: WeightUpdate) -> None:
        from mrlx_plugin.local.model import load_model

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
