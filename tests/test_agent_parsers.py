"""Tool-call and reasoning parsers: what a model's completion text becomes in an OpenAI answer."""

from __future__ import annotations

import json
import re
import sys
import types
from dataclasses import dataclass

import pytest

from mrlx_plugin.agents.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ToolCall,
    hermes,
    parse_turn,
    reasoning_parser,
    render_calls_hermes,
    think,
    tool_parser,
)


def tool(name: str) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": f"the {name} tool", "parameters": {}},
    }


TOOLS = [tool("add"), tool("search")]


def block(obj) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"<tool_call>\n{body}\n</tool_call>"


# --- hermes -------------------------------------------------------------------------------------


def test_several_calls_in_one_turn_around_text_keep_their_order():
    text = (
        "Let me compute both.\n"
        + block({"name": "add", "arguments": {"a": 1, "b": 2}})
        + "\n"
        + block({"name": "search", "arguments": {"q": "x"}})
        + "\nThen I answer."
    )
    content, calls, malformed = hermes(text, TOOLS)
    assert calls == [("add", '{"a": 1, "b": 2}'), ("search", '{"q": "x"}')]
    assert content == "Let me compute both.\nThen I answer."
    assert malformed == 0


def test_blocks_need_no_newlines_and_removal_leaves_at_most_one_blank_line():
    call = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert hermes(f"Sum {call} done", TOOLS)[0] == "Sum done"
    assert hermes(f"Sum{call}done", TOOLS)[0] == "Sumdone"
    assert hermes(f"A\n\n\n{call}\n\n{call}\n\n\nB", TOOLS)[0] == "A\n\nB"
    assert hermes(f"  {call}  ", TOOLS) == ("", [("add", "{}")], 0)


def test_malformed_json_stays_verbatim_and_the_good_call_beside_it_is_parsed():
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'  # one brace short
    text = f"First.\n{bad}\n" + block({"name": "search", "arguments": {"q": "y"}}) + "\nLast."
    content, calls, malformed = hermes(text, TOOLS)
    assert calls == [("search", '{"q": "y"}')]
    assert content == f"First.\n{bad}\nLast."
    assert malformed == 1


@pytest.mark.parametrize(
    "body",
    [
        {"name": "delete_everything", "arguments": {}},  # not one of the request's tools
        ["add", {"a": 1}],  # not an object
        {"arguments": {"a": 1}},  # no name
        {"name": 7, "arguments": {}},  # name not a string
        {"name": "add", "arguments": [1, 2]},  # arguments not an object
        {"name": "add", "arguments": "[1, 2]"},  # a JSON string holding a non-object
        {"name": "add", "arguments": "not json"},
        {"name": "add", "arguments": None},
    ],
)
def test_a_block_that_is_not_a_call_of_a_known_tool_stays_as_text(body):
    text = "Before " + block(body)
    content, calls, malformed = hermes(text, TOOLS)
    assert (content, calls, malformed) == (text, [], 1)


def test_an_unclosed_block_cut_at_the_token_cap_stays_as_text():
    done = block({"name": "add", "arguments": {"a": 1}})
    cut = '<tool_call>\n{"name": "search", "argum'
    content, calls, malformed = hermes(f"{done}\nand {cut}", TOOLS)
    assert calls == [("add", '{"a": 1}')]
    assert content == f"and {cut}"
    assert malformed == 1
    assert hermes(cut, TOOLS) == (cut, [], 1)


def test_arguments_as_a_json_string_are_read_and_missing_ones_are_empty():
    quoted = {"name": "add", "arguments": json.dumps({"a": 1, "b": [2, 3]})}
    _, calls, malformed = hermes(block(quoted) + block({"name": "search"}), TOOLS)
    assert calls == [("add", '{"a": 1, "b": [2, 3]}'), ("search", "{}")]
    assert malformed == 0


def test_unicode_is_kept_as_is_in_arguments_and_content():
    text = "Météo à 東京 🌧\n" + block({"name": "search", "arguments": {"q": "東京の天気"}})
    content, calls, _ = hermes(text, TOOLS)
    assert content == "Météo à 東京 🌧"
    assert calls == [("search", '{"q": "東京の天気"}')]
    assert json.loads(calls[0][1]) == {"q": "東京の天気"}


def test_special_token_looking_text_and_stray_closing_tags_stay_content():
    text = "I will end here <|im_end|> </tool_call> <|endoftext|> </think>"
    assert hermes(text, TOOLS) == (text, [], 0)


def test_without_tools_nothing_is_parsed():
    text = block({"name": "add", "arguments": {}})
    assert hermes(text, None) == (text, [], 0)
    assert hermes(text, []) == (text, [], 0)


# --- think --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\nStep 1.\n</think>\n\nThe answer is 4.", ("Step 1.", "The answer is 4.")),
        (
            "Step 1 (the template opened the think).\n</think>\n\n4",
            ("Step 1 (the template opened the think).", "4"),
        ),
        ("<think>\nStep 1, still going", ("Step 1, still going", "")),
        ("Just an answer.", (None, "Just an answer.")),
        ("<think>a</think>b</think>c", ("a", "b</think>c")),
        ("<think>a<think>b</think>c", ("a<think>b", "c")),
        ("a</think>b<think>c", ("a", "b<think>c")),
        ("<think>\n\n</think>\n\nHi", ("", "Hi")),
    ],
)
def test_think_splits_reasoning_from_the_rest(text, expected):
    assert think(text) == expected


# --- parse_turn ---------------------------------------------------------------------------------


def test_parse_turn_splits_reasoning_first_and_parses_calls_in_the_rest_only():
    inner = block({"name": "search", "arguments": {"q": "draft"}})  # a call thought about, not made
    text = f"<think>Maybe {inner}</think>\nOK.\n" + block({"name": "add", "arguments": {"a": 2}})
    turn = parse_turn(text, TOOLS, hermes, think)
    assert turn.reasoning == f"Maybe {inner}"
    assert turn.content == "OK."
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("add", '{"a": 2}')]
    assert turn.malformed == 0


def test_parse_turn_with_no_tools_or_no_tool_parser_parses_no_calls():
    text = "Hi " + block({"name": "add", "arguments": {}})
    for tools, parser in ((None, hermes), ([], hermes), (TOOLS, None)):
        turn = parse_turn(text, tools, parser, None)
        assert (turn.content, turn.reasoning, turn.tool_calls, turn.malformed) == (text, None, (), 0)


def test_parse_turn_empty_parts_are_none():
    turn = parse_turn("<think>\n\n</think>\n" + block({"name": "add"}), TOOLS, hermes, think)
    assert turn.content is None and turn.reasoning is None
    assert turn.tool_calls[0].arguments == "{}"


def test_call_ids_are_fresh_and_of_the_openai_shape():
    text = "".join(block({"name": "add", "arguments": {"i": i}}) for i in range(20))
    ids = [c.id for _ in range(5) for c in parse_turn(text, TOOLS, hermes, None).tool_calls]
    assert len(ids) == 100 and len(set(ids)) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_parse_turn_rejects_what_a_systems_own_parser_lets_through():
    def loose(text, tools):
        return "said", [("add", '"{\\"a\\": 1}"'), ("rm", "{}"), ("search", "[1]"), ("search", "{")], 0

    turn = parse_turn("whatever", TOOLS, loose, None)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("add", '{"a": 1}')]
    assert turn.malformed == 3
    assert turn.content.splitlines() == [
        "said",
        '{"name": "rm", "arguments": {}}',
        '{"name": "search", "arguments": [1]}',
        '{"name": "search", "arguments": {}',
    ]


# --- lookup -------------------------------------------------------------------------------------


def test_built_in_names():
    assert tool_parser("hermes") is hermes and tool_parser("none")("x", TOOLS) == ("x", [], 0)
    assert reasoning_parser("think") is think and reasoning_parser("none")("<think>a</think>") == (
        None,
        "<think>a</think>",
    )
    assert reasoning_parser(None) is None
    assert set(TOOL_PARSERS) == {"hermes", "none"} and set(REASONING_PARSERS) == {"think", "none"}


def test_an_unknown_name_lists_the_known_ones_including_the_systems_own():
    mine = {"mine": hermes}
    with pytest.raises(ValueError) as err:
        tool_parser("qwen", mine)
    message = str(err.value)
    assert "unknown tool parser 'qwen'" in message
    assert (
        "'hermes'" in message and "'none'" in message and "'mine'" in message and "sglang:<name>" in message
    )
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'r1'; known: 'none', 'think'"):
        reasoning_parser("r1")


def test_a_systems_own_parsers_extend_and_override_the_built_ins():
    def mine(text, tools):
        return "", [("add", "{}")], 0

    def mine_think(text):
        return "all", ""

    assert tool_parser("hermes", {"hermes": mine}) is mine
    assert tool_parser("mine", {"mine": mine}) is mine
    assert tool_parser("hermes", {"mine": mine}) is hermes
    assert reasoning_parser("think", {"think": mine_think}) is mine_think
    assert TOOL_PARSERS["hermes"] is hermes  # the built-in table is not changed


def test_render_calls_hermes_is_read_back_by_hermes():
    calls = [ToolCall("call_1", "add", '{"a": 1}'), ToolCall("call_2", "search", '{"q": "東京"}')]
    text = render_calls_hermes(calls)
    assert text.startswith('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>')
    assert hermes(text, TOOLS) == ("", [("add", '{"a": 1}'), ("search", '{"q": "東京"}')], 0)
    openai_form = [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    assert render_calls_hermes(openai_form) == render_calls_hermes(calls[:1])


# --- SGLang's parsers ---------------------------------------------------------------------------
# A stand-in `sglang` shaped like SGLang's own modules (constructor keywords, method names, return
# shapes), read from github.com/sgl-project/sglang:
#   python/sglang/srt/function_call/function_call_parser.py  FunctionCallParser(tools, tool_call_parser,
#       tokenizer=None), ToolCallParserEnum, parse_non_stream(full_text) -> (normal_text, [ToolCallItem])
#   python/sglang/srt/function_call/core_types.py             ToolCallItem(tool_index, name, parameters)
#   python/sglang/srt/entrypoints/openai/protocol.py          Function(description, name, parameters),
#       Tool(type, function)
#   python/sglang/srt/parser/reasoning_parser.py              ReasoningParser(model_type, stream_reasoning,
#       ...), DetectorMap, parse_non_stream(full_text) -> (reasoning_text, normal_text), "" when absent
# Its detector passes through every call it finds (names and parameters unchecked) so that the
# adapter's own checks are what the tests see.


@dataclass(kw_only=True)
class Function:
    description: str | None = None
    name: str
    parameters: object | None = None
    strict: bool = False


@dataclass(kw_only=True)
class Tool:
    type: str = "function"
    function: Function


@dataclass(kw_only=True)
class ToolCallItem:
    tool_index: int
    name: str | None = None
    parameters: str


class FunctionCallParser:
    ToolCallParserEnum = {"qwen25": object, "qwen": object, "llama3": object}
    made: list = []

    def __init__(self, tools: list, tool_call_parser: str, tokenizer=None):
        if tool_call_parser not in self.ToolCallParserEnum:
            raise ValueError(f"Unsupported tool_call_parser: {tool_call_parser}")
        assert all(isinstance(t, Tool) and isinstance(t.function, Function) for t in tools)
        self.tools = tools
        FunctionCallParser.made.append(self)

    def parse_non_stream(self, full_text: str) -> tuple[str, list]:
        if not self.tools:
            return full_text, []
        if "RAISE" in full_text:
            raise json.JSONDecodeError("Expecting value", full_text, 0)
        found = re.findall(r"<tool_call>(.*?)</tool_call>", full_text, re.DOTALL)
        if not found:
            return full_text, []
        calls = []
        for body in found:
            obj = json.loads(body)
            arguments = json.dumps(obj.get("arguments", {}), ensure_ascii=False)
            calls.append(ToolCallItem(tool_index=0, name=obj["name"], parameters=arguments))
        return full_text[: full_text.find("<tool_call>")], calls


class ReasoningParser:
    DetectorMap = {"qwen3": object, "deepseek-r1": object}
    made: list = []

    def __init__(
        self, model_type=None, stream_reasoning=True, force_reasoning=None, request=None, tokenizer=None
    ):
        if not model_type or model_type.lower() not in self.DetectorMap:
            raise ValueError(f"Unsupported model type: {model_type}")
        self.kwargs = {"model_type": model_type, "stream_reasoning": stream_reasoning}
        ReasoningParser.made.append(self)

    def parse_non_stream(self, full_text: str) -> tuple[str | None, str | None]:
        forced = self.kwargs["model_type"] == "deepseek-r1"
        if not forced and "<think>" not in full_text:
            return "", full_text
        body = full_text.removeprefix("<think>")
        if "</think>" not in body:
            return body, ""
        reasoning, _, normal = body.partition("</think>")
        return reasoning, normal


def install_sglang(monkeypatch, old_layout: bool = False) -> None:
    FunctionCallParser.made, ReasoningParser.made = [], []
    modules = {
        "sglang.srt.function_call_parser"
        if old_layout
        else "sglang.srt.function_call.function_call_parser": {"FunctionCallParser": FunctionCallParser},
        "sglang.srt.openai_api.protocol" if old_layout else "sglang.srt.entrypoints.openai.protocol": {
            "Tool": Tool,
            "Function": Function,
        },
        "sglang.srt.reasoning_parser" if old_layout else "sglang.srt.parser.reasoning_parser": {
            "ReasoningParser": ReasoningParser
        },
    }
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)


def test_without_sglang_the_sglang_names_say_what_to_use_instead(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` fails here even where it is installed
    with pytest.raises(ValueError) as err:
        tool_parser("sglang:qwen25")
    assert str(err.value).startswith(
        "tool parser 'sglang:qwen25' needs SGLang's parsers (`import sglang` failed: "
    )
    assert str(err.value).endswith("); use 'hermes' or install sglang")
    with pytest.raises(
        ValueError, match=r"reasoning parser 'sglang:qwen3' needs .*use 'think' or install sglang"
    ):
        reasoning_parser("sglang:qwen3")


def test_sglang_tool_parser_keeps_the_calls_of_known_tools_with_object_arguments(monkeypatch):
    install_sglang(monkeypatch)
    parse = tool_parser("sglang:qwen25")
    text = (
        "Checking.\n"
        + block({"name": "add", "arguments": {"a": 1}})
        + block({"name": "rm", "arguments": {}})
        + block({"name": "search", "arguments": [1]})
        + block({"name": "search", "arguments": {"q": "東京"}})
    )
    content, calls, malformed = parse(text, TOOLS)
    assert calls == [("add", '{"a": 1}'), ("search", '{"q": "東京"}')]
    assert malformed == 2
    assert content.splitlines() == [
        "Checking.",
        '{"name": "rm", "arguments": {}}',
        '{"name": "search", "arguments": [1]}',
    ]
    (made,) = FunctionCallParser.made
    assert [(t.type, t.function.name, t.function.description) for t in made.tools] == [
        ("function", "add", "the add tool"),
        ("function", "search", "the search tool"),
    ]
    turn = parse_turn(text, TOOLS, parse, None)
    assert [c.name for c in turn.tool_calls] == ["add", "search"] and turn.malformed == 2


def test_sglang_tool_parser_edge_cases(monkeypatch):
    install_sglang(monkeypatch)
    parse = tool_parser("sglang:qwen")
    assert parse("plain", TOOLS) == ("plain", [], 0)
    assert parse(block({"name": "add"}), None) == (block({"name": "add"}), [], 0)
    assert parse("RAISE " + block({"name": "add"}), TOOLS) == ("RAISE " + block({"name": "add"}), [], 1)
    with pytest.raises(
        ValueError, match=r"SGLang has no tool parser 'hermes2'; its tool parsers: llama3, qwen, qwen25"
    ):
        tool_parser("sglang:hermes2")
    with pytest.raises(
        ValueError, match=r"SGLang has no tool parser 'Qwen25'"
    ):  # SGLang matches these exactly
        tool_parser("sglang:Qwen25")


def test_sglang_reasoning_parser(monkeypatch):
    install_sglang(monkeypatch)
    qwen3 = reasoning_parser("sglang:qwen3")
    assert qwen3("<think>a</think>b") == ("a", "b")
    assert qwen3("no thinking") == (None, "no thinking")
    assert reasoning_parser("sglang:deepseek-r1")("a</think>b") == ("a", "b")
    assert reasoning_parser("sglang:Qwen3")("<think>a</think>b") == ("a", "b")  # SGLang lower-cases these
    assert all(p.kwargs["stream_reasoning"] is False for p in ReasoningParser.made)
    with pytest.raises(
        ValueError, match=r"SGLang has no reasoning parser 'r2'; its reasoning parsers: deepseek-r1, qwen3"
    ):
        reasoning_parser("sglang:r2")


def test_sglang_older_module_layout(monkeypatch):
    install_sglang(monkeypatch, old_layout=True)
    assert tool_parser("sglang:qwen25")(block({"name": "add"}), TOOLS) == ("", [("add", "{}")], 0)
    assert reasoning_parser("sglang:qwen3")("<think>a</think>b") == ("a", "b")
