"""The plugin's settings: one typed object built from the `mrlx:` key of the YAML.

slime sets every top-level key of the `--custom-config-path` YAML on `args`, so the plugin reads
`args.mrlx` (a dict). Miles does the same and also accepts `--mrlx-config PATH` (see
`rollout.add_arguments`). The schema is the core's own sections and the sections the caller adds
(`settings_model`): each agent system's (`System.settings`, next to the system) and the embedded
trainer's (`mrlx_plugin.local.trainer.settings`), which the core does not know. Each field's
description is the reference documentation of its key (`settings_reference_markdown()` renders
them as the docs' table; `model_json_schema()` of the model is the JSON Schema). Every error names
the key it is about and says what is expected; all errors of one file are reported together in one
`ConfigError`.

- `values`: what a setting holds (`${NAME}` strings, finite and bounded numbers) and how a value
  shows in a message;
- `messages`: pydantic's errors as one-line messages naming the key (`ConfigError`);
- `schema`: the core's sections and `settings_model`;
- `loader`: `parse_settings`, the one parser, and the hardened YAML loader under it;
- `reference`: the Markdown reference of every setting.
"""

from mrlx_plugin.core.config.loader import (
    MAX_YAML_ALIAS_VALUES,
    MAX_YAML_DEPTH,
    YamlLimitError,
    config_dir,
    config_label,
    is_inline,
    load_yaml,
    looks_like_a_path,
    parse_settings,
    raw_settings_from_args,
    read_text_setting,
    settings_from_yaml,
)
from mrlx_plugin.core.config.messages import TOP_KEY, ConfigError, unwrap
from mrlx_plugin.core.config.reference import settings_reference_markdown
from mrlx_plugin.core.config.schema import (
    AgentSettings,
    CoordinatorSettings,
    EngineSettings,
    RewardSettings,
    SamplingSettings,
    Section,
    Settings,
    SystemSection,
    settings_model,
)
from mrlx_plugin.core.config.values import (
    DAY_S,
    INT32_MAX,
    MAX_LEASE_S,
    MIN_LEASE_S,
    TURNS_WHY,
    EnvValue,
    Number,
    Pause,
    Seconds,
    Text,
    Tokens,
    Why,
    bounded,
    public_text,
    show_value,
)

__all__ = [
    "DAY_S",
    "INT32_MAX",
    "MAX_LEASE_S",
    "MAX_YAML_ALIAS_VALUES",
    "MAX_YAML_DEPTH",
    "MIN_LEASE_S",
    "TOP_KEY",
    "TURNS_WHY",
    "AgentSettings",
    "ConfigError",
    "CoordinatorSettings",
    "EngineSettings",
    "EnvValue",
    "Number",
    "Pause",
    "RewardSettings",
    "SamplingSettings",
    "Seconds",
    "Section",
    "Settings",
    "SystemSection",
    "Text",
    "Tokens",
    "Why",
    "YamlLimitError",
    "bounded",
    "config_dir",
    "config_label",
    "is_inline",
    "load_yaml",
    "looks_like_a_path",
    "parse_settings",
    "public_text",
    "raw_settings_from_args",
    "read_text_setting",
    "settings_from_yaml",
    "settings_model",
    "settings_reference_markdown",
    "show_value",
    "unwrap",
]
