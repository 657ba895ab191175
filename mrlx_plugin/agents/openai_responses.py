"""OpenAI's Responses API (`POST /v1/responses`) as a `WireApi`: the request's input items become
the session's chat messages, the turn a `response` object (or its stream of events).

What a request may bring, and what is done with it:

- `input`: a string (one user message) or items: `message` (user, system, developer, assistant;
  a string or `input_text`/`output_text` parts), `function_call`, `custom_tool_call`,
  `function_call_output`, `custom_tool_call_output`. Calls right after an assistant message join
  it, as this endpoint answered them, so an answer sent back is matched exactly. `reasoning` items
  are ignored: the session renders its own earlier answers from the text the model wrote,
  reasoning included (a history it did not answer loses them). An item's id, status and phase
  are not read. Image, file and audio parts, and any other item, are refused.
- `instructions`: a first system message; as on OpenAI, not carried over by `previous_response_id`.
- `tools`: `function` tools; a `namespace`'s tools as functions named `namespace.name`, the
  namespace's description before each one's (their calls come back with `namespace`); a `custom`
  tool as a function of one string argument `input` (its grammar shown in the argument's
  description, not enforced). `strict` is accepted and not enforced (no constrained decoding).
  Tools that OpenAI's servers run (`web_search`, `file_search`, `computer`, `mcp`, `local_shell`,
  ...) are refused: nothing here runs them.
- `tool_choice`: auto, none (calls are not parsed), required, or a function or custom tool by
  name: as in chat completions, not enforced while sampling.
- `temperature`, `top_p`, `max_output_tokens` (the turn's token cap): honoured.
- `previous_response_id`: that response's conversation (its input, then its output), then this
  input; for the responses of this session that were delivered with `store` true.
- `store`: true (the default) keeps the response for `previous_response_id` for the session's
  life (one episode); false keeps none.
- `stream`: honoured; the text goes out as the engine samples it, when it streams.
- `model`: accepted; the endpoint serves its own agent whatever it names.
  `parallel_tool_calls`: accepted; every call the model writes is parsed, one or many.
  `metadata`: echoed. `user`, `safety_identifier`, `prompt_cache_key`, `prompt_cache_retention`,
  `service_tier`, `client_metadata` (Codex's), `stream_options`: accepted and ignored; they serve
  OpenAI's accounting, caching and scheduling, never what is sampled.
- `include`: `reasoning.encrypted_content` (nothing is encrypted here: reasoning comes as
  `reasoning_text`) and hosted tools' outputs (none run) accepted; logprobs refused.
- `reasoning`: `effort` and `summary` accepted and ignored, as chat completions' `reasoning_effort`:
  the agent's chat template decides whether and how it reasons, and its reasoning is returned
  whole (`reasoning_text`), never summarised. `text`: format `text` only (`json_schema`,
  `json_object`, `verbosity`: refused, nothing constrains the sampling). `truncation`: `disabled`
  only (nothing is dropped: a conversation past the context is refused). `background`: false
  only. `top_logprobs`: 0 only. `max_tool_calls`: accepted (it caps hosted tools' calls; none run).

The conversation (instructions, the earlier response's, the input) and the tools are then checked
as a chat-completions request is (`check_request`): the same limits, named there as messages.
Any other field (`conversation`, `prompt`, `context_management`, ...) is refused, named. Errors
use OpenAI's error shape; after a stream began, an `error` event, then `response.failed` with the
error's `code` (which Codex reads: `context_length_exceeded` is not retried).
"""

from __future__ import annotations

import contextvars
import json
import secrets
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import orjson

from mrlx_plugin.agents.parsers import ParsedTurn, ToolCall
from mrlx_plugin.agents.request import MAX_MESSAGES, MAX_TOOLS, ChatError, ChatRequest, check_request
from mrlx_plugin.agents.wire import Send, TurnAnswer
from mrlx_plugin.core.values import JSON, JSONObject

if TYPE_CHECKING:
    from mrlx_plugin.agents.chat import AgentSession

# The request fields read (see the module's docstring); any other is refused.
_FIELDS = {
    *(  # noqa: SIM905 - a word list reads best as text
        "input instructions tools tool_choice temperature top_p max_output_tokens previous_response_id "
        "store stream include reasoning text truncation model parallel_tool_calls metadata user "
        "safety_identifier prompt_cache_key service_tier prompt_cache_retention client_metadata "
        "stream_options background top_logprobs max_tool_calls"
    ).split()
}
# `include` values accepted: none of them adds anything here (see the module's docstring).
_INCLUDES = {
    *(  # noqa: SIM905 - a word list reads best as text
        "reasoning.encrypted_content file_search_call.results web_search_call.results "
        "web_search_call.action.sources code_interpreter_call.outputs "
        "computer_call_output.output.image_url message.input_image.image_url"
    ).split()
}
_TOOL_KEYS = {"function": {"type", "name", "description", "parameters", "strict"}}
_TOOL_KEYS["custom"] = {"type", "name", "description", "format"}
_ROLES = ("user", "system", "developer", "assistant")
_TEXT = {"type": "text"}
Names = dict[str, tuple[str, str | None, str]]  # the model's tool name -> (kind, namespace, name)


class ResponsesRequest(ChatRequest):
    """A checked request, with what its answer needs."""

    store: bool
    previous: str | None  # previous_response_id
    own: list[JSON]  # the chat messages this request's input brought (not its instructions)
    names: Names
    echo: JSONObject  # the request's settings as the response object repeats them


@dataclass
class Stored:
    """A delivered response, for `previous_response_id`: its parent's conversation, then these."""

    parent: str | None
    messages: list[JSON]  # the request's own input, then the answer, as chat messages


# The reply whose stream this task writes: `stream_error` ends its events.
_streaming: contextvars.ContextVar[ResponsesReply | None] = contextvars.ContextVar("responses_stream")


def _bad(message: str, param: str = "input", code: str = "invalid_request_error") -> ChatError:
    return ChatError(400, message, code, param)


class Responses:
    name = "responses"

    def __init__(self) -> None:
        # Each session's stored responses, by the session's id (an AgentSession is an unhashable
        # dataclass), dropped with the session.
        self._stored: dict[int, dict[str, Stored]] = {}

    def check(self, body: JSON, session: AgentSession) -> ResponsesRequest:
        if not isinstance(body, dict):
            raise ChatError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - _FIELDS)
        if unknown:
            shown = ", ".join(sorted(_FIELDS))
            raise _bad(f"unsupported field(s) {', '.join(unknown)}; this endpoint reads {shown}", unknown[0])
        _check_settings(body)
        raw_tools = body.get("tools") or []
        if not isinstance(raw_tools, list) or len(raw_tools) > MAX_TOOLS:
            count = f"{len(raw_tools):,} tools" if isinstance(raw_tools, list) else "not a list"
            raise _bad(f"tools: {count}; send a list of at most {MAX_TOOLS:,}", "tools", "too_many_tools")
        tools, names = _tools(raw_tools)
        own = _input(body.get("input"))
        previous = body.get("previous_response_id")
        instructions = body.get("instructions")
        if not isinstance(instructions, (str, type(None))):
            raise _bad("instructions must be a string", "instructions")
        messages: list[JSON] = [{"role": "system", "content": instructions}] if instructions else []
        messages += (self._conversation(session, previous) if previous is not None else []) + own
        if not messages:
            raise _bad("input must be a string or a non-empty list of items")
        # The conversation as a chat-completions request: the same checks and limits, the same cost.
        chat: JSONObject = {"messages": messages, "tools": cast("list[JSON]", tools) or None}
        chat["tool_choice"] = _tool_choice(body.get("tool_choice", "auto" if tools else "none"), names)
        chat |= {k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None}
        if body.get("max_output_tokens") is not None:
            chat["max_completion_tokens"] = body["max_output_tokens"]
        checked = check_request(chat)
        echo: JSONObject = {k: body.get(k) for k in ("instructions", "metadata", "temperature", "top_p")}
        echo |= {
            "max_output_tokens": body.get("max_output_tokens"),
            "user": body.get("user"),
            "tools": raw_tools,
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": previous,
            "store": body.get("store") is not False,
            "text": {"format": {"type": "text"}},
            "reasoning": {"effort": None, "summary": None},
            "truncation": "disabled",
            "service_tier": body.get("service_tier") or "default",
        }
        return {
            **checked,
            "stream": body.get("stream") is True,
            "store": body.get("store") is not False,
            "previous": cast("str | None", previous),  # a stored response's id (`_conversation`)
            "own": own,
            "names": names,
            "echo": echo,
        }

    def reply(self, request: ChatRequest, send: Send, session: AgentSession) -> ResponsesReply:
        return ResponsesReply(self, cast(ResponsesRequest, request), send, session)

    def error_body(self, exc: ChatError) -> JSONObject:
        return exc.body()

    def stream_error(self, exc: ChatError) -> bytes:
        """An `error` event, then `response.failed` for the response the stream announced."""
        error: JSONObject = {"code": exc.code, "message": exc.message, "param": exc.param}
        reply = _streaming.get(None)
        if reply is None:  # no stream of this API began in this task: the error alone
            return _event("error", error, 0)
        failed = reply.response("failed") | {"error": {"code": exc.code, "message": exc.message}}
        return reply.event("error", **error) + reply.event("response.failed", response=failed)

    def remember(self, session: AgentSession, response_id: str, stored: Stored) -> None:
        key = id(session)
        if key not in self._stored:
            self._stored[key] = {}
            weakref.finalize(session, self._stored.pop, key, None)
        self._stored[key][response_id] = stored

    def _conversation(self, session: AgentSession, response_id: JSON) -> list[JSON]:
        """The chat messages of a stored response's conversation, its answer last."""
        stored = self._stored.get(id(session), {})
        if not isinstance(response_id, str) or response_id not in stored:
            raise _bad(
                f"previous_response_id {response_id!r} names no response of this session (responses are kept "
                "for the episode, and only those answered with store: true); send the conversation's items "
                "in input instead",
                "previous_response_id",
                "previous_response_not_found",
            )
        chain: list[list[JSON]] = []
        at: str | None = response_id
        while at is not None:
            chain.append(stored[at].messages)
            at = stored[at].parent
        return [m for part in reversed(chain) for m in part]


def _check_settings(body: JSONObject) -> None:
    """Refuse the settings this endpoint would not honour (the module's docstring)."""
    include, reasoning, text = body.get("include") or [], body.get("reasoning") or {}, body.get("text") or {}
    if not isinstance(include, list) or not all(isinstance(i, str) and i in _INCLUDES for i in include):
        raise _bad(f"include {include!r}: only {sorted(_INCLUDES)} are served (no log-probs)", "include")
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise _bad("reasoning may hold effort and summary", "reasoning")
    cap = body.get("max_output_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise _bad("max_output_tokens must be an integer >= 1", "max_output_tokens")
    if not isinstance(text, dict) or set(text) - {"format"} or text.get("format") not in (None, _TEXT):
        raise _bad(f"text {text!r}: only the text format is served (no constrained decoding)", "text")
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation must be disabled (a conversation past the context is refused)", "truncation")
    for key in ("stream", "store", "parallel_tool_calls", "background"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise _bad(f"{key} must be true or false", key)
    if body.get("background"):
        raise _bad("background responses are not served; send background: false", "background")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or top != 0):
        raise _bad("log-probs are not returned here (the trainer keeps them)", "top_logprobs")
    if not isinstance(body.get("metadata") or {}, dict):
        raise _bad("metadata must be an object", "metadata")


# --- tools -------------------------------------------------------------------------------------


def _tools(raw: list[JSON]) -> tuple[list[JSONObject], Names]:
    """The request's tools as chat function tools, and what each name the model sees stands for."""
    tools: list[JSONObject] = []
    names: Names = {}
    for i, tool in enumerate(raw):
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            inner, ns = tool.get("tools"), tool.get("name")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise _bad(f"tools[{i}]: a namespace needs a name and a list of tools", "tools")
            about = tool.get("description")
            for j, t in enumerate(inner):
                spec = _tool(t, f"tools[{i}].tools[{j}]", ns, names)
                if isinstance(about, str) and about:  # the namespace's description, shown with each tool
                    function = cast(JSONObject, spec["function"])
                    function["description"] = f"({ns}: {about}) {function.get('description') or ''}".strip()
                tools.append(spec)
        else:
            tools.append(_tool(tool, f"tools[{i}]", None, names))
    return tools, names


def _tool(tool: JSON, where: str, namespace: str | None, names: Names) -> JSONObject:
    """One function or custom tool as a chat function tool, its name recorded in `names`."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or not isinstance(kind, str) or kind not in _TOOL_KEYS:
        raise _bad(
            f"{where}: {kind if isinstance(kind, str) else 'this'} tools are not served: tools that OpenAI's "
            "servers run (web_search, file_search, computer, mcp, local_shell, ...) have no runner here; "
            'send function or custom tools (Codex: web_search = "disabled" in its config.toml)',
            "tools",
        )
    extra, name = sorted(set(tool) - _TOOL_KEYS[kind]), tool.get("name")
    if extra or not isinstance(name, str) or not name:
        raise _bad(f"{where}: a {kind} tool holds a name and at most {sorted(_TOOL_KEYS[kind])}", "tools")
    shown = f"{namespace}.{name}" if namespace else name
    if shown in names:
        raise _bad(f"{where}: two tools are named {shown!r}", "tools")
    names[shown] = (kind, namespace, name)
    spec: JSONObject = {"name": shown}
    if isinstance(tool.get("description"), str):
        spec["description"] = tool["description"]
    parameters = (
        tool.get("parameters") if kind == "function" else _custom_parameters(tool.get("format"), where)
    )
    if not isinstance(parameters, (dict, type(None))):
        raise _bad(f"{where}: parameters must be a JSON schema object", "tools")
    if parameters is not None:
        spec["parameters"] = parameters
    return {"type": "function", "function": spec}


def _custom_parameters(fmt: JSON, where: str) -> JSONObject:
    """A custom tool's free-form input as one string argument; a grammar is shown, not enforced."""
    described = "the tool's input, as free-form text"
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if not isinstance(syntax, str) or not isinstance(definition, str):
            raise _bad(f"{where}: a grammar format needs a syntax and a definition", "tools")
        described = f"the tool's input, text in this {syntax} grammar:\n{definition}"
    elif fmt not in (None, {"type": "text"}):
        raise _bad(f"{where}: format must be text or a grammar", "tools")
    input_spec: JSONObject = {"type": "string", "description": described}
    return {"type": "object", "properties": {"input": input_spec}, "required": ["input"]}


def _tool_choice(choice: JSON, names: Names) -> JSON:
    if choice in ("auto", "none", "required"):
        return choice
    kind, name = (choice.get("type"), choice.get("name")) if isinstance(choice, dict) else (None, None)
    found = [n for n, (k, _, inner) in names.items() if k == kind and name in (n, inner)]
    if not isinstance(kind, str) or kind not in _TOOL_KEYS or len(found) != 1:
        raise _bad(
            f"tool_choice {choice!r}: expected auto, none, required, or a function or custom tool among the "
            "tools, by name",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": found[0]}}


# --- input items -------------------------------------------------------------------------------


def _input(raw: JSON) -> list[JSON]:
    """The input items as chat messages (see the module's docstring)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_MESSAGES:
        raise _bad(
            f"input must be a string or a list of at most {MAX_MESSAGES:,} items", code="too_many_messages"
        )
    messages: list[JSON] = []
    joins = False  # the last message is an assistant turn: calls that come next are its own
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if not isinstance(item, dict) or kind == "reasoning":
            if kind is None:
                raise _bad(f"{where}: expected an item object")
            continue  # see the module's docstring
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise _bad(f"{where}: role must be one of {', '.join(_ROLES)}")
            messages.append({"role": item["role"], "content": _text(item.get("content"), where)})
            joins = item["role"] == "assistant"
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name, ns = item.get("call_id"), item.get("name"), item.get("namespace")
            arguments = item.get("arguments")
            if kind == "custom_tool_call":  # as the answer gave it: one string argument (`_tool`)
                arguments = (
                    json.dumps({"input": item.get("input")}) if isinstance(item.get("input"), str) else None
                )
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
                raise _bad(f"{where}: a call needs a call_id, a name and its arguments (input) as a string")
            function: JSONObject = {
                "name": f"{ns}.{name}" if isinstance(ns, str) and ns else name,
                "arguments": arguments,
            }
            if not joins:
                messages.append({"role": "assistant", "content": None, "tool_calls": []})
                joins = True
            last = cast(JSONObject, messages[-1])
            last["tool_calls"] = [
                *cast("list[JSON]", last.get("tool_calls") or []),
                {"id": call_id, "type": "function", "function": function},
            ]
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}: an output needs the call_id of its call")
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), where)}
            )
            joins = False
        else:
            raise _bad(
                f"{where}: {kind} items are not served; send messages, function or custom tool calls and "
                "their outputs (and reasoning, which is ignored)"
            )
    return messages


def _text(content: JSON, where: str) -> str:
    """A content string, or the text of its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind, text = (part.get("type"), part.get("text")) if isinstance(part, dict) else (None, None)
        if kind not in ("input_text", "output_text") or not isinstance(text, str):
            raise _bad(
                f"{where}.content[{j}]: {kind or 'this part'} is not served: only text (input_text, "
                "output_text) reaches the model; send images, files and audio as text, or leave them out"
            )
        texts.append(text)
    return "".join(texts)


# --- the answer --------------------------------------------------------------------------------


def _event(kind: str, data: JSONObject, seq: int) -> bytes:
    payload = orjson.dumps({"type": kind, **data, "sequence_number": seq})
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


def _output(parsed: ParsedTurn, names: Names, message_id: str, message_first: bool) -> list[JSONObject]:
    """The answer's output items: its reasoning, its text (an answer with neither text nor calls
    is an empty message, so that the client's copy holds the turn), its calls as their tools'
    items. A message already streamed comes first."""
    text = parsed.content or ""
    reasoning: list[JSONObject] = []
    if parsed.reasoning is not None:
        content: list[JSON] = [{"type": "reasoning_text", "text": parsed.reasoning}]
        rs_id = "rs_" + secrets.token_hex(24)
        reasoning.append(
            {"type": "reasoning", "id": rs_id, "summary": [], "content": content, "status": "completed"}
        )
    message = [_message(message_id, text)] if text or not parsed.tool_calls or message_first else []
    calls = [_call_item(c, names) for c in parsed.tool_calls]
    return (message + reasoning if message_first else reasoning + message) + calls


def _message(item_id: str, text: str) -> JSONObject:
    content: list[JSON] = [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": "completed", "content": content}


def _call_item(call: ToolCall, names: Names) -> JSONObject:
    """A parsed call as its tool's kind of item (a custom tool's input is its one string argument)."""
    kind, namespace, name = names.get(call.name, ("function", None, call.name))
    item: JSONObject = {"id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id, "name": name}
    if kind == "custom":
        item |= {"type": "custom_tool_call", "input": _custom_input(call)}
    else:
        item |= {"type": "function_call", "arguments": call.arguments}
    if namespace is not None:
        item["namespace"] = namespace
    return item | {"status": "completed"}


def _custom_input(call: ToolCall) -> str:
    """A custom tool's input: its `input` argument, or all the arguments' JSON when the model wrote
    others (sent back, that call is not the one answered: the conversation starts anew)."""
    value = json.loads(call.arguments).get("input")
    return value if isinstance(value, str) else call.arguments


def _pending(item: JSONObject) -> JSONObject:
    """An item as `response.output_item.added` announces it: in progress, its text still to come."""
    empty = {"message": "content", "reasoning": "content", "function_call": "arguments"}
    key = empty.get(cast(str, item["type"]), "input")
    return item | {key: [] if key == "content" else "", "status": "in_progress"}


def answer_message(parsed: ParsedTurn) -> JSONObject:
    """The answer as a chat message: what the client's copy of it converts back to (`_input`)."""
    message: JSONObject = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    return message


class ResponsesReply:
    """A `response` object, or its stream of events: the text as it is sampled, then the rest."""

    def __init__(self, api: Responses, request: ResponsesRequest, send: Send, session: AgentSession):
        self.api, self.request, self.send, self.session = api, request, send, session
        self.streams = request["stream"]
        self.id, self.created, self.seq = "resp_" + secrets.token_hex(24), int(time.time()), 0
        self.message_id = "msg_" + secrets.token_hex(24)
        self.items: list[JSONObject] = []  # the output items announced so far
        self.sent = ""  # the text streamed so far (its message item is open once it is not empty)

    def response(self, status: str, answer: TurnAnswer | None = None) -> JSONObject:
        usage: JSON = None
        if answer is not None:
            usage = {
                "input_tokens": answer.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": answer.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": answer.prompt_tokens + answer.completion_tokens,
            }
        return self.request["echo"] | {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.session.agent,
            "output": list(self.items),
            "usage": usage,
            "background": False,
        }

    def event(self, kind: str, **data: JSON) -> bytes:
        self.seq += 1
        return _event(kind, data, self.seq - 1)

    async def emit(self, kind: str, **data: JSON) -> None:
        await self.send.event(self.event(kind, **data))

    async def start(self) -> None:
        if self.streams:
            _streaming.set(self)
            await self.send.open_stream()
            await self.emit("response.created", response=self.response("in_progress"))
            await self.emit("response.in_progress", response=self.response("in_progress"))

    async def text(self, delta: str) -> None:
        if not self.streams or not delta:
            return
        if not self.sent:  # the message item opens with the first text
            await self._open(_message(self.message_id, ""))
        self.sent += delta
        at: dict[str, JSON] = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        await self.emit("response.output_text.delta", **at, delta=delta, logprobs=[])

    async def finish(self, answer: TurnAnswer) -> None:
        status = "incomplete" if answer.finish_reason == "length" else "completed"
        output = _output(answer.parsed, self.request["names"], self.message_id, bool(self.sent))
        if not self.streams:
            self.items = output
            await self.send.json(self.response(status, answer))
        else:
            for i, item in enumerate(output):
                await self._stream_item(item, opened=i < len(self.items))
            await self.emit(f"response.{status}", response=self.response(status, answer))
            await self.send.close_stream()
        if self.request["store"]:  # delivered: kept for previous_response_id
            own = [*self.request["own"], answer_message(answer.parsed)]
            self.api.remember(self.session, self.id, Stored(self.request["previous"], own))

    async def _open(self, item: JSONObject) -> None:
        self.items.append(_pending(item))
        await self.emit("response.output_item.added", output_index=len(self.items) - 1, item=self.items[-1])
        if item["type"] == "message":
            at = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
            part: JSON = {"type": "output_text", "text": "", "annotations": []}
            await self.emit("response.content_part.added", **at, part=part)

    async def _stream_item(self, item: JSONObject, opened: bool) -> None:
        """One output item's events (the message's, when its text streamed: the rest of them)."""
        if not opened:
            await self._open(item)
        index = len(self.items) - 1
        at: dict[str, JSON] = {"item_id": item["id"], "output_index": index}
        if item["type"] in ("message", "reasoning"):
            text = cast(str, cast("list[JSONObject]", item["content"])[0]["text"])
            kind, at["content_index"] = "output_text" if item["type"] == "message" else "reasoning_text", 0
            sent = self.sent if opened else ""  # only a message streams before the turn ends
            rest = text[len(sent) :] if text.startswith(sent) else ""
            extra: JSONObject = {"logprobs": []} if kind == "output_text" else {}
            if rest:
                await self.emit(f"response.{kind}.delta", **at, delta=rest, **extra)
            await self.emit(f"response.{kind}.done", **at, text=text, **extra)
            if kind == "output_text":
                part: JSON = {"type": "output_text", "text": text, "annotations": []}
                await self.emit("response.content_part.done", **at, part=part)
        elif item["type"] == "function_call":
            await self.emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            await self.emit(
                "response.function_call_arguments.done", **at, arguments=item["arguments"], name=item["name"]
            )
        else:
            await self.emit("response.custom_tool_call_input.delta", **at, delta=item["input"])
            await self.emit("response.custom_tool_call_input.done", **at, input=item["input"])
        self.items[index] = item
        await self.emit("response.output_item.done", output_index=index, item=item)
