"""The research pair (`mrlx_lab/examples/research_pair`): its corpus, search and warm-start data, then
`mrlx demo --research`, shortened: two models behind the coordinator, as agent code with a tool."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _demo import REPO

from mrlx_lab.examples.research_pair import corpus
from mrlx_plugin.local.model import load_tokenizer

SHORT = [
    "--preset",
    "tiny",
    "--steps",
    "2",
    "--prompts-per-step",
    "2",
    "--samples-per-prompt",
    "4",
    "--eval-prompts",
    "4",
    "--eval-interval",
    "2",
    # Enough for the tiny searcher to write well-formed calls (the tool's output is then in its samples).
    "--warmup-steps",
    "1000",
    "--warmup-lr",
    "1e-2",
    "--save-samples",
    "--quiet",
]


def _spans(sample: dict, tok) -> tuple[str, str]:
    """The text of a sample's response tokens that are trained (loss mask 1), and of those that are not."""
    response = sample["tokens"][len(sample["tokens"]) - sample["response_length"] :]
    assert len(response) == len(sample["loss_mask"])
    trained = [t for t, m in zip(response, sample["loss_mask"]) if m]
    context = [t for t, m in zip(response, sample["loss_mask"]) if not m]
    return tok.decode(trained), tok.decode(context)


def test_held_out_facts_are_searchable_only_in_evaluation_and_never_asked_in_training():
    train = corpus.questions(2 * corpus.N_TRAIN, seed=1)
    held_out = corpus.questions(16, seed=1, split=corpus.HELD_OUT)
    assert train == corpus.questions(2 * corpus.N_TRAIN, seed=1)
    asked_in_training = {q for q, _ in train}
    assert len(asked_in_training) == len(corpus.SPLITS[corpus.TRAIN])
    assert not asked_in_training & {q for q, _ in held_out}
    training_docs = corpus.documents(corpus.TRAIN)
    for question, capital in held_out:
        country = question.removeprefix("What is the capital of ").removesuffix("?")
        assert corpus.search(country, training_docs) == corpus.NO_RESULTS
        assert corpus.search(country, corpus.documents(corpus.HELD_OUT)) == corpus.document(country, capital)
    assert corpus.search_query('{"query": "  "}') is None and corpus.search_query("[1]") is None
    assert corpus.search_query('{"query": "Varo"}') == "Varo"


def test_the_warm_start_holds_no_true_fact_and_the_searcher_searches_half_the_time(tmp_path):
    rows = {
        agent: [
            json.loads(line)["messages"]
            for line in corpus.warmup_examples(tmp_path / f"{agent}.jsonl", 400, 0, agent, "TOOLS").open()
        ]
        for agent in ("planner", "searcher")
    }
    for messages in rows["planner"] + rows["searcher"]:
        text = " ".join(m["content"] for m in messages)
        words = set(text.replace("{", " ").replace("}", " ").replace(".", " ").replace("?", " ").split())
        assert not any(country in words and capital in words for country, capital in corpus.FACTS.items())
    firsts = [m[2]["content"] for m in rows["searcher"]]
    searches = [f for f in firsts if f.startswith("<tool_call>")]
    assert len(searches) == 300 and len(firsts) - len(searches) == 100  # a guess in one row in four
    for m in rows["searcher"]:
        if m[2]["content"].startswith("<tool_call>"):  # the delegation's country is searched
            body = json.loads(m[2]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
            assert body["name"] == "search" and body["arguments"]["query"] in m[1]["content"]
    for m in rows["planner"]:  # the delegation names the asked country; the answer repeats the report
        assert m[0]["content"].removeprefix("What is the capital of ").removesuffix("?") in m[1]["content"]
        if len(m) > 2:
            assert m[3]["content"] == "\\boxed{" + m[2]["content"].removeprefix("Searcher: ") + "}"


@pytest.mark.slow  # the whole two-model loop, with warm-starts long enough for tool calls
def test_short_research_demo_trains_both_models_and_masks_the_tool_output(tmp_path):
    out = tmp_path / "research"
    run = subprocess.run(
        [sys.executable, "-m", "mrlx_lab.demos.research", "--out", str(out), *SHORT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "mrlx demo --research finished" in run.stdout and "held-out (4), before RL" in run.stdout

    report = json.loads((out / "metrics.json").read_text())
    p_rows = [r for r in report["metrics"]["planner"] if r["step"] >= 0]
    s_rows = [r for r in report["metrics"]["searcher"] if r["step"] >= 0]
    assert [r["step"] for r in p_rows] == [0, 1] and [r["step"] for r in s_rows] == [0, 1]
    # the planner's job ran every episode and sent the searcher's samples through the coordinator
    assert all(r["coordinator/samples_sent"] == 8 and r["coordinator/groups_sent"] == 2 for r in p_rows)
    assert all(r["coordinator/groups"] == 2 and r["samples"] == 8 for r in s_rows)
    # both engines took each step's new weights
    for rows in (p_rows, s_rows):
        assert [r["engine/weight_versions"] for r in rows] == [["1"], ["2"]]
    for name in ("planner", "searcher"):
        warm = [r for r in report["metrics"][name] if r["step"] == -1 and "warm_start/steps" in r]
        assert warm and warm[0]["warm_start/steps"] == 1000
    summary = report["summary"]
    assert summary["held_out"]["before"]["step"] == 0 and summary["held_out"]["after"]["step"] == 2
    assert summary["agents"]["searcher"]["samples_trained"] == 16
    assert (out / "rewards.png").read_bytes()[:4] == b"\x89PNG"

    # Each trainer trained its own agent's samples only, and the searcher's hold the tool's output
    # as context: its tokens are never trained on, the searcher's own call and report are.
    samples = {
        name: [json.loads(line) for line in (out / name / "samples.jsonl").read_text().splitlines()]
        for name in ("planner", "searcher")
    }
    for name, rows in samples.items():
        assert len(rows) == 16 and {r["metadata"]["mrlx"]["agent"] for r in rows} == {name}
    tok = load_tokenizer(out / "models" / "searcher")
    searched = 0
    for s in samples["searcher"]:
        trained, context = _spans(s, tok)
        if "<|im_start|>tool" in context:
            searched += 1
            result = context.split("<|im_start|>tool\n", 1)[1].split("<|im_end|>", 1)[0]
            assert result.startswith(("The capital of", "No results.")), context
            assert "<tool_call>" in trained and result not in trained
        assert "<|im_start|>tool" not in trained
    assert searched >= 1, "no well-formed search call in the short run: the warm-start is too short"
