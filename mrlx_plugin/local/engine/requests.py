"""The embedded engine's requests: SGLang's request bodies as pydantic models, and the one
`RequestError` (HTTP 400) naming the offending field. Shared by the HTTP front (`engine`) and the
batching worker (`batcher`), which runs a request's `SamplingParams`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mrlx_plugin.core.values import JSONObject

DEFAULT_MAX_NEW_TOKENS = 128

M = TypeVar("M", bound=BaseModel)


class RequestError(ValueError):
    """A request the engine refuses (HTTP 400); `field` names the offending part."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


class _Request(BaseModel):
    """JSON types as sent (no "8" for 8, no 1 for true); a null field means its default, as in
    SGLang (slime sends `stop_token_ids: null`)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def nulls_are_defaults(cls, raw: object) -> object:
        return {k: v for k, v in raw.items() if v is not None} if isinstance(raw, dict) else raw


def _neutral(ok: Callable[[object], bool]) -> object:
    """A field SGLang knows that this engine honours only at its default value."""

    def check(v: object) -> object:
        if not ok(v):
            raise PydanticCustomError(
                "unsupported",
                "is not supported by this engine (got {got}); leave it unset",
                {"got": repr(v)[:80]},
            )
        return v

    return Annotated[object, AfterValidator(check)]  # any JSON value, checked by `ok`


def _token_ids(ids: list[int], info: ValidationInfo) -> list[int]:
    vocab = (info.context or {}).get("vocab_size")
    if vocab is not None and ids and (min(ids) < 0 or max(ids) >= vocab):
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise PydanticCustomError(
                    "token_id",
                    "{token} is not a token id of this model (0 <= id < {vocab})",
                    {"token": t, "vocab": vocab, "index": i},
                )
    return ids


def _top_k(v: int) -> int:
    if v != -1 and v < 1:
        raise PydanticCustomError("top_k", "must be -1 (off) or an integer >= 1")
    return v


def _stops(v: list[str]) -> list[str]:
    if not all(v):
        raise PydanticCustomError("stop", "must be a non-empty string or a list of them")
    return v


TokenIds = Annotated[list[int], AfterValidator(_token_ids)]
Stops = Annotated[
    list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v), AfterValidator(_stops)
]


class SamplingParams(_Request):
    """SGLang's `sampling_params`. An unknown key is refused, as SGLang refuses it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0)  # 0: greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Annotated[int, AfterValidator(_top_k)] = -1
    min_p: float = Field(0.0, ge=0, le=1)
    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    stop: Stops = []
    stop_token_ids: TokenIds = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    repetition_penalty: _neutral(lambda v: v == 1) = 1.0
    # As SGLang: subtracted from the logits of the tokens already generated (per occurrence; once).
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    n: _neutral(lambda v: v == 1) = 1
    regex: _neutral(lambda v: False) = None
    json_schema: _neutral(lambda v: False) = None
    ebnf: _neutral(lambda v: False) = None
    structural_tag: _neutral(lambda v: False) = None
    logit_bias: _neutral(lambda v: not v) = None
    # Accepted and without effect: no spacing question arises with a byte-level tokenizer,
    # custom_params only feed custom logit processors (none here), and a stream sends each
    # step's tokens as they come (an interval of 1).
    spaces_between_special_tokens: object = None
    custom_params: object = None
    stream_interval: object = None


class GenerateRequest(_Request):
    """One prompt of a `/generate` body (a batched body is split into these first). Unknown
    top-level keys are ignored, as SGLang ignores them; a prompt is `input_ids` or `text`."""

    input_ids: Annotated[TokenIds, Field(min_length=1)] | None = None
    text: Annotated[str, Field(min_length=1)] | None = None
    sampling_params: SamplingParams = SamplingParams()
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)  # -1: no prompt log-probs
    stream: bool = False  # the answer as server-sent events, a chunk per step (one prompt only)
    return_text_in_logprobs: _neutral(lambda v: not v) = False
    top_logprobs_num: _neutral(lambda v: not v) = 0
    token_ids_logprob: _neutral(lambda v: not v) = None
    image_data: _neutral(lambda v: not v) = None
    video_data: _neutral(lambda v: not v) = None
    audio_data: _neutral(lambda v: not v) = None
    input_embeds: _neutral(lambda v: False) = None
    # The name of a loaded LoRA adapter (`--lora-paths NAME=DIR`, `/load_lora_adapter`); none: the base.
    lora_path: Annotated[str, Field(min_length=1)] | None = None
    return_hidden_states: _neutral(lambda v: not v) = False
    return_routed_experts: _neutral(lambda v: not v) = False
    custom_logit_processor: _neutral(lambda v: False) = None


class AbortRequest(_Request):
    abort_all: bool = False
    rid: str | None = None
    abort_message: str | None = None


class PauseRequest(_Request):
    # "retract" (SGLang moves running requests back to its queue) looks the same from outside
    # as "in_place" here: they resume, unchanged, on /continue_generation.
    mode: Literal["abort", "in_place", "retract"] = "abort"


class UpdateWeightsRequest(_Request):
    model_path: str = Field(min_length=1)
    weight_version: Annotated[str | None, BeforeValidator(lambda v: str(v) if type(v) is int else v)] = None
    abort_all_requests: bool = False
    load_format: Literal["auto"] | None = None


class LoadLoraAdapterRequest(_Request):
    """SGLang's `/load_lora_adapter`. `upsert` replaces an adapter already loaded under the name (as
    SGLang's tensor loads do), and `weight_version` is the version its answers report: the embedded
    trainer pushes one agent's adapter that way without touching the others'."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # accepted: every adapter stays loaded here
    upsert: bool = False
    weight_version: Annotated[str | None, BeforeValidator(lambda v: str(v) if type(v) is int else v)] = None


class UnloadLoraAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=128)


# Keys of a batched /generate body that may hold one value per prompt.
_PER_PROMPT = (
    "input_ids",
    "text",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "lora_path",
)


def _field(loc: Sequence[int | str], renamed: dict[str, str]) -> str:
    out = ""
    for k, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + (renamed.get(part, part) if k == 0 else part)
    return out or "body"


def _validation_error(exc: ValidationError, renamed: dict[str, str] | None = None) -> RequestError:
    """The first problem pydantic found, as one message naming its field (`input_ids[1]`,
    `sampling_params.top_p`), what is wrong and the value sent."""
    err = exc.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    loc = list(err["loc"]) + ([ctx["index"]] if "index" in ctx else [])
    field = _field(loc, renamed or {})
    if err["type"] == "extra_forbidden":
        known = ", ".join(sorted(SamplingParams.model_fields))
        return RequestError(field, f"unknown sampling parameter; known: {known}")
    msg = err["msg"][0].lower() + err["msg"][1:]
    if err["type"] not in ("unsupported", "token_id", "missing"):  # (those name the value themselves)
        msg += f", got {repr(err['input'])[:80]}"
    return RequestError(field, msg)


def validate(model: type[M], data: object, renamed: dict[str, str] | None = None, **context: object) -> M:
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise _validation_error(exc, renamed) from None


def split_generate_body(body: object) -> tuple[list[tuple[JSONObject, dict[str, str]]], bool]:
    """The prompts of a `/generate` body, each with the names its fields have in the body
    (`input_ids[2]`), and whether the body was batched. In a batched body (a list of id lists,
    or of texts) a list under a per-prompt key gives one value per prompt; anything else is
    shared by all."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    if (body.get("input_ids") is None) == (body.get("text") is None):
        raise RequestError("input_ids", "send exactly one of input_ids and text")
    ids, text = body.get("input_ids"), body.get("text")
    batched = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    if not batched:
        return [(body, {})], False
    n = len(ids if ids is not None else text)
    if n == 0:
        raise RequestError("text", "must be a non-empty string or a list of them")
    listed = [k for k in _PER_PROMPT if isinstance(body.get(k), list)]
    for key in listed:
        if len(body[key]) != n:
            raise RequestError(key, f"has {len(body[key])} entries for {n} prompts")
    return [
        ({**body, **{k: body[k][i] for k in listed}}, {k: f"{k}[{i}]" for k in listed}) for i in range(n)
    ], True
