"""Engine answers no one may train on, and HTTP answers that are not HTTP.

An engine (a buggy one, a proxy in the way, an attacker on the network) can answer `/generate`
in the protocol's shape with values no sampler produces: ids outside the vocabulary, negative or
past int32, null, positive or impossibly low log-probs (-1e30; -1e39, past float32), more tokens
than asked for, counts that are not counts. Each becomes ABORTED samples of that episode only
(reward 0.0, loss mask all zero, no bad id in any sample), counted as
`multi_agent/malformed_answers`; nothing raises out of `generate` and the rollout finishes. A
`text` the ids do not spell is not what is graded or shown: the ids are. In a two-model run the
same holds for a peer's turn, and a peer's sample the coordinator's frames cannot carry goes as
an ABORTED filler: neither fails the initiator's step.

Below HTTP: a raw TCP server answering a malformed Content-Length, a malformed status line or an
endless chunked body gets an EngineError at once (retryable), and the body is cut off at the
client's limit, so memory stays bounded. An answer larger than its request's `max_new_tokens`
allows (in bytes or in JSON values) is malformed, refused before it is read in full or parsed.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import pytest
from _host import faulted_rollout, group, params, slime_args
from _raw_server import RawServer
from _raw_server import answer as http_answer

from mrlx_lab.stub_engine.answers import DEFAULT_TEXT, MALFORMED_MODES, WRONG_TEXT
from mrlx_plugin.core.config import EngineSettings
from mrlx_plugin.core.engine_client import MAX_BODY_BYTES, EngineClient, EngineError, MalformedAnswer
from mrlx_plugin.core.host import Status, run_in_host_loop
from mrlx_plugin.core.metrics import compute_metrics
from mrlx_plugin.core.sglang import ANSWER_BYTES_FIXED, ANSWER_BYTES_PER_TOKEN
from mrlx_plugin.local.trainer.fake_host import LocalDataSource
from mrlx_plugin.rewards.shaping import normalize
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime, runtime_for


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
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
    "tiny_logprob": "log-prob -1e+30 is below -10000",
    "overflow_logprob": "log-prob -1e+39 is below -10000",
    "too_many_tokens": "500 tokens for a request of max_new_tokens 128",
    "bad_prompt_tokens": "meta_info.prompt_tokens is 'many'",
    "bad_cached_tokens": "meta_info.cached_tokens is {'gpu': 5}",
}
REFUSED = [m for m in MALFORMED_MODES if m != "wrong_text"]


def test_every_refused_mode_is_named():
    assert sorted(REASONS) == sorted(REFUSED)


@pytest.mark.parametrize("mode", REFUSED)
def test_a_malformed_answer_fails_its_episode_not_the_rollout(mode, stub_engine, tiny_model_dir):
    engine = {"max_retries": 2, "request_timeout_s": 10.0, "backoff_s": 0.01}
    # returns: nothing raised out of generate
    args, samples = faulted_rollout(
        stub_engine.url, str(tiny_model_dir), "malformed", engine, mode, 1, rollout_max_response_len=128
    )
    aborted = [s for s in samples if s.status == Status.ABORTED]
    assert len({s.metadata["mrlx"]["episode_id"] for s in aborted}) == 1, (
        "only the malformed answer's episode"
    )
    assert [s for s in samples if s.status == Status.COMPLETED], "the other episodes went on"
    for s in aborted:
        assert (
            s.reward == 0.0
            and set(s.loss_mask) == {0}
            and set(s.rollout_log_probs) == {0.0}
            and s.remove_sample
        )
        reason = s.metadata["mrlx"]["abort_reason"]
        assert reason.startswith("malformed answer from " + stub_engine.url) and REASONS[mode] in reason, (
            reason
        )
    for s in samples:  # no sample carries an id the trainer or the coordinator's int32 frames cannot hold
        assert min(s.tokens) >= 0 and max(s.tokens) < 512
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
    assert str(error) == (
        f"{stub_engine.url}/generate: malformed answer: log-prob 3.0 is positive "
        "(log-probabilities are <= 0) (after 1 attempt)"
    )


def test_a_text_the_ids_do_not_spell_is_not_what_is_graded(stub_engine, tiny_model_dir):
    """The stub's ids spell its default text (`\\boxed{42}`, right) while its `text` says
    `\\boxed{7}` (wrong): graders and peers read what the trained ids spell."""

    async def run():
        mrlx = {
            "run_id": "wrong-text",
            "system": "pipeline",
            "pipeline": {"num_parallel": 1, "weighting": "none"},
            "engine": {"max_retries": 0, "request_timeout_s": 10.0},
        }
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
    await server.write(
        writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12x\r\n\r\n{}"
    )
    await _hold(server, writer)


async def bad_status(server: RawServer, writer: asyncio.StreamWriter) -> None:
    await server.write(writer, b"HTTP/1.1 2OO OK\r\nContent-Length: 2\r\n\r\n{}")
    await _hold(server, writer)


async def endless_chunks(server: RawServer, writer: asyncio.StreamWriter) -> None:
    await server.write(
        writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"[" * (1 << 20)
    while True:
        await server.write(writer, b"%x\r\n%s\r\n" % (len(chunk), chunk))


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def refuse(answer, sampling: dict, timeout: float, retries: int = 1):
    """Call `generate` against a raw server answering `answer`; return the EngineError, the
    seconds it took, how much the process's peak RSS grew (MiB; None where the kernel cannot
    restart the count) and the server."""

    async def run():
        async with RawServer(answer) as server:
            client = EngineClient(
                server.url, EngineSettings(max_retries=retries, backoff_s=0.01, request_timeout_s=timeout)
            )
            try:
                try:
                    Path("/proc/self/clear_refs").write_text("5")  # restart the peak-RSS count here
                    before = peak_rss_mib()
                except OSError:  # a kernel without it: the bytes the server sent still bound the body
                    before = None
                started = time.monotonic()
                with pytest.raises(EngineError) as info:
                    await client.generate([1, 2, 3], sampling)
                grew = None if before is None else peak_rss_mib() - before
                return info.value, time.monotonic() - started, grew, server
            finally:
                await client.close()

    return asyncio.run(run())


@pytest.mark.parametrize(
    "answer, sampling, reason",
    [
        (bad_length, {"max_new_tokens": 16}, "bad Content-Length in the answer: '12x'"),
        (bad_status, {"max_new_tokens": 16}, "not an HTTP/1.1 status line: 'HTTP/1.1 2OO OK'"),
        # a request that does not bound its answer: the client's absolute limit cuts it
        (endless_chunks, {}, f"the answer is over the {MAX_BODY_BYTES}-byte limit"),
    ],
    ids=["content-length", "status-line", "endless-chunked-body"],
)
def test_an_answer_that_is_not_http_fails_at_once_with_bounded_memory(answer, sampling, reason):
    timeout = 30.0
    error, elapsed, grew_mib, server = refuse(answer, sampling, timeout)
    assert error.reason == reason and error.retryable and error.attempts == 2, str(error)
    assert len(server.requests) == 2  # retried once, as any passing fault
    assert elapsed < timeout / 2, "the client's own parse ended the call, not its deadline"
    # the body is cut at the limit: what was sent is about two limits (two attempts), and what
    # the process held at its peak is far below what an endless answer would have made it hold.
    # The peak counts the whole test process (the raw server's chunk copies and send buffers
    # too), so it is bounded by a few limits, not one; an unbounded client grows without end.
    assert server.sent < 2 * MAX_BODY_BYTES + (16 << 20)
    assert grew_mib is None or grew_mib < 2.5 * MAX_BODY_BYTES / 2**20, f"peak RSS grew {grew_mib:.0f} MiB"


# --- answers larger than their request allows ----------------------------------------------

BOMB_HEAD = b'{"text":"","meta_info":{"finish_reason":{"type":"length"},"output_token_logprobs":['


def bomb(size: int, head: bytes = BOMB_HEAD, entry: bytes = b"[0,0]") -> bytes:
    """A JSON answer of about `size` bytes made of tiny entries: the most Python objects a parse
    can build per byte."""
    count = max(1, (size - len(head)) // (len(entry) + 1))
    return head + b",".join([entry] * count) + b"]}}"


async def declared_and_held(server: RawServer, writer: asyncio.StreamWriter) -> None:
    """A 200 head declaring a 4 MiB body, then nothing: only a client that refuses it by its
    declared length ends the call before its deadline."""
    await server.write(
        writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (4 << 20)
    )
    await _hold(server, writer)


def reply_with(body: bytes):
    async def reply(server: RawServer, writer: asyncio.StreamWriter) -> None:
        await server.write(writer, http_answer(200, body))

    return reply


# For max_new_tokens 16 an answer may take 64 KiB + 16 x 512 bytes, and hold 4,096 + 16 x 32 JSON values.
SMALL_REQUEST_BYTES = ANSWER_BYTES_FIXED + 16 * ANSWER_BYTES_PER_TOKEN


@pytest.mark.parametrize(
    "answer, reason",
    [
        (
            declared_and_held,
            f"the answer is {4 << 20} bytes, more than an answer of max_new_tokens 16 may take "
            f"({SMALL_REQUEST_BYTES} bytes)",
        ),
        (
            endless_chunks,
            f"the answer is over {SMALL_REQUEST_BYTES} bytes, more than an answer of "
            "max_new_tokens 16 may take",
        ),
        # within the byte allowance, and no entry more than asked for: junk beside them
        (
            reply_with(
                bomb(
                    SMALL_REQUEST_BYTES - 100,
                    head=b'{"text":"","meta_info":{"finish_reason":"stop",'
                    b'"output_token_logprobs":[[-0.5,7]],"junk":[',
                    entry=b"0",
                )
            ),
            "JSON values, more than an answer of max_new_tokens 16 holds (4608)",
        ),
    ],
    ids=["declared-length", "endless-chunked-body", "many-values"],
)
def test_an_answer_larger_than_its_request_allows_is_refused_before_it_is_read_or_parsed(answer, reason):
    """The request's `max_new_tokens` bounds the answer's bytes and its JSON values; an answer
    past either is malformed (not retried) and refused before the body is read (by its declared
    length), before more than the allowance is read (a body without a length) or before it is
    parsed (too many values)."""
    error, _, grew_mib, server = refuse(answer, {"max_new_tokens": 16}, timeout=30.0)
    assert isinstance(error, MalformedAnswer) and not error.retryable and error.attempts == 1, str(error)
    assert reason in error.reason, error.reason
    assert len(server.requests) == 1, "a malformed answer is not retried"
    assert grew_mib is None or grew_mib < 64, f"peak RSS grew {grew_mib:.0f} MiB"


def test_a_hostile_answer_within_the_byte_allowance_is_refused_before_its_values_are_built():
    """16 MiB of `[0,0]` entries for a request of max_new_tokens 32768 (whose answers may take
    16 MiB): parsing it builds some 2.8 million lists (the peak RSS grew 465 MiB); it is refused
    by counting its JSON delimiters first, so memory grows by a few copies of the body only."""
    body = bomb(16 << 20)
    error, _, grew_mib, server = refuse(reply_with(body), {"max_new_tokens": 32768}, timeout=60.0)
    # the body itself, the server's send buffer and the client's chunks: a few times 16 MiB
    assert grew_mib is None or grew_mib < 6 * 16, f"peak RSS grew {grew_mib:.0f} MiB"
    assert isinstance(error, MalformedAnswer) and error.attempts == 1, str(error)
    assert "JSON values, more than an answer of max_new_tokens 32768 holds" in error.reason, error.reason


# --- a peer's samples: what job A hands job B through the coordinator ----------------------


def initiator_step(
    a_url: str,
    b_url: str,
    model_dir,
    start_coordinator,
    monkeypatch,
    run_id: str,
    plugins: list[str] | None = None,
):
    """One step of job A of a two-model dialogue run (A speaks on `a_url`, B on `b_url`): A's
    rollout output, and what B's queue then holds for that step (the groups B leases)."""
    from _coord_procs import TOKEN_ENV
    from _twojobs import TOKEN, two_job_config

    from mrlx_plugin.link.client import CoordinatorClient
    from mrlx_plugin.rollout import initiator_rollout

    coordinator = start_coordinator(run_id=run_id, agents=("a", "b"), token=TOKEN)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    mrlx = two_job_config(
        "a",
        run_id=run_id,
        urls={"b": b_url},
        coordinator=coordinator.url,
        coordinator_settings={"wait_deadline_s": 20},
        dialogue={"max_turns": 2},
        engine={"max_retries": 0, "request_timeout_s": 10.0},
    )
    if plugins:
        mrlx["plugins"] = plugins
    args = slime_args(
        a_url,
        str(model_dir),
        mrlx,
        rollout_batch_size=1,
        n_samples_per_prompt=2,
        rollout_max_response_len=128,
    )
    out = initiator_rollout(args, 0, LocalDataSource([("What is 40 + 2?", "42")], 2))
    run_in_host_loop(runtime_for(args).aclose())

    async def take():
        client = CoordinatorClient(coordinator.url, run_id=run_id, agent="b", token=TOKEN)
        try:
            return await client.lease(10, lease_s=60, wait_s=0, step=0)
        finally:
            await client.close()

    return out, asyncio.run(take())


def test_a_peer_turn_with_a_log_prob_past_float32_aborts_its_episode_not_the_step(
    stub_engine, logs_dir, tiny_model_dir, monkeypatch, start_coordinator
):
    """B's engine answers one turn with a log-prob of -1e39, which no float32 holds: the episode
    ends ABORTED as for any malformed answer, and A's step goes on with its group whole (the
    coordinator's frames carry log-probs as float32; such a value once failed A's whole step)."""
    from mrlx_lab.stub_engine import start_stub_engine

    b_engine = start_stub_engine(log_dir=logs_dir, name="stub-b-overflow-logprob")
    try:
        post(b_engine.url + "/_stub/faults", {"mode": "overflow_logprob", "count": 1})
        out, lease = initiator_step(
            stub_engine.url, b_engine.url, tiny_model_dir, start_coordinator, monkeypatch, "overflow-logprob"
        )
        assert get(b_engine.url + "/_stub/stats")["faults_served"] == 1
    finally:
        b_engine.stop()
    samples = [s for g in out.samples for episode in g for s in episode]
    assert compute_metrics(samples)["multi_agent/malformed_answers"] == 1
    reasons = {s.metadata["mrlx"]["abort_reason"] for s in samples if s.status == Status.ABORTED}
    assert len(reasons) == 1 and "log-prob -1e+39 is below -10000" in reasons.pop()
    assert out.metrics["coordinator/samples_sent"] == 2 and out.metrics["coordinator/items_refused"] == 0
    assert [len(g) for g in lease.groups] == [2], "B's group arrives whole"
    statuses = sorted(item.fields["status"] for item in lease.groups[0])
    assert statuses == ["aborted", "completed"], statuses
    for item in lease.groups[0]:
        assert min(item.rollout_log_probs) >= -10000.0


UNENCODABLE_METADATA = """
import numpy

ENDED = []

@hookimpl
def mrlx_episode_end(episode, samples):
    # A plugin's bookkeeping that keeps a numpy value (not JSON) in the first episode's metadata,
    # which every sample of that episode carries: B's sample too.
    ENDED.append(episode.id)
    if len(ENDED) == 1:
        episode.metadata["score"] = numpy.float32(0.5)
"""


def test_a_peer_sample_the_coordinator_frames_cannot_encode_goes_as_a_filler_and_the_step_goes_on(
    stub_engine, tiny_model_dir, tmp_path, monkeypatch, start_coordinator, caplog
):
    """One of B's samples holds a value the frame encoder refuses (a numpy number in its metadata,
    put there by a plugin): it goes to B as an ABORTED filler, counted with the refused items and
    logged naming the agent and the cause; the other sample and A's step go on."""
    from _hookmodule import write_hook_module

    plugin = write_hook_module(tmp_path, monkeypatch, "numpy_episode_metadata", UNENCODABLE_METADATA)
    with caplog.at_level("WARNING", logger="mrlx_plugin.link.outbox"):
        out, lease = initiator_step(
            stub_engine.url,
            stub_engine.url,
            tiny_model_dir,
            start_coordinator,
            monkeypatch,
            "unencodable",
            plugins=[plugin],
        )
    assert out.metrics["coordinator/items_refused"] == 1 and out.metrics["coordinator/samples_sent"] == 2
    assert [len(g) for g in lease.groups] == [2], "B's group arrives whole"
    items = sorted(lease.groups[0], key=lambda item: item.fields["status"])
    filler, kept = items
    assert filler.fields["status"] == "aborted" and filler.fields["remove_sample"] is True
    assert list(filler.loss_mask) == [0]
    assert "not JSON-serialisable" in filler.fields["metadata"]["mrlx"]["refused"]
    assert kept.fields["status"] == "completed" and any(kept.loss_mask)
    logged = [r.getMessage() for r in caplog.records if "cannot be encoded" in r.getMessage()]
    assert len(logged) == 1 and "'b'" in logged[0] and "numpy.float32" in logged[0], logged
