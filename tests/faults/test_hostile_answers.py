"""Engine answers no one may train on, and HTTP answers that are not HTTP.

An engine (a buggy one, a proxy in the way, an attacker on the network) can answer `/generate`
in the protocol's shape with values no sampler produces: ids outside the vocabulary, negative or
past int32, null or positive log-probs, more tokens than asked for, counts that are not counts.
Each becomes ABORTED samples of that episode only (reward 0.0, loss mask all zero, no bad id in
any sample), counted as `multi_agent/malformed_answers`; nothing raises out of `generate` and
the rollout finishes. A `text` the ids do not spell is not what is graded or shown: the ids are.

Below HTTP: a raw TCP server answering a malformed Content-Length, a malformed status line or an
endless chunked body gets an EngineError at once (retryable), and the body is cut off at the
client's limit, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import pytest
from _raw_server import RawServer
from _host import group, params, slime_args

from mrlx_plugin.core.config import EngineSettings
from mrlx_plugin.core.engine_client import MAX_BODY_BYTES, EngineClient, EngineError, MalformedAnswer
from mrlx_plugin.core.host import Status, run_in_host_loop
from mrlx_plugin.local.fake_host import LocalDataSource, default_rollout
from mrlx_plugin.local.stub_engine import DEFAULT_TEXT, MALFORMED_MODES, WRONG_TEXT
from mrlx_plugin.core.metrics import compute_metrics
from mrlx_plugin.rewards.shaping import normalize
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime, runtime_for


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read() or b"{}")


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


# What each malformed answer's abort reason names.
REASONS = {
    "out_of_vocab": "outside the vocabulary of agent 'solver' (ids 0 to 511)",
    "negative_id": "token id -1 is not a token id",
    "huge_id": f"token id {2**40} is not a token id",
    "null_logprob": "log-prob None is not a number",
    "positive_logprob": "log-prob 3.0 is positive",
    "too_many_tokens": "500 tokens for a request of max_new_tokens 128",
    "bad_prompt_tokens": "meta_info.prompt_tokens is 'many'",
    "bad_cached_tokens": "meta_info.cached_tokens is {'gpu': 5}",
}
REFUSED = [m for m in MALFORMED_MODES if m != "wrong_text"]


def test_every_refused_mode_is_named():
    assert sorted(REASONS) == sorted(REFUSED)


@pytest.mark.parametrize("mode", REFUSED)
def test_a_malformed_answer_fails_its_episode_not_the_rollout(mode, stub_engine, tiny_model_dir):
    mrlx = {"run_id": "malformed", "system": "pipeline", "pipeline": {"num_parallel": 1},
            "engine": {"max_retries": 2, "request_timeout_s": 10.0, "backoff_s": 0.01}}
    args = slime_args(stub_engine.url, str(tiny_model_dir), mrlx, rollout_batch_size=2, n_samples_per_prompt=2,
                      sglang_server_concurrency=1, rollout_max_response_len=128)
    source = LocalDataSource([("What is 40 + 2?", "42")], 2)
    post(stub_engine.url + "/_stub/faults", {"mode": mode, "count": 1})
    out = default_rollout(args, 0, source)  # returns: nothing raised out of generate
    run_in_host_loop(runtime_for(args).aclose())
    samples = [s for g in out.samples for episode in g for s in episode]
    aborted = [s for s in samples if s.status == Status.ABORTED]
    assert len({s.metadata["mrlx"]["episode_id"] for s in aborted}) == 1, "only the malformed answer's episode"
    assert [s for s in samples if s.status == Status.COMPLETED], "the other episodes went on"
    for s in aborted:
        assert s.reward == 0.0 and set(s.loss_mask) == {0} and set(s.rollout_log_probs) == {0.0} and s.remove_sample
        reason = s.metadata["mrlx"]["abort_reason"]
        assert reason.startswith("malformed answer from " + stub_engine.url) and REASONS[mode] in reason, reason
    for s in samples:  # no sample carries an id the trainer or the coordinator's int32 frames cannot hold
        assert 0 <= min(s.tokens) and max(s.tokens) < 512
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
    assert get(stub_engine.url + "/_stub/stats")["faults_served"] == 1, "a malformed answer is not retried"
    metrics = compute_metrics(samples)
    assert metrics["multi_agent/malformed_answers"] == 1 and metrics["multi_agent/aborted_episodes"] == 1
    raw, adv = normalize(args, samples)
    assert all(a == 0.0 for s, a in zip(samples, adv) if s.status == Status.ABORTED)


def test_the_engine_client_refuses_a_malformed_answer_with_one_clear_error(stub_engine):
    async def run():
        client = EngineClient(stub_engine.url, EngineSettings(max_retries=3, backoff_s=0.01))
        try:
            post(stub_engine.url + "/_stub/faults", {"mode": "positive_logprob", "count": 5})
            with pytest.raises(MalformedAnswer) as info:
                await client.generate([1, 2, 3], {"max_new_tokens": 16})
            return info.value
        finally:
            await client.close()

    error = asyncio.run(run())
    assert not error.retryable and error.attempts == 1
    assert str(error) == (f"{stub_engine.url}/generate: malformed answer: log-prob 3.0 is positive "
                          "(log-probabilities are <= 0) (after 1 attempt)")


def test_a_text_the_ids_do_not_spell_is_not_what_is_graded(stub_engine, tiny_model_dir):
    """The stub's ids spell its default text (`\\boxed{42}`, right) while its `text` says
    `\\boxed{7}` (wrong): graders and peers read what the trained ids spell."""
    async def run():
        mrlx = {"run_id": "wrong-text", "system": "pipeline", "pipeline": {"num_parallel": 1, "weighting": "none"},
                "engine": {"max_retries": 0, "request_timeout_s": 10.0}}
        args = slime_args(stub_engine.url, str(tiny_model_dir), mrlx)
        post(stub_engine.url + "/_stub/faults", {"mode": "wrong_text", "count": 1000})
        out = await generate(args, group(0, 1)[0], params(args))
        await (await get_runtime(args)).aclose()
        return out

    out = asyncio.run(run())
    assert get(stub_engine.url + "/_stub/stats")["faults_served"] == 3  # every call answered the wrong text
    assert all(s.status == Status.COMPLETED for s in out)
    solver = next(s for s in out if s.metadata["mrlx"]["agent"] == "solver")
    assert solver.metadata["mrlx"]["raw_reward"] == 1.0 and solver.reward == 1.0
    assert "\\boxed{42}" in solver.response and WRONG_TEXT not in solver.response
    assert solver.response.strip() == DEFAULT_TEXT


# --- HTTP that is not HTTP -----------------------------------------------------------------


async def _hold(server: RawServer, writer: asyncio.StreamWriter) -> None:
    await asyncio.Event().wait()  # say nothing more: only the client's parse (or the test's end) ends it


async def bad_length(server: RawServer, writer: asyncio.StreamWriter) -> None:
    await server.write(writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12x\r\n\r\n{}")
    await _hold(server, writer)


async def bad_status(server: RawServer, writer: asyncio.StreamWriter) -> None:
    await server.write(writer, b"HTTP/1.1 2OO OK\r\nContent-Length: 2\r\n\r\n{}")
    await _hold(server, writer)


async def endless_chunks(server: RawServer, writer: asyncio.StreamWriter) -> None:
    await server.write(writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"[" * (1 << 20)
    while True:
        await server.write(writer, b"%x\r\n%s\r\n" % (len(chunk), chunk))


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/self/status")


@pytest.mark.parametrize("answer, reason", [
    (bad_length, "bad Content-Length in the answer: '12x'"),
    (bad_status, "not an HTTP/1.1 status line: 'HTTP/1.1 2OO OK'"),
    (endless_chunks, f"the answer is over the {MAX_BODY_BYTES}-byte limit"),
], ids=["content-length", "status-line", "endless-chunked-body"])
def test_an_answer_that_is_not_http_fails_at_once_with_bounded_memory(answer, reason):
    timeout = 30.0

    async def run():
        async with RawServer(answer) as server:
            client = EngineClient(server.url, EngineSettings(max_retries=1, backoff_s=0.01, request_timeout_s=timeout))
            try:
                try:
                    Path("/proc/self/clear_refs").write_text("5")  # restart the peak-RSS count here
                    before = peak_rss_mib()
                except OSError:  # a kernel without it: the bytes the server sent still bound the body
                    before = None
                started = time.monotonic()
                with pytest.raises(EngineError) as info:
                    await client.generate([1, 2, 3], {"max_new_tokens": 16})
                grew = None if before is None else peak_rss_mib() - before
                return info.value, time.monotonic() - started, grew, server
            finally:
                await client.close()

    error, elapsed, grew_mib, server = asyncio.run(run())
    assert error.reason == reason and error.retryable and error.attempts == 2, str(error)
    assert len(server.requests) == 2  # retried once, as any passing fault
    assert elapsed < timeout / 2, "the client's own parse ended the call, not its deadline"
    # the body is cut at the limit: what was sent is about two limits (two attempts), and what
    # the process held at its peak is far below what an endless answer would have made it hold.
    # The peak counts the whole test process (the raw server's chunk copies and send buffers
    # too), so it is bounded by a few limits, not one; an unbounded client grows without end.
    assert server.sent < 2 * MAX_BODY_BYTES + (16 << 20)
    assert grew_mib is None or grew_mib < 2.5 * MAX_BODY_BYTES / 2**20, f"peak RSS grew {grew_mib:.0f} MiB"
