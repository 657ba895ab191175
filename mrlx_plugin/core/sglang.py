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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
    input_ids: list[int], sampling_params: Mapping[str, object], extra: Mapping[str, object] | None
) -> bytes:
    """The JSON body of a `/generate` request; `extra` adds fields (an adapter's `lora_path`)."""
    body: dict[str, object] = {
        "input_ids": input_ids,
        "sampling_params": sampling_params,
        "return_logprob": True,
    }
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
