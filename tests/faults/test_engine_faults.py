"""Engine faults during a whole rollout: bounded retries, then ABORTED samples, counted, and the
rollout finishes. The host's default rollout drives the plugin's generate function."""

from __future__ import annotations

import pytest
from _host import faulted_rollout

from mrlx_plugin.core.host import Status
from mrlx_plugin.core.metrics import compute_metrics
from mrlx_plugin.rewards.shaping import normalize


@pytest.mark.parametrize("mode", ["http500", "close", "bad_json", "stall", "abort"])
def test_a_rollout_with_engine_faults_finishes_with_aborted_samples(mode, stub_engine, tiny_model_dir):
    engine = {"max_retries": 0, "request_timeout_s": 1.0, "backoff_s": 0.01}
    # a stall is cut at its deadline: this returns (pytest-timeout guards it)
    args, samples = faulted_rollout(stub_engine.url, str(tiny_model_dir), "faults", engine, mode, 2)
    aborted = [s for s in samples if s.status == Status.ABORTED]
    completed = [s for s in samples if s.status == Status.COMPLETED]
    assert len({s.metadata["mrlx"]["episode_id"] for s in aborted}) == 2  # the two faulted calls' episodes
    assert completed, "the other episodes went on"
    for s in aborted:
        assert s.reward == 0.0 and set(s.loss_mask) == {0} and s.remove_sample
    metrics = compute_metrics(samples)
    assert metrics["multi_agent/aborted_episodes"] == 2 and metrics["multi_agent/aborted_turns"] == 2
    raw, adv = normalize(args, samples)
    assert all(a == 0.0 for s, a in zip(samples, adv) if s.status == Status.ABORTED)
