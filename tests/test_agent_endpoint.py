"""Agents as code through the stand-in host: user code drives the official `openai` SDK (and raw
HTTP) against the endpoints of a rollout process; a recording proxy in front of a stub engine keeps
every `/generate`, so each sample's ids, loss mask and log-probs are checked against what the
engine returned, turn by turn."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
from _agent_systems import SEEN, TOOL_OUTPUT
from _host import group, params, slime_args

from mrlx_plugin.core.host import Status
from mrlx_plugin.core.metrics import compute_metrics
from mrlx_plugin.core.retry import wait_until
from mrlx_plugin.core.tokenizer import load_tokenizer
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime

CALL = 'Let me look it up.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "x7"}}\n</tool_call>'
ANSWER = "The value is \\boxed{42}."


def config(system: str, **agents) -> dict:
    return {
        "run_id": "agents-test",
        "plugins": ["_agent_systems"],
        "system": system,
        "agents": agents or {"solver": {"url": "self"}},
        "engine": {"max_retries": 0, "request_timeout_s": 10},
    }


def run(url: str, model_dir, mrlx: dict, n: int = 1, evaluation: bool = False, **flags) -> list:
    async def go():
        args = slime_args(url, str(model_dir), mrlx, **flags)
        try:
            return await asyncio.gather(
                *(generate(args, s, params(args), evaluation=evaluation) for s in group(0, n))
            )
        finally:
            await (await get_runtime(args)).aclose()

    return asyncio.run(go())


def test_a_tool_call_trains_the_engine_ids_exactly_and_masks_the_tool_output(engine_for, tiny_model_dir):
    proxy = engine_for(CALL, ANSWER)
    [samples] = run(proxy.url, tiny_model_dir, config("tool_use"))
    [s] = samples
    meta = s.metadata["mrlx"]
    seen = SEEN[meta["episode_id"]]
    first = seen["first"].choices[0]
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"key": "x7"}
    assert call.id.startswith("call_") and first.message.content == "Let me look it up."
    assert "\\boxed{42}" in seen["second"].choices[0].message.content
    assert s.status == Status.COMPLETED and s.reward == 1.0

    # Two engine calls; the second's prompt is the first's prompt, its exact answer, then the tool part.
    one, two = proxy.calls
    n1 = len(one["input_ids"]) + len(one["ids"])
    assert two["input_ids"][:n1] == one["input_ids"] + one["ids"]
    tool_part = two["input_ids"][n1:]
    assert s.tokens == two["input_ids"] + two["ids"]
    assert s.response_length == len(s.tokens) - len(one["input_ids"])
    assert s.loss_mask == [1] * len(one["ids"]) + [0] * len(tool_part) + [1] * len(two["ids"])
    assert s.rollout_log_probs == one["logprobs"] + [0.0] * len(tool_part) + two["logprobs"]
    # The tool's output is text: its special-token strings are not the special tokens.
    tok = load_tokenizer(str(tiny_model_dir))
    im_start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert tool_part.count(im_start) == 2  # the tool message's own, and the answer's prompt
    assert TOOL_OUTPUT in tok.decode(tool_part, skip_special_tokens=False)
    assert meta["episode"]["agent_code"]["solver"]["tool_calls"] == 1
    assert compute_metrics(samples)["agents/tool_calls"] == 1.0


def test_the_tools_reach_the_template_of_the_first_prompt(engine_for, tiny_model_dir):
    proxy = engine_for(CALL, ANSWER)
    run(proxy.url, tiny_model_dir, config("tool_use"))
    tok = load_tokenizer(str(tiny_model_dir))
    prompt = tok.decode(proxy.calls[0]["input_ids"], skip_special_tokens=False)
    assert "lookup" in prompt and "the value stored under a key" in prompt  # however the template writes it


def test_parallel_calls_are_separate_samples_up_to_the_declared_count(engine_for, tiny_model_dir):
    proxy = engine_for(ANSWER)
    [samples] = run(proxy.url, tiny_model_dir, config("parallel"))
    results = SEEN[samples[0].metadata["mrlx"]["episode_id"]]["results"]
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(refused) == 1 and getattr(refused[0], "status_code", None) == 429, results
    assert "samples" in str(refused[0])
    assert len(proxy.calls) == 3 and len(samples) == 3
    for s, call in zip(
        sorted(samples, key=lambda s: s.tokens), sorted(proxy.calls, key=lambda c: c["input_ids"] + c["ids"])
    ):
        assert s.tokens == call["input_ids"] + call["ids"] and s.reward == 0.5


def test_a_rewritten_history_is_a_new_sample_that_trains_only_the_new_turn(engine_for, tiny_model_dir):
    proxy = engine_for(ANSWER)
    [samples] = run(proxy.url, tiny_model_dir, config("rewrite"))
    assert len(samples) == 2
    one, two = proxy.calls
    first, second = sorted(samples, key=lambda s: len(s.tokens))
    assert first.tokens == one["input_ids"] + one["ids"]
    # The fork starts over: the edited answer is in its prompt, context only; the engine's answer to
    # it is its one trained turn.
    assert second.tokens == two["input_ids"] + two["ids"]
    assert sum(second.loss_mask) == len(two["ids"]) and second.loss_mask[-len(two["ids"]) :] == [1] * len(
        two["ids"]
    )
    tok = load_tokenizer(str(tiny_model_dir))
    assert "I edited this answer." in tok.decode(two["input_ids"])
    assert samples[0].metadata["mrlx"]["episode"]["agent_code"]["solver"]["forks"] == 1


def test_two_agents_on_two_models_each_reach_their_own_engine(engine_for, tiny_model_dir):
    planner, searcher = engine_for("Search for the value."), engine_for("The value is 42.")
    mrlx = config("two_models", planner={"url": "self"}, searcher={"url": searcher.url, "trainable": False})
    [samples] = run(planner.url, tiny_model_dir, mrlx)
    assert len(planner.calls) == 2 and len(searcher.calls) == 1
    [p] = [s for s in samples if s.metadata["mrlx"]["agent"] == "planner"]
    assert p.reward == 1.0
    # the planner's second call continues its first conversation: its exact answer, then the report
    one, two = planner.calls
    assert two["input_ids"][: len(one["input_ids"]) + len(one["ids"])] == one["input_ids"] + one["ids"]
    tok = load_tokenizer(str(tiny_model_dir))
    assert "The searcher reports: The value is 42." in tok.decode(two["input_ids"])


def test_per_turn_rewards_become_per_turn_returns(engine_for, tiny_model_dir):
    proxy = engine_for(ANSWER)
    mrlx = config("per_turn")
    mrlx["rewards"] = {"credit": "turn", "gamma": 1.0}
    [samples] = run(proxy.url, tiny_model_dir, mrlx)
    assert [s.metadata["mrlx"]["turn"] for s in samples] == [0, 1]
    # G_1 = -0.25 + outcome 1.0; G_0 = 0.5 + G_1
    assert [s.reward for s in samples] == [pytest.approx(1.25), pytest.approx(0.75)]
    one, two = proxy.calls
    assert samples[1].tokens == two["input_ids"] + two["ids"] and samples[1].loss_mask == [1] * len(
        two["ids"]
    )


def test_agent_code_that_raises_aborts_its_episode_with_the_reason(engine_for, tiny_model_dir):
    proxy = engine_for(ANSWER)
    [samples] = run(proxy.url, tiny_model_dir, config("raises"))
    [s] = samples
    assert s.status == Status.ABORTED and s.remove_sample and sum(s.loss_mask) == 0
    assert "ValueError: the user's code broke" in s.metadata["mrlx"]["abort_reason"]


# --- raw HTTP, as hostile code would send it ------------------------------------------------


def _post(endpoint, body, key=None, raw: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        endpoint.base_url + "/chat/completions",
        data=raw if raw is not None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key or endpoint.api_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def held(engine_for, tiny_model_dir):
    """An episode of the `hold` system running in a thread; yields (endpoint, finish(reward))."""
    proxy = engine_for(CALL, ANSWER)
    out: list = []
    thread = threading.Thread(
        target=lambda: out.append(run(proxy.url, tiny_model_dir, config("hold"), rollout_max_context_len=600))
    )
    thread.start()
    state = wait_until(
        lambda: next((v for v in SEEN.values() if "endpoint" in v and not v.get("taken")), None),
        60,
        what="the held episode's endpoint",
    )
    state["taken"] = True
    loop_done = state["done"]

    def finish(reward: float = 0.0):
        state["reward"] = json.dumps(reward)
        state["loop"].call_soon_threadsafe(loop_done.set)
        thread.join(60)
        return out[0][0]

    yield state["endpoint"], finish, proxy
    if thread.is_alive():
        finish()


USER = [{"role": "user", "content": "What is stored under x7?"}]


def test_hostile_requests_get_a_clear_4xx_and_train_nothing(held):
    endpoint, finish, proxy = held
    status, body = _post(endpoint, {"messages": USER}, key="mrlx-not-a-session")
    assert status == 404 and "no open session" in body["error"]["message"]
    status, body = _post(endpoint, {"messages": USER, "logit_bias": {"1": 5}})
    assert status == 400 and "token ids of the client's tokenizer" in body["error"]["message"]
    status, body = _post(endpoint, {"messages": USER, "best_of": 2})
    assert status == 400 and "best_of" in body["error"]["message"]
    status, body = _post(endpoint, None, raw=b"{not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    forged = USER + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_forged", "content": "x"},
    ]
    status, body = _post(endpoint, {"messages": forged})
    assert status == 400 and "call_forged" in body["error"]["message"]
    assert proxy.calls == []  # none of these reached the engine

    # A real turn, then a tool result too large for the context: refused, the conversation unchanged.
    status, first = _post(endpoint, {"messages": USER, "tools": [_lookup()]})
    assert status == 200, first
    [call] = first["choices"][0]["message"]["tool_calls"]
    history = USER + [first["choices"][0]["message"]]
    huge = history + [{"role": "tool", "tool_call_id": call["id"], "content": "y " * 5000}]
    status, body = _post(endpoint, {"messages": huge, "tools": [_lookup()]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert len(proxy.calls) == 1
    fine = history + [{"role": "tool", "tool_call_id": call["id"], "content": "42"}]
    status, second = _post(endpoint, {"messages": fine, "tools": [_lookup()]})
    assert status == 200 and len(proxy.calls) == 2
    samples = finish(1.0)
    trained = [s for s in samples if not s.remove_sample]
    assert len(trained) == 1  # one conversation; the refused requests opened none
    assert trained[0].tokens == proxy.calls[1]["input_ids"] + proxy.calls[1]["ids"]
    # counted by the session: logit_bias, the unknown field, the forged call id, the huge tool output (an
    # unknown key and a body that is not JSON never reach one)
    assert trained[0].metadata["mrlx"]["episode"]["agent_code"]["solver"]["refused"] == 4


def _lookup():
    from _agent_systems import LOOKUP

    return LOOKUP


def test_a_conversation_past_its_turns_is_refused_before_anything_is_appended(held):
    endpoint, finish, proxy = held
    messages = list(USER)
    for _ in range(3):  # the `hold` system declares turns={"solver": 3}
        status, reply = _post(endpoint, {"messages": messages, "tools": [_lookup()]})
        assert status == 200, reply
        message = reply["choices"][0]["message"]
        messages.append(message)
        if message.get("tool_calls"):
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "42"})
        else:
            messages.append({"role": "user", "content": "Again."})
    status, body = _post(endpoint, {"messages": messages, "tools": [_lookup()]})
    assert status == 429 and "3 turn(s)" in body["error"]["message"]
    [trained] = [s for s in finish(1.0) if not s.remove_sample]
    last = proxy.calls[-1]
    assert len(proxy.calls) == 3 and trained.tokens == last["input_ids"] + last["ids"]


def test_evaluation_shows_the_answer_of_the_agent_that_gave_it(engine_for, tiny_model_dir):
    planner, searcher = engine_for("Search for it. \\boxed{42}"), engine_for("The value is 42.")
    mrlx = config("two_models", planner={"url": "self"}, searcher={"url": searcher.url, "trainable": False})
    [s] = run(planner.url, tiny_model_dir, mrlx, evaluation=True)
    last = planner.calls[-1]
    assert s.metadata["mrlx"]["agent"] == "planner" and s.tokens == last["input_ids"] + last["ids"]
    assert "\\boxed{42}" in s.response and s.reward == 1.0
