"""The model-free stub engine over real sockets: protocol answers, fault injection, latency."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import orjson
import pytest

from mrlx_lab.stub_engine import start_stub_engine
from mrlx_lab.stub_engine.answers import DEFAULT_TEXT
from mrlx_plugin.core.retry import wait_until


def call(
    url: str, path: str, body: Any = None, method: str | None = None, timeout: float = 10.0
) -> tuple[int, bytes]:
    """(status, raw body) of one request on a fresh connection."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(
            method or ("POST" if data is not None else "GET"),
            path,
            body=data,
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def call_json(url: str, path: str, body: Any = None, method: str | None = None) -> tuple[int, Any]:
    status, raw = call(url, path, body, method)
    return status, json.loads(raw)


GEN = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 128}, "return_logprob": True}


def stats(url: str) -> dict[str, Any]:
    return call_json(url, "/_stub/stats")[1]


def test_generate_answers_in_the_sglang_shape(stub_engine):
    status, resp = call_json(stub_engine.url, "/generate", GEN)
    assert status == 200
    meta = resp["meta_info"]
    ids = [e[1] for e in meta["output_token_logprobs"]]
    assert len(ids) == meta["completion_tokens"] == 64
    assert all(0 <= i < 512 for i in ids) and all(e[0] <= 0 for e in meta["output_token_logprobs"])
    assert meta["finish_reason"] == {"type": "stop", "matched": ids[-1]}
    assert meta["prompt_tokens"] == 4 and meta["weight_version"] == "0"
    assert resp["text"] == DEFAULT_TEXT and "\\boxed{42}" in resp["text"] and "Judgment: 1" in resp["text"]
    # Deterministic for the same request; a smaller max_new_tokens caps the answer.
    assert (
        call_json(stub_engine.url, "/generate", GEN)[1]["meta_info"]["output_token_logprobs"]
        == meta["output_token_logprobs"]
    )
    capped = call_json(stub_engine.url, "/generate", {**GEN, "sampling_params": {"max_new_tokens": 5}})[1]
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(capped["meta_info"]["output_token_logprobs"]) == 5
    batched = call_json(stub_engine.url, "/generate", {**GEN, "input_ids": [[1, 2], [3]]})[1]
    assert isinstance(batched, list) and [b["meta_info"]["prompt_tokens"] for b in batched] == [2, 1]
    assert call_json(stub_engine.url, "/_stub/last")[1] == {**GEN, "input_ids": [[1, 2], [3]]}


def test_control_endpoints(stub_engine):
    url = stub_engine.url
    assert call(url, "/health")[0] == 200
    assert call_json(url, "/get_model_info")[1]["is_generation"] is True
    assert call_json(url, "/get_weight_version")[1] == {"weight_version": "0"}
    assert call_json(url, "/update_weights_from_disk", {"model_path": "/x"})[1]["success"] is True
    assert call_json(url, "/get_weight_version")[1] == {"weight_version": "1"}
    call_json(url, "/update_weights_from_disk", {"model_path": "/x", "weight_version": "v9"})
    assert call_json(url, "/generate", GEN)[1]["meta_info"]["weight_version"] == "v9"
    assert call(url, "/flush_cache", method="GET")[0] == 200
    assert call(url, "/abort_request", {"abort_all": True})[0] == 200
    assert call(url, "/nowhere")[0] == 404
    assert call(url, "/_stub/faults", {"mode": "explode"})[0] == 400


@pytest.mark.parametrize("count", [1, 2])
def test_http500_fault_then_recovery(stub_engine, count):
    url = stub_engine.url
    assert call_json(url, "/_stub/faults", {"mode": "http500", "count": count})[0] == 200
    for _ in range(count):
        status, raw = call(url, "/generate", GEN)
        assert status == 500 and "error" in json.loads(raw)
    assert call(url, "/generate", GEN)[0] == 200
    s = stats(url)
    assert s["generate"] == count + 1 and s["faults_served"] == count and s["generate_ok"] == 1


def test_close_fault_drops_the_connection(stub_engine):
    call_json(stub_engine.url, "/_stub/faults", {"mode": "close"})
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        call(stub_engine.url, "/generate", GEN)
    assert call(stub_engine.url, "/generate", GEN)[0] == 200
    assert stats(stub_engine.url)["faults_served"] == 1


def test_bad_json_fault_answers_200_with_a_body_that_is_not_json(stub_engine):
    call_json(stub_engine.url, "/_stub/faults", {"mode": "bad_json"})
    status, raw = call(stub_engine.url, "/generate", GEN)
    assert status == 200
    with pytest.raises(ValueError):
        json.loads(raw)


def test_stall_fault_never_answers(stub_engine):
    call_json(stub_engine.url, "/_stub/faults", {"mode": "stall"})
    with pytest.raises((socket.timeout, TimeoutError)):
        call(stub_engine.url, "/generate", GEN, timeout=0.5)
    # Other connections are served as usual.
    assert call(stub_engine.url, "/generate", GEN)[0] == 200
    assert stats(stub_engine.url)["faults_served"] == 1


def test_abort_fault_answers_with_finish_reason_abort_and_no_tokens(stub_engine):
    call_json(stub_engine.url, "/_stub/faults", {"mode": "abort"})
    status, resp = call_json(stub_engine.url, "/generate", GEN)
    assert status == 200
    assert resp["meta_info"]["finish_reason"]["type"] == "abort"
    assert resp["meta_info"]["output_token_logprobs"] == [] and resp["meta_info"]["completion_tokens"] == 0


def test_none_clears_pending_faults(stub_engine):
    call_json(stub_engine.url, "/_stub/faults", {"mode": "http500", "count": 5})
    call_json(stub_engine.url, "/_stub/faults", {"mode": "none"})
    assert call(stub_engine.url, "/generate", GEN)[0] == 200
    assert stats(stub_engine.url)["faults_served"] == 0


def test_keep_alive_serves_many_requests_on_one_connection(stub_engine):
    async def run() -> list[int]:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            statuses = []
            for _ in range(50):
                async with session.post(stub_engine.url + "/generate", json=GEN) as resp:
                    await resp.json()
                    statuses.append(resp.status)
            return statuses

    before = stats(stub_engine.url)
    assert asyncio.run(run()) == [200] * 50
    after = stats(stub_engine.url)
    assert after["generate"] - before["generate"] == 50
    assert after["connections"] - before["connections"] == 2  # the session's one, and this stats call's


def test_latency_delays_answers_without_blocking_others(logs_dir):
    stub = start_stub_engine(
        log_dir=logs_dir, name="stub-latency", extra=["--latency", "0.2", "--response-tokens", "8"]
    )
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: call_json(stub.url, "/generate", GEN), range(8)))
        assert all(status == 200 for status, _ in answers)
        assert all(len(resp["meta_info"]["output_token_logprobs"]) == 8 for _, resp in answers)
    finally:
        stub.stop()


def test_abort_request_and_pause_end_delayed_answers(logs_dir):
    stub = start_stub_engine(log_dir=logs_dir, name="stub-slow", extra=["--latency", "60"])
    try:
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(call_json, stub.url, "/generate", {**GEN, "rid": "r1"})
            second = pool.submit(call_json, stub.url, "/generate", {**GEN, "rid": "r2"})
            wait_until(lambda: stats(stub.url)["pending"] >= 2, 10, what="the two requests at the stub")
            assert call_json(stub.url, "/abort_request", {"rid": "r1"})[1]["num_aborted"] == 1
            status, resp = first.result(timeout=10)
            assert status == 200 and resp["meta_info"]["finish_reason"]["type"] == "abort"
            assert not second.done()
            assert call_json(stub.url, "/pause_generation", {"mode": "abort"})[1]["num_aborted"] == 1
            assert second.result(timeout=10)[1]["meta_info"]["finish_reason"]["type"] == "abort"
            call_json(stub.url, "/continue_generation", {})
    finally:
        stub.stop()


# --- streamed answers -------------------------------------------------------------------------------


JSON_HEADERS = {"Content-Type": "application/json"}


def stream_events(url: str, body: dict[str, Any]) -> tuple[int, str, list[bytes]]:
    """(status, content type, the data of each event) of one streamed `/generate`."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", "/generate", body=orjson.dumps(body), headers=JSON_HEADERS)
        resp = conn.getresponse()
        raw = resp.read()
        events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
        return resp.status, resp.getheader("Content-Type") or "", events
    finally:
        conn.close()


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_a_streamed_generate_is_an_sglang_event_stream(logs_dir, incremental):
    flags = ["--response-tokens", "10", "--stream-tokens", "4"]
    stub = start_stub_engine(
        log_dir=logs_dir,
        name=f"stub-stream-{incremental}",
        extra=flags + (["--incremental-streaming-output"] if incremental else []),
    )
    try:
        status, kind, events = stream_events(stub.url, {**GEN, "stream": True})
        host, port = stub.url.removeprefix("http://").split(":")
        plain = http.client.HTTPConnection(host, int(port), timeout=10)
        plain.request("POST", "/generate", body=orjson.dumps(GEN), headers=JSON_HEADERS)
        whole = json.loads(plain.getresponse().read())
        plain.close()
    finally:
        stub.stop()
    assert status == 200 and kind == "text/event-stream" and events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    metas = [c["meta_info"] for c in chunks]
    assert [m["completion_tokens"] for m in metas] == [4, 8, 10]
    assert [m["finish_reason"] for m in metas[:-1]] == [None, None]
    assert metas[-1]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert all(m["prompt_tokens"] == 4 and m["weight_version"] == "0" for m in metas)
    entries = [m["output_token_logprobs"] for m in metas]
    if incremental:  # what is new in each chunk
        assert [len(e) for e in entries] == [4, 4, 2]
        assert [x for e in entries for x in e] == whole["meta_info"]["output_token_logprobs"]
        assert "".join(c["text"] for c in chunks) == whole["text"] == DEFAULT_TEXT
    else:  # everything so far in each chunk, SGLang's default
        assert [len(e) for e in entries] == [4, 8, 10] and entries[0] == entries[2][:4]
        assert entries[-1] == whole["meta_info"]["output_token_logprobs"]
        assert chunks[-1]["text"] == whole["text"] and whole["text"].startswith(chunks[1]["text"])
    assert [c["output_ids"] for c in chunks][-1] == [e[1] for e in entries[-1]]


def test_a_delayed_stream_is_ended_by_an_abort_and_a_batch_does_not_stream(logs_dir):
    stub = start_stub_engine(log_dir=logs_dir, name="stub-stream-abort", extra=["--latency", "60"])
    try:
        with ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(stream_events, stub.url, {**GEN, "rid": "s1", "stream": True})
            wait_until(lambda: stats(stub.url)["pending"] >= 1, 10, what="the request at the stub")
            assert call_json(stub.url, "/abort_request", {"rid": "s1"})[1]["num_aborted"] == 1
            status, _, events = streamed.result(timeout=10)
        assert status == 200 and len(events) == 2 and events[1] == b"[DONE]"
        meta = json.loads(events[0])["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["output_token_logprobs"] == []
        status, raw = call(stub.url, "/generate", {**GEN, "input_ids": [[1], [2]], "stream": True})
        assert status == 400 and b"stream" in raw
    finally:
        stub.stop()
