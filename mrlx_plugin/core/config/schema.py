"""The settings' schema: the core's sections (agents, engine, rewards, coordinator) as pydantic
models, the base of the sections other areas declare (`Section`, a system's `SystemSection`), the
checks between sections, and `settings_model`, which adds the sections the caller gives (each
system's, the embedded trainer's) to the core's. Each field's description is the reference
documentation of its key."""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mrlx_plugin.core.config.messages import CROSS, TOP_KEY, ConfigError, keys_of, unknown_key
from mrlx_plugin.core.config.values import (
    INT32_MAX,
    MAX_LEASE_S,
    MIN_LEASE_S,
    Number,
    Pause,
    Seconds,
    Text,
    Tokens,
    bounded,
    problem,
    show_value,
)


def _top_k(value: int) -> int:
    if value != -1 and value < 1:
        raise problem(f"got {value}; expected -1 (every token) or at least 1")
    return value


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
    def _empty_is_defaults(cls, data: object) -> object:
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
            raise problem(f"got {show_value(url)}; expected 'self' or an http://host:port URL")
        return url

    @field_validator("adapter")
    @classmethod
    def _adapter_name(cls, name: str | None) -> str | None:
        # A name, not a path: SGLang looks the request's lora_path up among the adapters it loaded.
        if name is not None and not _ADAPTER_NAME.fullmatch(name):
            raise problem(
                f"got {show_value(name)}; expected the name an engine loaded the adapter under (letters, "
                "digits, '_', '-', '.', at most 128), not a path"
            )
        return name

    @model_validator(mode="after")
    def _defaults_from_url(self) -> AgentSettings:
        # None follows from the url: a job trains the model it serves, and rides out a peer's
        # aborts (a peer updating its weights), but not its own engine's.
        # Written past `__setattr__`, so that `model_fields_set` keeps saying what the YAML set (a
        # fully asynchronous rollout changes the default of `retry_on_abort`, not a chosen value).
        if self.trainable is None:
            self.__dict__["trainable"] = self.url == "self"
        if self.retry_on_abort is None:
            self.__dict__["retry_on_abort"] = self.url != "self"
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
    lone_baseline: Literal["none", "running"] = Field(
        "none",
        description="the advantage of a sample alone in its group (prompt group, credit group): `none`, 0.0 "
        "(it teaches nothing); `running`, its reward minus a running mean of its credit group's rewards "
        "(agent, role, what the turn saw) from earlier steps of this process, not divided by any spread; "
        "0.0 until one exists. Tree-sampling groups never use it. Kept in memory, not checkpointed "
        "(docs/credit.md)",
    )
    baseline_decay: bounded(
        float,
        gt=0,
        lt=1,
        why="at 0 the baseline is the last step's mean alone; at 1 it would never move from the first",
    ) = Field(
        0.9,
        description="`lone_baseline: running`: the weight of the old running mean in each step's update "
        "(new = decay * old + (1 - decay) * the step's mean of the credit group)",
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


class AsyncRolloutSettings(Section):
    max_staleness: bounded(
        int, ge=0, le=1024, why="a sample that many versions old no longer describes the policy it trains"
    ) = Field(
        2,
        description="under a fully asynchronous rollout (`mrlx_plugin.rollout.async_rollout`, Miles' "
        "`--fully-async` with `mrlx_plugin.rollout.AsyncDataBuffer`): a group is trained at most this many "
        "weight versions after the step its episodes started in, for this job's agents and for each peer "
        "that trains its samples; an older one is generated again",
    )
    max_in_flight_groups: bounded(int, ge=1, le=INT32_MAX, why="a count of prompt groups") | None = Field(
        None,
        description="`mrlx_plugin.rollout.async_rollout`: prompt groups generating at once (default: "
        "`--rollout-batch-size`)",
    )
    queue_groups: bounded(int, ge=1, le=INT32_MAX, why="a count of prompt groups") | None = Field(
        None,
        description="`mrlx_plugin.rollout.async_rollout`: finished and generating groups held at most; "
        "the producer starts no group beyond it (default: twice `--rollout-batch-size`)",
    )


def _plugin_sections_schema(schema: dict[str, Any]) -> None:  # pydantic's JSON schema, edited by key
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
    async_rollout: AsyncRolloutSettings = Field(
        default_factory=AsyncRolloutSettings,
        description="fully asynchronous rollouts: the staleness bound and the producer's limits",
    )
    # Any: pydantic leaves these values as written (the plugin's system checks its own section).
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
            raise problem(f"got {show_value(run_id)}; use letters, digits, '-', '_' and '.'")
        return run_id

    @model_validator(mode="before")
    @classmethod
    def _plugin_sections(cls, data: object) -> object:
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
                CROSS, "{count} problem(s) between settings", {"count": len(problems), "problems": problems}
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
    a = s.async_rollout
    if (
        a.max_in_flight_groups is not None
        and a.queue_groups is not None
        and a.queue_groups < a.max_in_flight_groups
    ):
        errors.append(
            f"{path}.async_rollout.queue_groups: {a.queue_groups} holds fewer groups than "
            f"{path}.async_rollout.max_in_flight_groups ({a.max_in_flight_groups}) would generate at once; "
            "raise it"
        )
    if known_systems is not None and s.system not in known_systems:
        errors.append(
            f"{path}.system: no agent system named {show_value(s.system)} is registered "
            f"(known: {', '.join(sorted(known_systems))}); list the module that registers it under "
            f"{path}.plugins"
        )
    # A key of no section: only the selected system's, when that system declares no model of it.
    errors += [unknown_key(f"{path}.{key}", key, type(s)) for key in s.extra if key != s.system]
    return errors


@cache
def _settings_model(sections: tuple[tuple[str, type[BaseModel]], ...]) -> type[Settings]:
    # (model, Field) by name, spread into create_model's keywords (typed per keyword there): Any
    fields: dict[str, Any] = {}
    for name, model in sections:
        if not name.isidentifier() or name.startswith("_") or name in keys_of(Settings) + ["extra"]:
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
