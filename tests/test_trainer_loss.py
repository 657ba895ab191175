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
from mrlx_plugin.local.trainer.loss import ppo_loss  # noqa: E402


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
