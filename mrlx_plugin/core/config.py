"""The plugin's settings: one typed object built from the `mrlx:` key of the YAML.

slime sets every top-level key of the `--custom-config-path` YAML on `args`, so the plugin reads
`args.mrlx` (a dict). Miles does the same and also accepts `--mrlx-config PATH` (see
`rollout.add_arguments`). The schema is the pydantic models below, the core's own sections,
and the sections the caller adds (`settings_model`): each agent system's (`System.settings`,
next to the system) and the embedded trainer's (`mrlx_plugin.local.settings`), which the core
does not know. Each field's description is the reference documentation of its key
(`settings_reference_markdown()` renders them as the docs' table; `model_json_schema()` of the
model is the JSON Schema). Every error names the key it is about and says what is expected; all
errors of one file are reported together in one `ConfigError`.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import reprlib
import types
import typing
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

TOP_KEY = "mrlx"


class ConfigError(ValueError):
    """A bad setting. The message names each offending key and what to do about it."""


# ---------------------------------------------------------------------------------------------
# Values: strings from the environment, numbers as YAML writes them
# ---------------------------------------------------------------------------------------------


class EnvValue(str):
    """A setting's string with `${NAME}` filled in from the environment. It is that string in
    every use; its repr, and so every message about it, shows what the YAML says (`${NAME}`),
    never the value, which may be a secret."""

    def __new__(cls, value: str, template: str) -> EnvValue:
        obj = super().__new__(cls, value)
        obj.env_template = template
        return obj

    def __repr__(self) -> str:
        return repr(self.env_template)

    def __reduce__(self) -> tuple:
        return (EnvValue, (str(self), self.env_template))


def public_text(value: Any) -> str:
    """`value` as a message may show it: a value from the environment as its `${NAME}` text."""
    return value.env_template if isinstance(value, EnvValue) else str(value)


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 200
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 3, 8, 8


def show_value(value: Any) -> str:
    """A value in an error message: its repr, cut short (a value can be a whole YAML subtree),
    and for a value from the environment the variable, not the value."""
    if isinstance(value, EnvValue):
        return f"{value!r} (from the environment)"
    return _SHORT.repr(value)


def _problem(message: str) -> PydanticCustomError:
    # The text goes in through the context: a template would read the braces of a message
    # (`{url: self}`, `{problem}`) as its own placeholders.
    return PydanticCustomError("mrlx", "{message}", {"message": message})


_CROSS = "mrlx_cross"  # the error that carries every problem found between sections


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand_env(value: str) -> str:
    """`${NAME}` and `${NAME:-default}` in a string setting, from the environment, so that the
    addresses of a multi-job run live in one env file (launch/mrlx.env) and nowhere else. The
    result is an `EnvValue`: messages show the YAML's text, never what the environment held."""
    if "${" not in value:
        return value
    missing: list[str] = []

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        found = os.environ.get(name)
        if found is None or (found == "" and default is not None):
            if default is None:
                missing.append(name)
                return ""
            return default
        return found

    expanded = _ENV_REF.sub(sub, value)
    if missing:
        names = f"variable {missing[0]} is" if len(missing) == 1 else f"variables {', '.join(missing)} are"
        raise _problem(
            f"environment {names} not set (the YAML says {value!r}); set it (launch/mrlx.env "
            "holds a run's addresses) or write the value itself"
        )
    return EnvValue(expanded, value) if _ENV_REF.search(value) else expanded


def _yaml_number(value: Any) -> Any:
    # YAML 1.1 reads 3e-4 (no dot) as a string: take it as the number meant.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    # Not finite (NaN, infinity): refused by `allow_inf_nan=False` beside this validator, which
    # pydantic checks before any bound (NaN would pass every comparison).
    return value


Text = Annotated[str, AfterValidator(_expand_env)]  # every string setting may name ${VARIABLES}
# Every number a setting holds is finite: YAML's .inf and .nan are no timeout, weight or temperature.
Number = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_yaml_number)]


# ---------------------------------------------------------------------------------------------
# Bounds: each number has the range a user would expect, checked when the file is read (by `mrlx
# check` and at start-up alike), so that a value past one is refused naming its key instead of
# failing, or quietly costing the run its time, when it is used
# ---------------------------------------------------------------------------------------------

DAY_S = 86_400
INT32_MAX = 2**31 - 1  # what SGLang and torch read token counts and ids as
# The coordinator's own bounds on a lease (mrlx_plugin.coordinator.server refuses any other).
MIN_LEASE_S, MAX_LEASE_S = 0.05, 7 * DAY_S


class Why(str):
    """Why a setting has its upper bound; a message about a value past it says so."""


def bounded(
    kind: type,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    why: str | None = None,
) -> Any:
    """`kind` (int, or float: finite, and read as YAML writes numbers) within the bounds given, as
    an annotated type: the bounds are pydantic's own (they show in the JSON Schema and the
    reference), `why` says what an upper bound protects."""
    # The bounds before the validator: pydantic then puts them in the JSON Schema as minimum/maximum.
    meta: list[Any] = [Field(ge=ge, gt=gt, le=le, lt=lt)]
    if kind is float:
        meta = [Field(ge=ge, gt=gt, le=le, lt=lt, allow_inf_nan=False), BeforeValidator(_yaml_number)]
    return Annotated[(kind, *meta, *([Why(why)] if why else []))]


_SECONDS_WHY = "a day; these are seconds, and a longer wait only hides a run that has stopped"
Seconds = bounded(float, gt=0, le=DAY_S, why=_SECONDS_WHY)  # a timeout or deadline
Pause = bounded(float, ge=0, le=DAY_S, why=_SECONDS_WHY)  # a wait between tries (0: none)
Tokens = bounded(int, ge=1, le=INT32_MAX, why="the engine reads token counts as 32-bit integers")
TURNS_WHY = "each turn is one more model call, and the transcript grows with each"


def _top_k(value: int) -> int:
    if value != -1 and value < 1:
        raise _problem(f"got {value}; expected -1 (every token) or at least 1")
    return value


# ---------------------------------------------------------------------------------------------
# The schema
# ---------------------------------------------------------------------------------------------


class Section(BaseModel):
    """A section of the settings: the base of every model here, and of the sections other areas
    declare (a system's `mrlx.NAME`, the embedded trainer's `mrlx.trainer`). `about`: what the
    reference says of the section's own key."""

    # strict: YAML's `true` is no number and `"5"` no integer; a setting means what it says.
    # Not frozen: the checks below fill in the defaults that follow from other settings in place
    # (pydantic keeps no other object from a validator of a model built by its constructor).
    model_config = ConfigDict(extra="forbid", strict=True)
    about: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _empty_is_defaults(cls, data: Any) -> Any:
        return {} if data is None else data  # `engine:` with nothing under it


class SystemSection(Section):
    """The section of an agent system (`mrlx.NAME`, the model its `System` declares as `settings`).

    `default_agents`: the agents (each at `url: self`) a config that lists none gets when the
    system is selected. `problems(settings, path)`: the checks between this section and the
    others (the agents it names), run when the system is selected, with every other check
    between sections; `path` is the section's dotted key, and each problem is one line naming
    its key.
    """

    default_agents: ClassVar[tuple[str, ...]] = ()

    def problems(self, settings: Settings, path: str) -> list[str]:
        return []


class SamplingSettings(Section):
    """Per-agent overrides of the host's sampling parameters (None keeps the host's value)."""

    # The bounds go inside the optional type, where the JSON Schema shows them.
    temperature: bounded(float, ge=0) | None = Field(None, description="sampling temperature (0: greedy)")
    top_p: bounded(float, gt=0, le=1) | None = Field(None, description="nucleus sampling mass")
    top_k: (
        Annotated[
            bounded(int, ge=-1, le=INT32_MAX, why="the engine reads it as a 32-bit integer"),
            AfterValidator(_top_k),
        ]
        | None
    ) = Field(None, description="sample from the k likeliest tokens, 1 or more (-1: every token)")
    max_new_tokens: Tokens | None = Field(None, description="per-turn cap on generated tokens")
    stop: list[Text] | None = Field(None, description="strings that end a turn")
    stop_token_ids: (
        list[bounded(int, ge=0, le=INT32_MAX, why="the engine reads token ids as 32-bit integers")] | None
    ) = Field(None, description="token ids that end a turn")


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


class AgentSettings(Section):
    url: Text = Field(
        "self", description="`self` (this job's router, from `--sglang-router-ip/port`) or `http://host:port`"
    )
    adapter: Text | None = Field(
        None,
        description="the LoRA adapter the engine at `url` serves this agent with (SGLang's `lora_path`, "
        "a name given to `--lora-paths` or `/load_lora_adapter`); none = the engine's base model",
    )
    tokenizer: Text | None = Field(
        None,
        description="path of the agent's tokenizer (and chat template); none = the job's `--hf-checkpoint`",
    )
    chat_template: Text | None = Field(
        None, description="Jinja text or a file path; none = the tokenizer's own template"
    )
    system_prompt: Text | None = Field(None, description="text, or a path to a `.txt`/`.md` file")
    trainable: bool | None = Field(
        None,
        description="whether the agent's turns are trained (loss mask 1); none = trainable when url is "
        "`self`",
    )
    sampling: SamplingSettings = Field(
        default_factory=SamplingSettings,
        description="overrides of the host's sampling parameters; an unset one keeps the host's",
    )
    retry_on_abort: bool | None = Field(
        None,
        description="retry a turn the engine aborted or failed (a peer updating weights, restarting); "
        "none = yes for peers, no for `self`",
    )
    api_key_env: Text | None = Field(
        None, description="environment variable holding the key of an SGLang server run with `--api-key`"
    )
    tool_parser: Text = Field(
        "hermes",
        description="agents as code: how tool calls are read from the agent's turns (`hermes`: Qwen/Hermes "
        "`<tool_call>` JSON; `none`; `sglang:NAME`: SGLang's parser; or a system's own)",
    )
    reasoning_parser: Text | None = Field(
        None,
        description="agents as code: how reasoning is split from the answer (`think`: `<think>...</think>`; "
        "`sglang:NAME`; none = no split)",
    )

    @field_validator("url")
    @classmethod
    def _http_or_self(cls, url: str) -> str:
        if url != "self" and not url.startswith(("http://", "https://")):
            raise _problem(f"got {show_value(url)}; expected 'self' or an http://host:port URL")
        return url

    @field_validator("adapter")
    @classmethod
    def _adapter_name(cls, name: str | None) -> str | None:
        # A name, not a path: SGLang looks the request's lora_path up among the adapters it loaded.
        if name is not None and not _ADAPTER_NAME.fullmatch(name):
            raise _problem(
                f"got {show_value(name)}; expected the name an engine loaded the adapter under (letters, "
                "digits, '_', '-', '.', at most 128), not a path"
            )
        return name

    @model_validator(mode="after")
    def _defaults_from_url(self) -> AgentSettings:
        # None follows from the url: a job trains the model it serves, and rides out a peer's
        # aborts (a peer updating its weights), but not its own engine's.
        if self.trainable is None:
            self.trainable = self.url == "self"
        if self.retry_on_abort is None:
            self.retry_on_abort = self.url != "self"
        return self


class EngineSettings(Section):
    """How the engine client talks to `/generate` (applies to every agent)."""

    request_timeout_s: Seconds = Field(900.0, description="one `/generate` call, connect to last byte")
    connect_timeout_s: Seconds = Field(10.0, description="opening a connection to an engine")
    max_retries: bounded(
        int,
        ge=0,
        le=100,
        why="each retry waits up to max_backoff_s: more only keeps calling an engine that is down",
    ) = Field(3, description="retries after the first try, for 5xx/429, broken JSON, resets, timeouts")
    backoff_s: Pause = Field(0.5, description="first wait between tries; doubles each time, with jitter")
    max_backoff_s: Pause = Field(8.0, description="cap on the wait between tries")
    abort_retry_wait_s: Pause = Field(2.0, description="wait before retrying a turn a peer engine aborted")
    peer_deadline_s: Seconds = Field(
        600.0, description="give up on an aborting/unreachable peer after this long"
    )
    max_connections: bounded(int, ge=1, le=65_535, why="each open connection takes a local port") = Field(
        1024, description="connection pool size per engine URL"
    )
    sampling_seed: bounded(int, ge=0, le=2**63 - 1, why="it is sent as a 64-bit integer") | None = Field(
        None,
        description="send each call a `sampling_seed` derived from this, the episode and the turn "
        "(SGLang honours it with deterministic inference; the embedded engine always)",
    )


class RewardSettings(Section):
    grader: Literal["math", "host"] = Field(
        "math", description="default grader hook: `math` (math-verify) or `host` (the host's `--rm-type`)"
    )
    shaping: Literal["independent", "cooperative", "zero_sum", "bilateral", "asymmetric"] = Field(
        "independent", description="episode reward shaping for systems other than the pipeline"
    )
    coupling: dict[str, dict[str, Number]] = Field(
        default_factory=dict, description="`asymmetric` shaping: `agent: {agent: weight}` rows"
    )
    grade_timeout_s: Seconds = Field(
        30.0,
        description="deadline of one grade (above the math verifier's own 10 s, which scores a hung "
        "parse 0); a grade past it aborts the episode",
    )
    credit: Literal["episode", "turn"] = Field(
        "episode",
        description="`episode`: one sample per transcript (all of an agent's turns, one reward); `turn`: "
        "one sample per model turn, its reward the turn's own plus the discounted outcome, "
        "normalised per (prompt group, agent, role, what the turn saw: the system's observation key, "
        "else the turn index)",
    )
    gamma: bounded(
        float,
        ge=0,
        le=1,
        why="a discount: more than 1 would weigh the outcome more the further a turn is from it",
    ) = Field(1.0, description="`credit: turn`: discount per turn by which the outcome reaches earlier turns")
    group_turns_by: Literal["observation", "index"] = Field(
        "observation",
        description="`credit: turn`: compare a turn with the prompt group's turns that saw the same "
        "(`observation`: the system's key for the turn, a game's information state; its turn index where "
        "the system gives none) or with those of the same index (`index`: larger groups, judged partly "
        "by the situation; docs/credit.md)",
    )
    branch: bounded(int, ge=1, le=64, why="each candidate is one more model call per trainable turn") = Field(
        1,
        description="`credit: turn`: candidates sampled per trainable turn from one context (tree sampling); "
        "the K are scored, trained as one advantage group, and the episode goes on from one",
    )
    branch_pick: Literal["best", "sample", "random"] = Field(
        "best",
        description="which candidate the episode goes on from: the best-scored (ties drawn at random, "
        "seeded), one drawn with probability rising with its score (softmax), or one drawn uniformly "
        "(`random`: the policy's own sample, so later turns see the states the policy reaches)",
    )
    branch_target: Literal["score", "taken_return"] = Field(
        "score",
        description="what the K candidates of a turn train on: `score`, each its score (one quantity for "
        "all K; docs/credit.md); `taken_return`, the taken one its realised return and the others "
        "their scores (biased: two quantities in one group; kept to compare with)",
    )


class CoordinatorSettings(Section):
    url: Text | None = Field(
        None, description="the run's coordinator (needed when a trainable agent is trained by another job)"
    )
    token_env: Text = Field(
        "MRLX_TOKEN", description="environment variable this job reads the coordinator's token from"
    )
    token_file: Text | None = Field(None, description="file this job reads the coordinator's token from")
    max_staleness: bounded(
        int, ge=0, le=1024, why="every version the initiator runs ahead keeps its samples queued for the peer"
    ) = Field(1, description="how many versions the initiator may run ahead of a peer")
    wait_deadline_s: Seconds = Field(1800.0, description="how long a barrier or lease wait may take")
    lease_s: bounded(
        float, ge=MIN_LEASE_S, le=MAX_LEASE_S, why="a week; the coordinator refuses a longer lease"
    ) = Field(600.0, description="length of a lease on delivered samples")
    request_timeout_s: Seconds = Field(60.0, description="one coordinator call")
    outage_deadline_s: Seconds = Field(
        600.0, description="each coordinator call rides out an outage this long, then fails"
    )


def _plugin_sections_schema(schema: dict[str, Any]) -> None:
    # `extra` is no key of the YAML: it holds the YAML's other keys, the plugin systems' sections.
    extra = schema["properties"].pop("extra")
    schema["additionalProperties"] = {"type": "object", "description": extra["description"]}


class Settings(Section):
    """Everything under the YAML's `mrlx:` key."""

    model_config = ConfigDict(json_schema_extra=_plugin_sections_schema)

    run_id: Text = Field("mrlx", description="names the run (letters, digits, `-`, `_` and `.`)")
    plugins: list[Text] = Field(default_factory=list, description="modules holding hook implementations")
    system: Text = Field("pipeline", description="`pipeline`, `dialogue`, or a name a plugin registers")
    self_agent: Text | None = Field(
        None, alias="self", description="the agent this job trains (multi-model jobs)"
    )
    agents: dict[str, AgentSettings] = Field(
        default_factory=dict,
        description="one entry per agent, by name; default for the pipeline: solver, rewriter and selector "
        "at `self`",
    )
    engine: EngineSettings = Field(
        default_factory=EngineSettings, description="how the engine client talks to `/generate`"
    )
    rewards: RewardSettings = Field(default_factory=RewardSettings, description="grading and reward shaping")
    coordinator: CoordinatorSettings = Field(
        default_factory=CoordinatorSettings, description="the multi-model run's coordinator"
    )
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="the settings section of a system a plugin registers without a settings model "
        "(`System.settings`), under the system's name; given to it as `episode.system_settings` and "
        "validated by the plugin",
    )
    # The sections of the systems (and of the embedded trainer) are no fields here: `settings_model`
    # adds one typed field per section the caller gives (`settings.pipeline`, `settings.game`).

    def agent(self, name: str) -> AgentSettings:
        return self.agents[name]

    @field_validator("run_id")
    @classmethod
    def _name_chars(cls, run_id: str) -> str:
        if not run_id or not all(c.isalnum() or c in "-_." for c in run_id):
            raise _problem(f"got {show_value(run_id)}; use letters, digits, '-', '_' and '.'")
        return run_id

    @model_validator(mode="before")
    @classmethod
    def _plugin_sections(cls, data: Any) -> Any:
        """Keys that are not the plugin's own go to `extra`: the section of a plugin's system is
        its to read (the checks below refuse every other one, with a suggestion)."""
        if not isinstance(data, dict):
            return data
        own = {f.alias or name for name, f in cls.model_fields.items() if name != "extra"}
        out = {k: v for k, v in data.items() if k in own}
        if any(k not in own for k in data):
            out["extra"] = {k: v for k, v in data.items() if k not in own}
        return out

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> Settings:
        """The checks between sections. They run once every value has its type (a bad value is
        left out and its default used, so it is reported once), and all their problems come
        back together as one error that `parse_settings` spreads out."""
        section = self.system_section()
        if section is not None and not self.agents:
            self.agents = {name: AgentSettings() for name in section.default_agents}
        problems = _cross_problems(self, TOP_KEY, (info.context or {}).get("known_systems"))
        if problems:
            raise PydanticCustomError(
                _CROSS, "{count} problem(s) between settings", {"count": len(problems), "problems": problems}
            )
        return self

    def system_section(self) -> SystemSection | None:
        """The section of the selected system, when the system declares one (a `SystemSection`)."""
        if self.system in Settings.model_fields or self.system not in type(self).model_fields:
            return None
        section = getattr(self, self.system)
        return section if isinstance(section, SystemSection) else None


def _cross_problems(s: Settings, path: str, known_systems: set[str] | None) -> list[str]:
    errors: list[str] = []
    names = list(s.agents)
    if not names:
        errors.append(f"{path}.agents: no agents are configured; list each agent with its url")
    if s.self_agent is not None and s.self_agent not in s.agents:
        errors.append(
            f"{path}.self: agent {show_value(s.self_agent)} is not under {path}.agents "
            f"(agents: {', '.join(names) or 'none'})"
        )
    section = s.system_section()
    if section is not None:
        errors += section.problems(s, f"{path}.{s.system}")
    r = s.rewards
    if r.branch > 1 and r.credit != "turn":
        errors.append(
            f"{path}.rewards.branch: {r.branch} candidates per turn are trained as one group per turn; "
            f"set {path}.rewards.credit: turn (or branch: 1)"
        )
    for who, row in s.rewards.coupling.items():
        if who not in s.agents:
            errors.append(f"{path}.rewards.coupling.{who}: not an agent")
        errors += [
            f"{path}.rewards.coupling.{who}.{other}: not an agent" for other in row if other not in s.agents
        ]
    if known_systems is not None and s.system not in known_systems:
        errors.append(
            f"{path}.system: no agent system named {show_value(s.system)} is registered "
            f"(known: {', '.join(sorted(known_systems))}); list the module that registers it under "
            f"{path}.plugins"
        )
    # A key of no section: only the selected system's, when that system declares no model of it.
    errors += [_unknown_key(f"{path}.{key}", key, type(s)) for key in s.extra if key != s.system]
    return errors


@cache
def _settings_model(sections: tuple[tuple[str, type[BaseModel]], ...]) -> type[Settings]:
    fields: dict[str, Any] = {}
    for name, model in sections:
        if not name.isidentifier() or name.startswith("_") or name in _keys(Settings) + ["extra"]:
            raise ConfigError(
                f"{TOP_KEY}.{name}: cannot be a section of its own (a key of the core's, or no Python "
                "name); register the system that declares it under another name"
            )
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigError(f"{TOP_KEY}.{name}: its settings must be a pydantic model; got {model!r}")
        about = getattr(model, "about", "") or (model.__doc__ or "").strip().split("\n\n")[0]
        fields[name] = (model, Field(default_factory=model, description=" ".join(about.split())))
    return create_model("Settings", __base__=Settings, __module__=__name__, **fields)


def settings_model(sections: Mapping[str, type[BaseModel]] | None = None) -> type[Settings]:
    """Settings with one typed field per section in `sections` (key -> model): the sections of
    the registered systems (`System.settings`) and of the embedded trainer, which the core does
    not know. Built once per set of sections."""
    return _settings_model(tuple((sections or {}).items())) if sections else Settings


# ---------------------------------------------------------------------------------------------
# Building: pydantic's errors as messages naming the key
# ---------------------------------------------------------------------------------------------


def _keys(model: Any) -> list[str]:
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    return sorted(f.alias or name for name, f in model.model_fields.items() if name != "extra")


def _unknown_key(path: str, key: Any, model: Any) -> str:
    known = _keys(model)
    hint = difflib.get_close_matches(str(key), known, n=1)
    did_you_mean = f"; did you mean '{hint[0]}'?" if hint else ""
    return f"{path}: unknown key{did_you_mean}" + (f" (known keys: {', '.join(known)})" if known else "")


def _unwrap(tp: Any) -> Any:
    """The type a value at a place must have: `X | None` and `Annotated[X, ...]` as X."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(inner) != 1:
                return tp
            tp = inner[0]
        else:
            return tp


def _declared_at(loc: tuple, root: type[BaseModel]) -> tuple[Any, list[Any]] | None:
    """(declared type, the field's own metadata) of the value at a pydantic error's location,
    walking from the model validated (`root`); None when the location names no declared value."""
    tp: Any = root
    found: list[Any] = []
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            fields = {f.alias or name: f for name, f in tp.model_fields.items()}
            if part not in fields:
                return None
            tp, found = fields[part].annotation, list(fields[part].metadata)
        elif typing.get_origin(tp) in (dict, list):
            tp, found = typing.get_args(tp)[-1], []
        else:
            return None
    return tp, found


def _type_at(loc: tuple, root: type[BaseModel]) -> Any:
    """The declared type of the value at a pydantic error's location, walking from `root`."""
    declared = _declared_at(loc, root)
    return None if declared is None else _unwrap(declared[0])


_NAMES = {
    str: ("a string", "strings"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    bool: ("true or false", "true or false"),
}


def _type_name(tp: Any, plural: bool = False) -> str:
    """How messages and the reference name a type: `a list of strings`, `'math' | 'host'`."""
    tp = _unwrap(tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return ("lists" if plural else "a list") + f" of {_type_name(typing.get_args(tp)[0], plural=True)}"
    if origin is dict:
        values = _type_name(typing.get_args(tp)[1], plural=True)
        return ("mappings" if plural else "a mapping") + f" of names to {values}"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "sections" if plural else "a section"
    return _NAMES[tp][plural] if tp in _NAMES else str(tp)


def _why_at(loc: tuple, root: type[BaseModel]) -> str | None:
    """What the upper bound of the setting at a pydantic error's location protects: the `Why` in
    its type (in the field's own metadata, or inside `X | None` and list items)."""
    declared = _declared_at(loc, root)
    if declared is None:
        return None
    tp, found = declared
    todo = [tp]
    while todo:
        tp = todo.pop()
        if typing.get_origin(tp) is Annotated:
            found += typing.get_args(tp)[1:]
            todo.append(typing.get_args(tp)[0])
        elif typing.get_origin(tp) in (Union, types.UnionType):
            todo += typing.get_args(tp)
    return next((str(m) for m in found if isinstance(m, Why)), None)


def _bound(value: Any) -> Any:
    """A bound as a message shows it: 86400, not 86400.0."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _dotted(loc: tuple) -> str:
    out = TOP_KEY
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _message(error: dict, root: type[BaseModel]) -> list[str]:
    """One pydantic error as this module's messages: `mrlx.dotted.key: what was wrong; what to do`."""
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == _CROSS:
        return list(ctx["problems"])
    loc = error["loc"][1:] if error["loc"][:1] == ("extra",) else error["loc"]  # `extra` is no YAML key
    if loc[-1:] == ("[key]",):
        return [f"{_dotted(loc[:-2])}: key {show_value(loc[-2])} must be a string"]
    path = _dotted(loc)
    if kind == "mrlx":
        return [f"{path}: {ctx['message']}"]
    if kind == "value_error":  # a ValueError of a section's own validator (a plugin's too): its text
        return [f"{path}: {ctx.get('error', error['msg'])}"]
    if kind == "extra_forbidden":
        model = _type_at(loc[:-1], root)
        return [_unknown_key(path, loc[-1], model)]
    unit = " of seconds" if str(loc[-1]).endswith("_s") else ""
    if kind == "greater_than_equal":
        bound = "0 or more" if ctx["ge"] == 0 else f"at least {_bound(ctx['ge'])}"
        return [f"{path}: got {show_value(value)}; expected {bound}"]
    if kind == "greater_than":
        return [
            f"{path}: got {show_value(value)}; expected "
            + (f"a positive number{unit}" if ctx["gt"] == 0 else f"more than {_bound(ctx['gt'])}")
        ]
    if kind in ("less_than_equal", "less_than"):
        bound = f"at most {_bound(ctx['le'])}" if "le" in ctx else f"less than {_bound(ctx['lt'])}"
        why = _why_at(loc, root)
        return [f"{path}: got {show_value(value)}; expected {bound}" + (f" ({why})" if why else "")]
    if kind == "finite_number":
        return [f"{path}: got {show_value(value)}; expected a finite number{unit}"]
    if kind in ("literal_error", "bool_type"):
        return [f"{path}: got {show_value(value)}; expected {_type_name(_type_at(loc, root))}"]
    if kind in ("model_type", "model_attributes_type"):
        return [f"{path}: got {type(value).__name__} {show_value(value)}; expected a mapping of settings"]
    if kind.endswith(("_type", "_parsing")) and _type_at(loc, root) is not None:
        expected = _type_name(_type_at(loc, root))
        return [f"{path}: got {type(value).__name__} {show_value(value)}; expected {expected}"]
    return [f"{path}: {error['msg']}"]


def _unshared(value: Any) -> Any:
    """A copy with no container shared: YAML aliases share one dict among places, and leaving a
    bad value out of one place must not change the others."""
    if isinstance(value, dict):
        return {k: _unshared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshared(v) for v in value]
    return value


def _leave_out(data: dict, loc: tuple) -> bool:
    """Remove the value a pydantic error is about from `data` (a bad list item takes its whole
    list), so that the next pass uses that setting's default. False when nothing was there."""
    loc = loc[1:] if loc[:1] == ("extra",) else loc
    holder, key, node = None, None, data
    for part in (p for p in loc if p != "[key]"):
        if isinstance(node, list):
            break
        if not isinstance(node, dict) or part not in node:
            return False
        holder, key, node = node, part, node[part]
    if holder is None:
        return False
    del holder[key]
    return True


def parse_settings(
    data: Any,
    source: str = "config",
    known_systems: set[str] | None = None,
    sections: Mapping[str, type[BaseModel]] | None = None,
) -> Settings:
    """Build Settings from the YAML's `mrlx` mapping, with a typed field for each of `sections`
    (see `settings_model`). Raises ConfigError naming every bad key. `known_systems`: the names
    of the registered systems (None: not checked). `mrlx_plugin.settings.parse_settings` gives
    the sections of the registered systems.

    pydantic stops at the first bad value of each place and checks between sections only once
    every value is good; to report every problem at once, each pass leaves the bad values out
    (their defaults apply, which are good) and validates again, until only the checks between
    sections are left."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {TOP_KEY}: got {type(data).__name__}; expected a mapping of settings")
    root = settings_model(sections)
    problems: list[str] = []
    context = {"known_systems": known_systems}
    copied = False
    while True:
        try:
            settings = root.model_validate(data, context=context)
            break
        except ValidationError as exc:
            found = exc.errors(include_url=False)
        for error in found:
            problems += _message(error, root)
        bad = [e["loc"] for e in found if e["type"] != _CROSS]
        if not copied:
            data, copied = _unshared(data), True
        if not any([_leave_out(data, loc) for loc in bad]):
            break
    if problems:
        raise ConfigError(f"{source}: " + "\n  ".join([f"{len(problems)} problem(s):", *problems]))
    return settings


# ---------------------------------------------------------------------------------------------
# The reference of every key, from the models
# ---------------------------------------------------------------------------------------------


def _reference_rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    top = issubclass(model, Settings)
    # The plugin systems' sections (`extra`) last, after the sections of the registered systems.
    fields = sorted(model.model_fields.items(), key=lambda item: top and item[0] == "extra")
    for name, f in fields:
        key = "<system name>" if (top and name == "extra") else (f.alias or name)
        path, tp = f"{prefix}.{key}", _unwrap(f.annotation)
        optional = type(None) in typing.get_args(f.annotation)
        inner = typing.get_args(tp)[-1] if typing.get_origin(tp) is dict else None
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            rows.append((path, _type_name(tp), "", f.description or ""))
            rows += _reference_rows(tp, path)
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            rows.append((path, _type_name(tp), "{}", f.description or ""))
            rows += _reference_rows(inner, f"{path}.NAME")
        else:
            default = f.get_default(call_default_factory=True)
            bounds, why = _bounds_text(f)
            kind = _type_name(tp) + bounds + (" or null" if optional else "")
            kind = "any mapping" if name == "extra" else kind
            meaning = (f.description or "") + (f" (the limit: {why})" if why else "")
            rows.append((path, kind, json.dumps(default), meaning))
    return rows


def _bounds_text(f: Any) -> tuple[str, str | None]:
    """A field's bounds as the reference writes them after its type (` from 1 to 64`), and what
    its upper bound protects."""
    found: dict[str, Any] = {}
    why = None
    todo: list[Any] = [*f.metadata, f.annotation]
    while todo:
        item = todo.pop()
        origin = typing.get_origin(item)
        if origin is Annotated or origin in (Union, types.UnionType, list):
            todo += typing.get_args(item)
        elif isinstance(item, Why):
            why = str(item)
        elif hasattr(item, "metadata") and not isinstance(item, type):  # a FieldInfo inside Annotated
            todo += item.metadata
        else:
            found.update({k: _bound(getattr(item, k)) for k in ("ge", "gt", "le", "lt") if hasattr(item, k)})
    low = f"from {found['ge']}" if "ge" in found else f"more than {found['gt']}" if "gt" in found else ""
    high = f"at most {found['le']}" if "le" in found else f"less than {found['lt']}" if "lt" in found else ""
    if "ge" in found and "le" in found:
        return f" ({found['ge']} to {found['le']})", why
    if low and high:
        return f" ({low}, {high})", why
    if "ge" in found:
        return f" ({found['ge']} or more)", why
    return (f" ({low or high})" if low or high else ""), why


def settings_reference_markdown(model: type[Settings] = Settings) -> str:
    """The reference of every setting of `model` (see `settings_model`) as a Markdown table:
    dotted key, type, default, meaning."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for path, kind, default, description in _reference_rows(model, TOP_KEY):
        shown = f"`{cell(default)}`" if default else ""
        lines.append(f"| `{cell(path)}` | {cell(kind)} | {shown} | {cell(description)} |")
    return "\n".join(lines) + "\n"


# A settings file is a few levels deep and a few hundred values long. These limits stop a
# malicious or broken file before it costs memory or the stack: anchors and aliases can make a
# few lines stand for billions of values ("billion laughs"), and nesting costs Python frames.
MAX_YAML_DEPTH = 64  # levels of nesting, counted through aliases
MAX_YAML_ALIAS_VALUES = 100_000  # values that aliases repeat, over the whole file


class YamlLimitError(yaml.YAMLError):
    """A YAML file past one of the limits above; `load_yaml` turns it into a ConfigError."""

    def __init__(self, path: list[str], node_or_mark: Any, problem: str):
        super().__init__(problem)
        self.key = _yaml_path(path)
        mark = getattr(node_or_mark, "start_mark", node_or_mark)
        self.line = mark.line + 1 if mark is not None else None
        self.problem = problem


def _yaml_path(segments: list[str]) -> str:
    shown = segments if len(segments) <= 8 else segments[:8] + ["..."]
    out = ""
    for seg in shown:
        out += seg if seg.startswith("[") or seg == "..." or not out else "." + seg
    return out or "(the top level)"


def _segment(parent: Any, index: Any) -> str:
    if isinstance(parent, yaml.SequenceNode):
        return f"[{index}]"
    if isinstance(index, yaml.ScalarNode):
        return str(index.value)
    return "(a key)" if parent is not None else ""


def _children(node: Any) -> list[tuple[str, Any, Any]]:
    """(path segment, child node, the node whose line names the place) of each child: for a
    mapping's value that is its key, since an alias's node carries the line of its anchor."""
    if isinstance(node, yaml.SequenceNode):
        return [(f"[{i}]", child, child) for i, child in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        out = []
        for key, value in node.value:
            out.append(("(a key)", key, key))
            out.append((str(key.value) if isinstance(key, yaml.ScalarNode) else "(a key)", value, key))
        return out
    return []


def _check_expansion(root: Any) -> None:
    """Refuse a document whose aliases loop, repeat more than MAX_YAML_ALIAS_VALUES values, or
    nest deeper than MAX_YAML_DEPTH. One pass over the node graph, each node once (aliases share
    nodes), without recursion."""
    size: dict[int, int] = {}  # id(node) -> values in it once every alias is written out
    depth: dict[int, int] = {}
    parents: dict[int, int] = {}  # id(node) -> how many places refer to it (more than one: aliased)
    on_stack: set[int] = set()
    stack = [("", root, iter(_children(root)))]
    on_stack.add(id(root))
    while stack:
        _, node, todo = stack[-1]
        for seg, child, where in todo:
            parents[id(child)] = parents.get(id(child), 0) + 1
            if id(child) in on_stack:
                raise YamlLimitError(
                    [s for s, _, _ in stack[1:]] + [seg],
                    where,
                    "an alias refers to a value that contains it (a loop); write the value out",
                )
            if id(child) not in size:
                on_stack.add(id(child))
                stack.append((seg, child, iter(_children(child))))
                break
        else:
            stack.pop()
            on_stack.discard(id(node))
            kids = [child for _, child, _ in _children(node)]
            size[id(node)] = 1 + sum(size[id(c)] for c in kids)
            depth[id(node)] = 1 + max((depth[id(c)] for c in kids), default=0)

    def descend(measure: dict[int, int], stop_at_alias: bool) -> tuple[list[str], Any]:
        """The path into the biggest (or deepest) child, down to the first alias (or the limit),
        and the last key on it (the line of a node reached through an alias is its anchor's)."""
        path, node, key = [], root, root
        while True:
            kids = _children(node)
            if not kids:
                return path, key
            seg, node, where = max(kids, key=lambda kid: measure[id(kid[1])])
            path.append(seg)
            if where is not node:
                key = where
            if (stop_at_alias and parents.get(id(node), 0) > 1) or len(path) >= MAX_YAML_DEPTH:
                return path, key

    if depth[id(root)] > MAX_YAML_DEPTH:
        path, node = descend(depth, stop_at_alias=False)
        raise YamlLimitError(
            path,
            node,
            f"nested more than {MAX_YAML_DEPTH} levels deep (aliases included); "
            "settings are a few levels deep: flatten it",
        )
    repeated = size[id(root)] - len(size)
    if repeated > MAX_YAML_ALIAS_VALUES:
        path, node = descend(size, stop_at_alias=True)
        raise YamlLimitError(
            path,
            node,
            f"the aliases (*name) of this file repeat {repeated:,} values, "
            f"more than the {MAX_YAML_ALIAS_VALUES:,} allowed (a 'billion laughs' "
            "YAML bomb?); write the values out, or nest fewer aliases",
        )


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last one,
    which would silently drop, say, one of two agents with one name), and a document past the
    limits above (before anything is built from it)."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._path: list[str] = []

    def compose_node(self, parent: Any, index: Any) -> Any:
        if parent is not None:
            self._path.append(_segment(parent, index))
        try:
            if len(self._path) > MAX_YAML_DEPTH:
                raise YamlLimitError(
                    list(self._path),
                    self.peek_event().start_mark,
                    f"nested more than {MAX_YAML_DEPTH} levels deep; settings are a few "
                    "levels deep: flatten it",
                )
            return super().compose_node(parent, index)
        finally:
            if parent is not None:
                self._path.pop()

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: the base class merges it
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); YAML would "
                    "keep "
                    "only the last, silently dropping the other: rename or merge them",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | os.PathLike) -> dict:
    """Read a `--custom-config-path` YAML (or Miles' inline `base64:...`) and return its mapping."""
    text = _read_file_arg(str(path))
    where = config_label(path)
    try:
        data = yaml.load(text, Loader=_StrictLoader) or {}
    except YamlLimitError as exc:
        line = f"line {exc.line}: " if exc.line is not None else ""
        raise ConfigError(f"{where}: {line}{exc.key}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping with the key '{TOP_KEY}'")
    return data


def is_inline(value: str | os.PathLike | None) -> bool:
    """Whether a `--custom-config-path` value is Miles' inline form (`base64:<payload>`), not a path."""
    return str(value or "").startswith("base64:")


def config_label(value: str | os.PathLike) -> str:
    """How messages name a config argument: the path, or a short name for an inline payload."""
    return "--custom-config-path base64:..." if is_inline(value) else str(value)


def config_dir(value: str | os.PathLike | None) -> Path | None:
    """The folder that relative file settings of this config are read from: the YAML file's own
    folder, or None (the working directory) for an inline config or none at all."""
    if not value or is_inline(value):
        return None
    path = Path(value)
    return path.parent if path.is_file() else None


def _read_file_arg(value: str) -> str:
    if is_inline(value):
        import base64
        import binascii

        try:
            return base64.b64decode(value[len("base64:") :], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"--custom-config-path base64:...: the payload is not base64 of UTF-8 YAML ({exc}); "
                "encode the YAML file with `base64 -w0 FILE`"
            ) from None
    try:
        return Path(value).read_text()
    except OSError as exc:
        raise ConfigError(f"{value}: cannot read the config file ({exc.strerror})") from None


def settings_from_yaml(
    path: str | os.PathLike,
    known_systems: set[str] | None = None,
    sections: Mapping[str, type[BaseModel]] | None = None,
) -> Settings:
    """`parse_settings` of a YAML file's `mrlx` key."""
    data = load_yaml(path)
    if TOP_KEY not in data:
        raise ConfigError(
            f"{path}: no top-level '{TOP_KEY}' key; put every plugin setting under '{TOP_KEY}:'"
        )
    return parse_settings(data[TOP_KEY], source=str(path), known_systems=known_systems, sections=sections)


def raw_settings_from_args(args: Any) -> tuple[Any, str, Path | None]:
    """The `mrlx` mapping as the host left it on `args`, where it came from (for messages), and the
    folder its relative file settings are read from (see `config_dir`)."""
    value = getattr(args, TOP_KEY, None)
    if isinstance(value, dict):
        source = getattr(args, "custom_config_path", None)
        if source and config_dir(source) is not None:
            # The host has parsed the file already, keeping the last of any repeated key; read
            # it again, strictly, so that a repeated key is an error instead of a silent drop.
            load_yaml(source)
        return value, config_label(source) if source else "args.mrlx", config_dir(source)
    file_arg = getattr(args, "mrlx_config", None) or getattr(args, "custom_config_path", None)
    if file_arg:
        data = load_yaml(file_arg)
        if TOP_KEY not in data:
            raise ConfigError(
                f"{config_label(file_arg)}: no top-level '{TOP_KEY}' key; put every plugin setting under "
                f"'{TOP_KEY}:'"
            )
        return data[TOP_KEY], config_label(file_arg), config_dir(file_arg)
    raise ConfigError(
        "no mrlx settings found: pass --custom-config-path FILE.yaml with a top-level 'mrlx:' key "
        "(or --mrlx-config FILE.yaml on Miles)"
    )


_FILE_SUFFIX = re.compile(r"\.[A-Za-z][A-Za-z0-9_-]{0,9}$")


def looks_like_a_path(value: str) -> bool:
    """The rule for settings that hold text or name a file (`system_prompt`, `chat_template`):
    a value that is one line, with no spaces and no braces, and that contains a '/' or ends in a
    file suffix (`.txt`, `.md`, `.jinja`, `.tmpl`, ...), names a file, which must exist. Any
    other value is the text itself: a prompt has spaces, a Jinja template braces."""
    return (
        bool(value)
        and not any(c.isspace() for c in value)
        and "{" not in value
        and "}" not in value
        and ("/" in value or _FILE_SUFFIX.search(value) is not None)
    )


def read_text_setting(value: str | None, base: Path | None = None, key: str = "setting") -> str | None:
    """A setting that holds either text or the path of a text file (system prompts, chat
    templates): the file's text when `value` names an existing file, an error naming `key` when
    it looks like a path (`looks_like_a_path`) but no such file exists, and `value` itself
    otherwise. A relative path is read from `base`, the YAML file's folder (see `config_dir`),
    or the working directory when there is none."""
    if value is None:
        return None
    if "\n" in value or len(value) >= 4096:
        return value
    candidate = Path(value).expanduser()
    if base is not None and not candidate.is_absolute():
        candidate = base / candidate
    # The file as a message may name it (a path from the environment stays `${NAME}`).
    file = show_value(value) if isinstance(value, EnvValue) else str(candidate)
    try:
        is_file = candidate.is_file()
    except OSError:  # e.g. a one-line text longer than a file name may be (ENAMETOOLONG): not a path
        return value
    if is_file:
        try:
            return candidate.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or "not UTF-8 text"
            raise ConfigError(f"{key}: cannot read {file} ({reason})") from None
    if not looks_like_a_path(value):
        return value
    where = f"from the YAML's folder, {base}" if base is not None else "from the working directory"
    problem = "is a folder, not a file" if candidate.exists() else "does not exist"
    raise ConfigError(
        f"{key}: {show_value(value)} names a file (one line, no spaces or braces, with a '/' or a file "
        f"suffix), but {file} {problem} (a relative path is read {where}); fix the path, or write the "
        "text itself (a prompt with spaces, a template with its braces)"
    )
