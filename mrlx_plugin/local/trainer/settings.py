"""The embedded CPU trainer's section (`mrlx.trainer`).

The trainer reads it from the settings it builds: its host args name the section's model
(`args.mrlx_sections = SECTIONS`), so that the runtime validates it with every other section
(`mrlx_plugin.settings.job_sections`), as `mrlx check` does; a job that does not read it (a slime
job) accepts the section unread.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from mrlx_plugin.core.config import Section, Settings, bounded

_LR_WHY = "a step as large as the weights themselves diverges at once"
_BETA_WHY = "torch's Adam needs a beta below 1; at 1 it would never forget a gradient"


class TrainerSettings(Section):
    """The embedded CPU trainer's loss and optimizer (`mrlx_plugin.local.trainer`); slime jobs
    ignore this section (their own flags of the same names apply)."""

    about = "the embedded CPU trainer only (slime jobs use their own flags)"

    lr: bounded(float, ge=0, le=1, why=_LR_WHY) = Field(1e-4, description="learning rate")
    lr_warmup_steps: bounded(int, ge=0) = Field(
        0, description="RL steps over which the learning rate rises linearly from lr / steps to lr"
    )
    lr_decay_style: Literal["constant", "cosine"] = Field(
        "constant", description="after warm-up: keep lr, or cosine down to lr_min"
    )
    lr_min: bounded(float, ge=0, le=1, why=_LR_WHY) = Field(
        0.0, description="the learning rate cosine decay ends at"
    )
    eps_clip: bounded(
        float, ge=0, le=1, why="the ratio's lower clip is 1 - eps_clip, which must stay 0 or more"
    ) = Field(0.2, description="PPO clip range below 1")
    eps_clip_high: bounded(float, ge=0) = Field(0.28, description="PPO clip range above 1")
    kl_coef: bounded(float, ge=0) = Field(
        0.0, description="KL to the initial (reference) model, low-variance estimator"
    )
    entropy_coef: bounded(float, ge=0) = Field(
        0.0,
        description="entropy bonus (slime's --entropy-coef): the loss takes off this times the entropy of "
        "the policy's whole next-token distribution at each trainable token (rollout temperature, per-token "
        "mean). It pulls every position toward uniform over the vocabulary, not toward mixing over moves: "
        "keep it small (1e-3 or so). It slows convergence to pure strategies, which helps games whose "
        "equilibrium is mixed (Kuhn poker); 0 is off. `train/entropy` is reported either way",
    )
    grpo_std_normalization: bool = Field(
        True,
        description="divide each group's centred rewards by the group's standard deviation (GRPO, slime's "
        "default; slime's --disable-grpo-std-normalization turns it off). false: mean only, whose expected "
        "update follows the policy gradient but scales with the rewards' range (set lr for it); "
        "docs/credit.md",
    )
    weight_decay: bounded(float, ge=0) = Field(0.0, description="AdamW weight decay")
    adam_beta1: bounded(float, ge=0, lt=1, why=_BETA_WHY) = Field(0.9, description="Adam beta1")
    adam_beta2: bounded(float, ge=0, lt=1, why=_BETA_WHY) = Field(0.98, description="Adam beta2")
    # A large epsilon scales Adam's steps with the gradient where the gradient is tiny: RL's noisy
    # small gradients then do not push every weight by a full `lr` (which wrecks small models).
    adam_eps: bounded(float, gt=0) = Field(
        1e-8,
        description="Adam epsilon (a large one keeps tiny noisy gradients from moving every weight by "
        "a full lr)",
    )
    max_grad_norm: bounded(float, gt=0) = Field(1.0, description="gradient clipping norm")
    micro_batch_size: bounded(int, ge=1) = Field(32, description="samples per forward/backward pass")
    ppo_epochs: bounded(int, ge=1) = Field(1, description="passes over each step's samples")
    warmup_sft_steps: bounded(int, ge=0) = Field(
        0, description="supervised warm-start steps on the task's format before RL"
    )
    warmup_sft_lr: bounded(float, ge=0, le=1, why=_LR_WHY) = Field(
        3e-3, description="learning rate of the supervised warm-start"
    )
    threads: bounded(
        int, ge=1, le=1024, why="torch threads per trainer: more than the machine's cores only slows it"
    ) = Field(1, description="torch threads per trainer")


# The sections only the embedded trainer reads, in place of the rollout's unread ones.
SECTIONS: dict[str, type[BaseModel]] = {"trainer": TrainerSettings}


def trainer_settings(settings: Settings) -> TrainerSettings:
    """The `mrlx.trainer` section of settings read with `SECTIONS` (validated with every other
    section)."""
    section = getattr(settings, "trainer", None)
    if not isinstance(section, TrainerSettings):  # a mistake of the program, not of the config
        raise RuntimeError(
            "the settings were read without the trainer's section model: give the host args "
            "mrlx_sections=mrlx_plugin.local.trainer.settings.SECTIONS before the runtime is built"
        )
    return section
