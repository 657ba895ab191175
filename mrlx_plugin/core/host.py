"""What the host (slime or Miles) provides, and our stand-ins when neither is importable.

The plugin always uses the host's own types when it can import them, so a sample it returns is
exactly what the host's trainer expects. Without a host (CI, a laptop, the embedded default) it
uses the dataclasses below, which have the same field names and status values.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, TypeVar, cast

if TYPE_CHECKING:
    from mrlx_plugin.core.sglang import SamplingParams

HOST: str | None = None

# Type checkers read the stand-ins below as the host's types: they have the fields both hosts
# share (`HostSample`), and neither host need be installed where the plugin is checked.
if not TYPE_CHECKING:
    try:  # slime
        from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
        from slime.utils.types import Sample

        HOST = "slime"
    except ImportError:
        try:  # Miles
            from miles.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
            from miles.utils.types import Sample

            HOST = "miles"
        except ImportError:
            HOST = None

if TYPE_CHECKING or HOST is None:

    @dataclass
    class Sample:
        """The host's Sample, field for field where a plugin touches it (docs/host-contract.md section 3)."""

        group_index: int | None = None
        index: int | None = None
        rollout_id: int | None = None
        prompt: str | list[dict[str, str]] = ""
        tokens: list[int] = field(default_factory=list)
        multimodal_inputs: dict[str, object] | None = None
        response: str = ""
        response_length: int = 0
        label: object = None  # the hosts declare `str | None`; a data set's ground truth may be any value
        reward: float | dict[str, object] | None = None
        loss_mask: list[int] | None = None
        weight_versions: list[str] = field(default_factory=list)
        rollout_log_probs: list[float] | None = None
        remove_sample: bool = False

        class Status(enum.Enum):
            PENDING = "pending"
            COMPLETED = "completed"
            TRUNCATED = "truncated"
            ABORTED = "aborted"
            FAILED = "failed"

        status: Status = Status.PENDING
        metadata: dict = field(default_factory=dict)
        generate_function_path: str | None = None
        custom_rm_path: str | None = None
        train_metadata: dict | None = None
        session_id: str | None = None

        def to_dict(self) -> dict[str, object]:
            value = self.__dict__.copy()
            value["status"] = self.status.value
            return value

        @staticmethod
        def from_dict(data: Mapping[str, object]) -> Sample:
            values = dict(data)
            values["status"] = Sample.Status(values.get("status", "pending"))
            names = set(Sample.__dataclass_fields__)
            build: Callable[..., Sample] = Sample  # its fields, as `data` holds them
            sample = build(**{k: v for k, v in values.items() if k in names})
            for key, value in values.items():
                if key not in names:
                    setattr(sample, key, value)
            return sample

    @dataclass
    class RolloutFnTrainOutput:
        samples: list[list[HostSample]]
        metrics: dict[str, float] | None = None

    @dataclass
    class RolloutFnEvalOutput:
        data: dict[str, EvalEntry]
        metrics: dict[str, float] | None = None


Status = Sample.Status


class HostSample(Protocol):
    """What the plugin reads and writes of a host's Sample: slime's, Miles', or the stand-in above
    (the fields both hosts share, docs/host-contract.md section 3). A Miles release older than its
    `rollout_id` field lacks it: read that one with getattr."""

    group_index: int | None
    index: int | None
    prompt: str | list[dict[str, str]]
    tokens: list[int]
    response: str
    response_length: int
    label: object
    reward: float | dict[str, object] | None
    loss_mask: list[int] | None
    rollout_log_probs: list[float] | None
    weight_versions: list[str]
    status: Status  # the host's Sample.Status
    metadata: dict[str, object]
    remove_sample: bool

    def to_dict(self) -> dict[str, object]: ...


class EvalEntry(TypedDict, total=False):
    """One evaluation data set's part of a `RolloutFnEvalOutput` (`data[name]`), as the hosts fill it."""

    rewards: list[float]
    truncated: list[bool]
    samples: list[HostSample]


class MilesGenerateInput(Protocol):
    """What the plugin reads of Miles' `GenerateFnInput` (a new-form generate function's one argument)."""

    args: argparse.Namespace
    sample: HostSample
    sampling_params: Mapping[str, object] | None


def copy_sample(sample: HostSample, **changes: object) -> HostSample:
    """A new Sample of the host's class with the identity fields of `sample` and `changes` applied.

    Only the fields a plugin owns are carried over; tokens, masks and log-probs start empty so that
    no list is shared between siblings.
    """
    # Built from the fields slime's and Miles' Sample share; the rest are set as attributes
    # (older Miles releases have no `rollout_id` field; a dataclass takes it as an attribute).
    new = Sample(
        group_index=sample.group_index,
        index=sample.index,
        prompt=sample.prompt,
        label=sample.label,
        metadata=dict(sample.metadata or {}),
    )
    new.rollout_id = getattr(sample, "rollout_id", None)
    session_id = getattr(sample, "session_id", None)
    if session_id is not None and hasattr(new, "session_id"):
        new.session_id = session_id
    for key, value in changes.items():
        setattr(new, key, value)
    return new


def load_function(path: str) -> Any:
    """The object a `--*-path` flag names (`package.module.attr`), loaded as the host loads it
    (an attribute of a module named at run time: whatever the flag names, called as it is)."""
    import importlib

    module, _, attr = str(path).rpartition(".")
    return getattr(importlib.import_module(module), attr)


def router_url(args: argparse.Namespace) -> str | None:
    """The job's own router (`url: self` in the config), or None when the host set none."""
    ip = getattr(args, "sglang_router_ip", None)
    port = getattr(args, "sglang_router_port", None)
    if not ip or not port:
        return None
    host = f"[{ip}]" if ":" in str(ip) and not str(ip).startswith("[") else ip
    return f"http://{host}:{port}"


def host_abort_flag(miles_input: object = None) -> Callable[[], bool]:
    """A function that tells whether the host has marked the current rollout aborted.

    slime keeps one `GenerateState` singleton whose `aborted` its default rollout sets before it
    aborts the requests still in flight. Miles keeps the flag on the `GenerateState` it hands to
    a new-form generate function (`input.state`), on every rollout path (class-based, legacy,
    fully async); its legacy adapter would hide it, which is why `generate` takes the new form
    there. Without a host nothing aborts a rollout but the engines' own `abort` answers.
    """
    state = getattr(miles_input, "state", None)
    if state is not None:
        return lambda: bool(getattr(state, "aborted", False))
    if HOST != "slime":
        return _never
    try:
        from slime.rollout.sglang_rollout import GenerateState
        from slime.utils.misc import SingletonMeta
    except ImportError:
        return _never

    def slime_aborted() -> bool:
        # Read the singleton without creating it: a rollout that has not started is not aborted.
        state = SingletonMeta._instances.get(GenerateState)
        return bool(state is not None and getattr(state, "aborted", False))

    return slime_aborted


def _never() -> bool:
    return False


async def host_reward(args: object, sample: HostSample) -> object:
    """The host's own grader for one sample (`--rm-type`, `--custom-rm-path`), when a host is
    installed. `args`: the host's args, or a view of them; what it returns is the host's (a
    number, or a dict of them that `--reward-key` picks from)."""
    if HOST == "slime":
        from slime.rollout.rm_hub import async_rm as slime_rm

        return await slime_rm(args, sample)
    if HOST == "miles":
        from miles.rollout.rm_hub import async_rm as miles_rm

        return await miles_rm(args, sample)
    raise RuntimeError(
        "grader 'host' needs slime or Miles installed in this environment; "
        "set mrlx.rewards.grader to 'math' or name your own grader hook"
    )


def wrap_generate_output(samples: HostSample | list[HostSample], miles_input: object) -> object:
    """Return `samples` in the form the caller used: Miles' GenerateFnOutput for an `input` call."""
    if miles_input is None:
        return samples
    try:
        from miles.rollout.base_types import GenerateFnOutput
    except ImportError:
        return samples
    return GenerateFnOutput(samples=samples)


def unpack_generate_call(
    args: argparse.Namespace | MilesGenerateInput,
    sample: HostSample | None,
    sampling_params: Mapping[str, object] | None,
    evaluation: bool,
) -> tuple[argparse.Namespace, HostSample, dict[str, object], bool, MilesGenerateInput | None]:
    """Accept slime's `(args, sample, sampling_params, evaluation)` and Miles' `(input)` forms.

    Returns (args, sample, sampling_params, evaluation, miles_input_or_None).
    """
    if sample is None and hasattr(args, "sample") and hasattr(args, "sampling_params"):
        miles_input = cast(MilesGenerateInput, args)
        return (
            miles_input.args,
            miles_input.sample,
            dict(miles_input.sampling_params or {}),
            bool(getattr(miles_input, "evaluation", False)),
            miles_input,
        )
    if sample is None:
        raise TypeError(
            "generate() takes (args, sample, sampling_params, evaluation=False) as slime calls it, "
            "or one Miles GenerateFnInput"
        )
    return cast(argparse.Namespace, args), sample, dict(sampling_params or {}), bool(evaluation), None


T = TypeVar("T")


class _LoopThread:
    """A persistent event loop on a daemon thread, like slime's own (used when no host is present)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mrlx-rollout-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[object, object, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


class HostProcess:
    """What the plugin keeps for the life of the host's rollout process, in one place.

    It is process-wide because the host calls flat functions (`generate(args, sample, ...)`,
    `initiator_rollout(args, rollout_id, ...)`, `reward(args, sample)`) that receive nothing but
    the host's `args`: what those calls share (the Runtime built from `args`, the math grader's
    worker) can only be found again from `args`, and the coroutines they hand over need one event
    loop that outlives every call. This object is the one owner of all of that:

    - `for_args(args, kind, build)`: one object per (host `args`, kind), built on first use;
    - `run(coro)`: the host's rollout event loop, or the plugin's own loop thread without a host;
    - `miles_rollout(args, data_source)`: Miles' class-based default rollout, one per data source.

    Everything else (tokenizers, engine clients, counters) belongs to the Runtime of its `args`.
    """

    def __init__(self) -> None:
        # `argparse.Namespace` is unhashable: objects are keyed by id(args), guarded by a weak
        # reference against the id's reuse by a later args object.
        self._per_args: dict[tuple[int, str], tuple[Callable[[], object], object]] = {}
        # Re-entrant: building one per-args object (the Runtime) may ask for another (its verifier).
        self._lock = threading.RLock()
        self._own_loop: _LoopThread | None = None
        self._loop_lock = threading.Lock()  # not the build lock: a long build must not hold up the loop
        self._miles_rollouts: dict[int, tuple[object, object]] = {}

    def cached(self, args: object, kind: str) -> object | None:
        """The `kind` object of `args` if it was built, else None (never blocks)."""
        entry = self._per_args.get((id(args), kind))
        if entry is not None and entry[0]() is args:
            return entry[1]
        return None

    def for_args(self, args: object, kind: str, build: Callable[[], T]) -> T:
        """The `kind` object of `args`, built by `build()` on first use (one build at a time)."""
        value = self.cached(args, kind)
        if value is not None:
            return cast(T, value)  # what `build` made for this kind
        with self._lock:
            value = self.cached(args, kind)
            if value is None:
                value = build()
                try:
                    ref: Callable[[], object] = weakref.ref(args)
                except TypeError:  # an args object without weakref support: keep it alive instead
                    ref = (lambda a: lambda: a)(args)
                # Forget objects of args that are gone, so that ids can be reused safely.
                for key in [k for k, (r, _) in self._per_args.items() if r() is None]:
                    del self._per_args[key]
                self._per_args[(id(args), kind)] = (ref, value)
            return cast(T, value)

    def run(self, coro: Coroutine[object, object, T]) -> T:
        """Run `coro` to completion on the host's rollout event loop and return its result.

        slime and Miles run every rollout coroutine (the generate function included) on one
        persistent background loop; rollout functions are synchronous and hand coroutines to it.
        The plugin does the same, so its connections and background tasks live in one loop.
        """
        for module in ("slime.utils.async_utils", "miles.utils.async_utils"):
            if HOST is not None and module.startswith(HOST):
                try:
                    run = __import__(module, fromlist=["run"]).run
                except ImportError:
                    break
                return cast(T, run(coro))
        if self._own_loop is None:
            with self._loop_lock:
                if self._own_loop is None:
                    self._own_loop = _LoopThread()
        return self._own_loop.run(coro)

    def miles_rollout(self, args: argparse.Namespace, data_source: object) -> object:
        """Miles' class-based rollout for `data_source`: built once and kept (it keeps state across
        calls: its GenerateState, eval datasets), like the one Miles' rollout manager would build."""
        from miles.rollout.base_types import RolloutFnConstructorInput
        from miles.rollout.inference_rollout.inference_rollout_common import InferenceRolloutFn

        entry = self._miles_rollouts.get(id(data_source))
        if entry is None or entry[0] is not data_source:
            entry = self._miles_rollouts[id(data_source)] = (
                data_source,
                InferenceRolloutFn(RolloutFnConstructorInput(args=args, data_source=data_source)),
            )
        return entry[1]


HOST_PROCESS = HostProcess()


def run_in_host_loop(coro: Coroutine[object, object, T]) -> T:
    """Run `coro` to completion on the host's rollout event loop (see `HostProcess.run`)."""
    return HOST_PROCESS.run(coro)


def host_default_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: bool = False
) -> Any:
    """The host's own default rollout, or the embedded stand-in without a host. It calls the
    `--custom-generate-function-path` function per sample. What it returns is the host's rollout
    output (a `RolloutFnTrainOutput`, or the evaluation's), as that host's version makes it.

    slime: `slime.rollout.sglang_rollout.generate_rollout`. Miles: the class-based
    `InferenceRolloutFn` (built once per data source and kept, as Miles' rollout manager does),
    or the legacy `miles.rollout.sglang_rollout.generate_rollout` when Miles runs with
    `MILES_USE_LEGACY_ROLLOUT_V1=1`.
    """
    if HOST == "slime":
        from slime.rollout.sglang_rollout import generate_rollout

        return generate_rollout(args, rollout_id, data_source, evaluation=evaluation)
    if HOST == "miles":
        return _miles_default_rollout(args, rollout_id, data_source, evaluation)
    # No host: the stand-in host that built `args` names its default rollout there
    # (`mrlx_plugin.local.trainer.fake_host.host_args`), as slime's own module would be importable.
    stand_in = getattr(args, "host_default_rollout", None)
    if stand_in is None:
        raise RuntimeError(
            "neither slime nor Miles is importable and `args` names no stand-in default rollout; "
            "run inside the host, or build args with mrlx_plugin.local.trainer.fake_host.host_args"
        )
    return stand_in(args, rollout_id, data_source, evaluation=evaluation)


async def host_generate_group(args: argparse.Namespace, group: list[HostSample]) -> list[Any]:
    """Generate and grade one prompt group as the host's default rollout does (the generate
    function per sample, then the reward), for a rollout that keeps groups in flight itself.

    slime: `slime.rollout.sglang_rollout.generate_and_rm_group` with the host's sampling
    parameters. Without a host: the stand-in named by `args.host_generate_group`. Miles' fully
    asynchronous rollout runs its own producer and never needs this.
    """
    if HOST == "slime":
        from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group

        params = GenerateState(args).sampling_params.copy()
        return cast("list[Any]", await generate_and_rm_group(args, group, params, evaluation=False))
    stand_in = getattr(args, "host_generate_group", None)
    if stand_in is None:
        raise RuntimeError(
            f"{HOST or 'no host'}: mrlx_plugin.rollout.async_rollout runs under slime or the embedded "
            "trainer; under Miles use --fully-async with --custom-async-data-buffer-path "
            "mrlx_plugin.rollout.AsyncDataBuffer"
        )
    return cast("list[Any]", await stand_in(args, group))


def miles_uses_legacy_rollout() -> bool:
    """Whether Miles runs its deprecated function-based rollout (`MILES_USE_LEGACY_ROLLOUT_V1=1`)."""
    try:
        from miles.utils.environ import use_legacy_rollout_v1
    except ImportError:
        return os.environ.get("MILES_USE_LEGACY_ROLLOUT_V1", "0") not in ("", "0")
    return bool(use_legacy_rollout_v1())


def _miles_default_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: bool
) -> Any:
    from miles.rollout.base_types import call_rollout_fn

    if miles_uses_legacy_rollout():
        from miles.rollout.sglang_rollout import generate_rollout

        return call_rollout_fn(generate_rollout, args, rollout_id, data_source, evaluation=evaluation)
    from miles.rollout.base_types import RolloutFnEvalInput, RolloutFnTrainInput
    from miles.rollout.inference_rollout.compatibility import call_rollout_function

    rollout_input = (
        RolloutFnEvalInput(rollout_id=rollout_id)
        if evaluation
        else RolloutFnTrainInput(rollout_id=rollout_id)
    )
    return call_rollout_function(HOST_PROCESS.miles_rollout(args, data_source), rollout_input)


class ModelMax(Protocol):
    """The host model's position limit, as read by `mrlx_plugin.link.limits.read_model_limits`."""

    @property
    def max_length(self) -> int | None: ...


@dataclass
class HostLimits:
    """The host's generation limits, as read from `args` (slime's flag names)."""

    max_context: int | None  # rollout_max_context_len (eval_max_context_len in evaluation)
    max_context_eval: int | None
    max_response: int | None  # rollout_max_response_len
    default_sampling: SamplingParams  # used when the host passes no sampling_params (CLI)
    # The host model's own position limit (`--max-position-embeddings`, else the checkpoint's
    # config.json): a longer sample has positions the trainer's model has no embedding for.
    model_max: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, model: ModelMax) -> HostLimits:
        """The limits of `args`; `model` holds the host model's limits (`max_length`), as read
        (blocking) from the flags or the checkpoint's config.json when the Runtime is built."""
        ctx = getattr(args, "rollout_max_context_len", None)
        sampling = {
            "temperature": getattr(args, "rollout_temperature", 1.0),
            "top_p": getattr(args, "rollout_top_p", 1.0),
            "top_k": getattr(args, "rollout_top_k", -1),
            "max_new_tokens": getattr(args, "rollout_max_response_len", None) or 1024,
            "stop": getattr(args, "rollout_stop", None),
            "stop_token_ids": getattr(args, "rollout_stop_token_ids", None),
            "skip_special_tokens": getattr(args, "rollout_skip_special_tokens", False),
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }
        return cls(
            max_context=ctx,
            max_context_eval=getattr(args, "eval_max_context_len", None) or ctx,
            max_response=getattr(args, "rollout_max_response_len", None),
            default_sampling={k: v for k, v in sampling.items() if v is not None},
            model_max=model.max_length,
        )
