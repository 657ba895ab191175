"""The model side of the embedded CPU engine: `BatchWorker`, the thread that owns a transformers
model and generates for every open request (`jobs.Job`). `server.py` is the HTTP front and
validates requests (`SamplingParams`); `adapters.py` decides which LoRA adapters load.

How it works:
- Continuous batching on one thread: requests that arrive while others decode are prefilled
  together (left-padded) and merged into the running batch between two decode steps; each
  decode step advances every running row by one token with a shared KV cache; a row that
  finishes leaves at once. The demo depends on this: its second agent's requests arrive one by
  one as the first agent's answers finish, and aborts must reach a single row.
- Log-probs: each generated token's log-prob is log-softmax(logits / temperature) over the full
  vocabulary (after the presence and frequency penalties), before top-k/top-p/min-p truncation
  (log-softmax(logits) when greedy). As in SGLang, a matched EOS or stop token id is part of the
  output ids and log-probs; the text omits it unless `no_stop_trim` is set.
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
`server.py`, `command.py`, for the argument parser) stays cheap.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import logging
import math
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mrlx_plugin.core.values import JSONObject
from mrlx_plugin.local.engine.adapters import check_coverage, check_weight_names
from mrlx_plugin.local.engine.jobs import Adapter, AdapterUpdate, Job, JobResult, WeightUpdate, failed_answer
from mrlx_plugin.local.engine.kv_cache import RunningBatch

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache, PreTrainedTokenizerBase
    from transformers.modeling_outputs import CausalLMOutputWithPast
else:
    torch = None  # set by `load_torch` when an engine starts

log = logging.getLogger("mrlx.engine")

# Admit at most this many (padded) prompt tokens into one prefill; bounds its memory.
PREFILL_TOKEN_BUDGET = 16384


def load_torch() -> ModuleType:
    """Import torch for this module's code and return it; call once before building a `BatchWorker`."""
    global torch
    import torch as _torch

    torch = _torch
    return _torch


class BatchWorker:
    """Owns the model; runs the generation loop on its own thread.

    `submit`, `abort`, `pause`, `resume`, `request_weight_update`, `stop`, `load` and the
    read-only attributes may be used from any thread; everything else runs on the worker.
    """

    def __init__(
        self,
        model: Any,  # a transformers model, or a peft model around one (adapters): used as either
        tokenizer: PreTrainedTokenizerBase,
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
        self._batch: RunningBatch | None = None
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
        self.aborted_requests = 0  # jobs that ended with finish_reason abort
        self.thread = threading.Thread(target=self._run, name="mrlx-engine-worker", daemon=True)

    @staticmethod
    def _logits_to_keep_arg(model: Any) -> str | None:  # (a model as `__init__` takes it)
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

    def cancel(self, jobs: list[Job], message: str) -> None:
        """Abort these jobs, waiting or running (their client went away)."""
        with self._cond:
            for job in jobs:
                if job.abort_message is None and not job.done:
                    job.abort_message = message
            self._cond.notify()

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
            answers: list[JSONObject] = []
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
                    u.deliver(failed_answer(u, "engine worker crashed"))
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
                    u.deliver(failed_answer(u, "engine is shutting down"))
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
        cache: DynamicCache | None,
        keep_all: bool,
        jobs: list[Job],
    ) -> CausalLMOutputWithPast:
        kwargs: dict[str, object] = {self._keep_arg: 1} if self._keep_arg and not keep_all else {}
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
        batch = RunningBatch(
            jobs, out.past_key_values, mask, self._sample(jobs, logits[:, -1, :]), mask.sum(1)
        )
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

    def _settle(self, batch: RunningBatch, merge: bool) -> None:
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
            if (s.frequency_penalty or s.presence_penalty) and job.out_ids:
                # SGLang's penalties, on the tokens generated so far; the log-probs are of the
                # penalised distribution, the one sampled from
                counts = torch.bincount(torch.tensor(job.out_ids), minlength=logits.shape[1])[
                    : logits.shape[1]
                ]
                logits[i] -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0)
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
            if job.on_step is not None and not job.done:  # a finished one is delivered instead
                job.on_step(len(job.out_ids))
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
        if job.finish is not None and job.finish.get("type") == "abort":
            self.aborted_requests += 1
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
                update.deliver(failed_answer(update, f"no LoRA adapter named {name!r} is loaded"))
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
                failed_answer(
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
                failed_answer(
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

        weights = check_weight_names(path)  # before peft could write any of them into the base
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
            check_coverage(model, internal, weights, result)
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

    def _adapter_answer(self, message: str) -> JSONObject:
        # SGLang's answer shape (`loaded_adapters`: name -> path), with each adapter's version.
        return {
            "success": True,
            "error_message": "",
            "message": message,
            "loaded_adapters": {n: a.path for n, a in self.adapters.items()},
            "weight_versions": {n: a.weight_version for n, a in self.adapters.items()},
        }
