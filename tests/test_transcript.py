"""Transcripts: each agent's own token-space view, the loss mask and log-probs aligned to it."""

from __future__ import annotations

import pytest

from mrlx_plugin.core.host import Sample, Status
from mrlx_plugin.core.tokenizer import load_tokenizer
from mrlx_plugin.core.transcript import Transcript, Turn, strip_reasoning


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(str(tiny_tokenizer_dir))


def turn(tok, text: str, end: bool = True, agent: str = "a") -> Turn:
    ids = tok.encode(text) + ([tok.eos_token_id] if end else [])
    return Turn(agent, ids, [-0.25] * len(ids), text, "stop" if end else "length", "7")


def test_prompt_is_the_agents_template(tok):
    msgs = [{"role": "system", "content": "You check answers."}, {"role": "user", "content": "Is 2+2=4?"}]
    t = Transcript.start("a", tok, msgs)
    text = tok.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert list(t.prompt_ids) == tok.encode(text)
    assert t.tokens == list(t.prompt_ids) and t.response_ids == []


def test_generated_ids_are_kept_exactly_with_their_logprobs(tok):
    t = Transcript.start("a", tok, [{"role": "user", "content": "hi"}])
    first = turn(tok, "Hello there")
    t.append_generated(first)
    assert t.tokens == list(t.prompt_ids) + first.token_ids
    assert t.loss_mask == [1] * len(first.token_ids)
    assert t.logprobs == first.logprobs
    assert t.weight_versions == ["7"]


def test_context_messages_are_masked_and_the_conversation_stays_well_formed(tok):
    msgs = [{"role": "user", "content": "What is 3+4?"}]
    t = Transcript.start("a", tok, msgs)
    reply = turn(tok, "It is 7.")
    t.append_generated(reply)
    assert t.append_messages([{"role": "user", "content": "Are you sure?"}])
    n_context = len(t.response_ids) - len(reply.token_ids)
    assert n_context > 0
    assert t.loss_mask == [1] * len(reply.token_ids) + [0] * n_context
    assert t.logprobs[len(reply.token_ids) :] == [0.0] * n_context
    full = msgs + [{"role": "assistant", "content": "It is 7."}, {"role": "user", "content": "Are you sure?"}]
    expected = tok.hf.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
    assert tok.decode(t.tokens, skip_special_tokens=False) == expected


def test_a_turn_cut_at_its_cap_gets_its_end_marker_before_the_next_message(tok):
    t = Transcript.start("a", tok, [{"role": "user", "content": "Count."}])
    t.append_generated(turn(tok, "1 2 3", end=False))
    assert t.truncated
    t.append_messages([{"role": "user", "content": "go on"}])
    text = tok.decode(t.tokens, skip_special_tokens=False)
    assert "1 2 3<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n" in text


def test_context_limit_cuts_and_marks_truncated(tok):
    t = Transcript.start("a", tok, [{"role": "user", "content": "x"}], max_context=40)
    room = t.room()
    assert room == 40 - len(t.prompt_ids)
    fits = t.append_messages([{"role": "user", "content": "a long message " * 20}])
    assert not fits and t.truncated
    assert len(t.tokens) == 40 and t.room() == 0


def test_to_sample_follows_the_host_contract(tok):
    template = Sample(group_index=3, index=17, prompt="p", label="7")
    t = Transcript.start("solver", tok, [{"role": "user", "content": "3+4?"}])
    t.append_generated(turn(tok, "7", agent="solver"))
    t.reward = 1.2
    s = t.to_sample(template, 17, aborted=False, meta={"agent": "solver"})
    assert s.tokens == list(t.prompt_ids) + t.response_ids
    assert s.response_length == len(t.response_ids) == len(s.loss_mask) == len(s.rollout_log_probs)
    assert (s.group_index, s.index, s.rollout_id, s.label) == (3, 17, 17, "7")
    assert s.status == Status.COMPLETED and s.reward == 1.2 and s.metadata["mrlx"]["agent"] == "solver"
    assert template.metadata == {}  # the input sample is not changed


def test_aborted_and_empty_samples_follow_the_failed_sample_pattern(tok):
    template = Sample(group_index=0, index=1)
    t = Transcript.start("solver", tok, [{"role": "user", "content": "q"}])
    t.append_generated(turn(tok, "partial"))
    s = t.to_sample(template, 1, aborted=True, meta={})
    assert s.status == Status.ABORTED and s.reward == 0.0 and s.remove_sample
    assert set(s.loss_mask) == {0} and set(s.rollout_log_probs) == {0.0}
    empty = Transcript.start("solver", tok, [{"role": "user", "content": "q"}]).to_sample(
        template, 1, aborted=True, meta={}
    )
    assert empty.response_length == 1 and empty.loss_mask == [0]  # never a zero-length response


def test_strip_reasoning():
    assert strip_reasoning("<think>hmm</think>  The answer is 4.") == "The answer is 4."
    assert strip_reasoning("plain") == "plain"
