"""The SGLang `/generate` protocol, as plain functions: the request's body, and the answer read and
checked (docs/host-contract.md section 7). Nothing here sends a byte; the engine client does.

A request carries the prompt's ids, the sampling parameters and `return_logprob`. The answer's
generated ids and their log-probs are read from `meta_info.output_token_logprobs`, never
re-tokenised from text, and checked before anyone trains on them: an answer whose values cannot
be right (ids that are not token ids, log-probs that are missing or not log-probabilities, more
tokens than the request allowed, counts that are not counts) raises `Malformed`; one that is not
the protocol's shape at all (a proxy's page, a cut-off body) raises `NotTheProtocol`. The agent's
transcript then checks the ids against its tokenizer's vocabulary (`Transcript.turn_from`).

An answer larger than its request's `max_new_tokens` allows, in bytes or in JSON values
(`answer_limits`), is malformed too, and refused before it is read in full or parsed: one answer
cannot hold the event loop or the process's memory for long.

Streaming (`"stream": true`, read by `StreamedAnswer`). SGLang answers 200 with
`Content-Type: text/event-stream`: one `data: {json}\n\n` event per chunk, each shaped as a whole
answer (`text`, `output_ids`, `meta_info`), then `data: [DONE]\n\n`. A refusal found once the
stream has begun is an event `data: {"error": {"message": ...}}`, then `[DONE]`. With SGLang's
default server arguments every chunk is cumulative: `text`, `output_ids` and
`meta_info.output_token_logprobs` hold everything generated so far (a client that falls behind
gets the newest state; the older chunks are dropped), so a stream of N tokens carries O(N^2)
bytes. With `--incremental-streaming-output` the three hold only what is new since the previous
chunk (queued chunks are joined). In both, `meta_info.completion_tokens` counts all tokens so
far, `prompt_tokens` and `weight_version` come with every chunk, and `finish_reason` is null
until the last chunk, which carries it (`{"type": "stop"|"length"|"abort", ...}`), the final
counts and `cached_tokens`. A chunk is read as incremental when the tokens it holds and the ones
before it add up to its `completion_tokens` (after the first chunk, where both forms agree), else
as cumulative, whose repeated tokens must equal the earlier ones. The ids are read from the
log-prob entries, as for a whole answer; `output_ids` is not read. SGLang aborts a streamed
request whose client goes away.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import orjson

from mrlx_plugin.core.values import LOG_PROB_EPSILON, MAX_TOKEN_ID, MIN_LOG_PROB

# What an answer to a request for N new tokens may take: N x ANSWER_BYTES_PER_TOKEN +
# ANSWER_BYTES_FIXED bytes (never more than the client's `max_answer_bytes`). A token costs its
# log-prob entry (`[-0.0001234567890123,151643,null],` is 35 bytes), its id where the engine also
# lists ids, and its text (a few bytes; a vocabulary's longest tokens are about 128; twice with
# `return_text_in_logprobs`); the fixed part is the meta info (finish reason, counts, latency).
ANSWER_BYTES_PER_TOKEN = 512
ANSWER_BYTES_FIXED = 64 * 1024
# And the JSON values (Python objects, once parsed) it may hold, counted by their delimiters
# (`_check_values`): a token's entry has 5 (`[`, `]`, two commas and the one after it), the
# quotes, commas, brackets and colons of its text count too. Bytes alone do not bound the parse:
# tiny entries (`[0,0],` repeated) make 3 objects of 6 bytes, and building them holds the event
# loop (orjson keeps the GIL, so parsing in a worker thread would not free it): seconds and over
# 1 GiB for 32 MiB. Within this allowance a parse builds at most a few times the objects of a
# real answer of N tokens (mrlx_lab/bench/answer_stall.py measures the stall).
ANSWER_VALUES_PER_TOKEN = 32
ANSWER_VALUES_FIXED = 4096

# A request's `sampling_params` (the host's, the agent's settings over them, a call's over those):
# JSON values by name, read as SGLang reads them (`int(params["max_new_tokens"])`), hence `Any`.
SamplingParams = dict[str, Any]


class NotTheProtocol(Exception):
    """An answer that is not the protocol's shape (retried: it may pass)."""


class Malformed(Exception):
    """An answer in the protocol's shape whose values no engine can have sampled (not retried)."""


class StreamRefused(Exception):
    """A stream the engine ended with an error event: its refusal of the request, as an HTTP 400
    would be for an answer not streamed (not retried)."""


@dataclass
class GenerateResult:
    token_ids: list[int]
    logprobs: list[float]
    text: str  # the engine's text; transcripts use what the ids spell instead
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str | None
    prompt_tokens: int
    cached_tokens: int
    retries: int = 0  # retried attempts behind this result (the engine client sets it)


def generate_body(
    input_ids: list[int],
    sampling_params: Mapping[str, object],
    extra: Mapping[str, object] | None,
    stream: bool = False,
) -> bytes:
    """The JSON body of a `/generate` request; `extra` adds fields (an adapter's `lora_path`);
    `stream` asks for the answer as a stream of chunks (`StreamedAnswer` reads it)."""
    body: dict[str, object] = {
        "input_ids": input_ids,
        "sampling_params": sampling_params,
        "return_logprob": True,
    }
    if stream:
        body["stream"] = True
    if extra:
        body.update(extra)
    # orjson's result keeps the capacity of its growing buffer (~512 KiB for a 2k-token prompt)
    # until freed; a right-sized copy keeps thousands of requests in flight affordable.
    return bytes(memoryview(orjson.dumps(body)))


def requested_max(sampling_params: Mapping[str, object]) -> int | None:
    """The request's `max_new_tokens`, when it is a count (what bounds its answer)."""
    value = sampling_params.get("max_new_tokens") if isinstance(sampling_params, dict) else None
    return value if type(value) is int and value >= 0 else None


def answer_limits(max_new_tokens: int) -> tuple[int, int]:
    """(bytes, JSON values) an answer to a request for `max_new_tokens` new tokens may have."""
    return (
        ANSWER_BYTES_FIXED + ANSWER_BYTES_PER_TOKEN * max_new_tokens,
        ANSWER_VALUES_FIXED + ANSWER_VALUES_PER_TOKEN * max_new_tokens,
    )


def too_many_bytes(length: int | None, cap: int, max_new_tokens: int | None) -> Malformed:
    """An answer past the bytes its request allows (`cap`): `length` declared, or None when it was
    cut off while being read."""
    if length is not None:
        return Malformed(
            f"the answer is {length} bytes, more than an answer of max_new_tokens "
            f"{max_new_tokens} may take ({cap} bytes)"
        )
    return Malformed(
        f"the answer is over {cap} bytes, more than an answer of max_new_tokens {max_new_tokens} may take"
    )


def read_answer(body: bytes, max_new_tokens: int | None, prompt_tokens: int) -> GenerateResult:
    """A 200 answer's body as a GenerateResult (`prompt_tokens`: the count when the engine gives
    none). Raises NotTheProtocol or Malformed (see `parse_generate_response`)."""
    ids, logprobs, text, finish, version, meta = parse_generate_response(body, max_new_tokens)
    return GenerateResult(
        token_ids=ids,
        logprobs=logprobs,
        text=text,
        finish_reason=finish,
        weight_version=version,
        prompt_tokens=_count(meta, "prompt_tokens", prompt_tokens),
        cached_tokens=_count(meta, "cached_tokens", 0),
    )


def parse_generate_response(
    body: bytes, max_new_tokens: int | None = None
) -> tuple[list[int], list[float], str, str, str | None, dict]:
    """Read ids, log-probs, text, finish reason and weight version from a `/generate` body.

    Raises NotTheProtocol for a body that is not the protocol's shape (retried) and Malformed for
    values that cannot be right: ids that are not integers in [0, 2**31), log-probs that are not
    finite numbers in [MIN_LOG_PROB, 0], more ids than `max_new_tokens`, more JSON values than an
    answer of `max_new_tokens` tokens holds (checked before parsing), counts that are not integers.
    """
    if max_new_tokens is not None:
        _check_values(body, max_new_tokens)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise NotTheProtocol(f"response is not JSON ({exc}); starts {body[:80]!r}") from None
    if isinstance(data, list) and len(data) == 1:  # batched form with one request
        data = data[0]
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise NotTheProtocol(f"response has no meta_info; starts {body[:80]!r}")
    meta = data["meta_info"]
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if finish_type not in ("stop", "length", "abort"):
        raise NotTheProtocol(f"unknown finish_reason {finish!r}")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        if finish_type != "abort":
            raise NotTheProtocol("meta_info.output_token_logprobs is missing; was return_logprob sent?")
        entries = []
    if not isinstance(entries, list):
        raise NotTheProtocol("meta_info.output_token_logprobs is not a list")
    if max_new_tokens is not None and len(entries) > max_new_tokens:
        raise Malformed(f"{len(entries)} tokens for a request of max_new_tokens {max_new_tokens}")
    ids, logprobs = _ids_and_logprobs(entries) if entries else ([], [])
    text = data.get("text", "")
    if not isinstance(text, str):
        raise NotTheProtocol("text is not a string")
    version = meta.get("weight_version")
    return ids, logprobs, text, finish_type, (None if version is None else str(version)), meta


class StreamedAnswer:
    """A streamed `/generate` answer, read as its bytes arrive (`feed`) and checked chunk by chunk
    as `read_answer` checks a whole answer: each chunk within the bytes and JSON values a whole
    answer to the request may take (`answer_limits`) and within `max_event_bytes` (the client's
    cap), ids that are token ids, log-probs that are log-probabilities, no more tokens in all than
    `max_new_tokens`, and the tokens a cumulative chunk repeats equal to the ones before it.
    `result()` is then the GenerateResult the same answer unstreamed gives. The bytes of a whole
    stream are not capped (a cumulative one carries O(N^2)); the call's timeout bounds it.

    `streamed` and `passed_on` are the engine client's to set: whether the answer came as a stream
    at all (an engine may answer a streamed request with a whole answer), and how many chunks'
    ids it has passed on to its caller."""

    def __init__(self, max_new_tokens: int | None, prompt_tokens: int, max_event_bytes: int):
        self.max_new_tokens = max_new_tokens
        self.prompt_tokens = prompt_tokens
        allowed = max_event_bytes if max_new_tokens is None else answer_limits(max_new_tokens)[0]
        # Past the request's allowance a chunk is malformed; past the client's cap, only too large.
        self.cap, self.allowance_binds = min(allowed, max_event_bytes), allowed < max_event_bytes
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.chunks = 0
        self.last: dict | None = None  # the meta_info of the chunk that finished the answer
        self.finish = ""
        self.done = False  # `data: [DONE]` came
        self.streamed = False
        self.passed_on = 0
        self._buffer = bytearray()
        self._entries: list[Any] = []  # the output_token_logprobs entries so far, as parsed

    def feed(self, data: bytes) -> Iterator[list[int]]:
        """The new ids of each chunk that `data` completes, in order (a chunk that brings none
        yields nothing). Raises NotTheProtocol, Malformed or StreamRefused."""
        buffer = self._buffer
        scan = max(0, len(buffer) - 1)  # an event's end may straddle two reads
        buffer += data
        start = 0
        while (end := buffer.find(b"\n\n", scan)) >= 0:
            if end - start > self.cap:
                self._too_large(end - start)
            event = bytes(buffer[start:end])
            start = scan = end + 2
            new = self._chunk(event)
            if new:
                yield new
        del buffer[:start]
        if len(buffer) > self.cap:  # an event still open, past what a whole one may take
            self._too_large(len(buffer))

    def result(self) -> GenerateResult:
        """The answer, once the stream has ended. Raises NotTheProtocol for a stream that ended
        before the chunk that finishes the answer (cut off: retried like a cut-off answer), and
        Malformed for counts that are not counts."""
        if self.last is None:
            where = "inside an event" if self._buffer.strip() else f"after {self.chunks} chunks"
            raise NotTheProtocol(f"the stream ended {where}, before a chunk with a finish_reason")
        meta = self.last
        version = meta.get("weight_version")
        return GenerateResult(
            token_ids=self.ids,
            logprobs=self.logprobs,
            text=self.text,
            finish_reason=self.finish,
            weight_version=None if version is None else str(version),
            prompt_tokens=_count(meta, "prompt_tokens", self.prompt_tokens),
            cached_tokens=_count(meta, "cached_tokens", 0),
        )

    def _chunk(self, event: bytes) -> list[int]:
        """Read one event: the new ids of its chunk (none for `[DONE]` or a comment)."""
        data = _event_data(event)
        if self.done:
            raise NotTheProtocol(f"an event after data: [DONE]; starts {event[:80]!r}")
        if data == b"[DONE]":
            if self.last is None:
                raise NotTheProtocol(f"data: [DONE] after {self.chunks} chunks, none with a finish_reason")
            self.done = True
            return []
        if not data:
            return []  # comments only (a keep-alive)
        if self.last is not None:
            raise NotTheProtocol(f"a chunk after the one with the finish_reason; starts {data[:80]!r}")
        if self.max_new_tokens is not None:
            _check_values(data, self.max_new_tokens)
        number = self.chunks + 1
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise NotTheProtocol(f"stream chunk {number} is not JSON ({exc}); starts {data[:80]!r}") from None
        if isinstance(chunk, dict) and "error" in chunk and "meta_info" not in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamRefused(f"the engine ended the stream with an error: {str(message)[:500]}")
        if not isinstance(chunk, dict) or not isinstance(chunk.get("meta_info"), dict):
            raise NotTheProtocol(f"stream chunk {number} has no meta_info; starts {data[:80]!r}")
        meta = chunk["meta_info"]
        finish = meta.get("finish_reason")
        finish_type = finish.get("type") if isinstance(finish, dict) else finish
        if finish_type not in (None, "stop", "length", "abort"):
            raise NotTheProtocol(f"unknown finish_reason {finish!r} in stream chunk {number}")
        entries = meta.get("output_token_logprobs")
        if entries is None and finish_type != "abort":
            raise NotTheProtocol(
                f"stream chunk {number} has no meta_info.output_token_logprobs; was return_logprob sent?"
            )
        if entries is not None and not isinstance(entries, list):
            raise NotTheProtocol(f"meta_info.output_token_logprobs of stream chunk {number} is not a list")
        text = chunk.get("text")
        if text is not None and not isinstance(text, str):
            raise NotTheProtocol(f"text of stream chunk {number} is not a string")
        have, total = len(self.ids), meta.get("completion_tokens")
        n = len(entries) if entries else 0
        incremental = have > 0 and type(total) is int and have + n == total
        if entries and not incremental and have:  # cumulative: the tokens before come again
            # Compared as parsed, entry by entry (one C-level pass), and only the new ones read
            # and checked: a cumulative stream carries O(N^2) entries in all.
            if n < have or entries[:have] != self._entries:
                raise Malformed(
                    f"stream chunk {number} does not repeat the {have} tokens of the chunks before it, "
                    f"and its {n} tokens do not add up to its completion_tokens {total!r} either"
                )
            self._entries = entries
            entries = entries[have:]
        elif entries and not incremental:
            self._entries = entries
        elif entries:
            self._entries.extend(entries)
        ids, logprobs = _ids_and_logprobs(entries) if entries else ([], [])
        if self.max_new_tokens is not None and have + len(ids) > self.max_new_tokens:
            raise Malformed(f"{have + len(ids)} tokens for a request of max_new_tokens {self.max_new_tokens}")
        self.ids += ids
        self.logprobs += logprobs
        if text is not None:
            self.text = self.text + text if incremental else text
        self.chunks = number
        if finish_type is not None:
            self.last, self.finish = meta, finish_type
        return ids

    def _too_large(self, size: int) -> NoReturn:
        if self.allowance_binds:
            raise Malformed(
                f"a stream chunk of {size} bytes or more, more than an answer of max_new_tokens "
                f"{self.max_new_tokens} may take ({self.cap} bytes)"
            )
        raise NotTheProtocol(f"a stream chunk over the {self.cap}-byte limit")


def _event_data(event: bytes) -> bytes:
    """The data of one server-sent event: its `data:` lines, joined (comment lines skipped)."""
    lines = []
    for line in event.split(b"\n"):
        line = line.removesuffix(b"\r")
        if line.startswith(b"data:"):
            lines.append(line[5:].removeprefix(b" "))
        elif line and not line.startswith(b":"):
            raise NotTheProtocol(f"a stream line that is not data: {line[:80]!r}")
    return b"\n".join(lines)


def _ids_and_logprobs(entries: list[Any]) -> tuple[list[int], list[float]]:
    """The ids and log-probs of `output_token_logprobs` entries (parsed JSON, of any shape until
    checked here), checked. The checks are C-level passes: they run over every generated token of
    every call."""
    try:
        columns = list(zip(*entries))  # [(logprob, ...), (token_id, ...), ...] in one C-level pass
    except TypeError:
        columns = []
    if len(columns) < 2:
        raise NotTheProtocol("meta_info.output_token_logprobs entries are not [logprob, token_id, ...]")
    ids, logprobs = list(columns[1]), list(columns[0])
    if set(map(type, ids)) != {int}:
        bad = next(i for i in ids if type(i) is not int)
        raise Malformed(f"token id {bad!r} is not an integer")
    low, high = min(ids), max(ids)
    if low < 0 or high > MAX_TOKEN_ID:
        raise Malformed(f"token id {low if low < 0 else high} is not a token id")
    kinds = set(map(type, logprobs))
    if kinds != {float}:
        if not kinds <= {float, int}:
            bad = next(x for x in logprobs if type(x) not in (float, int))
            raise Malformed(f"log-prob {bad!r} is not a number")
        try:
            logprobs = [float(x) for x in logprobs]
        except OverflowError:
            raise Malformed("a log-prob is not a finite number") from None
    top, bottom = max(logprobs), min(logprobs)
    if top > LOG_PROB_EPSILON:
        raise Malformed(f"log-prob {top!r} is positive (log-probabilities are <= 0)")
    if not math.isfinite(bottom):
        raise Malformed(f"log-prob {bottom!r} is not a finite number")
    if bottom < MIN_LOG_PROB:
        raise Malformed(f"log-prob {bottom!r} is below {MIN_LOG_PROB:g}, lower than a sampled token's can be")
    return ids, logprobs


def _count(meta: dict, key: str, default: int) -> int:
    value = meta.get(key)
    if value is None:
        return default
    if type(value) is not int or value < 0:
        raise Malformed(f"meta_info.{key} is {value!r}; expected a count (an integer >= 0)")
    return value


_DELIMITERS = b'"[]{},:'


def _check_values(body: bytes, max_new_tokens: int) -> None:
    """Refuse a body that holds more JSON values than an answer of `max_new_tokens` tokens,
    before any is built. Every value is a string (two quotes), an array or object (its brackets
    or braces) or a scalar after `[`, `,` or `:`, so the count of these delimiters bounds the
    values a parse builds (nesting aside, which orjson stops at depth 1024). A body of at most
    twice the limit in bytes cannot hold more (a value and its separator take two bytes), so most
    real answers (about 45 bytes a token) are not counted; a count is one C-level pass."""
    limit = answer_limits(max_new_tokens)[1]
    if len(body) <= 2 * limit:
        return
    count = len(body) - len(body.translate(None, _DELIMITERS))
    if count > limit:
        raise Malformed(
            f"the answer holds up to {count} JSON values, more than an answer of max_new_tokens "
            f"{max_new_tokens} holds ({limit})"
        )
