"""The embedded CPU trainer: one agent's slime job, on a CPU, readable top to bottom.

It plays the host's part for one agent exactly as slime's synchronous loop does, calling the
plugin's functions the way slime calls them:

    for rollout_id in range(start, num_rollout):
        output = rollout_fn(args, rollout_id, data_source)        # --rollout-function-path
        samples = flatten(output.samples)
        raw, advantages = normalize(args, samples)                # --custom-reward-post-process-path
        log_rollout(rollout_id, args, samples, metrics, secs)     # --custom-rollout-log-function-path
        ppo_step(samples, advantages)                             # the trainer's own work
        save a checkpoint; push it to the engine                  # /update_weights_from_disk
                                                                  # (--adapter: /load_lora_adapter)
        (the next rollout reports the new version to the coordinator)
        every --eval-interval steps: rollout_fn(..., evaluation=True) on held-out prompts
        --engine-call-budget spent (episodes x engine calls, summed): evaluate, stop

With `--rollout-function mrlx_plugin.rollout.async_rollout` the rollout is fully asynchronous:
episodes keep generating on the plugin's loop thread while this thread trains, and a step's
`rollout_s` is the time it waited for finished groups (with the peers' barrier of a multi-model
run). Each row's `step_s` is the step's wall time without its evaluation, so the trainer's idle
fraction is `rollout_s / step_s`.

The loss (`loss`) is slime's shape: PPO-clip per token with separate low/high clip ranges, the ratio
taken against the rollout log-probs (`--use-rollout-logprobs`), log-probs computed at the
rollout temperature, an optional low-variance KL to the initial model, and a per-token mean
over every trainable token of the step. Settings come from `mrlx.trainer` in the same YAML.

With `--adapter DIR` the policy is a LoRA adapter on the base `--model` (one agent of several
served as adapters of one base model by one engine): only the adapter's parameters train, and
checkpoints and pushes hold only the adapter, loaded under the agent's `adapter` name.

    python -m mrlx_plugin.local.trainer --config job.yaml --model DIR --engine-url URL \
        --rollout-function mrlx_plugin.rollout.initiator_rollout --out runs/demo/doctor ...
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

from mrlx_plugin.local.trainer.evaluation import evaluate, evaluation_sets
from mrlx_plugin.local.trainer.flags import build_parser
from mrlx_plugin.local.trainer.loss import learning_rate, ppo_step, trainable_parameters
from mrlx_plugin.local.trainer.records import append_row, drop_rows_from, read_rows
from mrlx_plugin.local.trainer.warm_start import warm_start
from mrlx_plugin.local.trainer.weights import (
    Snapshots,
    engine_version,
    latest_checkpoint,
    population_of,
    push_weights,
    save_checkpoint,
    trained_adapter,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from mrlx_plugin.core.host import HostSample, RolloutFnTrainOutput
    from mrlx_plugin.local.model import Policy
    from mrlx_plugin.local.trainer.evaluation import EvalSet
    from mrlx_plugin.local.trainer.fake_host import LocalDataSource
    from mrlx_plugin.local.trainer.settings import TrainerSettings
    from mrlx_plugin.systems.game_pool import PopulationSettings

log = logging.getLogger("mrlx.trainer")


def trained_counts(samples: list[HostSample]) -> tuple[int, int]:
    """(samples, tokens) the step trains on: the samples that are not ABORTED (an aborted
    episode's, or the fillers standing in for turns an episode did not reach) and have a token
    to train (loss mask 1), and those tokens."""
    from mrlx_plugin.core.host import Status

    counted = [s for s in samples if s.status != Status.ABORTED and sum(s.loss_mask or []) > 0]
    return len(counted), sum(sum(s.loss_mask) for s in counted)


def step_engine_calls(metrics: Mapping[str, float]) -> float:
    """Engine calls one step's rollout spent: its episodes x `multi_agent/engine_calls` (every
    call: turns, tree-sampling candidates, the moves played ahead to score them), plus, under a
    fully asynchronous rollout, the calls of the groups it gave back to be generated again
    (`multi_agent/engine_calls_given_back`). A plugin without the per-episode metric: its model
    turns plus the candidates not gone on from."""
    episodes = metrics.get("multi_agent/episodes") or 0.0
    per_episode = metrics.get("multi_agent/engine_calls")
    if per_episode is None:
        per_episode = (metrics.get("multi_agent/avg_turns") or 0.0) + (
            metrics.get("credit/branch_candidates") or 0.0
        )
    return episodes * per_episode + (metrics.get("multi_agent/engine_calls_given_back") or 0.0)


def trained_staleness(groups: Iterable[list[object]], step: int, own_agent: str) -> dict[str, float]:
    """`staleness_trained/AGENT/N`: how many of the step's prompt groups are N weight versions older
    than AGENT's trainer at this step (from the birth stamps `generate` puts on every episode:
    this job's agents against its step, each peer against its version then; see
    `mrlx_plugin.async_rollout`). A synchronous step trains its own groups (0 for this job)."""
    from mrlx_plugin.async_rollout import leaves, staleness

    counts: dict[str, float] = {}
    for group in groups:
        own, peers = staleness(leaves(group), step)
        for agent, value in [*([(own_agent, own)] if own is not None else []), *peers.items()]:
            key = f"staleness_trained/{agent}/{value}"
            counts[key] = counts.get(key, 0.0) + 1.0
    return counts


def flatten(groups: Iterable[object]) -> list[HostSample]:
    """The samples of nested lists of them, in order."""
    out: list[HostSample] = []
    for item in groups:
        if isinstance(item, list):
            out.extend(flatten(item))
        else:
            out.append(cast("HostSample", item))
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    # Agent code's HTTP clients (the openai SDK's httpx) would log every request of every episode.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    ns = build_parser().parse_args(argv)
    if ns.engine_call_budget is not None and ns.engine_call_budget < 1:
        print(
            f"trainer: --engine-call-budget: got {ns.engine_call_budget}; expected at least 1",
            file=sys.stderr,
        )
        return 2
    import torch

    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.core.host import run_in_host_loop
    from mrlx_plugin.runtime import cached_runtime, runtime_for

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(ns.seed)
    torch.manual_seed(ns.seed)
    args = _host_args(ns, out)
    checkpoint = latest_checkpoint(out) if ns.resume else None
    try:
        cfg, adapter, population = _settings(ns, args, checkpoint)
    except ConfigError as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(cfg.threads)
    job = _Job.load(ns, out, args, cfg, adapter, checkpoint)
    if population is not None and adapter is not None:
        job.snapshots = Snapshots(
            ns.engine_url, out / "snapshots", adapter, population.every, population.keep
        )
    try:
        job.eval_sets = evaluation_sets(ns, args)
        job.train()
    except ConfigError as exc:  # a setting found wrong at the first step (say, the coordinator's queue)
        print(f"trainer: {exc}", file=sys.stderr)
        return 2
    finally:  # also on errors: close the rollout loop's connections (no "unclosed session" noise)
        run_in_host_loop(runtime_for(args).aclose())
        for eval_args in {id(a): a for _, a, _ in job.eval_sets}.values():  # one per config
            if eval_args is not args and cached_runtime(eval_args) is not None:
                run_in_host_loop(cached_runtime(eval_args).aclose())
    return 0


def _host_args(ns: argparse.Namespace, out: Path) -> argparse.Namespace:
    """What slime would hand the plugin: args (its flags, plus the YAML's `mrlx` key)."""
    from mrlx_plugin.local.trainer.fake_host import host_args
    from mrlx_plugin.local.trainer.settings import SECTIONS

    ns.hf_checkpoint = ns.hf_checkpoint or ns.model
    args = host_args(ns, ns.config)
    args.custom_generate_function_path = ns.custom_generate_function_path
    args.rollout_function_path = ns.rollout_function
    # Its checkpoint schedule, under slime's flag names: every step is saved, synchronously (the
    # responder's rollout reads these to know which steps a resumed job would not train again).
    args.save, args.save_interval, args.async_save = str(out / "checkpoints"), 1, False
    args.num_rollout = ns.num_rollout
    args.mrlx_trains_adapters = True  # this trainer trains LoRA adapters (hostcheck.check_trained_adapters)
    args.mrlx_sections = SECTIONS  # this trainer reads mrlx.trainer: validated with the other sections
    return args


def _settings(
    ns: argparse.Namespace, args: argparse.Namespace, checkpoint: Path | None
) -> tuple[TrainerSettings, str | None, PopulationSettings | None]:
    """The job's `mrlx.trainer` settings, the adapter it trains (None: the whole model), checked
    against --adapter and the checkpoint it resumes, and the game's population whose snapshots it
    takes (`mrlx.game.population`: only for the adapter it trains) (ConfigError)."""
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.model import is_adapter_dir
    from mrlx_plugin.local.trainer.settings import trainer_settings
    from mrlx_plugin.runtime import runtime_for

    runs_episodes = ("initiator_rollout", "async_rollout", "default_rollout")
    settings = runtime_for(args, tokenizers=ns.rollout_function.endswith(runs_episodes)).settings
    cfg = trainer_settings(settings)
    adapter = trained_adapter(settings, ns.adapter)
    if adapter is not None and not is_adapter_dir(ns.adapter):
        raise ConfigError(f"--adapter {ns.adapter}: no LoRA adapter there (adapter_config.json missing)")
    if checkpoint is not None and is_adapter_dir(checkpoint) != (adapter is not None):
        held, trains = (
            ("a LoRA adapter", "a whole model")
            if adapter is None
            else ("a whole model", f"adapter {adapter!r}")
        )
        raise ConfigError(
            f"--resume: {checkpoint} holds {held} but this run trains {trains}; resume with the "
            "--adapter and config it was saved under"
        )
    return cfg, adapter, population_of(settings, adapter)


@dataclass
class _Job:
    """One agent's job once loaded: what slime would hold (args, the data source, the rollout
    function) and what its trainer holds (the policy, its frozen reference, the optimizer)."""

    ns: argparse.Namespace
    out: Path
    args: argparse.Namespace
    cfg: TrainerSettings
    adapter: str | None  # the LoRA adapter trained (its name on the engine); None: the whole model
    data_source: LocalDataSource
    rollout_fn: Callable[..., object]  # slime's rollout function: `--rollout-function`
    model: Policy
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    ref: Policy | None = None  # the KL term's reference policy (None without the KL term)
    start: int = 0  # the first step to run
    resumed_from: str | None = None
    eval_sets: list[EvalSet] = field(default_factory=list)
    snapshots: Snapshots | None = None  # a game's population of past policies (`mrlx.game.population`)

    @classmethod
    def load(
        cls,
        ns: argparse.Namespace,
        out: Path,
        args: argparse.Namespace,
        cfg: TrainerSettings,
        adapter: str | None,
        checkpoint: Path | None,
    ) -> _Job:
        """The data source, the policy (a LoRA policy: the base with this agent's adapter, only the
        adapter trainable) and its optimizer; then the checkpoint resumed, or the warm-start done;
        then the frozen reference."""
        import torch

        from mrlx_plugin.core.host import load_function
        from mrlx_plugin.local.model import load_policy, load_tokenizer
        from mrlx_plugin.local.trainer.fake_host import LocalDataSource, read_prompts
        from mrlx_plugin.local.trainer.tasks import task_prompts

        prompts = (
            read_prompts(ns.prompt_data, ns.input_key, ns.label_key, ns.metadata_key)
            if ns.prompt_data
            else task_prompts(ns.task, ns.task_size, seed=ns.seed)
        )
        data_source = LocalDataSource(prompts, ns.n_samples_per_prompt, shuffle=True, seed=ns.seed)
        rollout_fn = load_function(ns.rollout_function)
        if adapter is None:
            model = load_policy(checkpoint or ns.model)
        else:
            model = load_policy(ns.model, checkpoint or ns.adapter, trainable=True)
        params = trainable_parameters(model)
        log.info(
            "training %s: %d of %d parameters",
            f"adapter {adapter!r} on {ns.model}" if adapter else f"the whole model {checkpoint or ns.model}",
            sum(p.numel() for p in params),
            sum(p.numel() for p in model.parameters()),
        )
        optimizer = torch.optim.AdamW(
            params,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
        )
        job = cls(
            ns,
            out,
            args,
            cfg,
            adapter,
            data_source,
            rollout_fn,
            model,
            load_tokenizer(checkpoint or ns.model),
            optimizer,
        )
        if checkpoint is not None:
            job.resume(checkpoint)
        elif ns.warmup_data and cfg.warmup_sft_steps:  # a frozen agent is warm-started too: the baseline
            job.warm_start()
        job.ref = job.reference()
        return job

    def resume(self, checkpoint: Path) -> None:
        """Continue from `checkpoint`: its optimizer, random and data-source states; the rows of the
        steps it does not hold are dropped, and its weights go to the engines."""
        import torch

        state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        if state.get("data_source") is not None:
            self.data_source.load_state_dict(state["data_source"])
        self.start, self.resumed_from = state["step"] + 1, str(checkpoint)
        for name in ("samples.jsonl", "metrics.jsonl"):  # rows of steps the checkpoint does not hold
            drop_rows_from(self.out / name, self.start)
        log.info("resumed from %s: continuing at step %d", checkpoint, self.start)
        push_weights(self.ns.engine_url, checkpoint, version=self.start, adapter=self.adapter)

    def warm_start(self) -> None:
        """The supervised warm-start on --warmup-data, logged as step -1, saved in out/warm_start
        and pushed to the engines as weight version 0."""
        cfg, out = self.cfg, self.out
        losses = warm_start(
            self.model,
            self.tokenizer,
            self.ns.warmup_data,
            cfg.warmup_sft_steps,
            cfg.warmup_sft_lr,
            cfg.micro_batch_size,
            self.ns.seed,
        )
        log.info(
            "warm-start (supervised, output format only): %d steps, loss %.3f -> %.3f",
            len(losses),
            losses[0],
            losses[-1],
        )
        append_row(
            out / "metrics.jsonl",
            {
                "step": -1,
                "warm_start/steps": len(losses),
                "warm_start/loss_first": losses[0],
                "warm_start/loss_last": losses[-1],
            },
        )
        self.model.save_pretrained(str(out / "warm_start"))
        self.tokenizer.save_pretrained(str(out / "warm_start"))
        push_weights(self.ns.engine_url, out / "warm_start", version=0, adapter=self.adapter)

    def reference(self) -> Policy | None:
        """The KL term's reference: the policy RL starts from, the initial model (or adapter) after
        any warm-start, a frozen copy of its own; None without the KL term."""
        from mrlx_plugin.local.model import is_adapter_dir, load_policy

        warm, ns = self.out / "warm_start", self.ns
        if self.adapter is None:
            ref_dirs = (warm if (warm / "config.json").exists() else Path(ns.model), None)
        else:
            ref_dirs = (Path(ns.model), warm if is_adapter_dir(warm) else Path(ns.adapter))
        return load_policy(*ref_dirs) if self.cfg.kl_coef else None

    def starting_adapter(self) -> Path:
        """The adapter the first rollout is served (weight version `start`): the checkpoint resumed,
        else the warm-started adapter, else --adapter."""
        from mrlx_plugin.local.model import is_adapter_dir

        if self.resumed_from is not None:
            return Path(self.resumed_from)
        warm = self.out / "warm_start"
        return warm if is_adapter_dir(warm) else Path(self.ns.adapter)

    def train(self) -> None:
        """Evaluate the starting policy (a new run), then a step per rollout until --num-rollout, or
        until --engine-call-budget is spent."""
        ns = self.ns
        if self.snapshots is not None:  # before the first rollout: its episodes may draw any of them
            self.snapshots.take(self.start, self.starting_adapter())
        if self.eval_sets and self.start == 0:  # the starting policy, before any RL step (version 0)
            append_row(
                self.out / "metrics.jsonl",
                {"step": -1, "eval/before_training": True, **evaluate(self.eval_sets, self.rollout_fn, 0)},
            )
        # Engine calls spent in training so far (a resumed run: those of the steps it keeps).
        kept = read_rows(self.out / "metrics.jsonl") if self.resumed_from else []
        calls_spent = sum(r.get("engine_calls") or 0.0 for r in kept)
        for rollout_id in range(self.start, ns.num_rollout):
            row = self.step(rollout_id, calls_spent)
            calls_spent = cast(float, row["engine_calls_total"])
            if row.get("engine_call_budget_spent"):
                log.info(
                    "engine-call budget spent: %.0f calls of %d after step %d; stopping",
                    calls_spent,
                    ns.engine_call_budget,
                    rollout_id,
                )
                break

    def step(self, rollout_id: int, calls_spent: float) -> dict[str, object]:
        """One step as slime runs it: the rollout, the rewards normalised and logged, the update, the
        checkpoint and its push (the responder's groups acked once saved); its metrics row, also
        appended to metrics.jsonl (`calls_spent`: the engine calls spent before it)."""
        from mrlx_plugin.core.metrics import log_rollout
        from mrlx_plugin.rollout import ack_trained_groups, normalize
        from mrlx_plugin.runtime import runtime_for
        from mrlx_plugin.systems.game_pool import WEIGHT_VERSION_ARG

        ns, args, cfg, out = self.ns, self.args, self.cfg, self.out
        # The weight version this rollout's engines serve: step r-1's weights were pushed as version r
        # (the start as 0). A game's population draws the snapshots that exist at it.
        setattr(args, WEIGHT_VERSION_ARG, rollout_id)
        t0 = time.monotonic()
        output = cast(
            "RolloutFnTrainOutput", self.rollout_fn(args, rollout_id, self.data_source, evaluation=False)
        )
        samples = flatten(output.samples)
        rollout_s = time.monotonic() - t0
        raw, advantages = normalize(args, samples)
        metrics: dict[str, float] = dict(output.metrics or {})
        if not ns.rollout_function.endswith("responder_rollout"):  # a job that runs the episodes
            own = runtime_for(args).settings.self_agent or "self"
            metrics |= trained_staleness(cast("list[list[object]]", output.samples), rollout_id, own)
        log_rollout(rollout_id, args, samples, metrics, rollout_s)

        t1 = time.monotonic()
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(cfg, rollout_id, ns.num_rollout)
        train = (
            {"train/frozen": 1.0}
            if ns.freeze
            else ppo_step(
                self.model, self.ref, self.optimizer, samples, advantages, cfg, args.rollout_temperature
            )
        )
        if ns.save_samples:  # before the checkpoint: a resumed run drops the rows of an unsaved step
            with (out / "samples.jsonl").open("a") as f:
                for s, adv in zip(samples, advantages):
                    f.write(
                        json.dumps({"step": rollout_id, "advantage": adv, **s.to_dict()}, default=str) + "\n"
                    )
        checkpoint = save_checkpoint(
            out, rollout_id, self.model, self.tokenizer, self.optimizer, self.data_source, ns.keep_checkpoints
        )
        if ns.rollout_function.endswith("responder_rollout"):  # trained and saved: never trained again
            ack_trained_groups(args, rollout_id)
        push_weights(ns.engine_url, checkpoint, version=rollout_id + 1, adapter=self.adapter)
        if self.snapshots is not None:  # version r+1 is a snapshot when `every` divides it
            self.snapshots.take(rollout_id + 1, checkpoint)
        calls = step_engine_calls(metrics)
        calls_spent += calls
        spent = ns.engine_call_budget is not None and calls_spent >= ns.engine_call_budget
        trained, tokens = trained_counts(samples)
        row = {
            "step": rollout_id,
            "samples": len(samples),
            "samples_trained": trained,
            "tokens_trained": tokens,
            "engine_calls": calls,
            "engine_calls_total": calls_spent,
            "rollout_s": rollout_s,
            "train_s": time.monotonic() - t1,
            "raw_reward_mean": sum(raw) / max(1, len(raw)),
            "engine/weight_versions": [engine_version(url, self.adapter) for url in ns.engine_url],
            **metrics,
            **train,
        }
        if self.resumed_from and rollout_id == self.start:
            row["resumed_from"] = self.resumed_from
        if spent:
            row["engine_call_budget_spent"] = True
        row["step_s"] = time.monotonic() - t0  # the step without its evaluation: rollout_s / step_s idles
        last = spent or rollout_id + 1 == ns.num_rollout
        if self.eval_sets and ((rollout_id + 1) % ns.eval_interval == 0 or last):
            t2 = time.monotonic()
            row |= evaluate(self.eval_sets, self.rollout_fn, rollout_id + 1)  # the weights this step made
            row["eval_s"] = time.monotonic() - t2
        append_row(out / "metrics.jsonl", row)
        log.info(
            "step %d: %d samples, reward %.3f, rollout %.1fs, train %.1fs",
            rollout_id,
            len(samples),
            row["raw_reward_mean"],
            rollout_s,
            row["train_s"],
        )
        return row
