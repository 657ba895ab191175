"""The model side of the embedded CPU engine: one sequence to generate (`Job`), its outcome
(`JobResult`) and `BatchWorker`, the thread that owns a transformers model and generates for
every open request. `engine.py` is the HTTP front and validates requests (`SamplingParams`).

How it works:
- Continuous batching on one thread: requests that arrive while others decode are prefilled
  together (left-padded) and merged into the running batch between two decode steps; each
  decode step advances every running row by one token with a shared KV cache; a row that
  finishes leaves at once. The demo depends on this: its second agent's requests arrive one by
  one as the first agent's answers finish, and aborts must reach a single row.
- Log-probs: each generated token's log-prob is log-softmax(logits / temperature) over the full
  vocabulary, before top-k/top-p/min-p truncation (log-softmax(logits) when greedy). As in
  SGLang, a matched EOS or stop token id is part of the output ids and log-probs; the text
  omits it unless `no_stop_trim` is set.
- A request with `sampling_seed` samples from its own generator, so its output does not depend
  on which other requests shared its batch; the others use the worker's (`--seed`).
- Weight updates load in the worker thread and swap in between steps: running rows finish
  first (or are aborted, with `abort_all_requests`); while generation is paused the swap
  happens at once. A directory that does not load leaves the old weights serving.
- LoRA adapters (peft): several adapters on the one base model, each request naming its own
  (`Job.adapter`; none is the base). A batch mixes adapters row by row (peft's `adapter_names`),
  so the agents' requests share batches. Each adapter has its own weight version; an update to
  one (`AdapterUpdate`) is swapped in like a weight update (running rows finish first, new ones
  wait), loads the new weights under a fresh internal name and retires the old, so the other
  adapters and the base never change, and a directory that does not load leaves the old adapter
  serving. A directory loads only when its weights file fits its adapter_config.json: a LoRA
  weight of each module the config adapts (peft would leave a missing one as initialised, B = 0,
  serving the base's outputs under a new version), none that fits no module, and no base model
  weight (peft would write it into the base that every row shares).

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
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mrlx_plugin.local.requests import SamplingParams
else:
    torch = None  # set by `load_torch` when an engine starts

log = logging.getLogger("mrlx.engine")

# Admit at most this many (padded) prompt tokens into one prefill; bounds its memory.
PREFILL_TOKEN_BUDGET = 16384


def load_torch() -> Any:
    """Import torch for this module's code and return it; call once before building a `BatchWorker`."""
    global torch
    import torch as _torch

    torch = _torch
    return _torch


@dataclass
class Job:
    """One sequence to generate; created on the event loop, advanced by the worker thread."""

    rid: str
    prompt_ids: list[int]
    settings: SamplingParams
    return_logprob: bool
    logprob_start_len: int  # -1: no prompt log-probs
    deliver: Callable[[JobResult], None]
    created: float = field(default_factory=time.monotonic)
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    abort_message: str | None = None  # set by any thread, read by the worker between steps
    generator: Any = None
    finish: dict[str, Any] | None = None
    error: str | None = None
    adapter: str | None = None  # a loaded LoRA adapter's name; None: the base model

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None


@dataclass
class JobResult:
    job: Job
    text: str
    weight_version: str


@dataclass
class WeightUpdate:
    """A `/update_weights_from_disk` call handed to the worker; `deliver` receives its answer."""

    model_path: str
    weight_version: str | None
    abort_all: bool
    deliver: Callable[[dict[str, Any]], None]


@dataclass
class AdapterUpdate:
    """A `/load_lora_adapter` (`path` set) or `/unload_lora_adapter` (`path` None) call handed to
    the worker; `deliver` receives its answer."""

    name: str
    path: str | None
    weight_version: str | None
    upsert: bool
    deliver: Callable[[dict[str, Any]], None]


@dataclass
class Adapter:
    """A loaded adapter: where it was loaded from, its weight version, its name inside the peft model."""

    path: str
    weight_version: str
    internal: str


# --- KV-cache plumbing that works across transformers versions --------------------------------


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


def _left_pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([torch.zeros(shape, dtype=t.dtype), t], dim=dim)


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
        # leaves that much padding behind, which every later step would pay for).
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

    def merge(self, other: _Batch) -> _Batch:
        la, lb = self.mask.shape[1], other.mask.shape[1]
        width = max(la, lb)
        tensors = [
            (
                torch.cat([_left_pad(ka, width - la, 2), _left_pad(kb, width - lb, 2)]),
                torch.cat([_left_pad(va, width - la, 2), _left_pad(vb, width - lb, 2)]),
            )
            for (ka, va), (kb, vb) in zip(_cache_tensors(self.cache), _cache_tensors(other.cache))
        ]
        mask = torch.cat([_left_pad(self.mask, width - la, 1), _left_pad(other.mask, width - lb, 1)])
        return _Batch(
            self.jobs + other.jobs,
            _make_cache(tensors),
            mask,
            torch.cat([self.next_tokens, other.next_tokens]),
            torch.cat([self.next_pos, other.next_pos]),
        )


class BatchWorker:
    """Owns the model; runs the generation loop on its own thread.

    `submit`, `abort`, `pause`, `resume`, `request_weight_update`, `stop`, `load` and the
    read-only attributes may be used from any thread; everything else runs on the worker.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_path: str,
        max_batch: int,
        seed: int,
        weight_version: str = "0",
        enable_lora: bool = False,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.max_batch = max_batch
        self.weight_version = weight_version
        self.vocab_size = int(model.config.vocab_size)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        eos: set[int] = set()
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
        self._running: list[Job] = []  # admitted and not finished (guarded by _cond)
        self._batch: _Batch | None = None
        self.paused: str | None = None  # None | "abort" | "in_place"
        self._updates: collections.deque[WeightUpdate | AdapterUpdate] = collections.deque()
        # LoRA: the adapters by public name (read from any thread, changed by the worker only),
        # and a counter for the internal names (a public name may hold a '.', a peft name may not).
        self.enable_lora = enable_lora
        self.adapters: dict[str, Adapter] = {}
        self._loaded = 0
        self._stopping = False
        self._keep_arg = self._logits_to_keep_arg(model)
        self.steps = 0
        self.generated_tokens = 0
        self.thread = threading.Thread(target=self._run, name="mrlx-engine-worker", daemon=True)

    @staticmethod
    def _logits_to_keep_arg(model: Any) -> str | None:
        # Asking for the last position's logits only saves a (rows x prompt x vocab) tensor. A peft
        # model's forward takes **kwargs and hands them to the base model's: ask the base.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = inspect.signature(base.forward).parameters
        return next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)

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
            self.paused = mode
            self._cond.notify()
        return self.abort(message="aborted by /pause_generation") if mode == "abort" else 0

    def resume(self) -> None:
        with self._cond:
            self.paused = None
            self._cond.notify()

    def load_adapters(self, specs: list[tuple[str, str]]) -> None:
        """Load `(name, dir)` adapters before the worker starts (`--lora-paths`); ValueError when
        one does not load."""
        for name, path in specs:
            if name in self.adapters:
                raise ValueError(f"{name}={path}: the name {name!r} is given twice")
            answers: list[dict[str, Any]] = []
            self._apply_adapter_update(AdapterUpdate(name, path, None, False, answers.append))
            if not answers[0]["success"]:
                raise ValueError(answers[0]["error_message"])

    def request_weight_update(self, update: WeightUpdate | AdapterUpdate) -> None:
        with self._cond:
            self._updates.append(update)
            self._cond.notify()
        if isinstance(update, WeightUpdate) and update.abort_all:
            self.abort(message="aborted by /update_weights_from_disk (abort_all_requests)")

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self.abort(message="engine is shutting down")
        self.thread.join(timeout)

    def load(self) -> dict[str, int]:
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting)}

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # --- the worker thread ---------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            try:
                self._loop()
            except BaseException:  # never die silently: fail everything still open
                log.exception("engine worker crashed")
                with self._cond:
                    jobs = list(self._waiting) + self._running
                    updates = list(self._updates)
                    self._waiting.clear()
                    self._running, self._updates = [], collections.deque()
                for job in jobs:
                    if not job.done:
                        job.error = "engine worker crashed; see the engine log"
                        self._deliver(job)
                for u in updates:
                    u.deliver(_failed(u, "engine worker crashed"))
                raise

    def _has_work(self) -> bool:
        if self._stopping or self._updates or any(j.abort_message for j in self._running):
            return True
        if any(j.abort_message for j in self._waiting):
            return True
        return not self.paused and bool(self._waiting or self._running)

    def _admit(self) -> list[Job]:
        """Waiting jobs that fit the batch and the prefill budget (called under `_cond`)."""
        admit: list[Job] = []
        width = 0
        while self._waiting and len(self._running) + len(admit) < self.max_batch:
            width = max(width, len(self._waiting[0].prompt_ids))
            if admit and width * (len(admit) + 1) > PREFILL_TOKEN_BUDGET:
                break  # the rest join after the next decode step
            admit.append(self._waiting.popleft())
        self._running += admit
        return admit

    def _loop(self) -> None:
        while True:
            admit: list[Job] = []
            update: WeightUpdate | AdapterUpdate | None = None
            with self._cond:
                while not self._has_work():
                    self._cond.wait(timeout=1.0)
                # Aborted jobs that never started finish here, with no tokens.
                dropped = [j for j in self._waiting if j.abort_message]
                if dropped:
                    self._waiting = collections.deque(j for j in self._waiting if not j.abort_message)
                stopping = self._stopping and not self._running and not self._waiting
                if stopping:
                    updates, self._updates = list(self._updates), collections.deque()
                # A weight update waits for running rows to finish, unless generation is paused
                # (rows then stay frozen in place across the swap, as in SGLang).
                elif self._updates and (not self._running or self.paused):
                    update = self._updates.popleft()
                elif not self._updates and not self.paused:
                    admit = self._admit()
            for job in dropped:
                self._finish_abort(job)
            if stopping:
                for u in updates:
                    u.deliver(_failed(u, "engine is shutting down"))
                return
            self._drop_aborted_rows()
            if isinstance(update, AdapterUpdate):
                self._apply_adapter_update(update)
                continue
            if update is not None:
                self._apply_weight_update(update)
                continue
            if admit:
                self._prefill(admit)
            if self._batch is not None and not self.paused:
                self._decode_step()

    # --- generation ------------------------------------------------------------------------

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        cache: Any,
        keep_all: bool,
        jobs: list[Job],
    ) -> Any:
        kwargs: dict[str, Any] = {self._keep_arg: 1} if self._keep_arg and not keep_all else {}
        if self.adapters:  # each row through its own adapter, or the base (peft's "__base__")
            kwargs["adapter_names"] = [
                self.adapters[j.adapter].internal if j.adapter else "__base__" for j in jobs
            ]
        return self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            **kwargs,
        )

    def _prefill(self, jobs: list[Job]) -> None:
        from transformers import DynamicCache

        gone = [j for j in jobs if j.adapter is not None and j.adapter not in self.adapters]
        if gone:  # validated when it arrived; unloaded while it waited
            self._fail(gone, f"LoRA adapter {gone[0].adapter!r} was unloaded before the request ran")
            jobs = [j for j in jobs if j not in gone]
            if not jobs:
                return
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for i, job in enumerate(jobs):
            n = len(job.prompt_ids)
            ids[i, width - n :] = torch.tensor(job.prompt_ids, dtype=torch.long)
            mask[i, width - n :] = 1
            if job.settings.sampling_seed is not None:
                job.generator = torch.Generator().manual_seed(job.settings.sampling_seed)
        # Every position's logits only when a job asked for prompt log-probs (rare; costly).
        keep_all = any(j.logprob_start_len >= 0 for j in jobs)
        try:
            out = self._forward(ids, mask, (mask.cumsum(1) - 1).clamp(min=0), DynamicCache(), keep_all, jobs)
        except Exception as exc:  # this prefill's failure, not the engine's
            log.exception("prefill failed")
            self._fail(jobs, f"prefill failed: {exc}")
            return
        logits = out.logits.float()
        for i, job in enumerate(jobs):
            if job.logprob_start_len >= 0:
                job.input_logprobs = self._prompt_logprobs(job, logits[i, width - len(job.prompt_ids) :])
        batch = _Batch(jobs, out.past_key_values, mask, self._sample(jobs, logits[:, -1, :]), mask.sum(1))
        self._settle(batch, merge=True)

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
            out = self._forward(
                batch.next_tokens[:, None], mask, batch.next_pos[:, None], batch.cache, False, batch.jobs
            )
        except Exception as exc:
            log.exception("decode step failed")
            self._batch = None
            self._fail(batch.jobs, f"decode failed: {exc}")
            return
        self.steps += 1
        batch.mask, batch.cache, batch.next_pos = mask, out.past_key_values, batch.next_pos + 1
        batch.next_tokens = self._sample(batch.jobs, out.logits[:, -1, :].float())
        self._settle(batch, merge=False)

    def _settle(self, batch: _Batch, merge: bool) -> None:
        """Deliver the rows of `batch` that finished; keep the others running (a freshly
        prefilled `batch` joins the running one when `merge`)."""
        keep = [i for i, job in enumerate(batch.jobs) if not job.done]
        for job in batch.jobs:
            if job.done:
                self._deliver(job)
        rest = batch if len(keep) == len(batch.jobs) else (batch.select(keep) if keep else None)
        if merge:
            if rest is not None:
                self._batch = rest if self._batch is None else self._batch.merge(rest)
        else:
            self._batch = rest
        if len(keep) < len(batch.jobs):
            self._sync_running()

    def _sample(self, jobs: list[Job], logits: torch.Tensor) -> torch.Tensor:
        """Pick each row's next token, record it and its log-prob, and check for a finish."""
        for i, job in enumerate(jobs):
            s = job.settings
            if len(job.out_ids) < s.min_new_tokens and not s.ignore_eos:
                banned = list(self.eos_ids | set(s.stop_token_ids))
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
            if job.settings.max_new_tokens == 0:  # prefill only (prompt log-probs)
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
        if 0 < s.top_k < probs.shape[0]:
            kth = torch.topk(probs, s.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if s.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            sorted_p[(cum - sorted_p) > s.top_p * cum[-1]] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        if s.min_p > 0:
            probs = torch.where(probs >= s.min_p * probs.max(), probs, torch.zeros_like(probs))
        gen = job.generator if job.generator is not None else self._generator
        return int(torch.multinomial(probs, 1, generator=gen))

    def _check_finish(self, job: Job) -> None:
        # SGLang's order: length first, then a stop token, then a stop string.
        s = job.settings
        n, last = len(job.out_ids), job.out_ids[-1]
        if n >= s.max_new_tokens:
            job.finish = {"type": "length", "length": s.max_new_tokens}
        elif (
            not s.ignore_eos and n >= s.min_new_tokens and (last in self.eos_ids or last in s.stop_token_ids)
        ):
            job.finish = {"type": "stop", "matched": last}
        elif s.stop and n >= s.min_new_tokens:
            # Every token holds at least one byte, so a stop string of b bytes that ends in the
            # newest token lies within the last b tokens (plus special tokens that decode to
            # nothing; a margin covers those): decoding that tail is enough.
            window = max(len(x.encode()) for x in s.stop) + 16
            tail = self.tokenizer.decode(job.out_ids[-window:], skip_special_tokens=s.skip_special_tokens)
            matched = next((x for x in s.stop if x in tail), None)
            if matched is not None:
                job.finish = {"type": "stop", "matched": matched}
        if job.finish is None and len(job.prompt_ids) + n >= self.max_positions:
            job.finish = {"type": "length", "length": n}  # no position left for another token

    def _drop_aborted_rows(self) -> None:
        batch = self._batch
        if batch is not None and any(job.abort_message for job in batch.jobs):
            for job in batch.jobs:
                if job.abort_message:
                    job.finish = {"type": "abort", "message": job.abort_message}
            self._settle(batch, merge=False)

    def _sync_running(self) -> None:
        # `_running` holds every admitted job not finished yet, including those still before
        # their prefill, so that an abort arriving mid-prefill reaches them too.
        with self._cond:
            self._running = [j for j in self._running if not j.done]

    def _finish_abort(self, job: Job) -> None:
        job.finish = {"type": "abort", "message": job.abort_message or "aborted"}
        self._deliver(job)

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
        adapter = self.adapters.get(job.adapter) if job.adapter else None
        job.deliver(JobResult(job, text, adapter.weight_version if adapter else self.weight_version))

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
                    "num_paused_requests": 0,
                    "message": f"could not load weights from {update.model_path}: {exc}; "
                    "the old weights keep serving",
                }
            )
            return
        self.model, self._keep_arg, self.model_path = (
            model,
            self._logits_to_keep_arg(model),
            update.model_path,
        )
        if update.weight_version is not None:
            self.weight_version = update.weight_version
        elif self.weight_version.isdigit():
            self.weight_version = str(int(self.weight_version) + 1)
        update.deliver(
            {
                "success": True,
                "num_paused_requests": len(self._batch.jobs) if self._batch else 0,
                "message": f"loaded weights from {update.model_path}; weight_version {self.weight_version}",
            }
        )

    def _apply_adapter_update(self, update: AdapterUpdate) -> None:
        """Load, replace (upsert) or unload one adapter; the others and the base stay as they are."""
        name, old = update.name, self.adapters.get(update.name)
        if old is not None and (update.path is None or update.upsert):
            self._abort_rows_of(name)
        if update.path is None:  # unload
            if old is None:
                update.deliver(_failed(update, f"no LoRA adapter named {name!r} is loaded"))
                return
            del self.adapters[name]
            if self.adapters:
                self.model.delete_adapter(old.internal)
            else:  # the last one: back to the plain base model
                self.model = self.model.unload()
                self._keep_arg = self._logits_to_keep_arg(self.model)
            update.deliver(self._adapter_answer(f"unloaded LoRA adapter {name!r}"))
            return
        if old is not None and not update.upsert:
            update.deliver(
                _failed(
                    update,
                    f"a LoRA adapter named {name!r} is already loaded (from {old.path}); unload it first, "
                    "or send upsert: true to replace it",
                )
            )
            return
        internal = f"adapter{self._loaded}"
        try:
            self._load_adapter(internal, update.path)
        except Exception as exc:  # noqa: BLE001 - whatever fails, what was loaded keeps serving
            self._loaded += 1  # never reuse a name a failed load may have left behind
            log.warning("LoRA adapter %r from %s did not load: %s", name, update.path, exc)
            update.deliver(
                _failed(
                    update,
                    f"could not load LoRA adapter {name!r} from {update.path}: {exc}"
                    + ("; the old adapter keeps serving" if old is not None else ""),
                )
            )
            return
        self._loaded += 1
        version = update.weight_version
        if version is None:
            version = str(int(old.weight_version) + 1) if old and old.weight_version.isdigit() else "0"
        self.adapters[name] = Adapter(update.path, version, internal)
        if old is not None:
            self.model.delete_adapter(old.internal)
        update.deliver(self._adapter_answer(f"loaded LoRA adapter {name!r}; weight_version {version}"))

    def _load_adapter(self, internal: str, path: str) -> None:
        """Load the adapter at `path` under the peft name `internal`; nothing changes when it
        fails (AdapterWeightsError: its weights file does not fit its adapter_config.json)."""
        from peft import LoraConfig, PeftModel, get_peft_model

        weights = _check_weight_names(path)  # before peft could write any of them into the base
        first = not self.adapters and not isinstance(self.model, PeftModel)
        # the key renames of a transformers model whose layout changed, which peft's from_pretrained
        # applies: a file saved against the old layout loads as a first adapter and as a later one
        base = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        renames = getattr(base, "_checkpoint_conversion_mapping", None) or None
        try:
            if first:  # the base model becomes a peft model with this adapter's layers
                config = LoraConfig.from_pretrained(path)
                config.inference_mode = True
                model = get_peft_model(self.model, config, adapter_name=internal)
            else:
                model = self.model
            result = model.load_adapter(path, adapter_name=internal, is_trainable=False, key_mapping=renames)
            _check_coverage(model, internal, weights, result)
        except BaseException:
            if first:
                # peft puts the adapter's layers into the base before it loads their weights: a
                # load that fails half way leaves them there. The base is reloaded clean.
                from mrlx_plugin.local.model import load_model

                self.model = load_model(self.model_path)
                self.model.eval()
            elif internal in self.model.peft_config:  # half loaded: drop what came in
                self.model.delete_adapter(internal)
            raise
        if first:
            model.eval()
            self.model, self._keep_arg = model, self._logits_to_keep_arg(model)

    def _abort_rows_of(self, name: str) -> None:
        """Abort the rows generating through adapter `name` (there are some only while generation
        is paused in place: an update otherwise waits for every row to finish): the rest of a
        row must come from the weights its start came from, or its log-probs mix two policies."""
        batch = self._batch
        if batch is not None and any(j.adapter == name for j in batch.jobs):
            for job in batch.jobs:
                if job.adapter == name:
                    job.abort_message = job.abort_message or f"LoRA adapter {name!r} was updated or unloaded"
            self._drop_aborted_rows()

    def _adapter_answer(self, message: str) -> dict[str, Any]:
        # SGLang's answer shape (`loaded_adapters`: name -> path), with each adapter's version.
        return {
            "success": True,
            "error_message": "",
            "message": message,
            "loaded_adapters": {n: a.path for n, a in self.adapters.items()},
            "weight_versions": {n: a.weight_version for n, a in self.adapters.items()},
        }


class AdapterWeightsError(ValueError):
    """An adapter directory whose weights file does not fit its adapter_config.json."""


# How many tensor names a refusal quotes.
_QUOTED_NAMES = 3


def _quote(names: list[str]) -> str:
    shown = ", ".join(names[:_QUOTED_NAMES])
    return shown + (f", ... ({len(names) - _QUOTED_NAMES} more)" if len(names) > _QUOTED_NAMES else "")


def _check_weight_names(path: str) -> str:
    """The weights file of the peft adapter directory `path` (its name), after checking that each
    tensor in it is a LoRA weight. peft loads the other names of a file as they are: one that
    names a base model weight (a whole lm_head, a bias) would be written into the base model that
    every row shares. safetensors names are read from the file's header."""
    from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

    directory = Path(path)
    if (directory / SAFETENSORS_WEIGHTS_NAME).is_file():
        from safetensors import safe_open

        name = SAFETENSORS_WEIGHTS_NAME
        with safe_open(str(directory / name), framework="pt") as f:
            names = list(f.keys())
    elif (directory / WEIGHTS_NAME).is_file():
        name = WEIGHTS_NAME
        names = list(torch.load(directory / name, map_location="cpu", weights_only=True))
    else:
        # (peft would look for the directory's name on a model hub)
        raise AdapterWeightsError(
            f"no {SAFETENSORS_WEIGHTS_NAME} (or {WEIGHTS_NAME}) in it: a peft adapter directory holds its "
            "weights beside adapter_config.json; save the adapter with peft's save_pretrained"
        )
    foreign = sorted(n for n in names if not any(part.startswith("lora_") for part in n.split(".")))
    if foreign:
        raise AdapterWeightsError(
            f"tensors in {name} that are not LoRA weights: {len(foreign)} ({_quote(foreign)}); peft would "
            "write them over the base model's weights of the same names, which every adapter and the base "
            "share; save only the adapter, with peft's save_pretrained"
        )
    return name


def _check_coverage(model: Any, internal: str, weights: str, result: Any) -> None:
    """Refuse a load (AdapterWeightsError) whose file left some of the adapter's weights as peft
    initialised them (B = 0: those modules compute what the base does), or held weights that
    belong to none of its modules (a file of another adapter, or renamed). `result` is what
    peft's load_adapter returned: the missing and unexpected names, the former of every adapter."""

    def saved_name(key: str) -> str:  # a name as the adapter's file spells it
        return ".".join(p for p in key.removeprefix("base_model.model.").split(".") if p != internal)

    mine = [n for n, _ in model.named_parameters() if internal in n.split(".")]
    missing = sorted(saved_name(k) for k in result.missing_keys if internal in k.split("."))
    unexpected = sorted(saved_name(k) for k in result.unexpected_keys)
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} of its {len(mine)} LoRA weights are missing from {weights} ({_quote(missing)})"
        )
    if unexpected:
        problems.append(
            f"tensors in {weights} that belong to none of its LoRA modules: {len(unexpected)} "
            f"({_quote(unexpected)})"
        )
    if problems:
        raise AdapterWeightsError(
            "its weights do not fit its adapter_config.json: "
            + "; ".join(problems)
            + "; save the adapter with peft's save_pretrained, from a model with the same LoRA settings"
        )


def _failed(update: WeightUpdate | AdapterUpdate, message: str) -> dict[str, Any]:
    """The answer of an update that did not happen, in the shape of its endpoint's answers."""
    if isinstance(update, AdapterUpdate):
        return {"success": False, "error_message": message}
    return {"success": False, "message": message, "num_paused_requests": 0}
