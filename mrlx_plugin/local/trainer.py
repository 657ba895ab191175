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

The loss is slime's shape: PPO-clip per token with separate low/high clip ranges, the ratio
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
import math
import os
import random
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

log = logging.getLogger("mrlx.trainer")


# ----------------------------------------------------------------------------------------------
# Arguments: slime's flag names for what slime would be given
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from mrlx_plugin.local.fake_host import add_host_arguments

    p = argparse.ArgumentParser(
        prog="python -m mrlx_plugin.local.trainer", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--config", required=True, help="the job's YAML (mrlx: ..., with mrlx.trainer)")
    p.add_argument("--model", required=True, help="the agent's initial model directory")
    p.add_argument(
        "--adapter",
        default=None,
        metavar="DIR",
        help="train a LoRA adapter on --model (the base), starting from this peft directory; the engine "
        "serves it under the trained agent's `adapter` setting",
    )
    p.add_argument(
        "--engine-url", action="append", default=[], help="this agent's engine(s), for weight pushes"
    )
    p.add_argument(
        "--rollout-function",
        default="mrlx_plugin.local.fake_host.default_rollout",
        help="what slime's --rollout-function-path would name",
    )
    p.add_argument("--custom-generate-function-path", default="mrlx_plugin.rollout.generate")
    p.add_argument("--num-rollout", type=int, default=10)
    p.add_argument(
        "--task",
        default="arithmetic",
        help="built-in prompts (mrlx_plugin.local.tasks) when no --prompt-data",
    )
    p.add_argument("--task-size", type=int, default=256, help="how many built-in prompts")
    p.add_argument(
        "--warmup-data", default=None, help="JSONL of {'messages': [...]} for the supervised warm-start"
    )
    p.add_argument("--out", required=True, help="checkpoints, metrics.jsonl and samples go here")
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument(
        "--freeze", action="store_true", help="no RL updates (the warm-start still runs): a baseline"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-samples", action="store_true", help="write every trained sample to samples.jsonl")
    p.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="evaluate before the first step, after every N steps and after the last (slime's flag); "
        "needs --eval-prompt-data",
    )
    p.add_argument(
        "--eval-prompt-data",
        nargs="+",
        default=None,
        metavar="[NAME] FILE",
        help="JSONL of held-out prompts for evaluation episodes; or NAME FILE pairs (slime's form), each "
        "evaluated under every --eval-config, as set CONFIG/NAME",
    )
    p.add_argument(
        "--n-samples-per-eval-prompt", type=int, default=1, help="evaluation episodes per held-out prompt"
    )
    p.add_argument(
        "--eval-config",
        action="append",
        default=[],
        metavar="[NAME=]FILE",
        help="YAML of the evaluation episodes (default: --config, as set `eval`); repeat for several "
        "sets, e.g. one per seat order of a game",
    )
    p.add_argument(
        "--engine-call-budget",
        type=int,
        default=None,
        help="stop after the step at which the engine calls spent in training (every step's episodes "
        "x its `multi_agent/engine_calls`) reach this, evaluating first; --num-rollout stays the most "
        "steps. Runs compared at one budget spend the same calls, past it by at most one step",
    )
    add_host_arguments(p)
    return p


# ----------------------------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------------------------


def _batch(samples: list[Any]) -> tuple[Any, Any, Any, Any]:
    """Right-padded token ids and attention mask, and per-position response tensors aligned with
    the model's shifted log-probs: position j scores token j + 1."""
    import torch

    longest = max(len(s.tokens) for s in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.long)
    attention = torch.zeros((len(samples), longest), dtype=torch.long)
    mask = torch.zeros((len(samples), longest - 1))
    old = torch.zeros((len(samples), longest - 1))
    for i, s in enumerate(samples):
        n, r = len(s.tokens), s.response_length
        ids[i, :n] = torch.tensor(s.tokens)
        attention[i, :n] = 1
        mask[i, n - 1 - r : n - 1] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, n - 1 - r : n - 1] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
    return ids, attention, mask, old


def token_logprobs(model: Any, ids: Any, attention: Any, temperature: float) -> Any:
    """log p(token j + 1 | tokens <= j) at the rollout temperature, for every position j."""
    import torch

    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    if temperature and temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def ppo_loss(
    model: Any,
    ref: Any,
    samples: list[Any],
    advantages: list[float],
    cfg: Any,
    temperature: float,
    total_tokens: int,
) -> tuple[Any, dict[str, float]]:
    """Sum over the micro-batch of the per-token PPO-clip (+ KL) loss, divided by the step's
    trainable token count, so micro-batches add up to the step's per-token mean."""
    import torch

    ids, attention, mask, old = _batch(samples)
    adv = torch.tensor(advantages, dtype=torch.float32)[:, None]
    new = token_logprobs(model, ids, attention, temperature)
    # The log-ratio is clamped before exp: a token the old policy gave -100 and the new one ~0 would
    # overflow float32 (exp(100)) and make the loss inf; past e^20 the clip decides anyway.
    ratio = torch.exp(torch.clamp((new - old) * mask, -20.0, 20.0))  # 1 off the trainable tokens
    unclipped = -adv * ratio
    clip = -adv * torch.clamp(ratio, 1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    per_token = torch.maximum(unclipped, clip)
    info = {
        "clipped_tokens": float(((clip > unclipped).float() * mask).sum()),
        "kl_sum": 0.0,
        "drift_sum": float(((new.detach() - old).abs() * mask).sum()),
    }
    if ref is not None and cfg.kl_coef:
        with torch.no_grad():
            ref_lp = token_logprobs(ref, ids, attention, temperature)
        delta = ref_lp - new
        kl = torch.exp(delta) - delta - 1  # low-variance KL estimate
        per_token = per_token + cfg.kl_coef * kl
        info["kl_sum"] = float((kl.detach() * mask).sum())
    return (per_token * mask).sum() / total_tokens, info


def trainable_parameters(model: Any) -> list[Any]:
    """The parameters that train: all of a whole model's, only the adapter's of a LoRA policy."""
    return [p for p in model.parameters() if p.requires_grad]


def learning_rate(cfg: Any, step: int, total: int) -> float:
    """slime's schedule: linear warm-up over `lr_warmup_steps`, then constant or cosine to `lr_min`."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_decay_style == "cosine":
        done = (step - cfg.lr_warmup_steps) / max(1, total - cfg.lr_warmup_steps)
        return cfg.lr_min + 0.5 * (cfg.lr - cfg.lr_min) * (1 + math.cos(math.pi * min(1.0, done)))
    return cfg.lr


def ppo_step(
    model: Any,
    ref: Any,
    optimizer: Any,
    samples: list[Any],
    advantages: list[float],
    cfg: Any,
    temperature: float,
) -> dict[str, float]:
    """One optimizer step per PPO epoch over every sample with a trainable token."""
    import torch

    batch = [(s, a) for s, a in zip(samples, advantages) if sum(s.loss_mask or []) > 0]
    if not batch:
        return {"train/skipped": 1.0}
    total = sum(sum(s.loss_mask) for s, _ in batch)
    model.train()
    stats: dict[str, float] = {}
    for _ in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        loss_value = clipped = kl_sum = drift = 0.0
        for k in range(0, len(batch), cfg.micro_batch_size):
            part = batch[k : k + cfg.micro_batch_size]
            loss, info = ppo_loss(
                model, ref, [s for s, _ in part], [a for _, a in part], cfg, temperature, total
            )
            loss.backward()
            loss_value += float(loss.detach())
            clipped += info["clipped_tokens"]
            kl_sum += info["kl_sum"]
            drift += info["drift_sum"]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable_parameters(model), cfg.max_grad_norm))
        optimizer.step()
        # train/logprob_drift: mean |trainer log-prob - rollout log-prob| of the step's first pass;
        # near 0 when the engine and the trainer agree on the weights and the sampling temperature.
        stats = stats or {"train/logprob_drift": drift / total}
        stats |= {
            "train/loss": loss_value,
            "train/clip_fraction": clipped / total,
            "train/kl": kl_sum / total,
            "train/grad_norm": grad_norm,
            "train/tokens": float(total),
        }
    model.eval()
    return stats


# ----------------------------------------------------------------------------------------------
# The supervised warm-start (format only, optional)
# ----------------------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (a trainer's metrics.jsonl, warm-start data); none when the
    file is not there yet."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def warm_start(
    model: Any, tokenizer: Any, path: str, steps: int, lr: float, batch: int, seed: int
) -> list[float]:
    """Cross-entropy on the assistant messages of `path` for `steps` steps; returns the losses."""
    import torch

    rows = read_rows(Path(path))
    rng = random.Random(seed)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        chosen = [rng.choice(rows)["messages"] for _ in range(batch)]
        ids, labels = [], []
        for messages in chosen:
            prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
            full = prompt + messages[-1]["content"] + tokenizer.eos_token
            p_ids = tokenizer.encode(prompt, add_special_tokens=False)
            f_ids = tokenizer.encode(full, add_special_tokens=False)
            ids.append(f_ids)
            labels.append([-100] * len(p_ids) + f_ids[len(p_ids) :])
        longest = max(map(len, ids))
        x = torch.tensor([i + [0] * (longest - len(i)) for i in ids])
        y = torch.tensor([lab + [-100] * (longest - len(lab)) for lab in labels])
        attention = (torch.arange(longest)[None, :] < torch.tensor([len(i) for i in ids])[:, None]).long()
        loss = model(input_ids=x, attention_mask=attention, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


# ----------------------------------------------------------------------------------------------
# Checkpoints and weight pushes
# ----------------------------------------------------------------------------------------------


def save_checkpoint(
    out: Path, step: int, model: Any, tokenizer: Any, optimizer: Any, data_source: Any, keep: int
) -> Path:
    """out/checkpoints/step_{step:05d}: the weights (from_pretrained layout; of a LoRA policy, only
    the adapter, in peft's layout), the tokenizer and the trainer state."""
    import torch

    final = out / "checkpoints" / f"step_{step:05d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "data_source": data_source.state_dict() if hasattr(data_source, "state_dict") else None,
    }
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # a checkpoint directory is complete or absent
    for old in sorted((out / "checkpoints").glob("step_*"))[:-keep]:
        if not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return final


def engine_version(url: str, adapter: str | None = None) -> str | None:
    """The weight version an engine reports now (after a push: proof that it took the weights);
    with `adapter`, the version of that adapter (from /server_info's `lora_adapters`). None when
    the engine is unreachable or does not report it."""
    route = "/server_info" if adapter else "/get_weight_version"
    try:
        with urllib.request.urlopen(url.rstrip("/") + route, timeout=10) as resp:
            answer = json.loads(resp.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None
    if adapter:
        entry = (answer.get("lora_adapters") or {}).get(adapter)
        return entry.get("weight_version") if isinstance(entry, dict) else None
    return answer.get("weight_version")


def latest_checkpoint(out: Path) -> Path | None:
    found = sorted(p for p in (out / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    return found[-1] if found else None


def push_weights(
    engines: list[str], path: Path, version: int, adapter: str | None = None, deadline_s: float = 300.0
) -> None:
    """Load `path` into every engine of this agent and set its weight version (SGLang's
    /update_weights_from_disk); with `adapter`, `path` is a LoRA adapter, loaded (or replaced)
    under that name with SGLang's /load_lora_adapter, the base model and other adapters untouched.

    An engine that is down (restarting) is retried with backoff until `deadline_s`; one that
    refuses the weights is an error. Runs on the host's event loop, as the rollouts do.
    """
    from mrlx_plugin.core.host import run_in_host_loop

    run_in_host_loop(_push_weights(engines, path, version, adapter, deadline_s))


def _engine_message(raw: bytes) -> str:
    """An engine's reason for a refusal: SGLang's `message` (weights) or `error_message` (adapters)."""
    try:
        answer = json.loads(raw)
    except ValueError:
        return repr(raw[:200])
    if isinstance(answer, dict) and (answer.get("error_message") or answer.get("message")):
        return str(answer.get("error_message") or answer.get("message"))
    return repr(raw[:200])


async def _push_weights(
    engines: list[str], path: Path, version: int, adapter: str | None, deadline_s: float
) -> None:
    import asyncio

    import aiohttp

    from mrlx_plugin.core.retry import Backoff, Deadline, RetriesExhausted, retry

    if adapter is None:
        route, what = "/update_weights_from_disk", f"the weights at {path}"
        body: dict[str, Any] = {"model_path": str(path), "weight_version": str(version)}
    else:
        route, what = "/load_lora_adapter", f"adapter {adapter!r} at {path}"
        body = {"lora_name": adapter, "lora_path": str(path), "upsert": True, "weight_version": str(version)}
    async with aiohttp.ClientSession() as session:
        for url in engines:
            deadline = Deadline(deadline_s)

            async def attempt(_: int, url: str = url, deadline: Deadline = deadline) -> dict[str, Any]:
                timeout = aiohttp.ClientTimeout(total=max(1.0, deadline.remaining()))
                async with session.post(url.rstrip("/") + route, json=body, timeout=timeout) as resp:
                    raw = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url} refused {what}: HTTP {resp.status} {_engine_message(raw)}")
                return json.loads(raw or b"{}")

            def on_retry(n: int, exc: BaseException, wait: float, url: str = url) -> None:
                log.warning("engine %s unreachable (%s); retrying the weight push in %.1fs", url, exc, wait)

            try:
                answer = await retry(
                    attempt,
                    deadline=deadline,
                    backoff=Backoff(base_s=0.25, max_s=2.0),
                    on_retry=on_retry,
                    retryable=lambda e: isinstance(e, (aiohttp.ClientConnectionError, asyncio.TimeoutError)),
                )
            except RetriesExhausted as exc:
                raise RuntimeError(
                    f"{url} did not take {what} within {deadline_s:.0f}s: {exc.last}"
                ) from None
            if not answer.get("success", True):
                reason = answer.get("error_message") or answer.get("message")
                raise RuntimeError(f"{url} refused {what}: {reason}")


def trained_adapter(settings: Any, adapter_dir: str | None) -> str | None:
    """The name the engine serves the trained agent's LoRA adapter under (its `adapter` setting),
    or None when the trainer trains a whole model. `adapter_dir` is --adapter; the two must come
    together, or a push would load weights the agent's requests never name (ConfigError)."""
    from mrlx_plugin.core.config import ConfigError

    agent = settings.self_agent
    if agent is None:
        served = [
            (n, a.adapter)
            for n, a in settings.agents.items()
            if a.trainable and a.url == "self" and a.adapter
        ]
        if served:
            name, lora = served[0]
            raise ConfigError(
                f"mrlx.agents.{name}.adapter: this job trains the engine's whole model (it names no "
                f"mrlx.self), but {name!r} is served as LoRA adapter {lora!r}; train each adapter in a job "
                f"of its own (mrlx.self: the agent, --adapter DIR), or set mrlx.agents.{name}.trainable: "
                "false"
            )
        if adapter_dir is not None:
            raise ConfigError(
                f"--adapter {adapter_dir}: the job names no agent it trains (mrlx.self), so it trains the "
                "engine's whole model; set mrlx.self to the agent this adapter serves"
            )
        return None
    name = getattr(settings.agents.get(agent), "adapter", None)
    if adapter_dir is not None and name is None:
        raise ConfigError(
            f"--adapter {adapter_dir}: the trained agent {agent!r} has no adapter; set "
            f"mrlx.agents.{agent}.adapter to the name its engine serves the adapter under"
        )
    if name is not None and adapter_dir is None:
        raise ConfigError(
            f"mrlx.agents.{agent}.adapter is {name!r}: pass --adapter DIR, the adapter's initial weights "
            "(a peft directory for the base --model)"
        )
    return name


# ----------------------------------------------------------------------------------------------
# Evaluation (slime's --eval-interval): whole episodes on held-out prompts, nothing trained
# ----------------------------------------------------------------------------------------------


def evaluation_sets(ns: argparse.Namespace, args: Any) -> list[tuple[str, Any, Any]]:
    """(name, args, data source) per evaluation set: the held-out prompts of --eval-prompt-data
    under each --eval-config (default: the job's own config and args, as set `eval`); with
    named prompt files, one set per config and file, `CONFIG/NAME`."""
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.fake_host import LocalDataSource, host_args, read_prompts

    if ns.eval_interval is None:
        return []
    if not ns.eval_prompt_data:
        raise ConfigError("--eval-interval: give the held-out prompts with --eval-prompt-data")
    if ns.eval_interval < 1:
        raise ConfigError(f"--eval-interval: got {ns.eval_interval}; expected at least 1")
    data = ns.eval_prompt_data
    if len(data) == 1:
        files = [("", data[0])]
    elif len(data) % 2 == 0:
        files = list(zip(data[0::2], data[1::2]))
    else:
        raise ConfigError(
            f"--eval-prompt-data: got {len(data)} values; give one file, or NAME FILE pairs (slime's form)"
        )
    sets = []
    for spec in ns.eval_config or [None]:
        if spec is None:
            name, eval_args = "eval", args
        else:
            name, _, path = spec.rpartition("=")
            name = name or Path(path).stem
            eval_args = host_args(ns, path)
            eval_args.custom_generate_function_path = args.custom_generate_function_path
            eval_args.rollout_function_path = args.rollout_function_path
        eval_args.n_samples_per_eval_prompt = ns.n_samples_per_eval_prompt
        for label, file in files:
            prompts = read_prompts(file, ns.input_key, ns.label_key)
            source = LocalDataSource(prompts[:1], 1, eval_prompts=prompts)
            sets.append((f"{name}/{label}" if label else name, eval_args, source))
    return sets


def evaluate(sets: list[tuple[str, Any, Any]], rollout_fn: Any, rollout_id: int) -> dict[str, Any]:
    """Run every evaluation set through the rollout function in evaluation mode, as slime's
    `eval` does; `eval/<set>/reward_mean` is the mean reward of its episodes' final answers,
    `eval/<set>/<metric>` the rollout metrics of its samples."""
    from mrlx_plugin.core.metrics import compute_metrics

    out: dict[str, Any] = {}
    for name, eval_args, source in sets:
        t0 = time.monotonic()
        output = rollout_fn(eval_args, rollout_id, source, evaluation=True)
        rewards: list[float] = []
        samples: list[Any] = []
        for entry in (output.data or {}).values():
            rewards += [float(r) for r in entry.get("rewards") or []]
            samples += list(entry.get("samples") or [])
        out[f"eval/{name}/reward_mean"] = sum(rewards) / len(rewards) if rewards else None
        out[f"eval/{name}/episodes"] = len(rewards)
        out |= {f"eval/{name}/{k}": v for k, v in compute_metrics(samples).items()}
        out[f"eval/{name}/seconds"] = time.monotonic() - t0
    return out


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def trained_counts(samples: list[Any]) -> tuple[int, int]:
    """(samples, tokens) the step trains on: the samples that are not ABORTED (an aborted
    episode's, or the fillers standing in for turns an episode did not reach) and have a token
    to train (loss mask 1), and those tokens."""
    from mrlx_plugin.core.host import Status

    counted = [s for s in samples if s.status != Status.ABORTED and sum(s.loss_mask or []) > 0]
    return len(counted), sum(sum(s.loss_mask) for s in counted)


def step_engine_calls(metrics: dict[str, Any]) -> float:
    """Engine calls one step's rollout spent: its episodes x `multi_agent/engine_calls` (every
    call: turns, tree-sampling candidates, the moves played ahead to score them). A plugin
    without that metric: its model turns plus the candidates not gone on from."""
    episodes = metrics.get("multi_agent/episodes") or 0.0
    per_episode = metrics.get("multi_agent/engine_calls")
    if per_episode is None:
        per_episode = (metrics.get("multi_agent/avg_turns") or 0.0) + (
            metrics.get("credit/branch_candidates") or 0.0
        )
    return episodes * per_episode


def flatten(groups: Any) -> list[Any]:
    out: list[Any] = []
    for item in groups:
        if isinstance(item, list):
            out.extend(flatten(item))
        else:
            out.append(item)
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
    from mrlx_plugin.core.host import load_function, run_in_host_loop
    from mrlx_plugin.core.metrics import log_rollout
    from mrlx_plugin.local.fake_host import LocalDataSource, host_args, read_prompts
    from mrlx_plugin.local.model import is_adapter_dir, load_policy, load_tokenizer
    from mrlx_plugin.local.settings import trainer_settings
    from mrlx_plugin.local.tasks import task_prompts
    from mrlx_plugin.rewards.shaping import normalize
    from mrlx_plugin.rollout import ack_trained_groups
    from mrlx_plugin.runtime import cached_runtime, runtime_for

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(ns.seed)
    torch.manual_seed(ns.seed)

    # What slime would hand the plugin: args (its flags, plus the YAML's `mrlx` key) and a data source.
    ns.hf_checkpoint = ns.hf_checkpoint or ns.model
    args = host_args(ns, ns.config)
    args.custom_generate_function_path = ns.custom_generate_function_path
    args.rollout_function_path = ns.rollout_function
    # Its checkpoint schedule, under slime's flag names: every step is saved, synchronously (the
    # responder's rollout reads these to know which steps a resumed job would not train again).
    args.save, args.save_interval, args.async_save = str(out / "checkpoints"), 1, False
    args.num_rollout = ns.num_rollout
    args.mrlx_trains_adapters = True  # this trainer trains LoRA adapters (hostcheck.check_trained_adapters)
    checkpoint = latest_checkpoint(out) if ns.resume else None
    try:
        settings = runtime_for(
            args,
            tokenizers=ns.rollout_function.endswith("initiator_rollout")
            or ns.rollout_function.endswith("default_rollout"),
        ).settings
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
    except ConfigError as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(cfg.threads)
    prompts = (
        read_prompts(ns.prompt_data, ns.input_key, ns.label_key)
        if ns.prompt_data
        else task_prompts(ns.task, ns.task_size, seed=ns.seed)
    )
    data_source = LocalDataSource(prompts, ns.n_samples_per_prompt, shuffle=True, seed=ns.seed)
    rollout_fn = load_function(ns.rollout_function)
    responder = ns.rollout_function.endswith("responder_rollout")

    # The model (a LoRA policy: the base with this agent's adapter, only the adapter trainable), its
    # frozen reference (for the KL term) and the optimizer.
    start, resumed_from = 0, None
    if adapter is None:
        model = load_policy(checkpoint or ns.model)
    else:
        model = load_policy(ns.model, checkpoint or ns.adapter, trainable=True)
    tokenizer = load_tokenizer(checkpoint or ns.model)
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
    if checkpoint is not None:
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        if state.get("data_source") is not None:
            data_source.load_state_dict(state["data_source"])
        start, resumed_from = state["step"] + 1, str(checkpoint)
        for name in ("samples.jsonl", "metrics.jsonl"):  # rows of steps the checkpoint does not hold
            _drop_rows_from(out / name, start)
        log.info("resumed from %s: continuing at step %d", checkpoint, start)
        push_weights(ns.engine_url, checkpoint, version=start, adapter=adapter)
    elif ns.warmup_data and cfg.warmup_sft_steps:  # a frozen agent is warm-started too: it is the baseline
        losses = warm_start(
            model,
            tokenizer,
            ns.warmup_data,
            cfg.warmup_sft_steps,
            cfg.warmup_sft_lr,
            cfg.micro_batch_size,
            ns.seed,
        )
        log.info(
            "warm-start (supervised, output format only): %d steps, loss %.3f -> %.3f",
            len(losses),
            losses[0],
            losses[-1],
        )
        _append(
            out / "metrics.jsonl",
            {
                "step": -1,
                "warm_start/steps": len(losses),
                "warm_start/loss_first": losses[0],
                "warm_start/loss_last": losses[-1],
            },
        )
        model.save_pretrained(str(out / "warm_start"))
        tokenizer.save_pretrained(str(out / "warm_start"))
        push_weights(ns.engine_url, out / "warm_start", version=0, adapter=adapter)

    # The KL reference is the policy RL starts from: the initial model (or adapter) after any
    # warm-start, a frozen copy of its own.
    warm = out / "warm_start"
    if adapter is None:
        ref_dirs = (warm if (warm / "config.json").exists() else Path(ns.model), None)
    else:
        ref_dirs = (Path(ns.model), warm if is_adapter_dir(warm) else Path(ns.adapter))
    ref = load_policy(*ref_dirs) if cfg.kl_coef else None
    eval_sets: list[tuple[str, Any, Any]] = []
    try:
        eval_sets = evaluation_sets(ns, args)
        if eval_sets and start == 0:  # the starting policy, before any RL step (weight version 0)
            _append(
                out / "metrics.jsonl",
                {"step": -1, "eval/before_training": True, **evaluate(eval_sets, rollout_fn, 0)},
            )
        # Engine calls spent in training so far (a resumed run: those of the steps it keeps).
        kept = read_rows(out / "metrics.jsonl") if resumed_from else []
        calls_spent = sum(r.get("engine_calls") or 0.0 for r in kept)
        for rollout_id in range(start, ns.num_rollout):
            t0 = time.monotonic()
            output = rollout_fn(args, rollout_id, data_source, evaluation=False)
            samples = flatten(output.samples)
            rollout_s = time.monotonic() - t0
            raw, advantages = normalize(args, samples)
            metrics: dict[str, Any] = dict(output.metrics or {})
            log_rollout(rollout_id, args, samples, metrics, rollout_s)

            t1 = time.monotonic()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(cfg, rollout_id, ns.num_rollout)
            train = (
                {"train/frozen": 1.0}
                if ns.freeze
                else ppo_step(model, ref, optimizer, samples, advantages, cfg, args.rollout_temperature)
            )
            if ns.save_samples:  # before the checkpoint: a resumed run drops the rows of an unsaved step
                with (out / "samples.jsonl").open("a") as f:
                    for s, adv in zip(samples, advantages):
                        f.write(
                            json.dumps({"step": rollout_id, "advantage": adv, **s.to_dict()}, default=str)
                            + "\n"
                        )
            checkpoint = save_checkpoint(
                out, rollout_id, model, tokenizer, optimizer, data_source, ns.keep_checkpoints
            )
            if responder:  # trained and saved (the checkpoint holds the step): never trained again
                ack_trained_groups(args, rollout_id)
            push_weights(ns.engine_url, checkpoint, version=rollout_id + 1, adapter=adapter)
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
                "engine/weight_versions": [engine_version(url, adapter) for url in ns.engine_url],
                **metrics,
                **train,
            }
            if resumed_from and rollout_id == start:
                row["resumed_from"] = resumed_from
            if spent:
                row["engine_call_budget_spent"] = True
            last = spent or rollout_id + 1 == ns.num_rollout
            if eval_sets and ((rollout_id + 1) % ns.eval_interval == 0 or last):
                row |= evaluate(eval_sets, rollout_fn, rollout_id + 1)  # the weights this step made
            _append(out / "metrics.jsonl", row)
            log.info(
                "step %d: %d samples, reward %.3f, rollout %.1fs, train %.1fs",
                rollout_id,
                len(samples),
                row["raw_reward_mean"],
                rollout_s,
                row["train_s"],
            )
            if spent:
                log.info(
                    "engine-call budget spent: %.0f calls of %d after step %d; stopping",
                    calls_spent,
                    ns.engine_call_budget,
                    rollout_id,
                )
                break
    except ConfigError as exc:  # a setting found wrong at the first step (say, the coordinator's queue)
        print(f"trainer: {exc}", file=sys.stderr)
        return 2
    finally:  # also on errors: close the rollout loop's connections (no "unclosed session" noise)
        run_in_host_loop(runtime_for(args).aclose())
        for eval_args in {id(a): a for _, a, _ in eval_sets}.values():  # one per config
            if eval_args is not args and cached_runtime(eval_args) is not None:
                run_in_host_loop(cached_runtime(eval_args).aclose())
    return 0


def _drop_rows_from(path: Path, step: int) -> None:
    if not path.exists():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", -1) < step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _append(path: Path, row: dict[str, Any]) -> None:
    clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in row.items()}
    with path.open("a") as f:
        f.write(json.dumps(clean, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
