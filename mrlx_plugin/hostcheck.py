"""Start-up checks of the host's flags against what the plugin will hand it.

Two things stop a real job long after it started (after model loading, after the first
rollout) unless they are caught when the plugin is first called:

- The data-parallel split. slime and Miles cut each step into micro-batches and give every
  data-parallel rank the same number of them. With fixed micro-batches (no
  `--use-dynamic-batch-size`) a step of S samples makes ceil(S / micro_batch_size) of them, and
  that count must be a multiple of dp_size (times the micro-batch group under virtual pipeline
  parallelism), or the host's split raises. A step holds `global_batch_size` episodes (the host
  counts rollout ids) times the samples each episode returns, so the check needs the system's
  fan-out. A system whose fan-out varies by design needs the dynamic path.
- The rollout mode. A multi-model job must run the plugin's `initiator_rollout`, `async_rollout`
  or `responder_rollout`, or Miles' `--fully-async`; under `--fully-async` the buffer must be the
  plugin's `AsyncDataBuffer`; slime's own fully asynchronous rollout and its top-p training path
  cannot take mrlx episodes at all.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

from mrlx_plugin.core.config import ConfigError, Settings


@dataclass(frozen=True)
class HostSplit:
    """How the host will split a step, read from its flags."""

    episodes_per_step: int  # global_batch_size: rollout ids per optimizer step
    dp_size: int
    mb_group: int  # micro-batch group per virtual-pipeline stage (1 without virtual pipeline)
    micro_batch_size: int | None  # None on the dynamic path
    dynamic: bool

    @property
    def align(self) -> int:
        """A step's micro-batch count must be a multiple of this."""
        return self.dp_size * self.mb_group

    def fits(self, samples: int) -> bool:
        if samples < self.align:
            return False
        if self.dynamic:  # the host splits bins until the count aligns
            return True
        return math.ceil(samples / self.micro_batch_size) % self.align == 0


def _int(args: argparse.Namespace, name: str, default: int | None = None) -> int | None:
    value = getattr(args, name, None)
    return default if value is None else int(value)


def host_split(args: argparse.Namespace) -> HostSplit | None:
    """The host's split settings, or None when `args` carries no trainer batch flags (the CLI,
    the embedded trainer: nothing splits there)."""
    dynamic = bool(getattr(args, "use_dynamic_batch_size", False))
    mbs = _int(args, "micro_batch_size")
    if not dynamic and mbs is None:
        return None
    episodes = _int(args, "global_batch_size")
    if episodes is None:
        per_rollout = _int(args, "rollout_batch_size", 0) * _int(args, "n_samples_per_prompt", 1)
        episodes = per_rollout // (_int(args, "num_steps_per_rollout") or 1)
    dp = _int(args, "data_parallel_size")
    if dp is None:
        world = _int(args, "world_size") or _int(args, "actor_num_nodes", 1) * _int(
            args, "actor_num_gpus_per_node", 1
        )
        model_parallel = (
            _int(args, "tensor_model_parallel_size", 1)
            * _int(args, "pipeline_model_parallel_size", 1)
            * _int(args, "context_parallel_size", 1)
        )
        dp = max(1, world // max(1, model_parallel))
    vpp = _int(args, "virtual_pipeline_model_parallel_size", 1)
    group = _int(args, "microbatch_group_size_per_vp_stage") or _int(args, "pipeline_model_parallel_size", 1)
    return HostSplit(episodes, dp, group if vpp > 1 else 1, None if dynamic else mbs, dynamic)


_DP = (
    "the data-parallel size: --actor-num-nodes x --actor-num-gpus-per-node / (--tensor-model-parallel-size x "
    "--pipeline-model-parallel-size x --context-parallel-size)"
)
_DYNAMIC = "--use-dynamic-batch-size --max-tokens-per-gpu N"


def check_step_split(args: argparse.Namespace, per_episode: int | None, system: str, source: str) -> None:
    """Refuse host batch settings under which a step of this job could not be split.

    `per_episode` is how many samples each episode returns to this job (None: it varies)."""
    split = host_split(args)
    if split is None:
        return
    if per_episode is None:
        if not split.dynamic:
            raise ConfigError(
                f"{source}: system {system!r} returns a varying number of samples per episode (it declares "
                "no "
                f"fan_out), so a step's sample count is arbitrary and the host's fixed micro-batches "
                f"(--micro-batch-size {split.micro_batch_size}) cannot split it across {split.dp_size} "
                "data-parallel "
                f"ranks; pass {_DYNAMIC}, or give the system a fixed fan_out"
            )
        return
    samples = split.episodes_per_step * per_episode
    if split.fits(samples):
        return
    group = (
        f" x the micro-batch group ({split.mb_group}, --microbatch-group-size-per-vp-stage)"
        if split.mb_group > 1
        else ""
    )
    head = (
        f"{source}: the host could not split this job's steps across its data-parallel ranks. Each episode "
        "of "
        f"system {system!r} returns {per_episode} sample(s) to this job, so a step of "
        f"{split.episodes_per_step} "
        "episodes (--global-batch-size, or --rollout-batch-size x --n-samples-per-prompt / "
        "--num-steps-per-rollout) "
        f"holds {samples} samples"
    )
    if split.dynamic:
        raise ConfigError(
            f"{head}, fewer than the {split.align} micro-batches the split needs ({_DP}{group}); "
            "train more episodes per step or use fewer data-parallel ranks"
        )
    count = math.ceil(samples / split.micro_batch_size)
    sizes = [m for m in range(1, samples + 1) if math.ceil(samples / m) % split.align == 0]
    hint = f"--micro-batch-size {' or '.join(str(m) for m in sizes[-3:])}" if sizes else ""
    unit = split.align * split.micro_batch_size // math.gcd(split.align * split.micro_batch_size, per_episode)
    raise ConfigError(
        f"{head}; with --micro-batch-size {split.micro_batch_size} that is {count} micro-batches, not a "
        "multiple "
        f"of {split.align} ({_DP}{group}), and the host's split would stop the job at its first step. "
        f"Pass {_DYNAMIC} (any count splits), or sizes that divide: "
        + (f"{hint}, or " if hint else "")
        + f"a step of a multiple of {unit} episodes"
    )


_PLUGIN_ROLLOUTS = {
    ("mrlx_plugin.rollout", "initiator_rollout"),
    ("mrlx_plugin.rollout", "responder_rollout"),
    ("mrlx_plugin.rollout", "async_rollout"),
}
_PLUGIN_BUFFER = "mrlx_plugin.rollout.AsyncDataBuffer"
# The re-exported name, and where the class lives.
_PLUGIN_BUFFERS = (_PLUGIN_BUFFER, "mrlx_plugin.async_rollout.AsyncDataBuffer")
# Host flags that filter or rework a step's groups, which the fully asynchronous rollouts do not apply.
_FILTERS_NOT_APPLIED = ("dynamic_sampling_filter_path", "rollout_all_samples_process_path")


def check_rollout_mode(args: argparse.Namespace, source: str, peer_agents: Sequence[str]) -> None:
    """Refuse host rollout modes the plugin cannot run under (docs/host-contract.md section 11).
    `source` names the settings in messages; `peer_agents` are the trainable agents other jobs train."""
    from mrlx_plugin.core.host import HOST, load_function

    path = getattr(args, "rollout_function_path", None)
    if HOST == "slime" and path and str(path).endswith("fully_async_rollout.generate_rollout_fully_async"):
        # It orders finished groups by `getattr(item, "index")`, which for a list is the list's
        # own method: every generate function that returns several samples fails there.
        raise ConfigError(
            f"{source}: --rollout-function-path {path}: slime's fully asynchronous rollout cannot take "
            "generate functions that return several samples per input (it sorts groups by sample.index and "
            "fails on lists; THUDM/slime#2344), and every mrlx episode does; use the plugin's fully "
            "asynchronous rollout: --rollout-function-path mrlx_plugin.rollout.async_rollout"
        )
    if HOST == "miles" and path and str(path).endswith("mrlx_plugin.rollout.async_rollout"):
        raise ConfigError(
            f"{source}: --rollout-function-path {path} is slime's way to a fully asynchronous rollout; Miles "
            "runs its own: use --fully-async --custom-async-data-buffer-path " + _PLUGIN_BUFFER + " instead"
        )
    plugin_async = bool(path) and str(path).endswith("mrlx_plugin.rollout.async_rollout")
    if HOST == "slime" and plugin_async:
        for flag in ("colocate", "offload_rollout"):
            if getattr(args, flag, False):
                # slime releases the engines' memory once a rollout returns; the producer's turns go on.
                raise ConfigError(
                    f"{source}: --rollout-function-path {path} keeps episodes generating while the trainer "
                    f"trains, and --{flag.replace('_', '-')} gives the engines' GPUs to the trainer then; "
                    f"remove --{flag.replace('_', '-')}"
                )
    buffer = getattr(args, "custom_async_data_buffer_path", None)
    fully_async = bool(getattr(args, "fully_async", False))
    if plugin_async or fully_async:
        for flag in _FILTERS_NOT_APPLIED:
            if getattr(args, flag, None):
                raise ConfigError(
                    f"{source}: --{flag.replace('_', '-')} is not applied by the plugin's fully asynchronous "
                    "rollout (it keeps whole groups as they finish, within its staleness bound); remove it"
                )
    if fully_async and buffer not in _PLUGIN_BUFFERS:
        # Miles' default buffer refuses every group holding an ABORTED sample, and an episode that
        # ends early returns ABORTED fillers (zero loss mask) by design: those groups never train.
        raise ConfigError(
            f"{source}: --fully-async with --custom-async-data-buffer-path {buffer or 'unset'}: Miles' "
            "default buffer drops every group holding an ABORTED sample, and mrlx episodes that end early "
            f"hold ABORTED fillers that train nothing; set --custom-async-data-buffer-path {_PLUGIN_BUFFER}"
        )
    if HOST == "slime" and float(getattr(args, "rollout_top_p", 1.0) or 1.0) != 1.0:
        raise ConfigError(
            f"{source}: --rollout-top-p {args.rollout_top_p}: with top-p below 1 slime's training expects "
            "the "
            "sampled top-p token sets on every sample (rollout_top_p_token_ids), which mrlx episodes do not "
            "record; "
            "remove --rollout-top-p (an agent's own mrlx.agents.NAME.sampling.top_p is sent to its engine "
            "only)"
        )
    peers = list(peer_agents)
    if not peers:
        return  # a shared-model job: the host's rollout calls `generate` per sample, which is all it needs
    what = f"{source}: agent {peers[0]!r} is trained by another job (a multi-model run)"
    if getattr(args, "fully_async", False):
        if hasattr(args, "start_rollout_id") and args.start_rollout_id is None:
            # Miles leaves it None in a resumed run's parsed flags and resolves it on its trainer,
            # after the rollout manager took its copy of them: the buffer could not number steps.
            raise ConfigError(
                f"{what}, and this --fully-async job resumes from --load {getattr(args, 'load', None)} "
                "without --start-rollout-id: the plugin's buffer commits the other jobs' samples under "
                "this job's step numbers, and Miles tells its rollout manager no resumed step; pass "
                "--start-rollout-id (the step after the checkpoint's)"
            )
        return  # Miles' own producer runs the episodes; the plugin's buffer commits the peers' samples
    if not hasattr(args, "rollout_function_path"):
        return  # no host rollout loop (the `mrlx rollout` command runs episodes itself)
    try:
        fn = load_function(path) if path else None
    except (ImportError, AttributeError):
        fn = None
    # by name, not identity: this module sits below `mrlx_plugin.rollout`, which calls it
    if (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) not in _PLUGIN_ROLLOUTS:
        raise ConfigError(
            f"{what}, but --rollout-function-path is {path or 'the host default'!s}. Set "
            "--rollout-function-path mrlx_plugin.rollout.initiator_rollout (or async_rollout) in the job "
            "that runs the episodes and mrlx_plugin.rollout.responder_rollout in each other agent's job"
        )


_HOST_NAMES = {"slime": "slime", "miles": "Miles"}
# Why a host cannot train an agent's LoRA adapter (docs/multi-model.md, "Agents as LoRA adapters").
_NO_ADAPTER_TRAINING = {
    "slime": "slime has no LoRA training path: its Megatron trainer updates whole models (LoRA appears only "
    "in its Megatron-to-HF conversion)",
    "miles": "Miles trains LoRA adapters through its own drivers only: one fixed adapter per job "
    "(`--lora-rank`, served as `miles_lora`), or its multi-LoRA driver, which runs fully asynchronously "
    "with no --rollout-function-path and gives each prompt group to one adapter, while an mrlx episode "
    "returns samples of several agents; that driver is being replaced upstream by a Tinker-protocol "
    "gateway",
}


def check_trained_adapters(
    args: argparse.Namespace, settings: Settings, trained: Sequence[str], source: str
) -> None:
    """Refuse, at start-up, an agent this job would train as a LoRA adapter on a host that cannot
    train one. A frozen agent served as an adapter works on any host whose SGLang serves adapters
    (the request names it); the embedded trainer trains adapters (it marks its args
    `mrlx_trains_adapters`, also where slime happens to be importable)."""
    from mrlx_plugin.core.host import HOST

    why = _NO_ADAPTER_TRAINING.get(HOST or "")
    if why is None or getattr(args, "mrlx_trains_adapters", False):
        return
    for name in trained:
        adapter = settings.agents[name].adapter
        if adapter is not None:
            raise ConfigError(
                f"{source}: mrlx.agents.{name}.adapter: this {_HOST_NAMES[HOST]} job trains agent {name!r}, "
                "served as "
                f"LoRA adapter {adapter!r}, but {why}. Train {name!r} as a whole model of its own (a "
                f"multi-model run, docs/multi-model.md), or serve the adapter frozen ("
                + (
                    f"no job with mrlx.self: {name}, and trainable: false in every config"
                    if name == settings.self_agent
                    else f"mrlx.agents.{name}.trainable: false"
                )
                + "); the embedded trainer (`mrlx demo --adapters`) trains adapters"
            )
