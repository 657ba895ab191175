"""The plugin's settings: one typed object built from the `mrlx:` key of the YAML.

slime sets every top-level key of the `--custom-config-path` YAML on `args`, so the plugin reads
`args.mrlx` (a dict). Miles does the same and also accepts `--mrlx-config PATH` (see
`rollout.add_arguments`). Every error names the key it is about and says what is expected; all
errors of one file are reported together in one `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

TOP_KEY = "mrlx"


class ConfigError(ValueError):
    """A bad setting. The message names each offending key and what to do about it."""


# ---------------------------------------------------------------------------------------------
# The schema. Field comments are the reference documentation of each key (README links here).
# ---------------------------------------------------------------------------------------------


@dataclass
class SamplingSettings:
    """Per-agent overrides of the host's sampling parameters (None keeps the host's value)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None  # per-turn cap on generated tokens
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None


@dataclass
class AgentSettings:
    url: str = "self"  # "self" = this job's router (args.sglang_router_ip/port), else http://host:port
    tokenizer: str | None = None  # path of the agent's tokenizer; None = the job's --hf-checkpoint
    chat_template: str | None = None  # Jinja text or a file path; None = the tokenizer's own template
    system_prompt: str | None = None  # text, or a path to a .txt/.md file
    trainable: bool | None = None  # None = trainable when url is "self"
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    retry_on_abort: bool | None = None  # retry a turn the engine aborted; None = yes for peers, no for self
    api_key_env: str | None = None  # environment variable holding the key of an SGLang server run with --api-key


@dataclass
class EngineSettings:
    """How the engine client talks to `/generate` (applies to every agent)."""

    request_timeout_s: float = 900.0  # one /generate call, connect to last byte
    connect_timeout_s: float = 10.0
    max_retries: int = 3  # retries after the first try, for 5xx, broken JSON, resets, timeouts
    backoff_s: float = 0.5  # first wait between tries; doubles each time, with jitter
    max_backoff_s: float = 8.0
    abort_retry_wait_s: float = 2.0  # wait before retrying a turn a peer engine aborted
    peer_deadline_s: float = 600.0  # give up on an aborting/unreachable peer after this long
    max_connections: int = 1024  # connection pool size per engine URL
    # Reproducible sampling: each call carries `sampling_seed` derived from this seed, the episode
    # and the turn (SGLang honours it with deterministic inference; the embedded engine always).
    sampling_seed: int | None = None


@dataclass
class PipelineSettings:
    """The solver -> rewriter -> selector system (agents `solver`, `rewriter`, `selector`)."""

    num_parallel: int = 5  # solvers, and rewriters, per episode
    correct_weight: float = 1.2  # team weight when the selected answer is right
    incorrect_weight: float = 0.8  # team weight when it is wrong or none was selected
    # How the team weight meets each sample's own reward (see rewards.team_weighting):
    # offset: reward + (weight - 1), so wrong answers also feel the team outcome (default);
    # multiplicative: reward * weight, the host example's rule; none: leave rewards unweighted.
    weighting: Literal["offset", "multiplicative", "none"] = "offset"
    max_solution_tokens: int | None = None  # cap on each solution quoted to rewriters/selector


@dataclass
class RewardSettings:
    grader: Literal["math", "host"] = "math"  # default grader hook: math-verify, or the host's --rm-type
    # Episode shaping for systems other than the pipeline (multi-model dialogue).
    shaping: Literal["independent", "cooperative", "zero_sum", "bilateral", "asymmetric"] = "independent"
    coupling: dict[str, dict[str, float]] = field(default_factory=dict)  # asymmetric: agent -> {agent: weight}
    grade_timeout_s: float = 30.0  # above the math verifier's own 10 s, which scores a hung parse 0


@dataclass
class DialogueSettings:
    first: str | None = None  # who speaks first; None = the first agent listed
    order: list[str] | None = None  # turn order; None = the agents in the order listed
    max_turns: int = 8
    stop_patterns: dict[str, str] = field(default_factory=dict)  # agent -> regex that ends the episode
    final_answer_agent: str | None = None  # whose last message is the episode's final answer
    # agent -> its first message; "{problem}", "{label}" and "{metadata[KEY]}" are filled in from the
    # input sample (so an agent can be told what others must not see). Default: the problem.
    openings: dict[str, str] = field(default_factory=dict)


@dataclass
class CoordinatorSettings:
    url: str | None = None
    token_env: str = "MRLX_TOKEN"
    token_file: str | None = None
    max_staleness: int = 1
    wait_deadline_s: float = 1800.0
    lease_s: float = 600.0
    request_timeout_s: float = 60.0
    outage_deadline_s: float = 600.0  # each coordinator call rides out an outage this long, then fails


@dataclass
class TrainerSettings:
    """The embedded CPU trainer's loss and optimizer (`mrlx_plugin.local.trainer`); slime jobs
    ignore this section (their own flags of the same names apply)."""

    lr: float = 1e-4
    lr_warmup_steps: int = 0  # RL steps over which the learning rate rises linearly from lr / steps to lr
    lr_decay_style: Literal["constant", "cosine"] = "constant"  # after warm-up: keep, or cosine to lr_min
    lr_min: float = 0.0
    eps_clip: float = 0.2  # PPO clip range below 1
    eps_clip_high: float = 0.28  # and above 1
    kl_coef: float = 0.0  # KL to the initial (reference) model, low-variance estimator
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    # A large epsilon scales Adam's steps with the gradient where the gradient is tiny: RL's noisy
    # small gradients then do not push every weight by a full `lr` (which wrecks small models).
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    micro_batch_size: int = 32
    ppo_epochs: int = 1
    warmup_sft_steps: int = 0  # supervised warm-start steps on the task's format before RL
    warmup_sft_lr: float = 3e-3
    threads: int = 1  # torch threads per trainer


@dataclass
class Settings:
    run_id: str = "mrlx"
    plugins: list[str] = field(default_factory=list)  # modules holding hook implementations
    system: str = "pipeline"  # pipeline | dialogue | a name a plugin registers
    self_agent: str | None = None  # YAML key `self`: the agent this job trains (multi-model)
    agents: dict[str, AgentSettings] = field(default_factory=dict)
    engine: EngineSettings = field(default_factory=EngineSettings)
    rewards: RewardSettings = field(default_factory=RewardSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    dialogue: DialogueSettings = field(default_factory=DialogueSettings)
    coordinator: CoordinatorSettings = field(default_factory=CoordinatorSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    # Sections for systems registered by plugins: mrlx.<system name>: {...}, validated by the plugin.
    extra: dict[str, Any] = field(default_factory=dict)

    def agent(self, name: str) -> AgentSettings:
        return self.agents[name]


class _AnyKey(dict):
    """Stands in for sample metadata when checking an opening template."""

    def __missing__(self, key: str) -> str:
        return ""


_YAML_NAMES = {"self_agent": "self"}
_PY_NAMES = {v: k for k, v in _YAML_NAMES.items()}
PIPELINE_AGENTS = ("solver", "rewriter", "selector")


# ---------------------------------------------------------------------------------------------
# Building and validating
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


def _show(value: Any) -> str:
    """A value in an error message: its repr, cut short (a value can be a whole YAML subtree),
    and for a value from the environment the variable, not the value."""
    if isinstance(value, EnvValue):
        return f"{value!r} (from the environment)"
    return _SHORT.repr(value)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of names to {_type_name(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, path: str, errors: list[str]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, path, errors)
    if origin is Literal:
        if value not in typing.get_args(tp):
            errors.append(f"{path}: got {_show(value)}; expected {_type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: got {type(value).__name__} {_show(value)}; expected {_type_name(tp)}")
            return []
        (item_tp,) = typing.get_args(tp)
        return [_convert(item_tp, v, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: got {type(value).__name__} {_show(value)}; expected {_type_name(tp)}")
            return {}
        key_tp, val_tp = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                errors.append(f"{path}: key {_show(k)} must be a string")
                continue
            out[k] = _convert(val_tp, v, f"{path}.{k}", errors)
        return out
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            errors.append(
                f"{path}: got {type(value).__name__} {_show(value)}; expected a mapping of settings"
            )
            return tp()
        return _build_dataclass(tp, value, path, errors)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            errors.append(f"{path}: got {_show(value)}; expected true or false")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string: take it as the number meant
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{path}: got {type(value).__name__} {_show(value)}; expected a number")
            return 0.0
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{path}: got {type(value).__name__} {_show(value)}; expected an integer")
            return 0
        return value
    if tp is str:
        if not isinstance(value, str):
            errors.append(f"{path}: got {type(value).__name__} {_show(value)}; expected a string")
            return str(value)
        return _expand_env(value, path, errors)
    return value


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand_env(value: str, path: str, errors: list[str]) -> str:
    """`${NAME}` and `${NAME:-default}` in a string setting, from the environment, so that the
    addresses of a multi-job run live in one env file (launch/mrlx.env) and nowhere else. The
    result is an `EnvValue`: messages show the YAML's text, never what the environment held."""
    if "${" not in value:
        return value

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        found = os.environ.get(name)
        if found is None or (found == "" and default is not None):
            if default is None:
                errors.append(f"{path}: environment variable {name} is not set (the YAML says {value!r}); "
                              "set it (launch/mrlx.env holds a run's addresses) or write the value itself")
                return ""
            return default
        return found

    expanded = _ENV_REF.sub(sub, value)
    return EnvValue(expanded, value) if _ENV_REF.search(value) else expanded


def _build_dataclass(cls: type, data: dict, path: str, errors: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    yaml_to_py = {_YAML_NAMES.get(n, n): n for n in fields}
    kwargs = {}
    for key, value in data.items():
        py_name = yaml_to_py.get(key)
        if py_name is None or py_name == "extra":
            if "extra" in fields:  # top level: sections for plugin systems, checked later
                kwargs.setdefault("extra", {})[key] = value
                continue
            known = sorted(k for k in yaml_to_py if k != "extra")
            hint = difflib.get_close_matches(str(key), known, n=1)
            did_you_mean = f"; did you mean '{hint[0]}'?" if hint else ""
            errors.append(f"{path}.{key}: unknown key{did_you_mean} (known keys: {', '.join(known)})")
            continue
        before = len(errors)
        converted = _convert(hints[py_name], value, f"{path}.{key}", errors)
        if len(errors) == before:  # a bad value keeps the default, so it is reported once
            kwargs[py_name] = converted
    return cls(**kwargs)


def _check(settings: Settings, path: str, errors: list[str], known_systems: set[str] | None) -> None:
    if not settings.run_id or not all(c.isalnum() or c in "-_." for c in settings.run_id):
        errors.append(f"{path}.run_id: got {_show(settings.run_id)}; use letters, digits, '-', '_' and '.'")
    if settings.system == "pipeline" and not settings.agents:
        settings.agents = {name: AgentSettings() for name in PIPELINE_AGENTS}
    if not settings.agents:
        errors.append(f"{path}.agents: no agents are configured; list each agent with its url")
    for name, agent in settings.agents.items():
        apath = f"{path}.agents.{name}"
        if agent.url != "self" and not (agent.url.startswith("http://") or agent.url.startswith("https://")):
            errors.append(f"{apath}.url: got {_show(agent.url)}; expected 'self' or an http://host:port URL")
        s = agent.sampling
        if s.max_new_tokens is not None and s.max_new_tokens < 1:
            errors.append(f"{apath}.sampling.max_new_tokens: got {s.max_new_tokens}; expected at least 1")
        if s.temperature is not None and s.temperature < 0:
            errors.append(f"{apath}.sampling.temperature: got {s.temperature}; expected 0 or more")
        if s.top_p is not None and not 0 < s.top_p <= 1:
            errors.append(f"{apath}.sampling.top_p: got {s.top_p}; expected a number in (0, 1]")
        if agent.trainable is None:
            agent.trainable = agent.url == "self"
        if agent.retry_on_abort is None:
            agent.retry_on_abort = agent.url != "self"
    if settings.self_agent is not None and settings.self_agent not in settings.agents:
        errors.append(
            f"{path}.self: agent {_show(settings.self_agent)} is not under {path}.agents "
            f"(agents: {', '.join(settings.agents) or 'none'})"
        )
    if settings.system == "pipeline":
        missing = [n for n in PIPELINE_AGENTS if n not in settings.agents]
        if missing:
            errors.append(
                f"{path}.agents: the pipeline system needs agents {', '.join(PIPELINE_AGENTS)}; "
                f"missing {', '.join(missing)} (add e.g. `{missing[0]}: {{url: self}}`)"
            )
        p = settings.pipeline
        if p.num_parallel < 1:
            errors.append(f"{path}.pipeline.num_parallel: got {p.num_parallel}; expected at least 1")
        for key in ("correct_weight", "incorrect_weight"):
            if getattr(p, key) < 0:
                errors.append(f"{path}.pipeline.{key}: got {getattr(p, key)}; expected 0 or more")
    if settings.system == "dialogue":
        d = settings.dialogue
        names = list(settings.agents)
        if len(names) < 2:
            errors.append(f"{path}.agents: the dialogue system needs at least two agents; got {len(names)}")
        for key, who in (("first", d.first), ("final_answer_agent", d.final_answer_agent)):
            if who is not None and who not in settings.agents:
                errors.append(
                    f"{path}.dialogue.{key}: {_show(who)} is not an agent (agents: {', '.join(names)})"
                )
        for i, who in enumerate(d.order or []):
            if who not in settings.agents:
                errors.append(
                    f"{path}.dialogue.order[{i}]: {_show(who)} is not an agent (agents: {', '.join(names)})"
                )
        for who in d.stop_patterns:
            if who not in settings.agents:
                errors.append(f"{path}.dialogue.stop_patterns.{who}: not an agent (agents: {', '.join(names)})")
            else:
                try:
                    re.compile(d.stop_patterns[who])
                except re.error as exc:
                    errors.append(f"{path}.dialogue.stop_patterns.{who}: not a regular expression ({exc})")
        for who, text in d.openings.items():
            if who not in settings.agents:
                errors.append(f"{path}.dialogue.openings.{who}: not an agent (agents: {', '.join(names)})")
            else:
                try:
                    text.format(problem="", label="", metadata=_AnyKey())
                except (KeyError, IndexError, ValueError, AttributeError) as exc:
                    errors.append(
                        f"{path}.dialogue.openings.{who}: cannot fill in {exc}; use {{problem}}, {{label}} or "
                        "{metadata[KEY]} (double the braces for literal ones)"
                    )
        if d.max_turns < 1:
            errors.append(f"{path}.dialogue.max_turns: got {d.max_turns}; expected at least 1")
    for who, row in settings.rewards.coupling.items():
        if who not in settings.agents:
            errors.append(f"{path}.rewards.coupling.{who}: not an agent")
        for other in row:
            if other not in settings.agents:
                errors.append(f"{path}.rewards.coupling.{who}.{other}: not an agent")
    if settings.coordinator.max_staleness < 0:
        errors.append(
            f"{path}.coordinator.max_staleness: got {settings.coordinator.max_staleness}; expected 0 or more"
        )
    for key in ("wait_deadline_s", "lease_s", "request_timeout_s", "outage_deadline_s"):
        if getattr(settings.coordinator, key) <= 0:
            errors.append(
                f"{path}.coordinator.{key}: got {getattr(settings.coordinator, key)}; expected a positive number of seconds"
            )
    e = settings.engine
    for key in ("request_timeout_s", "connect_timeout_s", "peer_deadline_s"):
        if getattr(e, key) <= 0:
            errors.append(f"{path}.engine.{key}: got {getattr(e, key)}; expected a positive number of seconds")
    if e.max_retries < 0:
        errors.append(f"{path}.engine.max_retries: got {e.max_retries}; expected 0 or more")
    builtin = {"pipeline", "dialogue"}
    if known_systems is not None and settings.system not in known_systems:
        errors.append(
            f"{path}.system: no agent system named {_show(settings.system)} is registered "
            f"(known: {', '.join(sorted(known_systems))}); list the module that registers it under {path}.plugins"
        )
    for key in settings.extra:
        if key != settings.system or settings.system in builtin:
            known = sorted({_YAML_NAMES.get(f.name, f.name) for f in dataclasses.fields(Settings)} - {"extra"})
            hint = difflib.get_close_matches(key, known, n=1)
            did_you_mean = f"; did you mean '{hint[0]}'?" if hint else ""
            errors.append(f"{path}.{key}: unknown key{did_you_mean} (known keys: {', '.join(known)})")


def parse_settings(data: Any, source: str = "config", known_systems: set[str] | None = None) -> Settings:
    """Build Settings from the YAML's `mrlx` mapping. Raises ConfigError naming every bad key."""
    path = TOP_KEY
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {path}: got {type(data).__name__}; expected a mapping of settings")
    errors: list[str] = []
    settings = _build_dataclass(Settings, data, path, errors)
    _check(settings, path, errors, known_systems)
    if errors:
        raise ConfigError(f"{source}: " + ("\n  ".join([f"{len(errors)} problem(s):"] + errors)))
    return settings


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
                raise YamlLimitError([s for s, _, _ in stack[1:]] + [seg], where,
                                     "an alias refers to a value that contains it (a loop); "
                                     "write the value out")
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
        raise YamlLimitError(path, node, f"nested more than {MAX_YAML_DEPTH} levels deep (aliases included); "
                                         "settings are a few levels deep: flatten it")
    repeated = size[id(root)] - len(size)
    if repeated > MAX_YAML_ALIAS_VALUES:
        path, node = descend(size, stop_at_alias=True)
        raise YamlLimitError(path, node, f"the aliases (*name) of this file repeat {repeated:,} values, "
                                         f"more than the {MAX_YAML_ALIAS_VALUES:,} allowed (a 'billion laughs' "
                                         "YAML bomb?); write the values out, or nest fewer aliases")


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
                raise YamlLimitError(list(self._path), self.peek_event().start_mark,
                                     f"nested more than {MAX_YAML_DEPTH} levels deep; settings are a few "
                                     "levels deep: flatten it")
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
                    None, None,
                    f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); YAML would keep "
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


def settings_from_yaml(path: str | os.PathLike, known_systems: set[str] | None = None) -> Settings:
    data = load_yaml(path)
    if TOP_KEY not in data:
        raise ConfigError(f"{path}: no top-level '{TOP_KEY}' key; put every plugin setting under '{TOP_KEY}:'")
    return parse_settings(data[TOP_KEY], source=str(path), known_systems=known_systems)


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
                f"{config_label(file_arg)}: no top-level '{TOP_KEY}' key; put every plugin setting under '{TOP_KEY}:'"
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
    file = _show(value) if isinstance(value, EnvValue) else str(candidate)
    if candidate.is_file():
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
        f"{key}: {_show(value)} names a file (one line, no spaces or braces, with a '/' or a file suffix), "
        f"but {file} {problem} (a relative path is read {where}); fix the path, or write the text itself "
        "(a prompt with spaces, a template with its braces)"
    )
