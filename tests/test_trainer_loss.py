"""The embedded trainer: its PPO loss stays finite for every log-prob the engine client accepts;
each step's row counts what it trained (no fillers) and the engine calls it spent; and it stops
on an engine-call budget, evaluating first."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

torch = pytest.importorskip("torch")

from mrlx_plugin.core.host import Status  # noqa: E402
from mrlx_plugin.local.trainer.loop import step_engine_calls, trained_counts  # noqa: E402
from mrlx_plugin.local.trainer.loss import ppo_loss, ppo_step, trainable_parameters  # noqa: E402
from mrlx_plugin.local.trainer.settings import TrainerSettings  # noqa: E402


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
    cfg = SimpleNamespace(eps_clip=0.2, eps_clip_high=0.28, kl_coef=0.0, entropy_coef=0.0)
    model = _Confident()
    loss, info = ppo_loss(model, None, [sample], [advantage], cfg, temperature=1.0, total_tokens=2)
    loss.backward()
    assert math.isfinite(loss.item()), loss.item()
    assert math.isfinite(float(model.scale.grad))
    assert math.isfinite(info["drift_sum"])


def _trained_samples(n: int) -> list[SimpleNamespace]:
    """Samples of 10 tokens whose last 4 train (log-probs as an engine would report them)."""
    rng = torch.Generator().manual_seed(0)
    return [
        SimpleNamespace(
            tokens=torch.randint(3, 500, (10,), generator=rng).tolist(),
            response_length=4,
            loss_mask=[1, 1, 1, 1],
            rollout_log_probs=[-6.0] * 4,
        )
        for _ in range(n)
    ]


def test_the_entropy_bonus_alone_raises_the_entropy_at_the_trained_positions(tiny_model_dir: Path):
    from mrlx_plugin.local.model import load_model

    torch.manual_seed(0)
    model = load_model(tiny_model_dir)
    cfg = TrainerSettings(entropy_coef=1.0, lr=1e-3)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.lr)
    samples = _trained_samples(4)
    zero = [0.0] * len(samples)  # no policy-gradient signal: only the bonus moves the weights
    # each step reports the entropy of the policy it started from (before its update)
    entropies = [ppo_step(model, None, optimizer, samples, zero, cfg, 1.0)["train/entropy"] for _ in range(6)]
    assert all(math.isfinite(e) and e > 0 for e in entropies)
    assert entropies[-1] > entropies[0] + 1e-3, entropies
    assert entropies == sorted(entropies), entropies


def test_without_the_bonus_the_loss_is_the_ppo_loss_and_the_entropy_is_still_reported(tiny_model_dir: Path):
    from mrlx_plugin.local.model import load_model

    model = load_model(tiny_model_dir)
    samples = _trained_samples(3)
    advantages = [1.0, -0.5, 0.25]
    cfg = TrainerSettings()  # entropy_coef: 0
    assert cfg.entropy_coef == 0.0
    loss, info = ppo_loss(model, None, samples, advantages, cfg, temperature=1.0, total_tokens=12)
    with_bonus, info_b = ppo_loss(
        model, None, samples, advantages, TrainerSettings(entropy_coef=0.5), temperature=1.0, total_tokens=12
    )
    # The same forward pass: the bonus takes 0.5 x the mean entropy per trained token off, and
    # nothing else changes; the entropy measured is the same either way.
    assert info["entropy_sum"] == pytest.approx(info_b["entropy_sum"], rel=1e-6) and info["entropy_sum"] > 0
    expected = loss.item() - 0.5 * info["entropy_sum"] / 12
    assert with_bonus.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # Today's loss: PPO-clip per token against the rollout log-probs, mean over trained tokens.
    from mrlx_plugin.local.trainer.loss import _batch, token_logprobs

    ids, attention, mask, old = _batch(samples)
    with torch.no_grad():
        new = token_logprobs(model, ids, attention, 1.0)
    adv = torch.tensor(advantages)[:, None]
    ratio = torch.exp(torch.clamp((new - old) * mask, -20.0, 20.0))
    clipped = torch.clamp(ratio, 1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    assert loss.item() == pytest.approx(float((per_token * mask).sum() / 12), rel=1e-6)
    stats = ppo_step(
        model, None, torch.optim.AdamW(trainable_parameters(model), lr=0.0), samples, advantages, cfg, 1.0
    )
    assert stats["train/entropy"] == pytest.approx(info["entropy_sum"] / 12, rel=1e-4)


def test_samples_and_tokens_trained_leave_out_aborted_fillers_and_untrained_samples():
    def sample(status: Status, mask: list[int]) -> SimpleNamespace:
        return SimpleNamespace(status=status, loss_mask=mask)

    samples = [
        sample(Status.COMPLETED, [1, 1, 1]),
        sample(Status.TRUNCATED, [0, 1, 1]),
        sample(Status.ABORTED, [1, 1]),  # an aborted episode's: trains nothing
        sample(Status.ABORTED, [0]),  # a filler for a turn the episode did not reach
        sample(Status.COMPLETED, [0, 0]),  # another agent's view: no token to train
    ]
    assert trained_counts(samples) == (2, 5)


def test_engine_calls_of_a_step_come_from_the_metric_or_else_from_turns_and_candidates():
    assert step_engine_calls({"multi_agent/episodes": 4.0, "multi_agent/engine_calls": 2.5}) == 10.0
    # Without the metric (another plugin's rollout): its turns plus the candidates not gone on from.
    assert (
        step_engine_calls(
            {"multi_agent/episodes": 4.0, "multi_agent/avg_turns": 2.0, "credit/branch_candidates": 3.0}
        )
        == 20.0
    )
    assert step_engine_calls({}) == 0.0


def test_the_trainer_stops_after_the_step_that_spends_its_engine_call_budget(
    tmp_path: Path, tiny_model_dir: Path, stub_engine
):
    # A chain of 2 steps under per-turn credit; the stub's answer is never the running value, so
    # every episode is one engine call and one trained turn, its second turn an ABORTED filler.
    config = tmp_path / "job.yaml"
    agent = {"url": "self", "tokenizer": str(tiny_model_dir), "sampling": {"max_new_tokens": 8}}
    game = {"name": "chain", "seats": ["solver"], "max_turns": 2, "options": {"max_steps": 2}}
    config.write_text(
        yaml.safe_dump(
            {
                "mrlx": {
                    "run_id": "budget-test",
                    "system": "game",
                    "agents": {"solver": agent},
                    "game": game,
                    "rewards": {"credit": "turn"},
                    "trainer": {"threads": 1, "micro_batch_size": 8},
                }
            }
        )
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Chain: {i} +1 +2", "label": str(i + 3)}) + "\n" for i in range(4))
    )
    out = tmp_path / "trainer"
    argv = [
        *("--config", str(config), "--model", str(tiny_model_dir)),
        *("--engine-url", stub_engine.url, "--router-url", stub_engine.url),
        *("--prompt-data", str(prompts), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--num-rollout", "10", "--engine-call-budget", "6", "--out", str(out)),
        *("--eval-interval", "100", "--eval-prompt-data", str(prompts)),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "mrlx_plugin.local.trainer", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 0]
    # 4 episodes of one call a step: the budget of 6 is reached at the second step, which stops
    # the run there (10 steps were allowed), evaluated as a last step is.
    assert [r["step"] for r in steps] == [0, 1]
    assert [r["engine_calls"] for r in steps] == [4.0, 4.0] and steps[-1]["engine_calls_total"] == 8.0
    assert steps[-1]["engine_call_budget_spent"] is True and "engine_call_budget_spent" not in steps[0]
    assert steps[-1]["eval/eval/episodes"] == 4 and "eval/eval/episodes" not in steps[0]
    for r in steps:  # 8 samples returned a step, 4 of them ABORTED fillers
        assert r["samples"] == 8 and r["samples_trained"] == 4
        assert 4 <= r["tokens_trained"] <= 4 * 8
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step_00001"


@pytest.mark.parametrize("budget", ["0", "-3"])
def test_an_engine_call_budget_below_one_is_refused(budget: str, tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "mrlx_plugin.local.trainer", "--config", "x.yaml", "--model", "m"]
        + ["--out", str(tmp_path), "--engine-call-budget", budget],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"--engine-call-budget: got {budget}; expected at least 1" in proc.stderr
