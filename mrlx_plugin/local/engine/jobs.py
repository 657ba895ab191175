"""What passes between the embedded engine's event loop and its `BatchWorker` thread: a sequence
to generate (`Job`) and its outcome (`JobResult`), a weight or adapter update and its answer, and
a loaded adapter's record."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    import torch

    from mrlx_plugin.local.engine.requests import SamplingParams


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
    generator: torch.Generator | None = None
    finish: JSONObject | None = None  # SGLang's finish_reason
    error: str | None = None
    adapter: str | None = None  # a loaded LoRA adapter's name; None: the base model
    # A streamed job: called on the worker thread after each step that leaves it running, with
    # how many tokens it has (its lists only grow: that many entries can be read from any thread).
    on_step: Callable[[int], None] | None = None

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
    deliver: Callable[[JSONObject], None]


@dataclass
class AdapterUpdate:
    """A `/load_lora_adapter` (`path` set) or `/unload_lora_adapter` (`path` None) call handed to
    the worker; `deliver` receives its answer."""

    name: str
    path: str | None
    weight_version: str | None
    upsert: bool
    deliver: Callable[[JSONObject], None]


@dataclass
class Adapter:
    """A loaded adapter: where it was loaded from, its weight version, its name inside the peft model."""

    path: str
    weight_version: str
    internal: str


def failed_answer(update: WeightUpdate | AdapterUpdate, message: str) -> JSONObject:
    """The answer of an update that did not happen, in the shape of its endpoint's answers."""
    if isinstance(update, AdapterUpdate):
        return {"success": False, "error_message": message}
    return {"success": False, "message": message, "num_paused_requests": 0}
