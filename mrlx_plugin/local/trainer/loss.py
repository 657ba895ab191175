"""The embedded trainer's loss, in slime's shape: PPO-clip per token with separate low/high clip
ranges, the ratio taken against the rollout log-probs (`--use-rollout-logprobs`), log-probs
computed at the rollout temperature, an optional low-variance KL to the initial model, an
optional entropy bonus (slime's `--entropy-coef`: subtracted from the loss), and a per-token
mean over every trainable token of the step; slime's learning-rate schedule."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from mrlx_plugin.core.host import HostSample
    from mrlx_plugin.local.trainer.settings import TrainerSettings


def _batch(samples: list[HostSample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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


def next_token_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log p(v | tokens <= j) at the rollout temperature for every position j and vocabulary
    entry v: the full next-token distribution, shape (batch, length - 1, vocabulary)."""
    import torch

    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    if temperature and temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits[:, :-1], dim=-1)


def token_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log p(token j + 1 | tokens <= j) at the rollout temperature, for every position j."""
    return next_token_logprobs(model, ids, attention, temperature).gather(-1, ids[:, 1:, None]).squeeze(-1)


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """The entropy of each position's next-token distribution (`next_token_logprobs`), in nats."""
    import torch

    # A token a model masks out (logit -inf) adds 0 * log 0 = 0, not 0 * -inf = NaN.
    finite = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    return -(logprobs.exp() * finite).sum(-1)


def ppo_loss(
    model: torch.nn.Module,
    ref: torch.nn.Module | None,
    samples: list[HostSample],
    advantages: list[float],
    cfg: TrainerSettings,
    temperature: float,
    total_tokens: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over the micro-batch of the per-token PPO-clip (+ KL, - entropy bonus) loss, divided
    by the step's trainable token count, so micro-batches add up to the step's per-token mean.

    The entropy is that of the policy's whole next-token distribution at each trainable position
    (at the rollout temperature); `info["entropy_sum"]` always holds its sum over those positions,
    and the loss takes `entropy_coef` times it off only where the coefficient is not 0, so that
    with 0 the loss is the PPO (+ KL) loss exactly."""
    import torch

    ids, attention, mask, old = _batch(samples)
    adv = torch.tensor(advantages, dtype=torch.float32)[:, None]
    distribution = next_token_logprobs(model, ids, attention, temperature)
    new = distribution.gather(-1, ids[:, 1:, None]).squeeze(-1)
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
    if cfg.entropy_coef:
        spread = entropy(distribution)
        per_token = per_token - cfg.entropy_coef * spread
    else:  # measured, not trained: no graph kept for it
        spread = entropy(distribution.detach())
    info["entropy_sum"] = float((spread.detach() * mask).sum())
    return (per_token * mask).sum() / total_tokens, info


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that train: all of a whole model's, only the adapter's of a LoRA policy."""
    return [p for p in model.parameters() if p.requires_grad]


def learning_rate(cfg: TrainerSettings, step: int, total: int) -> float:
    """slime's schedule: linear warm-up over `lr_warmup_steps`, then constant or cosine to `lr_min`."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_decay_style == "cosine":
        done = (step - cfg.lr_warmup_steps) / max(1, total - cfg.lr_warmup_steps)
        return cfg.lr_min + 0.5 * (cfg.lr - cfg.lr_min) * (1 + math.cos(math.pi * min(1.0, done)))
    return cfg.lr


def ppo_step(
    model: torch.nn.Module,
    ref: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    samples: list[HostSample],
    advantages: list[float],
    cfg: TrainerSettings,
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
        loss_value = clipped = kl_sum = drift = spread = 0.0
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
            spread += info["entropy_sum"]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable_parameters(model), cfg.max_grad_norm))
        optimizer.step()
        # train/logprob_drift: mean |trainer log-prob - rollout log-prob| of the step's first pass;
        # near 0 when the engine and the trainer agree on the weights and the sampling temperature.
        # train/entropy: the same pass's mean entropy per trainable token, of the policy that sampled
        # (before this step's update): the measure of how mixed the policy still is.
        stats = stats or {"train/logprob_drift": drift / total, "train/entropy": spread / total}
        stats |= {
            "train/loss": loss_value,
            "train/clip_fraction": clipped / total,
            "train/kl": kl_sum / total,
            "train/grad_norm": grad_norm,
            "train/tokens": float(total),
        }
    model.eval()
    return stats
