"""Tool-call and reasoning parsers: a model's completion text -> content, reasoning and tool calls.

An agent's endpoint answers in OpenAI's format, so the text its model wrote has to be split into
`content`, the reasoning (`reasoning_content`) and `tool_calls`. These are pure functions of the
text (and the request's `tools`); `parse_turn` runs them and gives each call a fresh id.

Built in:
- tool parser `hermes`: the Qwen2.5 / Qwen3 / NousHermes form, any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text;
- tool parser `none`: never parses a call (everything stays content);
- reasoning parser `think`: `<think>...</think>`, also a completion that starts inside the
  reasoning because the chat template put `<think>` in the prompt (then: the text before the
  first `</think>`); reasoning parser `none` finds no reasoning.

SGLang's own parsers are used by naming `sglang:<name>`: a tool parser such as `sglang:qwen25`
(any `--tool-call-parser` name of SGLang) and a reasoning parser such as `sglang:qwen3` or
`sglang:deepseek-r1` (any `--reasoning-parser` name). SGLang is in the slime and Miles images; it
cannot be installed on a CPU-only machine, which is why `hermes` and `think` are written here.

A call is kept only when it names one of the request's tools and its arguments are a JSON object
(or a JSON string holding one); any other block stays in `content` as text and is counted in
`ParsedTurn.malformed`.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar, cast

from mrlx_plugin.core.values import JSON, JSONObject


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 hex digits, made by parse_turn
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ParsedTurn:
    content: str | None  # the text outside reasoning and tool calls (None when empty)
    reasoning: str | None  # the reasoning text (None when there is none or no reasoning parser)
    tool_calls: tuple[ToolCall, ...]
    malformed: int  # tool-call blocks that could not be parsed: left in `content` as text


# (text, tools) -> (content text, [(name, arguments JSON text)], malformed count); the tools are the
# request's, in OpenAI's format ({"type": "function", "function": {"name": ..., "parameters": ...}}).
ToolParser = Callable[[str, list[JSONObject] | None], tuple[str, list[tuple[str, str]], int]]
# text -> (reasoning or None, the rest)
ReasoningParser = Callable[[str], tuple[str | None, str]]

P = TypeVar("P")  # a parser's type

_NO_TOOL_PARSERS: Mapping[str, ToolParser] = MappingProxyType({})
_NO_REASONING_PARSERS: Mapping[str, ReasoningParser] = MappingProxyType({})
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_THINK, _END_THINK = "<think>", "</think>"


def _tool_specs(tools: Iterable[JSON] | None) -> list[JSONObject]:
    """The function specs of OpenAI-format tools ({"type": "function", "function": {"name": ...}}),
    each with a string `name`."""
    specs = []
    for tool in tools or ():
        if isinstance(tool, dict):
            function = tool.get("function")
            spec = function if isinstance(function, dict) else tool
            if isinstance(spec.get("name"), str):
                specs.append(spec)
    return specs


def _tool_names(tools: Iterable[JSON] | None) -> set[str]:
    return {cast(str, spec["name"]) for spec in _tool_specs(tools)}


def _arguments(value: object) -> str | None:
    """The JSON text of an arguments object, or None. A string is read as JSON text, and JSON text
    of a string holding an object counts too (some models quote the arguments)."""
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call_text(name: object, arguments: object) -> str:
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}'


def _screen(
    content: str, found: Iterable[tuple[object, object]], names: set[str]
) -> tuple[str, list[tuple[str, str]], int]:
    """Keep the calls of known tools whose arguments are a JSON object. The others are shown in the
    content as text (parsers other than hermes do not hand back a call's source text)."""
    kept: list[tuple[str, str]] = []
    dropped: list[str] = []
    for name, raw in found:
        arguments = _arguments(raw) if name in names else None
        if arguments is None:
            dropped.append(_call_text(name, raw))
        else:
            kept.append((cast(str, name), arguments))  # one of `names`
    return "\n".join([content.strip(), *dropped]).strip(), kept, len(dropped)


def _join(left: str, right: str) -> str:
    """Join the text around a removed block: at most one blank line, else a space, where there was any."""
    lhs, rhs = left.rstrip(), right.lstrip()
    gap_left, gap_right = left[len(lhs) :], right[: len(right) - len(rhs)]
    newlines = min(max(gap_left.count("\n"), gap_right.count("\n")), 2)
    return lhs + ("\n" * newlines or (" " if gap_left or gap_right else "")) + rhs


def _hermes_call(body: str, names: set[str]) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)  # surrounding whitespace is allowed by JSON itself
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    arguments = _arguments(obj.get("arguments", {}))
    return None if arguments is None else (obj["name"], arguments)


def hermes(text: str, tools: list[JSONObject] | None) -> tuple[str, list[tuple[str, str]], int]:
    """Qwen2.5 / Qwen3 / NousHermes `<tool_call>{json}</tool_call>` blocks, anywhere in the text."""
    names = _tool_names(tools)
    if not names:
        return text, [], 0
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    malformed, pos, end = 0, 0, 0
    for match in _BLOCK.finditer(text):
        end = match.end()
        call = _hermes_call(match.group(1), names)
        if call is None:
            malformed += 1  # left in place: it is part of the next kept segment
            continue
        calls.append(call)
        kept.append(text[pos : match.start()])
        pos = end
    # An opening tag with no close after the last block: the turn was cut at its token cap.
    malformed += text[end:].count("<tool_call>")
    return functools.reduce(_join, [*kept, text[pos:]]).strip(), calls, malformed


def no_tools(text: str, tools: list[JSONObject] | None) -> tuple[str, list[tuple[str, str]], int]:
    return text, [], 0


def think(text: str) -> tuple[str | None, str]:
    """`<think>reasoning</think>rest`; with no `<think>` before the first `</think>`, the template
    opened the reasoning in the prompt; with `<think>` but no close, the turn was cut inside it.
    Both parts are stripped; text before a `<think>` joins the rest."""
    start, close = text.find(_THINK), text.find(_END_THINK)
    if close < 0:
        if start < 0:
            return None, text
        return text[start + len(_THINK) :].strip(), text[:start].strip()
    after = text[close + len(_END_THINK) :]
    if 0 <= start < close:
        return text[start + len(_THINK) : close].strip(), (text[:start] + after).strip()
    return text[:close].strip(), after.strip()


def no_reasoning(text: str) -> tuple[str | None, str]:
    return None, text


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": hermes, "none": no_tools}
REASONING_PARSERS: dict[str, ReasoningParser] = {"think": think, "none": no_reasoning}


def _sglang(kind: str, name: str, fallback: str, paths: tuple[str, ...], cls: str, table: str = "") -> Any:
    """SGLang's parser class `cls` from the first of `paths` that imports (SGLang has moved them),
    after checking that `name` is one of its parsers (the table `table` of the class). Any: SGLang's
    class, found by name (no SGLang here to check its use against)."""
    errors = []
    for path in paths:
        try:
            found = getattr(importlib.import_module(path), cls)
            break
        # sglang can fail at import time in ways other than ImportError (a missing CUDA library).
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    else:
        raise ValueError(
            f"{kind} parser 'sglang:{name}' needs SGLang's parsers (`import sglang` failed: {errors[0]}); "
            f"use {fallback!r} or install sglang"
        )
    known = getattr(found, table, None) if table else None
    if known is not None and name not in known:
        raise ValueError(
            f"SGLang has no {kind} parser {name!r}; its {kind} parsers: {', '.join(sorted(known))}"
        )
    return found


def _sglang_tool_parser(name: str) -> ToolParser:
    paths = ("sglang.srt.function_call.function_call_parser", "sglang.srt.function_call_parser")
    parser_class = _sglang("tool", name, "hermes", paths, "FunctionCallParser", "ToolCallParserEnum")
    paths = ("sglang.srt.entrypoints.openai.protocol", "sglang.srt.openai_api.protocol")
    tool_class = _sglang("tool", name, "hermes", paths, "Tool")
    function_class = _sglang("tool", name, "hermes", paths, "Function")

    def parse(text: str, tools: list[JSONObject] | None) -> tuple[str, list[tuple[str, str]], int]:
        specs = _tool_specs(tools)
        if not specs:
            return text, [], 0
        fields = ("name", "description", "parameters")
        objects = [
            tool_class(type="function", function=function_class(**{k: s.get(k) for k in fields}))
            for s in specs
        ]
        try:
            normal, items = parser_class(tools=objects, tool_call_parser=name).parse_non_stream(text)
        # A detector that raises on odd model output must not end the episode: the text stays content.
        except Exception:
            return text, [], 1
        return _screen(normal, [(item.name, item.parameters) for item in items], _tool_names(specs))

    return parse


def _sglang_reasoning_parser(name: str) -> ReasoningParser:
    paths = ("sglang.srt.parser.reasoning_parser", "sglang.srt.reasoning_parser")
    # SGLang looks its reasoning parsers up in lower case (its tool parsers: as written).
    parser_class = _sglang("reasoning", name.lower(), "think", paths, "ReasoningParser", "DetectorMap")

    def parse(text: str) -> tuple[str | None, str]:
        # A fresh parser per turn: SGLang's detectors keep streaming state.
        reasoning, rest = parser_class(model_type=name, stream_reasoning=False).parse_non_stream(text)
        return (reasoning or None), (rest or "")

    return parse


def _lookup(kind: str, name: str, extra: Mapping[str, P], builtin: Mapping[str, P]) -> P:
    if name in extra:
        return extra[name]
    if name in builtin:
        return builtin[name]
    known = ", ".join(repr(n) for n in sorted({*extra, *builtin}))
    raise ValueError(
        f"unknown {kind} parser {name!r}; known: {known}, or 'sglang:<name>' for one of SGLang's parsers"
    )


def tool_parser(name: str, extra: Mapping[str, ToolParser] = _NO_TOOL_PARSERS) -> ToolParser:
    """The tool parser called `name`: 'sglang:<name>', one of `extra` (a system's own) or built in."""
    if name.startswith("sglang:") and name not in extra:
        return _sglang_tool_parser(name.removeprefix("sglang:"))
    return _lookup("tool", name, extra, TOOL_PARSERS)


def reasoning_parser(
    name: str | None, extra: Mapping[str, ReasoningParser] = _NO_REASONING_PARSERS
) -> ReasoningParser | None:
    """The reasoning parser called `name` (None: reasoning is not split off), looked up as tool_parser."""
    if name is None:
        return None
    if name.startswith("sglang:") and name not in extra:
        return _sglang_reasoning_parser(name.removeprefix("sglang:"))
    return _lookup("reasoning", name, extra, REASONING_PARSERS)


def parse_turn(
    text: str,
    tools: list[JSONObject] | None,
    tools_parser: ToolParser | None,
    reasoning: ReasoningParser | None,
) -> ParsedTurn:
    """Split one completion: reasoning first, then tool calls in the rest. A call that names no tool
    of `tools` or whose arguments are not a JSON object is malformed and shown in `content`."""
    thought, rest = reasoning(text) if reasoning is not None else (None, text)
    found: list[tuple[str, str]] = []
    malformed, names = 0, _tool_names(tools)
    if names and tools_parser is not None:
        rest, found, malformed = tools_parser(rest, tools)
        rest, found, rejected = _screen(rest, found, names)  # a system's own parser may let them through
        malformed += rejected
    calls = tuple(ToolCall(f"call_{secrets.token_hex(12)}", name, arguments) for name, arguments in found)
    return ParsedTurn(rest.strip() or None, thought or None, calls, malformed)


def render_calls_hermes(calls: Iterable[ToolCall | JSONObject]) -> str:
    """The text a hermes-format model writes for these calls (ToolCall or OpenAI `tool_calls` items)."""
    blocks = []
    for call in calls:
        if isinstance(call, dict):
            function = cast(JSONObject, call.get("function", call))
            name, arguments = function.get("name"), function.get("arguments", {})
        else:
            name, arguments = call.name, call.arguments
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        blocks.append(f"<tool_call>\n{_call_text(name, text)}\n</tool_call>")
    return "\n".join(blocks)
