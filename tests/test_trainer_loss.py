"""The embedded trainer's PPO loss stays finite for every log-prob the engine client accepts."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from mrlx_plugin.local.trainer import ppo_loss  # noqa: E402


class _Confident(torch.nn.Module):
    """A model that puts (almost) all its probability on token 1 everywhere: log-prob ~0."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, input_ids, attention_mask):
        logits = torch.full((*input_ids.shape, 4), -50.0)
        logits[..., 1] = 50.0
        return SimpleNamespace(logits=logits * self.scale)


@pytest.mark.parametrize("advantage", [-1.0, 1.0])
def test_a_large_drift_from_a_low_old_log_prob_gives_a_finite_loss_and_gradient(advantage):
    # The old policy gave each response token -100 (accepted: above the engine client's -1e4
    # floor); the new one gives ~0, so exp(new - old) = e^100 overflows float32 unless bounded.
    sample = SimpleNamespace(
        tokens=[1, 1, 1, 1], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-100.0, -100.0]
    )
    cfg = SimpleNamespace(eps_clip=0.2, eps_clip_high=0.28, kl_coef=0.0)
    model = _Confident()
    loss, info = ppo_loss(model, None, [sample], [advantage], cfg, temperature=1.0, total_tokens=2)
    loss.backward()
    assert math.isfinite(loss.item()), loss.item()
    assert math.isfinite(float(model.scale.grad))
    assert math.isfinite(info["drift_sum"])
