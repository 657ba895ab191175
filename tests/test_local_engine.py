"""The embedded engine (`mrlx engine`) over real sockets, and the tiny models it serves.

One engine process per module, private to these tests (they pause it, abort on it and swap its
weights, which must not leak into tests that share the session engine). The router tests run
the real `sglang-router` when it is installed.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mrlx_plugin.core.netutil import free_port
from mrlx_plugin.core.retry import wait_until
from mrlx_plugin.local.engine.router import router_command
from mrlx_plugin.local.model import CHATML_TEMPLATE, build_model, ensure_model, load_tokenizer
from mrlx_plugin.local.services import router_available, start_engine, start_router, start_service
from mrlx_plugin.local.trainer.weights import push_weights

# --- helpers -----------------------------------------------------------------------------------


def call(url: str, body: Any = None, method: str | None = None, timeout: float = 60.0) -> tuple[int, Any]:
    """(status, parsed JSON or raw text) of one HTTP call; never raises on HTTP errors."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def generate(base: str, ids: list[int], **params: Any) -> dict[str, Any]:
    rid = params.pop("rid", None)
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
    if rid:
        body["rid"] = rid
    status, out = call(base + "/generate", body)
    assert status == 200, out
    return out


def out_ids(resp: dict[str, Any]) -> list[int]:
    return [e[1] for e in resp["meta_info"]["output_token_logprobs"]]


def out_logprobs(resp: dict[str, Any]) -> list[float]:
    return [e[0] for e in resp["meta_info"]["output_token_logprobs"]]


def loads(base: str) -> dict[str, Any]:
    return call(base + "/v1/loads")[1]["loads"][0]


def wait_running(base: str, n: int = 1, timeout: float = 30.0) -> None:
    wait_until(lambda: loads(base)["num_running_reqs"] >= n, timeout, what=f"{n} requests running on {base}")


PROMPT = [1, 74, 75, 20, 21, 9]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def eng(tiny_model_dir, logs_dir):
    proc = start_engine(
        tiny_model_dir, log_dir=logs_dir, name="engine-local-tests", extra=["--max-batch", "16"], threads=1
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    """Same architecture and tokenizer, other weights (seed 1)."""
    return build_model(tmp_path_factory.mktemp("models-seed1") / "tiny-seed1", preset="tiny", seed=1)


# --- the tiny model and its tokenizer ---------------------------------------------------------


def test_tokenizer_round_trips_any_text_and_has_chatml(tok):
    for text in [
        "12+7=19",
        "The answer is \\boxed{42}.\nJudgment: 3",
        "  tabs\tand 😀 ÄÖ e\u0301",
        "<|im_start|>x",
    ]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (
        rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    longer = msgs + [{"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(longer, tokenize=False).startswith(
        tok.apply_chat_template(msgs, tokenize=False)
    )
    assert tok.chat_template == CHATML_TEMPLATE


def race(build: Any, n: int = 2) -> list[Any]:
    """Call `build()` from `n` threads at once; what each returned or raised."""
    results: list[Any] = []

    def one() -> None:
        try:
            results.append(build())
        except Exception as exc:  # noqa: BLE001 - the caller's assert reports it
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_ensure_model_is_idempotent_and_survives_a_race(tmp_path):
    target = tmp_path / "m"
    results = race(lambda: ensure_model(target, preset="tiny", seed=3))
    assert results == [target, target]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary directories left
    mtime = (target / "config.json").stat().st_mtime_ns
    assert ensure_model(target, preset="tiny", seed=3) == target
    assert (target / "config.json").stat().st_mtime_ns == mtime  # not rebuilt
    with pytest.raises(ValueError, match="seed"):
        ensure_model(target, preset="tiny", seed=4)


# --- /generate ---------------------------------------------------------------------------------


def test_generate_returns_ids_logprobs_and_text(eng, tok):
    resp = generate(eng.url, PROMPT, max_new_tokens=6, temperature=0)
    meta = resp["meta_info"]
    ids = out_ids(resp)
    assert len(ids) == len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "0"
    assert all(0 <= i < len(tok) for i in ids)
    assert all(lp <= 0 for lp in out_logprobs(resp))
    assert resp["text"] == tok.decode(ids, skip_special_tokens=True)
    # Without return_logprob the log-probs are left out, the rest is the same.
    status, plain = call(
        eng.url + "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    )
    assert status == 200 and "output_token_logprobs" not in plain["meta_info"]
    assert plain["text"] == resp["text"]


def test_greedy_is_deterministic_and_sampling_seed_reproduces(eng):
    a = generate(eng.url, PROMPT, max_new_tokens=12, temperature=0)
    b = generate(eng.url, PROMPT, max_new_tokens=12, temperature=0)
    assert out_ids(a) == out_ids(b)
    assert out_logprobs(a) == pytest.approx(out_logprobs(b), abs=1e-5)
    s1 = generate(eng.url, PROMPT, max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, sampling_seed=123)
    s2 = generate(eng.url, PROMPT, max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, sampling_seed=123)
    assert out_ids(s1) == out_ids(s2)


def _first_new_index(ids: list[int]) -> int:
    """The first position j >= 1 whose id did not occur before it (0 if none)."""
    for j in range(1, len(ids)):
        if ids[j] not in ids[:j]:
            return j
    return 0


def test_stop_token_ids_end_generation_and_are_returned(eng, tok):
    greedy = out_ids(generate(eng.url, PROMPT, max_new_tokens=16, temperature=0))
    j = _first_new_index(greedy)
    stop_id = greedy[j]
    resp = generate(eng.url, PROMPT, max_new_tokens=16, temperature=0, stop_token_ids=[stop_id])
    assert resp["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out_ids(resp) == greedy[: j + 1]  # the matched id is part of the output, as in SGLang
    assert resp["text"] == tok.decode(greedy[:j], skip_special_tokens=True)  # ... but not of the text
    kept = generate(
        eng.url, PROMPT, max_new_tokens=16, temperature=0, stop_token_ids=[stop_id], no_stop_trim=True
    )
    assert kept["text"] == tok.decode(greedy[: j + 1], skip_special_tokens=True)
    # ignore_eos also ignores stop ids (SGLang's rule); the cap then ends the request.
    capped = generate(
        eng.url, PROMPT, max_new_tokens=16, temperature=0, stop_token_ids=[stop_id], ignore_eos=True
    )
    assert capped["meta_info"]["finish_reason"]["type"] == "length" and out_ids(capped) == greedy


def test_stop_strings_end_generation_and_are_trimmed(eng, tok):
    greedy = out_ids(generate(eng.url, PROMPT, max_new_tokens=24, temperature=0))
    full = tok.decode(greedy)
    # A stop string that first appears after the first token: the decoded text of a token
    # that did not occur before.
    j, stop = None, None
    for k in range(1, len(greedy)):
        piece = tok.decode([greedy[k]])
        if (
            piece.strip()
            and piece.isprintable()
            and "\ufffd" not in piece
            and piece not in tok.decode(greedy[:k])
        ):
            j, stop = k, piece
            break
    if stop is None:
        pytest.skip(f"greedy output {full!r} has no usable stop string")
    resp = generate(eng.url, PROMPT, max_new_tokens=24, temperature=0, stop=[stop, "never-generated-xyz"])
    assert resp["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out_ids(resp) == greedy[: j + 1]
    assert resp["text"] == full[: full.find(stop)]
    kept = generate(eng.url, PROMPT, max_new_tokens=24, temperature=0, stop=stop, no_stop_trim=True)
    assert kept["text"].endswith(stop)


def test_text_input_and_batched_input(eng, tok):
    text = "<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n"
    status, resp = call(
        eng.url + "/generate",
        {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True},
    )
    assert status == 200
    assert resp["meta_info"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
    ids = tok.encode(text, add_special_tokens=False)
    assert out_ids(resp) == out_ids(generate(eng.url, ids, max_new_tokens=4, temperature=0))
    status, many = call(
        eng.url + "/generate",
        {
            "input_ids": [PROMPT, [5, 6]],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True,
            "rid": ["r1", "r2"],
        },
    )
    assert status == 200 and isinstance(many, list) and len(many) == 2
    assert [m["meta_info"]["id"] for m in many] == ["r1", "r2"]
    assert [m["meta_info"]["prompt_tokens"] for m in many] == [len(PROMPT), 2]
    assert out_ids(many[0]) == out_ids(generate(eng.url, PROMPT, max_new_tokens=3, temperature=0))


def test_prompt_logprobs_when_asked(eng):
    status, resp = call(
        eng.url + "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert status == 200
    entries = resp["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT
    assert entries[0][0] is None and all(e[0] <= 0 for e in entries[1:])
    # max_new_tokens 0: prompt log-probs only, no generated token.
    status, only = call(
        eng.url + "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 2,
        },
    )
    assert status == 200 and only["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert only["meta_info"]["output_token_logprobs"] == [] and only["text"] == ""
    assert only["meta_info"]["input_token_logprobs"] == entries[2:]


def test_concurrent_requests_are_batched_and_match_solo_answers(eng):
    prompts = [[3 + (7 * i + k) % 400 for k in range(2 + 3 * i)] for i in range(8)]
    solo = [generate(eng.url, p, max_new_tokens=24, temperature=0, ignore_eos=True) for p in prompts]
    _, before = call(eng.url + "/get_server_info")
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(
                lambda p: generate(eng.url, p, max_new_tokens=24, temperature=0, ignore_eos=True), prompts
            )
        )
    _, after = call(eng.url + "/get_server_info")
    tokens = after["generated_tokens"] - before["generated_tokens"]
    steps = after["decode_steps"] - before["decode_steps"]
    assert tokens == 8 * 24
    assert steps < tokens - 24  # several rows advanced per decode step
    for s, t in zip(solo, together):
        a, b = out_ids(s), out_ids(t)
        if a != b:  # only a near-tie may flip a greedy choice between batch shapes
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            assert a[:k] == b[:k] and abs(out_logprobs(s)[k] - out_logprobs(t)[k]) < 1e-4
        else:
            assert out_logprobs(s) == pytest.approx(out_logprobs(t), abs=1e-4)


# --- control endpoints -------------------------------------------------------------------------


def test_abort_request_ends_an_inflight_request_with_its_partial_output(eng):
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(generate, eng.url, PROMPT, max_new_tokens=100000, ignore_eos=True, rid="long-1")
        other = pool.submit(generate, eng.url, PROMPT, max_new_tokens=100000, ignore_eos=True, rid="long-2")
        wait_running(eng.url, 2)
        status, body = call(eng.url + "/abort_request", {"rid": "long-1"})
        assert status == 200 and body["num_aborted"] == 1
        first = long.result(timeout=30)
        assert first["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(out_ids(first)) == first["meta_info"]["completion_tokens"]
        assert not other.done()
        assert call(eng.url + "/abort_request", {"abort_all": True})[0] == 200
        second = other.result(timeout=30)
        assert second["meta_info"]["finish_reason"]["type"] == "abort"


def test_pause_aborts_inflight_and_holds_new_requests_until_continue(eng):
    with ThreadPoolExecutor(2) as pool:
        inflight = pool.submit(generate, eng.url, PROMPT, max_new_tokens=100000, ignore_eos=True)
        wait_running(eng.url, 1)
        assert call(eng.url + "/pause_generation", {"mode": "abort"})[0] == 200
        assert inflight.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
        held = pool.submit(generate, eng.url, PROMPT, max_new_tokens=2, temperature=0)
        wait_until(
            lambda: loads(eng.url)["num_waiting_reqs"] >= 1, 30, what="the engine to hold the new request"
        )
        assert not held.done()
        assert call(eng.url + "/continue_generation", {})[0] == 200
        assert held.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_in_place_keeps_requests_and_resumes_them(eng):
    with ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(generate, eng.url, PROMPT, max_new_tokens=300, ignore_eos=True, temperature=0)
        wait_running(eng.url, 1)
        assert call(eng.url + "/pause_generation", {"mode": "in_place"})[0] == 200
        _, loads = call(eng.url + "/v1/loads")
        assert loads["loads"][0]["num_running_reqs"] == 1
        assert call(eng.url + "/continue_generation", {})[0] == 200
        resp = inflight.result(timeout=60)
    assert resp["meta_info"]["finish_reason"] == {"type": "length", "length": 300}


def test_update_weights_from_disk_swaps_weights_and_bumps_the_version(eng, tiny_model_dir, other_model_dir):
    base = out_ids(generate(eng.url, PROMPT, max_new_tokens=12, temperature=0))
    status, body = call(eng.url + "/update_weights_from_disk", {"model_path": str(other_model_dir)})
    assert status == 200 and body["success"] is True, body
    assert call(eng.url + "/get_weight_version")[1] == {"weight_version": "1"}
    other = generate(eng.url, PROMPT, max_new_tokens=12, temperature=0)
    assert other["meta_info"]["weight_version"] == "1"
    assert out_ids(other) != base
    assert call(eng.url + "/get_model_info")[1]["model_path"] == str(other_model_dir)
    # A directory that is not a model is refused; the current weights keep serving.
    status, body = call(
        eng.url + "/update_weights_from_disk", {"model_path": str(other_model_dir / "missing")}
    )
    assert status == 400 and body["success"] is False and "model_path" in body["message"]
    assert out_ids(generate(eng.url, PROMPT, max_new_tokens=12, temperature=0)) == out_ids(other)
    # An explicit version is taken as given; the old weights give the old answers again.
    status, body = call(
        eng.url + "/update_weights_from_disk",
        {"model_path": str(tiny_model_dir), "weight_version": "7", "abort_all_requests": True},
    )
    assert status == 200 and body["success"] is True
    again = generate(eng.url, PROMPT, max_new_tokens=12, temperature=0)
    assert again["meta_info"]["weight_version"] == "7" and out_ids(again) == base


def test_update_weights_waits_for_inflight_requests_unless_told_to_abort(eng, tiny_model_dir):
    with ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(generate, eng.url, PROMPT, max_new_tokens=200, ignore_eos=True)
        wait_running(eng.url, 1)
        status, body = call(
            eng.url + "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "8"}
        )
        assert status == 200 and body["success"]
        assert inflight.done()  # the request finished before the swap was answered
        done = inflight.result()
    assert done["meta_info"]["finish_reason"]["type"] == "length"
    assert done["meta_info"]["weight_version"] != "8"
    with ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(generate, eng.url, PROMPT, max_new_tokens=100000, ignore_eos=True)
        wait_running(eng.url, 1)
        status, body = call(
            eng.url + "/update_weights_from_disk",
            {"model_path": str(tiny_model_dir), "weight_version": "9", "abort_all_requests": True},
        )
        assert status == 200 and body["success"]
        assert inflight.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "8"}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
        ({"input_ids": [1, 2], "sampling_params": {"best_of": 2}}, "sampling_params.best_of"),
        (
            {"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}},
            "sampling_params.repetition_penalty",
        ),
        ({"input_ids": [1, 10**6]}, "input_ids[1]"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1], "text": "x"}, "input_ids"),
        ({"input_ids": [[1, 2], [3]], "stream": True}, "stream"),  # a stream is of one prompt
        ({"input_ids": [1] * 5000}, "input_ids"),
    ],
)
def test_bad_requests_get_400_naming_the_field(eng, body, field):
    status, resp = call(eng.url + "/generate", body)
    assert status == 400
    assert resp["error"]["field"] == field and field in resp["error"]["message"]


def test_non_json_body_gets_400(eng):
    req = urllib.request.Request(eng.url + "/generate", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400 and b"JSON" in info.value.read()


def test_nulls_mean_defaults_and_unknown_top_level_keys_are_ignored(eng):
    # As in SGLang: slime sends `stop_token_ids: null`; a top-level key the engine does not know
    # is ignored, an unknown sampling parameter is refused (test above).
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "rid": None,
        "some_future_field": {"x": 1},
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "stop_token_ids": None, "top_k": None},
    }
    status, resp = call(eng.url + "/generate", body)
    assert status == 200, resp
    assert out_ids(resp) == out_ids(generate(eng.url, PROMPT, max_new_tokens=3, temperature=0))
    status, resp = call(eng.url + "/generate", {"input_ids": PROMPT, "sampling_params": None})
    assert status == 200 and resp["meta_info"]["finish_reason"]["type"] in ("length", "stop")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input_ids": [[1, 2], [3]], "rid": ["only-one"]}, "rid"),
        ({"input_ids": [[1, 2], [3, 10**6]]}, "input_ids[1][1]"),
        ({"input_ids": [[1, 2], [3]], "sampling_params": [{}, {"top_p": 0}]}, "sampling_params[1].top_p"),
        ({"input_ids": [1, True]}, "input_ids[1]"),
        ({"input_ids": [1, 2], "return_logprob": 1}, "return_logprob"),
        ({"input_ids": [1, 2], "return_text_in_logprobs": True}, "return_text_in_logprobs"),
        ({"input_ids": [1, 2], "logprob_start_len": 2}, "logprob_start_len"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": True}}, "sampling_params.temperature"),
        ({"input_ids": [1, 2], "sampling_params": [{}]}, "sampling_params"),
        ([1, 2], "body"),
    ],
)
def test_more_bad_requests_get_400_naming_the_field(eng, body, field):
    status, resp = call(eng.url + "/generate", body)
    assert status == 400, resp
    assert resp["error"]["field"] == field and resp["error"]["message"].startswith(field + ": ")


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "model_path"),
        ({"model_path": ""}, "model_path"),
        ({"model_path": "/x", "abort_all_requests": "yes"}, "abort_all_requests"),
        ({"model_path": "/x", "load_format": "dummy"}, "load_format"),
        ({"model_path": "/x", "weight_version": [1]}, "weight_version"),
    ],
)
def test_bad_weight_updates_get_400_and_keep_the_weights(eng, body, field):
    before = call(eng.url + "/get_weight_version")[1]
    status, resp = call(eng.url + "/update_weights_from_disk", body)
    assert status == 400 and resp["success"] is False and resp["message"].startswith(field + ": ")
    assert call(eng.url + "/get_weight_version")[1] == before


# --- weight pushes from the trainer ------------------------------------------------------------


def test_push_weights_sets_the_version_and_reports_a_refusal(eng, tiny_model_dir, tmp_path):
    push_weights([eng.url], tiny_model_dir, version=41)
    assert call(eng.url + "/get_weight_version")[1] == {"weight_version": "41"}
    with pytest.raises(RuntimeError, match="refused the weights at .*HTTP 400"):
        push_weights([eng.url], tmp_path / "not-a-model", version=42)
    assert call(eng.url + "/get_weight_version")[1] == {"weight_version": "41"}


def test_push_weights_waits_for_an_engine_that_comes_up(tmp_path, logs_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(RuntimeError, match="did not take the weights"):
        push_weights([url], tmp_path, version=1, deadline_s=0.5)
    outcome: list[Any] = []
    pusher = threading.Thread(
        target=lambda: outcome.append(push_weights([url], tmp_path, version=5, deadline_s=120))
    )
    pusher.start()
    stub = start_service(
        "stub-late",
        [sys.executable, "-m", "mrlx_lab.stub_engine", "--port", str(port)],
        log_dir=logs_dir,
        port=port,
    )
    try:
        pusher.join(120)
        assert outcome == [None]
        _, stats = call(url + "/_stub/stats")
        assert stats["weight_updates"] == 1 and stats["weight_version"] == "5"
    finally:
        stub.stop()


def test_a_streamed_generate_sends_each_step_as_sglang_streams(eng):
    sampling = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True, "stream": True}
    req = urllib.request.Request(eng.url + "/generate", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as resp:
        kind, raw = resp.headers.get("Content-Type", ""), resp.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert kind.startswith("text/event-stream") and events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    metas = [c["meta_info"] for c in chunks]
    counts = [m["completion_tokens"] for m in metas]
    assert len(chunks) > 1 and counts == sorted(set(counts)) and counts[-1] == 12
    assert all(m["finish_reason"] is None for m in metas[:-1])
    assert metas[-1]["finish_reason"] == {"type": "length", "length": 12}
    plain = generate(eng.url, PROMPT, **sampling)
    whole = plain["meta_info"]["output_token_logprobs"]
    for m in metas:  # everything so far in every chunk (SGLang's default)
        assert m["output_token_logprobs"] == whole[: m["completion_tokens"]]
    assert chunks[-1]["text"] == plain["text"] and chunks[-1]["output_ids"] == out_ids(plain)
    assert all(plain["text"].startswith(c["text"]) or "\ufffd" in c["text"] for c in chunks)


def test_info_and_health_endpoints(eng, tiny_model_dir):
    assert call(eng.url + "/health")[0] == 200
    assert call(eng.url + "/health_generate")[0] == 200
    status, info = call(eng.url + "/get_model_info")
    assert (
        status == 200
        and info["is_generation"] is True
        and "weight_version" in info
        and info["tokenizer_path"]
    )
    status, server = call(eng.url + "/get_server_info")
    assert status == 200 and isinstance(server, dict) and server["context_length"] > 0
    assert call(eng.url + "/flush_cache", method="GET")[0] == 200
    assert call(eng.url + "/flush_cache", {})[0] == 200
    assert call(eng.url + "/abort_request", {})[0] == 400  # neither rid nor abort_all
    assert call(eng.url + "/pause_generation", {"mode": "sideways"})[0] == 400


# --- behind the real sglang-router ------------------------------------------------------------

needs_router = pytest.mark.skipif(
    not router_available(), reason="sglang_router is not installed (pip install sglang-router)"
)


def _router_workers(router_url: str) -> list[str]:
    status, body = call(router_url + "/workers")
    assert status == 200, body
    return [w["url"] for w in body.get("workers", [])]


@needs_router
@pytest.mark.router
def test_engine_behind_router_with_worker_urls(eng, logs_dir):
    router = start_router([eng.url], log_dir=logs_dir, name="router-worker-urls")
    try:
        wait_until(
            lambda: eng.url in _router_workers(router.url), 30, what="the engine in the router's /workers"
        )
        direct = generate(eng.url, PROMPT, max_new_tokens=5, temperature=0)
        status, via = call(
            router.url + "/generate",
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                "return_logprob": True,
            },
        )
        assert status == 200, via
        assert (
            out_ids(via) == out_ids(direct)
            and via["meta_info"]["weight_version"] == direct["meta_info"]["weight_version"]
        )
        status, bad = call(router.url + "/generate", {"input_ids": [1, 10**6]})
        assert status == 400 and "input_ids[1]" in json.dumps(bad)
    finally:
        router.stop()


@pytest.mark.slow
@needs_router
@pytest.mark.router
def test_engine_registers_with_router_and_leaves_on_shutdown(tiny_model_dir, logs_dir):
    router = start_router([], log_dir=logs_dir, name="router-registration")
    engine = None
    try:
        engine = start_engine(
            tiny_model_dir,
            log_dir=logs_dir,
            name="engine-registering",
            extra=["--router-url", router.url],
            threads=1,
        )
        wait_until(
            lambda: engine.url in _router_workers(router.url),
            30,
            what="the engine to appear in the router's /workers",
        )
        status, via = call(
            router.url + "/generate",
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "return_logprob": True},
        )
        assert status == 200 and len(out_ids(via)) == 3
        engine.stop()
        wait_until(
            lambda: engine.url not in _router_workers(router.url),
            15,
            what="the engine to leave the router on shutdown",
        )
    finally:
        if engine is not None:
            engine.stop()
        router.stop()


@pytest.mark.slow
@needs_router
@pytest.mark.router
def test_engine_registers_with_a_router_that_starts_after_it(tiny_model_dir, logs_dir):
    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    engine = start_engine(
        tiny_model_dir, log_dir=logs_dir, name="engine-early", extra=["--router-url", router_url], threads=1
    )
    router = None
    try:
        router = start_service(
            "router-late", router_command("127.0.0.1", port), log_dir=logs_dir, port=port, timeout=60
        )
        wait_until(
            lambda: engine.url in _router_workers(router_url),
            60,
            what="the engine, retrying, to register with the router once it is up",
        )
        assert engine.alive()
    finally:
        engine.stop()
        if router is not None:
            router.stop()


def test_presence_and_frequency_penalties_steer_away_from_generated_tokens(eng):
    """SGLang's penalties: greedy decoding of the tiny model repeats tokens; with a presence
    penalty far above its logits' spread no generated token comes twice."""

    def greedy(**penalties):
        params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True, **penalties}
        status, resp = call(
            eng.url + "/generate", {"input_ids": [1, 5, 9], "sampling_params": params, "return_logprob": True}
        )
        assert status == 200, resp
        return [e[1] for e in resp["meta_info"]["output_token_logprobs"]]

    plain = greedy()
    assert len(set(plain)) < len(plain), plain  # repeats: the penalty has something to change
    penalised = greedy(presence_penalty=2.0)
    assert len(set(penalised)) == len(penalised), penalised
    assert penalised[0] == plain[0]  # nothing generated yet: the first token is the same
    frequent = greedy(frequency_penalty=2.0)
    assert len(set(frequent)) == len(frequent), frequent
    status, resp = call(eng.url + "/generate", {"input_ids": [1], "sampling_params": {"presence_penalty": 3}})
    assert status == 400 and resp["error"]["field"] == "sampling_params.presence_penalty"
