"""The functions the host's flags name.

    --custom-generate-function-path     mrlx_plugin.rollout.generate
    --custom-reward-post-process-path   mrlx_plugin.rollout.normalize
    --custom-rollout-log-function-path  mrlx_plugin.rollout.log_rollout
    --custom-rm-path                    mrlx_plugin.rollout.reward      (optional)
    --custom-config-path                your.yaml                       (an `mrlx:` key)

A multi-model run adds one rollout function per job:

    --rollout-function-path  mrlx_plugin.rollout.initiator_rollout   (the job that runs episodes)
    --rollout-function-path  mrlx_plugin.rollout.responder_rollout   (each other trainable agent's job)

Fully asynchronous rollouts (episodes keep running while the trainer trains; see `async_rollout`
in `mrlx_plugin.async_rollout`), for a shared-model job and for the job that runs a multi-model
run's episodes:

    slime:  --rollout-function-path  mrlx_plugin.rollout.async_rollout
    Miles:  --fully-async --custom-async-data-buffer-path mrlx_plugin.rollout.AsyncDataBuffer

`generate` runs one multi-agent episode per input sample. slime calls it as
`generate(args, sample, sampling_params, evaluation=...)`. Miles looks at the name of the first
parameter: `input` makes it pass one `GenerateFnInput` (the new form), which carries its rollout
state, so the episode sees Miles' abort flag; any other name would put the function behind
Miles' legacy adapter, which drops that state.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Literal, cast, overload

from mrlx_plugin.async_rollout import (
    AsyncDataBuffer,
    Producer,
    leaves,
    open_step,
    producer_for,
    stamp_birth,
    start_step,
    take_step,
)
from mrlx_plugin.core.config import Settings
from mrlx_plugin.core.host import (
    HOST_PROCESS,
    HostSample,
    MilesGenerateInput,
    RolloutFnEvalOutput,
    RolloutFnTrainOutput,
    host_abort_flag,
    host_default_rollout,
    run_in_host_loop,
    unpack_generate_call,
    wrap_generate_output,
)
from mrlx_plugin.core.metrics import compute_metrics, log_eval_rollout, log_rollout
from mrlx_plugin.episodes import run_episode
from mrlx_plugin.link.outbox import initiator_barrier
from mrlx_plugin.link.save_rules import durable_step_before
from mrlx_plugin.rewards import shaping
from mrlx_plugin.rewards.shaping import reward
from mrlx_plugin.runtime import get_runtime, read_settings, responder_for, runtime_for

# Every function a host flag names is reachable here (the reward, normalisation and logging
# functions live with their kind and are named through this module).
__all__ = [
    "generate",
    "initiator_rollout",
    "responder_rollout",
    "async_rollout",
    "AsyncDataBuffer",
    "normalize",
    "reward",
    "log_rollout",
    "log_eval_rollout",
    "ack_trained_groups",
    "add_arguments",
]


@overload
async def generate(
    input: argparse.Namespace,
    sample: HostSample,
    sampling_params: Mapping[str, object] | None = None,
    evaluation: Literal[False] = False,
) -> list[HostSample]: ...


@overload
async def generate(
    input: argparse.Namespace,
    sample: HostSample,
    sampling_params: Mapping[str, object] | None = None,
    evaluation: bool = False,
) -> HostSample | list[HostSample]: ...


@overload
async def generate(input: MilesGenerateInput) -> object: ...  # Miles' GenerateFnOutput


async def generate(
    input: argparse.Namespace | MilesGenerateInput,
    sample: HostSample | None = None,
    sampling_params: Mapping[str, object] | None = None,
    evaluation: bool = False,
) -> object:
    """Run one episode of the configured agent system on `sample`.

    `input` is slime's `args` (then `sample` and `sampling_params` follow), or Miles' one
    `GenerateFnInput` (the first parameter's name `input` is what tells Miles to pass it).

    Training returns the same number of samples for every episode (the system's samples per
    episode for the agents this job trains, all with the input's rollout id and a reward set, ABORTED
    fillers standing in for what an episode did not produce); evaluation returns one sample
    holding the team's final answer and its grade. Engine faults never raise: they come back
    as ABORTED samples with reward 0.0 and a zero loss mask. No new turn starts once the host
    marks the rollout aborted. Settings errors raise ConfigError on the first call.
    """
    args, sample, sampling_params, evaluation, miles_input = unpack_generate_call(
        input, sample, sampling_params, evaluation
    )
    runtime = await get_runtime(args)
    if runtime.outbox is not None and not evaluation:
        # Before the episode, not after it has spent its engine calls: its peers' samples need a step.
        runtime.outbox.require_step()
    if not evaluation:  # the step it starts in, and its peers' versions then: its staleness later
        stamp_birth(sample, runtime.step, runtime.outbox.peer_versions if runtime.outbox is not None else {})
    # Other jobs' agents' samples reach the outbox through the mrlx_episode_end hook (see runtime).
    _, result = await run_episode(
        runtime.context, sample, sampling_params, evaluation, host_aborted=host_abort_flag(miles_input)
    )
    return wrap_generate_output(result, miles_input)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Miles calls this on the object named by --custom-generate-function-path or
    --rollout-function-path: it adds `--mrlx-config PATH`, read when the `--custom-config-path`
    YAML carries no `mrlx:` key."""
    if any("--mrlx-config" in action.option_strings for action in parser._actions):
        return
    parser.add_argument(
        "--mrlx-config",
        type=str,
        default=None,
        help="mrlx_plugin settings: a YAML file with a top-level 'mrlx:' key (or base64:<payload>)",
    )


# A function attribute Miles looks for (set through `__dict__`, where a function keeps its attributes).
generate.__dict__["add_arguments"] = add_arguments


@overload
def initiator_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: Literal[False] = False
) -> RolloutFnTrainOutput: ...


@overload
def initiator_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: bool
) -> RolloutFnTrainOutput | RolloutFnEvalOutput: ...


def initiator_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """`--rollout-function-path` of the job that runs every episode of a multi-model system.

    slime calls it right after this job's trainer pushed new weights. It reports this job's
    version to the coordinator and waits until every other trainable agent is within
    `coordinator.max_staleness` versions, runs the host's default rollout (which calls
    `generate` per sample: each turn goes to the speaking agent's URL), and before returning
    commits the other agents' samples of the prompt groups the host kept for this step.
    Evaluation runs the host's default evaluation and queues nothing.
    """
    runtime = runtime_for(args)
    if evaluation:
        return host_default_rollout(args, rollout_id, data_source, evaluation=True)
    outbox = runtime.outbox
    metrics: dict[str, float] = {}
    open_step(runtime, rollout_id)
    if outbox is not None:
        outbox.load_limits(args, runtime.tokenizers)  # once; blocking file reads stay off the event loop
        metrics.update(
            run_in_host_loop(
                initiator_barrier(runtime.coordinator, outbox, args, rollout_id, runtime.samples_per_episode)
            )
        )
    output = host_default_rollout(args, rollout_id, data_source, evaluation=False)
    if outbox is not None:
        kept = {_group_index(group) for group in output.samples}
        metrics.update(run_in_host_loop(outbox.drain(runtime.coordinator, rollout_id, kept)))
    output.metrics = {**(output.metrics or {}), **metrics}
    return output


@overload
def async_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: Literal[False] = False
) -> RolloutFnTrainOutput: ...


@overload
def async_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: bool
) -> RolloutFnTrainOutput | RolloutFnEvalOutput: ...


def async_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """`--rollout-function-path` of a fully asynchronous slime job (or embedded trainer): a
    shared-model job, or the job that runs a multi-model run's episodes.

    The first call starts a producer on the host's rollout loop that keeps
    `async_rollout.max_in_flight_groups` prompt groups generating across steps (the generate
    function per sample, then the reward, as slime's default rollout does); finished groups wait
    in a bounded queue. Each call opens step `rollout_id` (in a multi-model run: reports this
    job's version and waits for the peers, as `initiator_rollout` does), takes
    `--rollout-batch-size` finished groups oldest first, giving back to the data source each group
    beyond `async_rollout.max_staleness`, orders them by their first sample's index, and commits
    the kept groups' peer samples under this step, named after their places in it (see
    `mrlx_plugin.async_rollout`). Evaluation pauses new groups and runs the host's default
    evaluation.
    """
    runtime = runtime_for(args)
    if evaluation:
        producer = cast("Producer | None", HOST_PROCESS.cached(args, "producer"))
        if producer is None:
            return host_default_rollout(args, rollout_id, data_source, evaluation=True)
        run_in_host_loop(_set_paused(producer, True))
        try:
            return host_default_rollout(args, rollout_id, data_source, evaluation=True)
        finally:
            run_in_host_loop(_set_paused(producer, False))
    producer_for(args, data_source, runtime.settings)  # built here, outside the loop
    metrics = run_in_host_loop(start_step(runtime, args, rollout_id))
    groups, step_metrics = run_in_host_loop(take_step(runtime, args, rollout_id, data_source))
    metrics.update(step_metrics)
    metrics.update(compute_metrics([s for g in groups for s in leaves(g)]))
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)


async def _set_paused(producer: Producer, paused: bool) -> None:
    """Pause or resume new groups (an asyncio event: set on the loop it belongs to)."""
    if paused:
        producer.resumed.clear()
    else:
        producer.resumed.set()


def _group_index(group: Sequence[object]) -> int | None:
    """The prompt group of one group of the host's rollout output (samples, or lists of them)."""
    first = group[0]
    while isinstance(first, list):
        first = first[0]
    return cast(HostSample, first).group_index


@overload
def responder_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: Literal[False] = False
) -> RolloutFnTrainOutput: ...


@overload
def responder_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: bool
) -> RolloutFnTrainOutput | RolloutFnEvalOutput: ...


def responder_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: object, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """`--rollout-function-path` of a job whose agent's turns another job's episodes produce.

    It runs no episodes and never aborts this job's engines (they serve the initiator's turns).
    It acknowledges (a step watermark) every step that a resumed job would not train again: the
    last one slime has saved durably before this step (`durable_step_before`: the step of the last
    `--save-interval` save, the one before it with `--async-save`, every earlier step without
    `--save`). It reports this job's new weight version and leases the `--rollout-batch-size` whole
    groups of the initiator's step `rollout_id` (each the episodes of one of its prompt groups),
    waiting up to `coordinator.wait_deadline_s`; the leases are renewed while the step trains. A
    group the coordinator set aside, or with items this job's model cannot take (token ids outside
    its vocabulary, longer than its context: `--vocab-size`/`--max-position-embeddings`, else the
    `--hf-checkpoint` config), becomes as many ABORTED fillers. Evaluation runs the host's default
    evaluation.
    """
    if evaluation:  # the host's evaluation runs whole episodes here: they need every agent's tokenizer
        runtime = runtime_for(args)
        runtime.load_tokenizers()  # those a Runtime built without them skipped (the embedded trainer's)
        return host_default_rollout(args, rollout_id, data_source, evaluation=True)
    responder = responder_for(args)  # built once; its file reads stay off the event loop
    groups, metrics = run_in_host_loop(responder.take(rollout_id, durable_step_before(args, rollout_id)))
    metrics.update(compute_metrics([s for g in groups for s in g]))
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)


def ack_trained_groups(args: argparse.Namespace, step: int) -> None:
    """Acknowledge every group of the initiator's steps up to `step`, once this job's step `step`
    is saved.

    `responder_rollout` acknowledges at the top of each step what slime has saved by then (slime
    has no hook after a save). A host that knows when a step is saved (the embedded trainer does)
    calls this right after the save, so that the queue is emptied at once. Never raises: a failure
    is logged and the next step acknowledges through this step again.
    """
    run_in_host_loop(responder_for(args).finish(step))


def normalize(args: argparse.Namespace, samples: Sequence[HostSample]) -> tuple[list[float], list[float]]:
    """slime's `--custom-reward-post-process-path`: (raw rewards, advantages), one per sample, as
    `mrlx_plugin.rewards.shaping.normalize` computes them with the job's settings (the running
    baseline of `rewards.lone_baseline` needs them)."""
    return shaping.normalize(args, samples, job_settings(args))


def job_settings(args: argparse.Namespace) -> Settings | None:
    """The mrlx settings of the job whose `args` these are: its Runtime's or Responder's (built
    by the rollout before any step is normalised), else read from `args` (once per args); None
    for args that carry no mrlx settings (a host run not set up through mrlx's config)."""
    for owner in (HOST_PROCESS.cached(args, "runtime"), HOST_PROCESS.cached(args, "responder")):
        settings = getattr(owner, "settings", None)
        if isinstance(settings, Settings):
            return settings
    carries = (
        isinstance(getattr(args, "mrlx", None), dict)
        or getattr(args, "mrlx_config", None)
        or getattr(args, "custom_config_path", None)
    )
    if not carries:
        return None
    return cast(Settings, HOST_PROCESS.for_args(args, "settings", lambda: read_settings(args)[0]))


initiator_rollout.__dict__["add_arguments"] = add_arguments
async_rollout.__dict__["add_arguments"] = add_arguments
responder_rollout.__dict__["add_arguments"] = add_arguments
