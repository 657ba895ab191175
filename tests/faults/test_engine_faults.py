"""Engine faults during a whole rollout: bounded retries, then ABORTED samples, counted, and the
rollout finishes. The host's default rollout drives the plugin's generate function."""

from __future__ import annotations

import json
import urllib.request

import pytest
from _host import slime_args

from mrlx_plugin.core.host import Status, run_in_host_loop
from mrlx_plugin.core.metrics import compute_metrics
from mrlx_plugin.local.fake_host import LocalDataSource, default_rollout
from mrlx_plugin.rewards.shaping import normalize
from mrlx_plugin.runtime import runtime_for


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read() or b"{}")


@pytest.mark.parametrize("mode", ["http500", "close", "bad_json", "stall", "abort"])
def test_a_rollout_with_engine_faults_finishes_with_aborted_samples(mode, stub_engine, tiny_model_dir):
    mrlx = {
        "run_id": "faults",
        "system": "pipeline",
        "pipeline": {"num_parallel": 1},
        "engine": {"max_retries": 0, "request_timeout_s": 1.0, "backoff_s": 0.01},
    }
    args = slime_args(
        stub_engine.url,
        str(tiny_model_dir),
        mrlx,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        sglang_server_concurrency=1,
    )  # one episode at a time: the faults hit the first two calls
    source = LocalDataSource([("What is 40 + 2?", "42")], 2)
    post(stub_engine.url + "/_stub/faults", {"mode": mode, "count": 2})
    out = default_rollout(
        args, 0, source
    )  # a stall is cut at its deadline: this returns (pytest-timeout guards it)
    run_in_host_loop(runtime_for(args).aclose())
    samples = [s for group in out.samples for episode in group for s in episode]
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
